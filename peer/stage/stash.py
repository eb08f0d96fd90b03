"""What a stage's compute leaves behind: the stash of forwards awaiting their backward
(:class:`PendingForwards`), the result of a backward, and the runtime's counters.

A forward runs on an immutable snapshot of the weights and keeps its autograd graph in a
:class:`ForwardGroup` (one per forward call, shared by the micro-batches a server batch joined), so
the matching backward is exact for the weights that produced the activations.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import ItemsView, Iterable, Iterator, Mapping, ValuesView
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


class PendingForwards:
    """The stash: micro-batch id -> the :class:`ForwardGroup` of its forward, until its backward runs.

    Oldest first. Bounded in count (``max_pending``: beyond it the oldest forward of whoever holds the most
    goes) and, through the weight snapshots the groups hold, in bytes (``bound_bytes``, see
    :meth:`make_room`). Every record dropped before its backward is counted in ``stats``. Read (``in``,
    ``len``, :meth:`versions`) from other threads; written only on the runtime's compute thread.
    """

    def __init__(self, stats: RuntimeStats, max_pending: int = 256, bound_bytes: int = 0):
        self.stats = stats  # the runtime's counters: expired and dropped_stash_bound are counted here
        self.max_pending = max_pending
        self.bound_bytes = bound_bytes  # bytes the stashed snapshots may take; 0: no bound beyond max_staleness
        self._groups: OrderedDict[str, ForwardGroup] = OrderedDict()

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, microbatch_id: object) -> bool:
        return microbatch_id in self._groups

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __getitem__(self, microbatch_id: str) -> ForwardGroup:
        return self._groups[microbatch_id]

    def get(self, microbatch_id: str) -> ForwardGroup | None:
        return self._groups.get(microbatch_id)

    def items(self) -> ItemsView[str, ForwardGroup]:
        return self._groups.items()

    def values(self) -> ValuesView[ForwardGroup]:
        return self._groups.values()

    def add(self, group: ForwardGroup) -> None:
        """Hold ``group`` for each of its micro-batches (forgotten before, if retried); then evict past
        ``max_pending``, counted as expired."""
        for microbatch_id in group.rows:
            self._groups[microbatch_id] = group
        while len(self._groups) > self.max_pending:
            self.forget(self._eviction_victim())
            self.stats.expired += 1

    def forget(self, microbatch_id: str) -> None:
        """Drop the record of ``microbatch_id`` (its backward ran, or never will): its group waits for it no more."""
        group = self._groups.pop(microbatch_id, None)
        if group is not None:
            group.forget(microbatch_id)

    def clear(self) -> None:
        """Drop every record (the weights they were taken on were replaced)."""
        self._groups.clear()

    def _eviction_victim(self) -> str:
        """The oldest forward of whoever holds the most, so one caller's flood pushes out its own work, not
        another's. Keys are ``"<caller>|<ticket digest>|<id>"`` (the servicer's ``pending_key``)."""
        counts = Counter(key.split("|", 1)[0] for key in self._groups)
        hog = max(counts, key=counts.__getitem__)
        return next(key for key in self._groups if key.split("|", 1)[0] == hog)

    def expire(self, now: float, ttl_s: float, steps: int, max_staleness: int) -> int:
        """Drop forwards whose backward never came (older than ``ttl_s``: the trainer died) or could no longer
        apply (more than ``max_staleness`` of the runtime's ``steps`` ago); returns how many."""
        dead = [key for key, g in self._groups.items() if now - g.created_at > ttl_s or steps - g.step > max_staleness]
        for key in dead:
            self.forget(key)
        self.stats.expired += len(dead)
        return len(dead)

    # ---------------------------------------------------------------- the weight snapshots they hold
    def versions(self) -> list[dict[str, torch.Tensor]]:
        """The distinct weight snapshots held, oldest first."""
        return stashed_versions(self._groups)

    def snapshot_bytes(self) -> int:
        """Bytes of the weight snapshots held."""
        return tensor_bytes(t for params in self.versions() for t in params.values())

    def make_room(self, snapshot_bytes: int) -> None:
        """Before a new snapshot of ``snapshot_bytes``: drop the oldest stashed versions' forwards while one
        more snapshot would pass ``bound_bytes`` (counted; their backwards come back unknown and the trainer
        replays them on the live weights, so nothing is lost and memory never runs out)."""
        if not self.bound_bytes:
            return
        versions = self.versions()
        while versions and (len(versions) + 1) * snapshot_bytes > self.bound_bytes:
            oldest = versions.pop(0)
            for microbatch_id in [mb for mb, g in self._groups.items() if g.params is oldest]:
                self.forget(microbatch_id)
                self.stats.dropped_stash_bound += 1
