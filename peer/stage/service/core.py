"""The serving core every ``Stage`` RPC family shares: the runtime it serves, the queue in front of the compute
thread, server-side batching (the coalescers), the reply encoding and byte counts, the metrics after a
backward, and how a failed request is answered (:meth:`ServingCore.serve`, the error contract of
peer/stage/server.py).

One core per peer; the services (compute, state, chain) hold it and read the runtime from it on every call,
so a rebalancing move (:meth:`ServingCore.swap_runtime`) reaches them all at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import torch

from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.stage.coalescer import Coalescer
from swarmpipe.peer.stage.lifecycle import Lifecycle
from swarmpipe.peer.stage.metrics import PeerMetrics
from swarmpipe.peer.stage.request_checks import RequestError
from swarmpipe.peer.stage.runtime import BackwardResult, StageRuntime, UnknownMicrobatch
from swarmpipe.peer.stage.siblings import Siblings, SiblingWaits
from swarmpipe.peer.swarm.records import PeerState
from swarmpipe.peer.transport.error_contract import Rejections, short
from swarmpipe.peer.transport.streaming import TensorView
from swarmpipe.peer.transport.wire import WireError, encode, encode_parts
from swarmpipe.protos import swarm_pb2

CALL_DEADLINE_S = 300.0  # the longest any one call may hold the server (trainers' own deadlines are far shorter)
log = logging.getLogger("swarmpipe.server")


class ServingCore:
    """What the stage's RPC services share: runtime, lifecycle, metrics, rejections, queue and batching."""

    def __init__(self, runtime: StageRuntime, peer_id: str, metrics: PeerMetrics, lifecycle: Lifecycle):
        self.runtime = runtime  # swapped by a rebalancing move (swap_runtime): read it per call, never keep it
        self.peer_id = peer_id
        self.metrics = metrics
        self.metrics.watch_runtime(lambda: self.runtime)  # stash and device memory, read when scraped
        self.rejections = Rejections(
            log, self.metrics.errors, lambda: f"peer {peer_id[-6:]} stage {self.runtime.stage}"
        )
        self.lifecycle = lifecycle  # owned by the daemon; the server only reads it
        self.queue = 0  # calls waiting for (or in) compute
        self.in_flight = 0  # calls being served
        self._reported_steps = runtime.stats.steps
        self._reported_stash_drops = 0
        batching = runtime.spec.batching
        self.siblings = SiblingWaits(lambda: self.runtime.pending, lambda: self.spec.batching.backward_wait_ms)
        self.forwards = self._coalescer("forward", self._run_forwards, batching.wait_ms)
        self.backwards = self._coalescer("backward", lambda items: self.runtime.backward_many(items), 0.0)
        self.forward_backwards = self._coalescer(
            "forward_backward", lambda items: self.runtime.forward_backward_many(items), batching.wait_ms
        )

    @property
    def spec(self) -> RunSpec:
        return self.runtime.spec

    @property
    def state(self) -> PeerState:
        return self.lifecycle.state

    def swap_runtime(self, runtime: StageRuntime) -> None:
        """Serve another stage from now on (rebalancing); the old runtime must be drained first."""
        self.runtime = runtime
        self._reported_steps = runtime.stats.steps
        self.metrics.version.set(runtime.version)

    # ------------------------------------------------------------ batching
    def _submit(self, fn: Callable[[], Any]):
        return self.runtime.submit(fn)  # late-bound: a rebalancing move swaps the runtime

    def _coalescer(self, method: str, run: Callable[[list], list], wait_ms: float) -> Coalescer:
        return Coalescer(
            self._submit,
            run,
            max_items=self.spec.batching.max_microbatches,
            wait_s=wait_ms / 1000,
            name=method,
            on_batch=self.metrics.batch.labels(method).observe,
        )

    def _run_forwards(self, items: list[tuple[str, torch.Tensor]]) -> list[tuple[torch.Tensor, Siblings | None]]:
        """Compute thread: one forward for the batch; each caller gets the batch's shared sibling record."""
        outputs = self.runtime.forward_many(items)
        shared = len(items) > 1 and self.spec.batching.backward_wait_ms > 0
        siblings = Siblings(frozenset(mb for mb, _ in items)) if shared else None
        return [(out, siblings) for out in outputs]

    def coalescers(self) -> tuple[Coalescer, ...]:
        return self.forwards, self.backwards, self.forward_backwards

    # ------------------------------------------------------------ bytes
    def count_bytes(self, msg: swarm_pb2.Tensor | TensorView, incoming: bool, nbytes: int | None = None) -> None:
        if nbytes is None:  # ByteSize, not len(msg.data): reading a protobuf bytes field copies it
            nbytes = len(msg.data) if isinstance(msg, TensorView) else msg.ByteSize()
        (self.metrics.bytes_in if incoming else self.metrics.bytes_out).labels(msg.codec or "none").inc(nbytes)

    def encode(self, t: torch.Tensor, codec: str, sink: dict | None = None, field: str = "") -> swarm_pb2.Tensor:
        """The reply tensor in ``codec`` (from :func:`reply_codec`). With a ``sink`` (a streamed reply) its
        bytes go there as a buffer and the message carries only shape, dtype and codec: the frames are cut
        from the buffer directly."""
        if sink is None:
            msg = encode(t, codec)
            self.count_bytes(msg, incoming=False)
            return msg
        msg, payload = encode_parts(t, codec)
        sink[field] = payload
        self.count_bytes(msg, incoming=False, nbytes=memoryview(payload).nbytes)
        return msg

    # ------------------------------------------------------------ serving a call
    async def compute(self, method: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the single compute thread, counting the queue in front of it."""
        return await self.queued(method, lambda: self.runtime.run(fn))

    async def queued(self, method: str, start: Callable[[], Awaitable[Any]]) -> Any:
        """Await ``start()`` (a compute call or a coalescer's submit), counted in the queue and timed."""
        self.queue += 1
        self.metrics.queue.set(self.queue)
        started = time.perf_counter()
        try:
            return await start()
        finally:
            self.queue -= 1
            self.metrics.queue.set(self.queue)
            self.metrics.latency.labels(method).observe(time.perf_counter() - started)

    async def serve(self, method: str, context: grpc.aio.ServicerContext, handler: Callable[[], Any]) -> Any:
        """Count the call, run ``handler`` under the server's deadline, and answer what it raised by the
        error contract (peer/stage/server.py)."""
        self.metrics.requests.labels(method).inc()
        self.in_flight += 1
        try:
            async with asyncio.timeout(CALL_DEADLINE_S):  # a caller without a deadline cannot pin a slot forever
                return await handler()
        except TimeoutError:
            await self.rejections.reject(
                context,
                method,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the call outlived the server's deadline",
                "deadline",
            )
        except RequestError as e:
            await self.rejections.reject(context, method, e.code, str(e), e.code.name.lower())
        except WireError as e:
            await self.rejections.reject(context, method, grpc.StatusCode.INVALID_ARGUMENT, str(e), "invalid_tensor")
        except UnknownMicrobatch as e:  # routine (an evicted or validation forward): counted, not logged
            self.metrics.errors.labels(method, "unknown_microbatch").inc()
            await context.abort(grpc.StatusCode.NOT_FOUND, short(str(e.args[0])))
        except ValueError as e:
            await self.rejections.reject(context, method, grpc.StatusCode.INVALID_ARGUMENT, str(e), "invalid_argument")
        finally:
            self.in_flight -= 1

    def require_accepting(self) -> None:
        """UNAVAILABLE unless the peer takes new work (online)."""
        if not self.lifecycle.accepting:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE, f"peer is {self.state.value}; send new work to another replica"
            )

    def after_backward(self, result: BackwardResult) -> None:
        """The metrics a backward moves: its delay, a dropped gradient, steps, version, throughput."""
        self.metrics.delay.observe(result.delay)
        if not result.applied:
            self.metrics.dropped.labels(result.dropped_reason.split(":")[0]).inc()
            if result.dropped_reason.startswith("outlier"):  # rare, and worth a line: a bad or hostile trainer
                log.warning("peer %s stage %d: %s", self.peer_id[-6:], self.runtime.stage, result.dropped_reason)
        # Local steps, not versions: a version jumps when another replica's weights are averaged in.
        self.metrics.optimizer_steps.inc(self.runtime.stats.steps - self._reported_steps)
        self._reported_steps = self.runtime.stats.steps
        self.metrics.version.set(self.runtime.version)
        self.metrics.throughput.set(self.runtime.throughput())
        stash_drops = self.runtime.stats.dropped_stash_bound
        if stash_drops > self._reported_stash_drops:  # forwards dropped to keep the stash bound (replayed)
            self.metrics.dropped.labels("stash_bound").inc(stash_drops - self._reported_stash_drops)
            self._reported_stash_drops = stash_drops
