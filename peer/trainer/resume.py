"""The trainer's state file: where its data shard stands and what it has done, so a restart resumes.

Written atomically (temporary file, then rename) every time the trainer takes micro-batches from its
data, with the cursor *after* them: a trainer killed at any moment restarts past every sequence it
ever launched, so no sequence is trained twice within an epoch (the micro-batches that were in flight
when it died are not retried: at most once, never twice). Counters are those at the last write; a
clean stop (SIGTERM, the end of the run) writes the final ones.

The file names its run, shard and data, and a restart with another run, shard layout or data set is
refused rather than silently reading the wrong sequences.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmpipe.peer.data import DataCursor, DataError
from swarmpipe.peer.trainer.progress import Progress

FORMAT = "swarmpipe-trainer-state"
VERSION = 1
MAX_BYTES = 1 << 20
MAX_VAL_POINTS = 1000  # the validation series kept across restarts


@dataclass
class TrainerState:
    run_id: str
    shard: int
    num_shards: int
    data: str  # what the data source describes itself as (kind and path): a restart must read the same
    cursor: DataCursor = field(default_factory=DataCursor)
    counters: dict[str, int] = field(default_factory=dict)
    val_losses: list[tuple[int, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "run_id": self.run_id,
            "shard": self.shard,
            "num_shards": self.num_shards,
            "data": self.data,
            "cursor": self.cursor.to_dict(),
            "counters": dict(self.counters),
            "val_losses": [[s, v] for s, v in self.val_losses[-MAX_VAL_POINTS:]],
        }

    @classmethod
    def from_dict(cls, raw: Any) -> TrainerState:
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("version") != VERSION:
            raise DataError(f"not a trainer state file of version {VERSION}")
        counters = raw.get("counters") or {}
        if not isinstance(counters, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counters.values()
        ):
            raise DataError("trainer state: counters must be integers >= 0")
        points = raw.get("val_losses") or []
        try:
            val_losses = [(int(s), float(v)) for s, v in points]
        except (TypeError, ValueError):
            raise DataError("trainer state: val_losses must be [step, loss] pairs") from None
        try:
            return cls(
                run_id=str(raw["run_id"]),
                shard=int(raw["shard"]),
                num_shards=int(raw["num_shards"]),
                data=str(raw["data"]),
                cursor=DataCursor.from_dict(raw["cursor"]),
                counters={str(k): v for k, v in counters.items()},
                val_losses=val_losses,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"trainer state: {e}") from None


COUNTERS = ("completed", "dropped_stale", "failed", "retried")


class StateFile:
    """Reads the state at start, checks it belongs to this trainer, rewrites it as the cursor moves."""

    def __init__(self, path: str, run_id: str, shard: int, num_shards: int, data: str):
        self.path = Path(path) if path else None
        self.state = TrainerState(run_id, shard, num_shards, data)
        self.resumed = False

    def load(self) -> TrainerState:
        """The saved state when there is one for this run, shard layout and data; a fresh one otherwise.
        A state of another run or layout raises DataError (delete the file to start over)."""
        if self.path is None or not self.path.exists():
            return self.state
        if self.path.stat().st_size > MAX_BYTES:
            raise DataError(f"trainer state {self.path} is larger than {MAX_BYTES} bytes")
        try:
            saved = TrainerState.from_dict(json.loads(self.path.read_text()))
        except ValueError as e:
            raise DataError(f"trainer state {self.path}: {e}") from None
        mine = self.state
        theirs = (saved.run_id, saved.shard, saved.num_shards, saved.data)
        if theirs != (mine.run_id, mine.shard, mine.num_shards, mine.data):
            raise DataError(
                f"trainer state {self.path} is for run {saved.run_id!r} shard {saved.shard}/{saved.num_shards} "
                f"on {saved.data}; this trainer is run {mine.run_id!r} shard {mine.shard}/{mine.num_shards} on "
                f"{mine.data} (use another --state-file, or delete it to start over)"
            )
        self.state, self.resumed = saved, True
        return saved

    def restore(self, progress: Progress) -> None:
        """Carry the saved counters and validation series into a new tally."""
        for name in COUNTERS:
            setattr(progress, name, self.state.counters.get(name, 0))
        progress.started = progress.completed + progress.dropped_stale + progress.failed
        progress.resumed = progress.completed
        progress.val_losses = list(self.state.val_losses)

    def save(self, cursor: DataCursor, progress: Progress) -> None:
        if self.path is None:
            return
        self.state.cursor = cursor
        self.state.counters = {name: int(getattr(progress, name)) for name in COUNTERS}
        self.state.val_losses = list(progress.val_losses)
        tmp = self.path.with_name(self.path.name + ".tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(self.state.to_dict()))
        os.replace(tmp, self.path)
