"""gRPC service ``Stage``: validates every request, then runs it on the compute thread.

Error contract (status code: when):
  FAILED_PRECONDITION this peer serves another run or stage (it moved): the caller's view is stale
  INVALID_ARGUMENT   bad micro-batch id, bad tensor (dtype, shape, bytes, NaN/Inf)
  NOT_FOUND          backward for a micro-batch this peer holds no forward for
  UNAVAILABLE        the peer is draining or not ready: retry on another replica
  RESOURCE_EXHAUSTED message over the size cap (enforced by grpc itself)
  UNAUTHENTICATED    a private swarm's call without valid credentials (refused before any work)
The peer keeps serving after any of them. Request bytes that do not decode are INVALID_ARGUMENT too,
before any work; a status detail is short (a caller's strings cut), and a refused request is logged at
most once per caller per 10 s, never with a traceback (peer/transport/error_contract.py).
Forward / ForwardBackward with ``evaluate``: validation on the live weights, no batching, nothing kept (a Backward
for that id is NOT_FOUND), nothing stepped. ``Chain`` (micro-batches passed peer to peer): chain_rpc.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import torch

from swarmpipe.peer.stage.chain.service import ChainRPCs
from swarmpipe.peer.stage.coalescer import Coalescer
from swarmpipe.peer.stage.device import device_info, memory_in_use
from swarmpipe.peer.stage.lifecycle import Lifecycle
from swarmpipe.peer.stage.metrics import PeerMetrics
from swarmpipe.peer.stage.request_checks import (
    RequestError,
    check_header,
    check_logits_size,
    decode_grad_output,
    decode_stage_input,
    pending_key,
    reply_codec,
)
from swarmpipe.peer.stage.runtime import BackwardResult, StageRuntime, UnknownMicrobatch
from swarmpipe.peer.stage.service.state import StateRPCs
from swarmpipe.peer.stage.siblings import Siblings, SiblingWaits
from swarmpipe.peer.state.format import StageState
from swarmpipe.peer.state.transfer import DonorSnapshot
from swarmpipe.peer.swarm.records import WIRE_PROTOCOL, PeerState
from swarmpipe.peer.transport import security as process_security
from swarmpipe.peer.transport.channels import server_options, tune_allocator
from swarmpipe.peer.transport.error_contract import Rejections, caller_key, generated_handlers, guard_handlers, short
from swarmpipe.peer.transport.streaming import METHODS as STREAM_METHODS
from swarmpipe.peer.transport.streaming import TensorView, frames, reassemble
from swarmpipe.peer.transport.unauthenticated import counted
from swarmpipe.peer.transport.wire import WireError, decode, encode, encode_parts, is_empty
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

CALL_DEADLINE_S = 300.0  # the longest any one call may hold the server (trainers' own deadlines are far shorter)
MAX_CONCURRENT_RPCS = 512  # beyond this grpc answers RESOURCE_EXHAUSTED: memory per peer stays bounded
log = logging.getLogger("swarmpipe.server")


class StageServicer(StateRPCs, ChainRPCs, swarm_pb2_grpc.StageServicer):
    def __init__(
        self,
        runtime: StageRuntime,
        peer_id: str,
        metrics: PeerMetrics | None = None,
        lifecycle: Lifecycle | None = None,
    ):
        self.runtime = runtime
        self.spec = runtime.spec
        self.peer_id = peer_id
        self.metrics = metrics or PeerMetrics()
        self.metrics.watch_runtime(lambda: self.runtime)  # stash and device memory, read when scraped
        self.rejections = Rejections(
            log, self.metrics.errors, lambda: f"peer {peer_id[-6:]} stage {self.runtime.stage}"
        )
        self.lifecycle = lifecycle or Lifecycle()  # owned by the daemon; the server only reads it
        self.queue = 0
        self.in_flight = 0
        self.donor = DonorSnapshot()  # one export serves every shard of a joiner's download
        self._reported_steps = runtime.stats.steps
        self._reported_stash_drops = 0
        self.on_state_pushed: Callable[[StageState], None] | None = None  # hook for the event log
        self.device_total = device_info(runtime.device).total_bytes  # read once: Info is polled often
        batching = runtime.spec.batching
        self.siblings = SiblingWaits(lambda: self.runtime.pending, lambda: self.spec.batching.backward_wait_ms)
        self.forwards = self._coalescer("forward", self._run_forwards, batching.wait_ms)
        self.backwards = self._coalescer("backward", lambda items: self.runtime.backward_many(items), 0.0)
        self.forward_backwards = self._coalescer(
            "forward_backward", lambda items: self.runtime.forward_backward_many(items), batching.wait_ms
        )

    @property
    def state(self) -> PeerState:
        return self.lifecycle.state

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

    def swap_runtime(self, runtime: StageRuntime) -> None:
        """Serve another stage from now on (rebalancing); the old runtime must be drained first."""
        self.runtime = runtime
        self.spec = runtime.spec
        self.donor.clear()
        self._reported_steps = runtime.stats.steps
        self.metrics.version.set(runtime.version)

    def _count_bytes(self, msg: swarm_pb2.Tensor | TensorView, incoming: bool, nbytes: int | None = None) -> None:
        if nbytes is None:  # ByteSize, not len(msg.data): reading a protobuf bytes field copies it
            nbytes = len(msg.data) if isinstance(msg, TensorView) else msg.ByteSize()
        (self.metrics.bytes_in if incoming else self.metrics.bytes_out).labels(msg.codec or "none").inc(nbytes)

    def _encode(self, t: torch.Tensor, codec: str, sink: dict | None = None, field: str = "") -> swarm_pb2.Tensor:
        """The reply tensor in ``codec`` (from :func:`reply_codec`). With a ``sink`` (a streamed reply) its
        bytes go there as a buffer and the message carries only shape, dtype and codec: the frames are cut
        from the buffer directly."""
        if sink is None:
            msg = encode(t, codec)
            self._count_bytes(msg, incoming=False)
            return msg
        msg, payload = encode_parts(t, codec)
        sink[field] = payload
        self._count_bytes(msg, incoming=False, nbytes=memoryview(payload).nbytes)
        return msg

    # ------------------------------------------------------------ plumbing
    async def _compute(self, method: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the single compute thread, counting the queue in front of it."""
        return await self._queued(method, lambda: self.runtime.run(fn))

    async def _queued(self, method: str, start: Callable[[], Awaitable[Any]]) -> Any:
        self.queue += 1
        self.metrics.queue.set(self.queue)
        started = time.perf_counter()
        try:
            return await start()
        finally:
            self.queue -= 1
            self.metrics.queue.set(self.queue)
            self.metrics.latency.labels(method).observe(time.perf_counter() - started)

    async def _serve(self, method: str, context: grpc.aio.ServicerContext, handler: Callable[[], Any]) -> Any:
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

    def _require_accepting(self) -> None:
        if not self.lifecycle.accepting:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE, f"peer is {self.state.value}; send new work to another replica"
            )

    def _after_backward(self, result: BackwardResult) -> None:
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

    # ------------------------------------------------------------ RPCs
    async def Forward(
        self, request: swarm_pb2.ForwardRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.ForwardResponse:
        async def handle() -> swarm_pb2.ForwardResponse:
            check_header(self.spec, self.runtime.stage, request.run_id, request.stage, request.microbatch_id)
            self._require_accepting()
            if self.runtime.is_last and not request.evaluate:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT, "the last stage takes ForwardBackward, not Forward"
                )
            reply = reply_codec(request.reply_codec, self.spec.compression.activations)
            self._count_bytes(request.input, incoming=True)
            x = decode_stage_input(self.spec, self.runtime.is_first, request.input)
            mb = pending_key(caller_key(context.peer() or ""), request.microbatch_id, request.ticket)
            if self.runtime.is_last:  # the logits (inference through the swarm): bounded like any tensor
                check_logits_size(self.spec, x)
            if request.evaluate:  # forward-only on the live weights, nothing kept for a backward
                out = await self._compute("evaluate", lambda: self.runtime.evaluate(x))
            else:
                out, siblings = await self._queued(
                    "forward", lambda: self.forwards.submit((mb, x), key=(tuple(x.shape[1:]), x.dtype))
                )
                self.siblings.remember(mb, siblings)
            output = self._encode(out, reply, sink, "output")
            return swarm_pb2.ForwardResponse(output=output, version=self.runtime.version)

        return await self._serve("evaluate" if request.evaluate else "forward", context, handle)

    async def Backward(
        self, request: swarm_pb2.BackwardRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.BackwardResponse:
        async def handle() -> swarm_pb2.BackwardResponse:
            check_header(self.spec, self.runtime.stage, request.run_id, request.stage, request.microbatch_id)
            if self.runtime.is_last:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT, "the last stage takes ForwardBackward, not Backward"
                )
            reply = reply_codec(request.reply_codec, self.spec.compression.gradients)
            self._count_bytes(request.grad_output, incoming=True)
            grad = decode_grad_output(self.spec, self.runtime.is_last, request.grad_output)
            if request.replay:
                if self.state is PeerState.DRAINING:  # a replay is new work
                    self._require_accepting()
                if is_empty(request.input):
                    raise RequestError(
                        grpc.StatusCode.INVALID_ARGUMENT, "a replayed backward must carry the stage input"
                    )
                x = decode_stage_input(self.spec, self.runtime.is_first, request.input)
                result = await self._compute("backward", lambda: self.runtime.replay_backward(x, grad))
            else:
                mb = pending_key(caller_key(context.peer() or ""), request.microbatch_id, request.ticket)
                await self.siblings.wait(mb)
                result = await self._queued("backward", lambda: self.backwards.submit((mb, grad)))
            self._after_backward(result)
            response = swarm_pb2.BackwardResponse(
                version=self.runtime.version,
                delay=result.delay,
                applied=result.applied,
                dropped_reason=result.dropped_reason,
            )
            if result.grad_input is not None:
                response.grad_input.CopyFrom(self._encode(result.grad_input, reply, sink, "grad_input"))
            return response

        return await self._serve("backward", context, handle)

    async def ForwardBackward(
        self, request: swarm_pb2.ForwardBackwardRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.ForwardBackwardResponse:
        async def handle() -> swarm_pb2.ForwardBackwardResponse:
            check_header(self.spec, self.runtime.stage, request.run_id, request.stage, request.microbatch_id)
            self._require_accepting()
            if not self.runtime.is_last:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"ForwardBackward is for the last stage; this peer serves stage {self.runtime.stage}",
                )
            reply = reply_codec(request.reply_codec, self.spec.compression.gradients)
            self._count_bytes(request.input, incoming=True)
            x = decode_stage_input(self.spec, self.runtime.is_first, request.input)
            targets = decode(
                request.targets,
                max_elements=self.spec.limits.max_tensor_elements,
                allowed_dtypes=("int64",),
                expect_shape=tuple(x.shape[:2]),
                what="targets",
            )
            if request.evaluate:  # validation: the loss only; no gradient, no step, no optimizer state touched
                loss = await self._compute("evaluate", lambda: self.runtime.evaluate(x, targets))
                return swarm_pb2.ForwardBackwardResponse(
                    loss=float(loss), version=self.runtime.version, applied=False, dropped_reason=""
                )
            result = await self._queued(
                "forward_backward",
                lambda: self.forward_backwards.submit((x, targets), key=(tuple(x.shape[1:]), x.dtype)),
            )
            self._after_backward(result)
            response = swarm_pb2.ForwardBackwardResponse(
                loss=result.loss or 0.0,
                version=self.runtime.version,
                applied=result.applied,
                dropped_reason=result.dropped_reason,
            )
            if result.grad_input is not None:
                response.grad_input.CopyFrom(self._encode(result.grad_input, reply, sink, "grad_input"))
            return response

        return await self._serve("evaluate" if request.evaluate else "forward_backward", context, handle)

    async def Info(self, request: swarm_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> swarm_pb2.InfoResponse:
        stats = self.runtime.stats
        return swarm_pb2.InfoResponse(
            peer_id=self.peer_id,
            stage=self.runtime.stage,
            version=self.runtime.version,
            throughput=self.runtime.throughput(),
            queue=self.queue,
            state=self.state.value,
            samples_processed=stats.samples,
            dropped_stale=stats.dropped_stale,
            busy_seconds=stats.busy_seconds,
            cpu_seconds=time.process_time(),
            batches=sum(c.stats.batches for c in self._coalescers()),
            batched_microbatches=sum(c.stats.items for c in self._coalescers()),
            protocol=WIRE_PROTOCOL,
            device=str(self.runtime.device),
            device_memory_total=self.device_total,
            device_memory_used=memory_in_use(self.runtime.device),
            stash_bytes=self.runtime.stash_bytes(),
        )

    def _coalescers(self) -> tuple[Coalescer, ...]:
        return self.forwards, self.backwards, self.forward_backwards

    async def Stream(self, request_iterator, context: grpc.aio.ServicerContext):
        """Forward / Backward / ForwardBackward whose messages are too large for one gRPC message."""
        limits = self.spec.limits
        try:
            async with asyncio.timeout(CALL_DEADLINE_S):  # a trickling stream is cut off, its bytes dropped
                method, request = await reassemble(
                    request_iterator, max_total_bytes=limits.max_stream_mb << 20, what="stream"
                )
        except TimeoutError:
            await self.rejections.reject(
                context, "stream", grpc.StatusCode.DEADLINE_EXCEEDED, "the stream took too long", "deadline"
            )
            return
        except WireError as e:
            await self.rejections.reject(context, "stream", grpc.StatusCode.INVALID_ARGUMENT, str(e), "invalid_tensor")
            return
        sink: dict = {}  # the reply's tensor bytes, as buffers: framed without a protobuf copy
        response = await getattr(self, method)(request, context, sink)
        chunk = min(1 << 20, (limits.max_message_mb << 20) // 2)  # a frame never nears the message cap
        fields = STREAM_METHODS[method][3]
        # Serialized frames straight from the reply's buffers: the raw handler sends bytes as they are.
        for frame in frames(response, fields, chunk_bytes=chunk, payloads=[sink.get(f) for f in fields]):
            yield frame


def _stage_method_handlers(servicer: StageServicer) -> dict:
    """The generated handlers; ``Stream`` without protobuf (de)serializers (frames' payloads are sliced, not
    copied), the others answer undecodable bytes with INVALID_ARGUMENT (grpc's: UNKNOWN and a traceback)."""
    handlers = generated_handlers(servicer)
    handlers["Stream"] = grpc.stream_stream_rpc_method_handler(servicer.Stream)
    return guard_handlers(handlers, servicer.rejections.malformed)


async def start_server(
    servicer: StageServicer,
    host: str,
    port: int,
    security: process_security.Security | None = None,
    services: dict[str, dict[str, grpc.RpcMethodHandler]] | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Bind and start; returns the server and the real port (0 picks a free one). ``security``: credentials and
    TLS (default: the process's); ``services``: more services' handlers by full service name (the relay)."""
    tune_allocator()
    security = security or process_security.current()
    options = server_options(servicer.spec.limits.max_message_mb)
    interceptors = security.server_interceptors(counted(servicer.rejections))  # none in an open swarm
    server = grpc.aio.server(options=options, maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS, interceptors=interceptors)
    handlers = _stage_method_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("swarmpipe.Stage", handlers),))
    server.add_registered_method_handlers("swarmpipe.Stage", handlers)
    for name, extra in (services or {}).items():
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, extra),))
    bound = security.add_port(server, f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind the stage server to {host}:{port}")
    await server.start()
    return server, bound
