"""Server-side batching: requests that queue up while the compute thread is busy run as one batch.

A stage peer computes on one thread. Under load, Forward (or ForwardBackward, or
Backward) requests wait in front of it; running the waiting ones together as one
batch does the same arithmetic in fewer, larger kernels, and (for the update
side) one optimizer step instead of several. When the peer is idle nothing
waits: a lone request runs at once (``wait_s`` = 0, the default), so batching
adds no latency; a small ``wait_s`` trades latency for larger batches.

Only requests with the same ``key`` (for tensors: trailing shape and dtype) are
batched together, and at most ``max_items`` at a time. ``run_batch`` returns one
result or exception per item, so one bad request never fails its neighbours.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

log = logging.getLogger("swarmpipe.coalescer")
T = TypeVar("T")


@dataclass
class _Entry(Generic[T]):
    key: Hashable
    item: T
    future: asyncio.Future


@dataclass
class CoalescerStats:
    batches: int = 0
    items: int = 0
    sizes: Counter = field(default_factory=Counter)  # batch size -> how many batches

    @property
    def mean_batch(self) -> float:
        return self.items / self.batches if self.batches else 0.0


class Coalescer(Generic[T]):
    def __init__(
        self,
        submit: Callable[[Callable[[], Any]], Future],
        run_batch: Callable[[list[T]], list[Any]],
        max_items: int = 4,
        wait_s: float = 0.0,
        name: str = "batch",
        on_batch: Callable[[int], None] | None = None,
    ):
        if max_items < 1:
            raise ValueError("max_items must be >= 1")
        self._submit = submit  # queues work on the compute thread (StageRuntime.submit)
        self.run_batch = run_batch
        self.max_items = max_items
        self.wait_s = wait_s
        self.name = name
        self.on_batch = on_batch
        self.stats = CoalescerStats()
        self._queue: list[_Entry[T]] = []
        self._lock = threading.Lock()  # the queue is filled on the event loop and drained on the compute thread

    async def submit(self, item: T, key: Hashable = ()) -> Any:
        """Queue ``item``; returns its result (or raises its exception) once its batch ran."""
        loop = asyncio.get_running_loop()
        entry = _Entry(key, item, loop.create_future())
        with self._lock:
            self._queue.append(entry)
            queued = sum(1 for e in self._queue if e.key == key)
        if self.wait_s > 0 and queued < self.max_items:
            loop.call_later(self.wait_s, self._schedule_drain, loop)
        else:
            # call_soon, not a direct submit: requests woken in this same loop iteration join the batch.
            loop.call_soon(self._schedule_drain, loop)
        return await entry.future

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def _schedule_drain(self, loop: asyncio.AbstractEventLoop) -> None:
        # One drain per request: a drain that finds its request already taken by an earlier batch does nothing.
        # submit to the compute thread, not loop.run_in_executor: the results reach the loop through _settle alone, and an
        # asyncio wrapper future would wake the loop a second time per batch for nothing.
        try:
            self._submit(lambda: self._drain(loop)).add_done_callback(self._log_crash)
        except RuntimeError as e:  # the compute thread was shut down (the peer is stopping): fail what waits
            self._fail_all(e)

    def _log_crash(self, done: Future) -> None:
        if not done.cancelled() and done.exception() is not None:  # a bug in _drain itself, not in a batch
            log.error("%s: drain failed", self.name, exc_info=done.exception())

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            entries, self._queue = self._queue, []
        for entry in entries:
            _settle(entry.future, error)

    def _take(self) -> list[_Entry[T]]:
        with self._lock:
            live = [e for e in self._queue if not e.future.cancelled()]
            if not live:
                self._queue.clear()
                return []
            key = live[0].key
            batch = [e for e in live if e.key == key][: self.max_items]
            taken = {id(e) for e in batch}
            self._queue = [e for e in live if id(e) not in taken]
            return batch

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        batch = self._take()
        if not batch:
            return
        try:
            results = self.run_batch([e.item for e in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"{self.name}: {len(results)} results for {len(batch)} requests")
        except Exception as e:  # a bug in the batch function: every request in it fails with the same error
            log.exception("%s batch of %d failed", self.name, len(batch))
            results = [e] * len(batch)
        self.stats.batches += 1
        self.stats.items += len(batch)
        self.stats.sizes[len(batch)] += 1
        try:
            if self.on_batch is not None:
                self.on_batch(len(batch))
        except Exception:  # a metrics hook must not strand the batch's callers
            log.exception("%s: on_batch hook failed", self.name)
        try:
            loop.call_soon_threadsafe(_settle_all, batch, results)  # one wake-up of the loop per batch
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


def _settle_all(batch: list[_Entry], results: list[Any]) -> None:
    for entry, result in zip(batch, results):
        _settle(entry.future, result)


def _settle(future: asyncio.Future, result: Any) -> None:
    if future.done():  # the caller gave up (deadline, cancellation); the work was done anyway
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
