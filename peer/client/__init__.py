"""One way to call a stage: connections, deadlines, streaming, codecs, and the checks on what a stage answers.

Used by the trainer (its hub calls and chained calls, peer/trainer/) and by peers (a chain's call to the next
stage, peer/stage/chain/link.py) alike, so both ends hold a stage's answer to the same rules.
"""
