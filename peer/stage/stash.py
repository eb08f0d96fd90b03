"""What a stage's compute leaves behind: the stash of forwards awaiting their backward, the result of a
backward, and the runtime's counters.

A forward runs on an immutable snapshot of the weights and keeps its autograd graph in a
:class:`ForwardGroup` (one per forward call, shared by the micro-batches a server batch joined), so
the matching backward is exact for the weights that produced the activations.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate

import torch


def concat_rows(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[slice]]:
    """The tensors joined along the batch dimension (no copy for one), and each one's rows in the result."""
    joined = torch.cat(tensors) if len(tensors) > 1 else tensors[0]
    ends = list(accumulate(t.shape[0] for t in tensors))
    return joined, [slice(end - t.shape[0], end) for t, end in zip(tensors, ends)]


class UnknownMicrobatch(KeyError):
    """A backward for a micro-batch whose forward this peer never ran (or expired)."""


@dataclass
class ForwardGroup:
    """One forward call over one or more micro-batches (batched on the server), on one weight snapshot."""

    version: int
    step: int  # this runtime's local optimizer steps at the forward: the delay clock (versions jump on averaging)
    inputs: torch.Tensor  # the micro-batches' inputs, concatenated along the batch dimension
    output: torch.Tensor  # carries the autograd graph to the snapshot (none without stashing)
    params: dict[str, torch.Tensor] | None  # the stashed weight snapshot; None without stashing
    created_at: float
    rows: dict[str, slice]  # micro-batch id -> its rows in inputs / output
    outstanding: set[str]  # members whose backward has not run yet

    def forget(self, microbatch_id: str) -> None:
        self.outstanding.discard(microbatch_id)


@dataclass
class BackwardResult:
    grad_input: torch.Tensor | None
    delay: int
    applied: bool
    dropped_reason: str = ""
    loss: float | None = None


@dataclass
class RuntimeStats:
    forwards: int = 0
    backwards: int = 0
    replays: int = 0
    steps: int = 0
    dropped_stale: int = 0
    dropped_nonfinite: int = 0
    dropped_outlier: int = 0  # gradients far outside the stage's running norm statistics (norm_guard.py)
    recomputed: int = 0  # backwards of batched forwards whose siblings came apart (one extra forward each)
    expired: int = 0
    dropped_stash_bound: int = 0  # forwards whose stashed version was dropped to keep the stash bound
    evaluations: int = 0  # forward-only validation calls (no record, no update)
    samples: int = 0
    busy_seconds: float = 0.0  # time spent computing: busy fraction = its rate of change
    delays: Counter = field(default_factory=Counter)


def stashed_versions(pending: Mapping[str, ForwardGroup]) -> list[dict[str, torch.Tensor]]:
    """The distinct weight snapshots pending forwards hold, oldest first."""
    seen: dict[int, dict[str, torch.Tensor]] = {}
    for group in list(pending.values()):  # a copy: metrics read this from another thread
        if group.params is not None:
            seen.setdefault(id(group.params), group.params)
    return list(seen.values())


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
