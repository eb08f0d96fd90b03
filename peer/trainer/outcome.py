"""How a micro-batch ends, and its tally on the way: what ``MicrobatchRunner.run`` returns and the trainer counts.

``NoReplica`` and ``Rejected`` are the two ways a micro-batch stops part way (peer/trainer/microbatch.py): no
live replica of a stage for ``wait_timeout``, or every replica called the request invalid.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class NoReplica(RuntimeError):
    pass


class Rejected(RuntimeError):
    """Every live replica of a stage called the request invalid: this micro-batch cannot go on."""


class MicrobatchStatus(str, enum.Enum):
    COMPLETED = "completed"  # stage 0 acknowledged its backward; every stage applied the gradient
    DROPPED_STALE = "dropped_stale"  # ran to the end, but some stage refused its gradient as too old
    FAILED = "failed"  # stopped part way: no live replica for wait_timeout, or every replica rejected it


@dataclass(frozen=True)
class MicrobatchOutcome:
    """How one micro-batch ended: what ``MicrobatchRunner.run`` returns and the trainer counts."""

    microbatch_id: str
    status: MicrobatchStatus
    loss: float | None = None  # the last stage's loss; None when it failed before (or at) the last stage
    retries: int = 0  # calls sent again: forwards retried on another replica plus backwards replayed
    reason: str = ""  # why it failed, or which stages dropped it as stale; empty when completed


@dataclass
class Journey:
    """One micro-batch's own tally while it runs; local to one ``run`` call, never shared."""

    retries: int = 0
    stale_stages: list[int] = field(default_factory=list)
    relayed_hops: int = 0  # chain mode: hops the trainer carried (a segment's end to the next segment)
