"""peer/stage/chain"""
