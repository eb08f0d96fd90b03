"""The trainer's running tally: micro-batches started and how each ended, losses, rates.

Only the trainer writes it: it calls ``start()`` before launching a micro-batch
and ``apply(outcome)`` with what ``MicrobatchRunner.run`` returned. Everything
else (the progress bar, the "progress" event, the DHT record, the final
report) reads from it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from swarmpipe.peer.swarm.records import MAX_VAL_LOSS, TrainerRecord, now
from swarmpipe.peer.trainer.outcome import MicrobatchOutcome, MicrobatchStatus

LOSS_WINDOW = 10  # micro-batches averaged for the loss EMA, loss_first and loss_last
RECENT_WINDOW_S = 10.0


@dataclass
class Progress:
    started: int = 0
    completed: int = 0
    retried: int = 0  # summed over outcomes: retries on another replica plus backward replays
    dropped_stale: int = 0
    failed: int = 0
    losses: list[float] = field(default_factory=list)  # completed and dropped-stale, in the order they ended
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (completed, validation loss), in order
    resumed: int = 0  # completed before this process (restored from --state-file): not in its rates
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)
    t0: float = field(init=False)  # when the tally began, by ``clock``
    marks: deque[tuple[float, int]] = field(default_factory=deque, repr=False)  # (time, completed) samples

    def __post_init__(self) -> None:
        self.t0 = self.clock()

    # ------------------------------------------------------------ writes (trainer only)
    def start(self) -> int:
        """Count one more micro-batch launched; returns its ordinal (1-based), used in its id."""
        self.started += 1
        return self.started

    def apply(self, outcome: MicrobatchOutcome) -> None:
        """Fold one micro-batch's outcome in. A stale micro-batch still ran a forward: its loss is kept."""
        self.retried += outcome.retries
        if outcome.status is MicrobatchStatus.FAILED:
            self.failed += 1
            return
        if outcome.status is MicrobatchStatus.DROPPED_STALE:
            self.dropped_stale += 1
        else:
            self.completed += 1
        if outcome.loss is not None:
            self.losses.append(outcome.loss)

    def validated(self, step: int, val_loss: float) -> None:
        """Fold in one validation loss, measured when ``step`` micro-batches had completed."""
        self.val_losses.append((step, val_loss))

    # ------------------------------------------------------------ reads
    @property
    def ended(self) -> int:
        """Micro-batches that will not run any more, whichever way they ended."""
        return self.completed + self.dropped_stale + self.failed

    @property
    def lost(self) -> int:
        """Micro-batches that ended neither completed nor counted as dropped (the goal: always 0)."""
        return self.failed

    @property
    def unfinished(self) -> int:
        return self.started - self.ended

    @property
    def elapsed_s(self) -> float:
        return self.clock() - self.t0

    def samples_per_s(self, microbatch_size: int) -> float:
        elapsed = self.elapsed_s
        return (self.completed - self.resumed) * microbatch_size / elapsed if elapsed > 0 else 0.0

    def recent_samples_per_s(self, microbatch_size: int, window_s: float = RECENT_WINDOW_S) -> float:
        """Rate over the last ``window_s`` seconds: what the swarm does now, not since the start.
        Each call leaves a mark; marks older than the window are let go."""
        t = self.clock()
        self.marks.append((t, self.completed))
        while len(self.marks) > 2 and self.marks[1][0] < t - window_s:
            self.marks.popleft()
        t0, c0 = self.marks[0]
        return (self.completed - c0) * microbatch_size / (t - t0) if t > t0 else 0.0

    def loss_ema(self) -> float | None:
        return _mean(self.losses[-LOSS_WINDOW:])

    @property
    def val_loss(self) -> float | None:
        """The newest validation loss; None before the first evaluation."""
        return self.val_losses[-1][1] if self.val_losses else None

    def record(self, microbatch_size: int) -> TrainerRecord:
        """What the trainer announces in the DHT: the coordinator's dashboard and metrics read it."""
        return TrainerRecord(
            step=self.completed,
            loss=_announceable(self.loss_ema()),
            samples_per_s=self.samples_per_s(microbatch_size),
            microbatches_completed=self.completed,
            microbatches_retried=self.retried,
            microbatches_lost=self.lost,
            val_loss=_announceable(self.val_loss),
            updated_at=now(),
        )

    def report(self, run_id: str, microbatch_size: int) -> dict[str, Any]:
        """The final report (--report): field names are read by tests, bench and the demo; keep them."""
        return {
            "run_id": run_id,
            "steps": self.completed,
            "microbatches_started": self.started,
            "microbatches_completed": self.completed,
            "microbatches_retried": self.retried,
            "microbatches_dropped_stale": self.dropped_stale,
            "microbatches_lost": self.lost,
            "microbatches_unfinished": self.unfinished,
            "loss_first": _mean(self.losses[:LOSS_WINDOW]),
            "loss_last": _mean(self.losses[-LOSS_WINDOW:]),
            "samples_per_s": self.samples_per_s(microbatch_size),
            "elapsed_s": self.elapsed_s,
            "losses": self.losses,
            "val_loss": self.val_loss,
            "val_losses": [[step, loss] for step, loss in self.val_losses],
        }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _announceable(loss: float | None) -> float | None:
    """A loss the DHT record's bounds accept (finite, 0..MAX_VAL_LOSS), else none: readers refuse the rest."""
    return loss if loss is not None and 0 <= loss <= MAX_VAL_LOSS else None
