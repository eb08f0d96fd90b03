"""Which sequences a trainer reads, in which order, and where it stands: shards, cursors, micro-batches.

Every source numbers its training sequences globally (k = 0, 1, ...). A trainer with ``shard=i`` of
``num_shards=n`` reads only the k with k % n == i, so trainers never share a sequence and together
cover each epoch. ``DataCursor(epoch, position)`` counts the shard's sequences handed out in the
epoch; a trainer saves it and a restart continues right after them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from swarmpipe.peer.data.errors import DataError

VALID_FRACTION = 0.05  # random-access sources hold out the last 5 % of their windows ...
MAX_VALID_SEQUENCES = 256  # ... but never more than this (evaluation stays cheap) ...
MIN_VALID_SEQUENCES = 1  # ... and never none


@dataclass
class DataCursor:
    """Where one shard stands: ``position`` of its sequences handed out in ``epoch``."""

    epoch: int = 0
    position: int = 0

    def __post_init__(self) -> None:
        for name in ("epoch", "position"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise DataError(f"data cursor: {name} must be an integer >= 0, got {value!r}")

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    @classmethod
    def from_dict(cls, raw: Any) -> DataCursor:
        if not isinstance(raw, Mapping):
            raise DataError(f"data cursor must be a mapping with epoch and position, got {type(raw).__name__}")
        unknown = set(raw) - {"epoch", "position"}
        if unknown or "epoch" not in raw or "position" not in raw:
            raise DataError(f"data cursor needs exactly the keys epoch and position, got {sorted(map(str, raw))}")
        return cls(epoch=raw["epoch"], position=raw["position"])


def check_shard(shard: int, num_shards: int) -> None:
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise DataError(f"shard {shard} of {num_shards}: need num_shards >= 1 and 0 <= shard < num_shards")


def split_windows(windows: int) -> tuple[int, int]:
    """(training, validation) counts of a random-access source's windows; validation is the tail."""
    valid = min(MAX_VALID_SEQUENCES, max(MIN_VALID_SEQUENCES, int(windows * VALID_FRACTION)))
    if windows - valid < 1:
        raise DataError(f"only {windows} sequence(s) in the data: need at least {valid + 1} (training + validation)")
    return windows - valid, valid


def shard_size(total: int, shard: int, num_shards: int) -> int:
    """How many of ``range(total)`` fall to ``shard``."""
    return len(range(shard, total, num_shards))


def epoch_order(train: int, shard: int, num_shards: int, seed: int, epoch: int) -> np.ndarray:
    """The shard's training sequence indices for one epoch: a full pass in a fresh order.

    Seeded by ``seed + epoch`` so every trainer, and every restart, computes the same order."""
    mine = np.arange(shard, train, num_shards, dtype=np.int64)
    return mine[np.random.default_rng(seed + epoch).permutation(mine.size)]


class ShardSource(Protocol):
    """One shard's view of a source: its sequences in an epoch's order, from a position on."""

    def sequences(self, epoch: int, start: int) -> Iterator[tuple[int, np.ndarray]]:
        """(global index, ``seq_len + 1`` ids) for the shard's sequences ``start``, ``start + 1`` ... of ``epoch``."""
        ...


def to_batch(windows: list[np.ndarray], vocab_size: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 (inputs, targets) of shape [B, seq_len]; an id outside the vocabulary is a DataError."""
    ids = torch.from_numpy(np.stack(windows).astype(np.int64, copy=False))
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
        raise DataError(f"{what}: token id {bad} is outside the model's vocabulary [0, {vocab_size})")
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


class MicrobatchStream:
    """Micro-batches of one shard, across epochs; ``cursor`` is where it stands after the last batch.

    After a batch that finishes the epoch the cursor already reads (epoch + 1, 0): the saved cursor
    never points at an exhausted epoch."""

    def __init__(self, source: ShardSource, batch_size: int, vocab_size: int, cursor: DataCursor | None = None):
        if batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {batch_size}")
        self.source = source
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        start = cursor if cursor is not None else DataCursor()
        self._epoch = start.epoch
        self._position = start.position
        self._it: Iterator[tuple[int, np.ndarray]] | None = None
        self._peeked: tuple[int, np.ndarray] | None = None

    @property
    def cursor(self) -> DataCursor:
        return DataCursor(self._epoch, self._position)

    def _pull(self) -> tuple[int, np.ndarray] | None:
        if self._peeked is not None:
            item, self._peeked = self._peeked, None
            return item
        if self._it is None:
            self._it = self.source.sequences(self._epoch, self._position)
        return next(self._it, None)

    def _roll_over(self) -> None:
        self._epoch += 1
        self._position = 0
        self._it = None

    def next(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        windows: list[np.ndarray] = []
        indices: list[int] = []
        while len(windows) < self.batch_size:
            item = self._pull()
            if item is None:
                if self._position == 0:
                    raise DataError(f"no training sequences in epoch {self._epoch} of this shard (too little data)")
                self._roll_over()
                continue
            indices.append(item[0])
            windows.append(item[1])
            self._position += 1
        # look one ahead so the cursor of a batch that ends the epoch already names the next one
        self._peeked = self._pull()
        if self._peeked is None:
            self._roll_over()
        return (*to_batch(windows, self.vocab_size, f"sequences {indices[0]}..{indices[-1]}"), indices)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[int]]]:
        while True:
            yield self.next()


def fixed_batches(
    windows: list[np.ndarray], batch_size: int, vocab_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The validation windows as micro-batches of ``batch_size`` (the last may be smaller)."""
    if batch_size < 1:
        raise DataError(f"batch_size must be >= 1, got {batch_size}")
    return [
        to_batch(windows[i : i + batch_size], vocab_size, "validation sequences")
        for i in range(0, len(windows), batch_size)
    ]
