"""peer/stage/service"""
