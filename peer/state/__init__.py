"""peer/state"""
