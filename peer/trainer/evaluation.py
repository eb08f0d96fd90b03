"""Validation loss through the swarm: a fixed set of held-out micro-batches, run forward-only now and then.

The :class:`Evaluator` is given the runner, the validation batches (wherever they come from: a list of
``(inputs, targets)``) and ``every``: after every ``every`` completed training micro-batches,
:meth:`Evaluator.maybe_run` takes the whole set through the swarm (a few batches at a time, with the
``evaluate`` flag: peers keep nothing and step nothing) and returns the mean loss, weighted by each
batch's target count. The trainer runs it as a task beside training, one at a time, so training
never waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Sequence
from typing import Protocol

import torch

from swarmpipe.peer.events import EventLog

DEFAULT_CONCURRENCY = 4  # validation batches in flight at once


class EvaluatesBatches(Protocol):
    """What the evaluator needs of the runner (``MicrobatchRunner.evaluate``)."""

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> Awaitable[float | None]: ...


Batch = tuple[torch.Tensor, torch.Tensor]


class Evaluator:
    def __init__(
        self,
        runner: EvaluatesBatches,
        batches: Sequence[Batch],
        every: int,
        events: EventLog | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        clock=time.monotonic,
    ):
        if every < 0:
            raise ValueError(f"every must be >= 0 (0 disables), got {every}")
        self.runner = runner
        self.batches = list(batches)
        self.every = every
        self.events = events
        self.concurrency = max(1, concurrency)
        self.clock = clock
        self.history: list[tuple[int, float]] = []  # (completed training micro-batches, validation loss)
        self._next = every  # the completed count at which the next evaluation is due

    @property
    def enabled(self) -> bool:
        return self.every > 0 and bool(self.batches)

    @property
    def last(self) -> float | None:
        return self.history[-1][1] if self.history else None

    def due(self, completed: int) -> bool:
        return self.enabled and completed >= self._next

    async def maybe_run(self, completed: int) -> float | None:
        """Run the validation set when ``completed`` reached the next multiple of ``every``; None when
        not due (or when no batch could be evaluated). Missed multiples are not made up for."""
        if not self.due(completed):
            return None
        self._next = (completed // self.every + 1) * self.every  # before any await: due no more
        return await self.run(completed)

    async def run(self, completed: int) -> float | None:
        """Evaluate every validation batch now (the final evaluation calls this directly); the mean loss
        weighted by target count, recorded in ``history``, or None when no batch completed."""
        if not self.batches:
            return None
        started = self.clock()
        gate = asyncio.Semaphore(self.concurrency)

        async def one(inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
            async with gate:
                return await self.runner.evaluate(inputs, targets)

        losses = await asyncio.gather(*(one(x, y) for x, y in self.batches))
        total = weight = 0.0
        done = 0
        for (_, targets), loss in zip(self.batches, losses):
            if loss is None or not math.isfinite(loss):
                continue
            total += loss * targets.numel()
            weight += targets.numel()
            done += 1
        seconds = round(self.clock() - started, 3)
        if done == 0:
            self._emit("evaluation_failed", logging.WARNING, step=completed, batches=len(self.batches), seconds=seconds)
            return None
        val_loss = total / weight
        self.history.append((completed, val_loss))
        self._emit(
            "evaluated",
            logging.INFO,
            step=completed,
            val_loss=round(val_loss, 6),
            batches=done,
            failed=len(self.batches) - done,
            seconds=seconds,
        )
        return val_loss

    def _emit(self, kind: str, level: int, **fields) -> None:
        if self.events is not None:
            self.events.emit(kind, level=level, **fields)
