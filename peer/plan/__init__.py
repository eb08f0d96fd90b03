"""peer/plan"""
