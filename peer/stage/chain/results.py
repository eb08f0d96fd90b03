"""Each chained micro-batch runs once per peer, whoever asks again: the work and its result, by ticket and id.

A chain breaks in the middle (a peer dies during its backward, a call times out) after the stages below it
already stepped with the micro-batch's gradient. The peer above then sends the same micro-batch (same id, same
trainer ticket) through another replica, which calls the same next replicas again: they must answer with what
they already did, not step twice. So a peer keeps, per ``(ticket digest, micro-batch id)``:

* the work while it runs, as a task of its own: a caller that vanishes (its peer died, its deadline passed) does
  not cancel it, so a stage never steps without its result being kept, and a second request for the same
  micro-batch waits for the first one's result instead of starting over;
* the finished result (loss, input gradient, what every later stage did) for ``ttl_s``, bounded in count and
  bytes: the largest holder's oldest result goes first, so one caller's flood evicts its own.

Running work is bounded too (``max_running`` in all, ``max_running_per_caller`` per caller): beyond it a request
is refused with RESOURCE_EXHAUSTED before any work.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import torch

from swarmpipe.peer.stage.request_checks import RequestError
from swarmpipe.protos import swarm_pb2


@dataclass
class ChainDone:
    """What one stage's share of a chained micro-batch came to."""

    grad_input: torch.Tensor | None  # None on stage 0
    loss: float
    stages: list[swarm_pb2.ChainStageResult]  # this stage first, then every later one
    version: int = 0
    caller: str = ""
    created_at: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return 0 if self.grad_input is None else self.grad_input.numel() * self.grad_input.element_size()


def result_key(ticket: bytes, microbatch_id: str) -> str:
    return f"{hashlib.sha256(ticket).hexdigest()[:32]}|{microbatch_id}"


class ChainResults:
    def __init__(
        self,
        max_results: int = 512,
        max_bytes: int = 256 << 20,
        ttl_s: float = 120.0,
        max_running: int = 256,
        max_running_per_caller: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_results = max_results
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.max_running = max_running
        self.max_running_per_caller = max_running_per_caller
        self.clock = clock
        self.done: OrderedDict[str, ChainDone] = OrderedDict()
        self.running: dict[str, tuple[str, asyncio.Task[ChainDone]]] = {}  # key -> (caller, work)
        self.reused = 0  # requests answered from a kept result or from work already under way
        self._bytes = 0

    async def once(self, key: str, caller: str, work: Callable[[], Awaitable[ChainDone]]) -> ChainDone:
        """The result of ``work`` for ``key``: kept, under way, or started now (and kept once it ends)."""
        self._expire()
        kept = self.done.get(key)
        if kept is not None:
            self.reused += 1
            return kept
        running = self.running.get(key)
        if running is None:
            self._admit(caller)
            task = asyncio.ensure_future(self._run(key, caller, work))
            self.running[key] = (caller, task)
        else:
            self.reused += 1
            task = running[1]
        return await asyncio.shield(task)  # the caller may go; the work goes on

    def _admit(self, caller: str) -> None:
        if len(self.running) >= self.max_running:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many chained micro-batches under way here")
        if sum(c == caller for c, _ in self.running.values()) >= self.max_running_per_caller:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.max_running_per_caller} chained micro-batches from this caller are under way already",
            )

    async def _run(self, key: str, caller: str, work: Callable[[], Awaitable[ChainDone]]) -> ChainDone:
        try:
            result = await work()
        finally:
            self.running.pop(key, None)
        result.caller = caller
        result.created_at = self.clock()
        self._keep(key, result)
        return result

    def _keep(self, key: str, result: ChainDone) -> None:
        if result.nbytes > self.max_bytes:
            return
        old = self.done.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        self.done[key] = result
        self._bytes += result.nbytes
        while len(self.done) > self.max_results or self._bytes > self.max_bytes:
            self._drop(self._victim())

    def _victim(self) -> str:
        """The oldest result of whoever holds the most."""
        counts = Counter(r.caller for r in self.done.values())
        hog = max(counts, key=counts.__getitem__)
        return next(k for k, r in self.done.items() if r.caller == hog)

    def _drop(self, key: str) -> None:
        result = self.done.pop(key)
        self._bytes -= result.nbytes

    def _expire(self) -> None:
        now = self.clock()
        while self.done:
            key, oldest = next(iter(self.done.items()))
            if now - oldest.created_at <= self.ttl_s:
                break
            self._drop(key)

    @property
    def nbytes(self) -> int:
        return self._bytes

    async def close(self) -> None:
        """Cancel the work under way (the peer is leaving)."""
        tasks = [t for _, t in self.running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
