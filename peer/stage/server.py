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
for that id is NOT_FOUND), nothing stepped.

:class:`StageServicer` is composed of one service per RPC family, all on one serving core (queue, batching,
encoding, the error contract: peer/stage/service/core.py): compute (peer/stage/service/compute.py), state
(peer/stage/service/state.py) and the chain (micro-batches passed peer to peer: peer/stage/chain/service.py).
It answers ``Info`` and ``Stream`` itself; :func:`start_server` binds it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from swarmpipe.peer.stage.chain.service import ChainService
from swarmpipe.peer.stage.device import device_info, memory_in_use
from swarmpipe.peer.stage.lifecycle import Lifecycle
from swarmpipe.peer.stage.metrics import PeerMetrics
from swarmpipe.peer.stage.runtime import StageRuntime
from swarmpipe.peer.stage.service.compute import ComputeService
from swarmpipe.peer.stage.service.core import CALL_DEADLINE_S, ServingCore
from swarmpipe.peer.stage.service.state import StagePeers, StateService
from swarmpipe.peer.state.format import StageState
from swarmpipe.peer.swarm.identity import Identity
from swarmpipe.peer.swarm.records import WIRE_PROTOCOL
from swarmpipe.peer.transport import security as process_security
from swarmpipe.peer.transport.channels import server_options, tune_allocator
from swarmpipe.peer.transport.error_contract import Rejections, Unserved, generated_handlers, guard_handlers
from swarmpipe.peer.transport.overload import bounded_server
from swarmpipe.peer.transport.streaming import METHODS as STREAM_METHODS
from swarmpipe.peer.transport.streaming import frames, reassemble
from swarmpipe.peer.transport.unauthenticated import counted
from swarmpipe.peer.transport.wire import WireError
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

MAX_CONCURRENT_RPCS = 512  # beyond this grpc answers RESOURCE_EXHAUSTED: memory per peer stays bounded


class StageServicer(swarm_pb2_grpc.StageServicer):
    """The ``Stage`` service of one peer: each RPC goes to the service that owns its family.

    ``identity`` signs the state we serve and makes pushed state signed-only; ``stage_peers`` reads a stage's
    announced replicas (``SwarmDHT.stage_peers``: who may push state to us, which hops a chain may dial);
    ``on_state_pushed`` hears of each accepted push. All None outside a swarm (tests, benchmarks)."""

    def __init__(
        self,
        runtime: StageRuntime,
        peer_id: str,
        metrics: PeerMetrics | None = None,
        lifecycle: Lifecycle | None = None,
        identity: Identity | None = None,
        stage_peers: StagePeers | None = None,
        on_state_pushed: Callable[[StageState], None] | None = None,
    ):
        self.peer_id = peer_id
        self.metrics = metrics or PeerMetrics()
        self.lifecycle = lifecycle or Lifecycle()  # owned by the daemon; the server only reads it
        self.core = ServingCore(runtime, peer_id, self.metrics, self.lifecycle)
        self.compute_service = ComputeService(self.core)
        self.state_service = StateService(self.core, identity, stage_peers, on_state_pushed)
        self.chain_service = ChainService(self.core, stage_peers)
        self.device_total = device_info(runtime.device).total_bytes  # read once: Info is polled often

    @property
    def runtime(self) -> StageRuntime:
        """The runtime served now (a rebalancing move swaps it)."""
        return self.core.runtime

    @property
    def rejections(self) -> Rejections:
        return self.core.rejections

    def swap_runtime(self, runtime: StageRuntime) -> None:
        """Serve another stage from now on (rebalancing); the old runtime must be drained first."""
        self.core.swap_runtime(runtime)
        self.state_service.runtime_swapped()

    # ------------------------------------------------------------ RPCs, each to its owner
    async def Forward(
        self, request: swarm_pb2.ForwardRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.ForwardResponse:
        return await self.compute_service.Forward(request, context, sink)

    async def Backward(
        self, request: swarm_pb2.BackwardRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.BackwardResponse:
        return await self.compute_service.Backward(request, context, sink)

    async def ForwardBackward(
        self, request: swarm_pb2.ForwardBackwardRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.ForwardBackwardResponse:
        return await self.compute_service.ForwardBackward(request, context, sink)

    async def Chain(
        self, request: swarm_pb2.ChainRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.ChainResponse:
        return await self.chain_service.Chain(request, context, sink)

    async def ChainHandover(
        self, request: swarm_pb2.HandoverRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.HandoverResponse:
        return await self.chain_service.ChainHandover(request, context, sink)

    async def ChainResume(
        self, request: swarm_pb2.ResumeRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.ResumeResponse:
        return await self.chain_service.ChainResume(request, context, sink)

    async def DownloadState(self, request: swarm_pb2.DownloadStateRequest, context: grpc.aio.ServicerContext):
        # an async generator itself: grpc runs any other server-streaming handler as a sync generator
        async for chunk in self.state_service.DownloadState(request, context):
            yield chunk

    async def PushState(self, request_iterator, context: grpc.aio.ServicerContext) -> swarm_pb2.PushStateResponse:
        return await self.state_service.PushState(request_iterator, context)

    async def Info(self, request: swarm_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> swarm_pb2.InfoResponse:
        runtime, core = self.core.runtime, self.core
        stats = runtime.stats
        return swarm_pb2.InfoResponse(
            peer_id=self.peer_id,
            stage=runtime.stage,
            version=runtime.version,
            throughput=runtime.throughput(),
            queue=core.queue,
            state=core.state.value,
            samples_processed=stats.samples,
            dropped_stale=stats.dropped_stale,
            busy_seconds=stats.busy_seconds,
            cpu_seconds=time.process_time(),
            batches=sum(c.stats.batches for c in core.coalescers()),
            batched_microbatches=sum(c.stats.items for c in core.coalescers()),
            protocol=WIRE_PROTOCOL,
            device=str(runtime.device),
            device_memory_total=self.device_total,
            device_memory_used=memory_in_use(runtime.device),
            stash_bytes=runtime.pending.snapshot_bytes(),
        )

    async def Stream(self, request_iterator, context: grpc.aio.ServicerContext):
        """A unary RPC (``streaming.METHODS``: compute and chain) whose messages are too large for one gRPC
        message, reassembled and answered by that RPC's method here."""
        limits = self.core.spec.limits
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
        # by name on this servicer, so a wrapper of its method (tests/byzantine_peer.py) sees streamed calls too
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
    options = server_options(servicer.runtime.spec.limits.max_message_mb)
    interceptors = security.server_interceptors(counted(servicer.rejections))  # none in an open swarm
    # beyond MAX_CONCURRENT_RPCS: RESOURCE_EXHAUSTED, counted, before any other work (credentials included)
    server = bounded_server(options, interceptors, MAX_CONCURRENT_RPCS, servicer.rejections)
    handlers = _stage_method_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("swarmpipe.Stage", handlers),))
    server.add_registered_method_handlers("swarmpipe.Stage", handlers)
    for name, extra in (services or {}).items():
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, extra),))
    server.add_generic_rpc_handlers((Unserved(servicer.rejections),))  # a made-up path: UNIMPLEMENTED, counted
    bound = security.add_port(server, f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind the stage server to {host}:{port}")
    await server.start()
    return server, bound
