"""What both ends of a chained call (``rpc Chain``) agree on: the route's bounds and how a broken chain reads.

A peer that cannot pass a micro-batch on (no candidate of the next stage answered) answers its caller with
status ABORTED and the details ``chain broke at stage J (unreachable|failed): REASON``; every peer above it
passes that on unchanged, and the trainer takes hop J itself (peer/trainer/chain.py). ``unreachable``: every
candidate failed to connect or to answer in time (a hop the trainer may relay), ``failed``: at least one
refused or answered badly.
"""

from __future__ import annotations

import re

import grpc

MAX_CANDIDATES = 4  # replicas of one stage a route may name: a peer dials at most this many per hop
MAX_HOP_TIMEOUT_S = 300.0
BROKEN = grpc.StatusCode.ABORTED  # "the chain broke further down": not the answering peer's fault
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
MAX_REASON = 200
_BROKEN_AT = re.compile(r"^chain broke at stage (\d{1,4}) \((unreachable|failed)\): ")


class ChainBroken(Exception):
    """No candidate of ``stage`` answered; ``unreachable``: every one failed to connect or in time."""

    def __init__(self, stage: int, reason: str, unreachable: bool):
        self.stage = stage
        self.reason = reason[:MAX_REASON]
        self.unreachable = unreachable
        super().__init__(self.detail())

    def detail(self) -> str:
        kind = "unreachable" if self.unreachable else "failed"
        return f"chain broke at stage {self.stage} ({kind}): {self.reason}"

    @classmethod
    def parse(cls, details: str | None) -> ChainBroken | None:
        """The break an ABORTED status reports, or None when its details are not one."""
        match = _BROKEN_AT.match(details or "")
        if match is None:
            return None
        return cls(int(match[1]), (details or "")[match.end() :], match[2] == "unreachable")
