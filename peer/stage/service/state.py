"""The state side of the ``Stage`` service: a joiner downloads a stage's state (or, in a LoRA run, its
frozen base, or only its trained weights for a sibling's averaging round) from this replica, and a draining
replica pushes its newest state here to be blended in, its pull clipped like an averaging round's
(:class:`StateService`, one of the services :class:`~swarmpipe.peer.stage.server.StageServicer` composes).

Both directions are signed (:mod:`swarmpipe.peer.state.signing`): shards we serve carry our signature,
and a pushed state is taken only from a replica announced on our stage in the DHT, signed by it, no larger
than a state of this stage can be, and with a version no further ahead than its owner announced."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc

from swarmpipe.peer.plan.memory import state_bytes_bound
from swarmpipe.peer.stage.request_checks import RequestError, check_header
from swarmpipe.peer.stage.runtime import StageRuntime
from swarmpipe.peer.stage.service.core import ServingCore
from swarmpipe.peer.state.format import StageState, to_chunks
from swarmpipe.peer.state.push import PUSH_TIMEOUT_S, pusher_problem
from swarmpipe.peer.state.transfer import DonorSnapshot, ParamsExport, receive_pushed
from swarmpipe.peer.swarm.identity import Identity
from swarmpipe.peer.swarm.records import PeerState, StageRecord
from swarmpipe.protos import swarm_pb2

PUSH_EVERY_S = 30.0  # accepted pushes per sibling: a drain or a move hands its state over once
# stage -> that stage's signed records (``SwarmDHT.stage_peers``)
StagePeers = Callable[[int], Awaitable[dict[str, StageRecord]]]


class StateService:
    """``DownloadState`` and ``PushState`` on the runtime the core serves.

    ``identity`` signs the shards we serve and makes pushes signed-only (None only in tests without a
    swarm: shards unsigned, any push taken); ``stage_peers`` reads a stage's announced replicas, the only
    ones that may push to us (None: nobody is announced); ``on_state_pushed`` hears of each accepted push
    (the event log)."""

    def __init__(
        self,
        core: ServingCore,
        identity: Identity | None = None,
        stage_peers: StagePeers | None = None,
        on_state_pushed: Callable[[StageState], None] | None = None,
    ):
        self.core = core
        self.identity = identity
        self.stage_peers = stage_peers
        self.on_state_pushed = on_state_pushed
        self.donor = DonorSnapshot()  # one export serves every shard of a joiner's download
        self.params = ParamsExport()  # one export of the trained weights serves a slot's averaging pulls
        self.pushed_at: dict[str, float] = {}  # announced sibling -> when its last accepted push came

    @property
    def runtime(self) -> StageRuntime:
        return self.core.runtime

    def runtime_swapped(self) -> None:
        """A move: the exported state was the old stage's."""
        self.donor.clear()

    async def DownloadState(self, request: swarm_pb2.DownloadStateRequest, context: grpc.aio.ServicerContext):
        core = self.core
        core.metrics.requests.labels("download_state").inc()
        try:
            check_header(core.spec, self.runtime.stage, request.run_id, request.stage)
            if not core.lifecycle.serves_state:
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE, "this peer is still joining; download from another replica"
                )
            if request.params_only:  # a sibling's averaging round: our trainable weights, one stream
                if request.base or request.shard or request.num_shards > 1:
                    raise RequestError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "params_only is one whole stream of the trained weights: not with base or shards",
                    )
                chunks = await self.params.get(self.runtime, self._params_chunks)
            elif request.base:  # the frozen base weights of a LoRA run (full fine-tuning trains them)
                if core.spec.finetune.method != "lora":
                    raise RequestError(grpc.StatusCode.NOT_FOUND, "replicas serve base weights only in LoRA runs")
                state = await core.compute("download_state", self.runtime.weights.export_base)
            else:
                # Exported on the compute thread (one consistent version, never mid-update) and kept a while,
                # so every shard of one joiner's download comes from the same snapshot.
                state = await self.donor.get(lambda: core.compute("download_state", self.runtime.weights.export_state))
            if not request.params_only:
                chunks = await asyncio.to_thread(
                    to_chunks, state, request.shard, request.num_shards or 1, core.spec.compression.state, self.identity
                )
        except (RequestError, ValueError) as e:
            code = e.code if isinstance(e, RequestError) else grpc.StatusCode.INVALID_ARGUMENT
            core.metrics.errors.labels("download_state", code.name.lower()).inc()
            await context.abort(code, str(e))
            return
        for chunk in chunks:
            core.count_bytes(chunk.tensor, incoming=False)
            yield chunk

    async def PushState(self, request_iterator, context: grpc.aio.ServicerContext) -> swarm_pb2.PushStateResponse:
        """A draining replica hands over its newest state: average it into ours."""

        core = self.core

        async def handle() -> swarm_pb2.PushStateResponse:
            if core.state is PeerState.DRAINING:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "this peer is draining too")
            signed = self.identity is not None
            try:
                receiving = receive_pushed(request_iterator, self._push_cap(), signed=signed)
                state = await asyncio.wait_for(receiving, PUSH_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "the pushed state took too long") from None
            check_header(core.spec, self.runtime.stage, state.meta.get("run_id", ""), int(state.meta.get("stage", -1)))
            if signed:
                await self._check_pusher(state)
                self._limit_pushes(str(state.meta["signed_by"]))
            # bounded: the pushed weights' displacement from ours is clipped like an averaging round's
            scale, radius = await core.compute("push_state", lambda: _bounded_blend(self.runtime, state))
            state.meta.update(blend_scale=scale, blend_radius=radius)  # ours, after the signature check: for the log
            if self.on_state_pushed is not None:
                self.on_state_pushed(state)
            clipped = f" (its pull clipped to {scale:.2g} of the way)" if scale < 1.0 else ""
            clipped = " (an outlier, far beyond our trust radius: clipped to no pull)" if scale == 0.0 else clipped
            return swarm_pb2.PushStateResponse(
                accepted=True,
                version=self.runtime.version,
                detail=f"averaged state of version {state.version} into ours{clipped}",
            )

        return await core.serve("push_state", context, handle)  # StateError is a ValueError: INVALID_ARGUMENT

    async def _params_chunks(self) -> list[swarm_pb2.StateChunk]:
        state = await self.core.compute("download_state", self.runtime.weights.export_params)
        return await asyncio.to_thread(to_chunks, state, 0, 1, self.core.spec.compression.state, self.identity)

    def _push_cap(self) -> int:
        """The most bytes a pushed state of this stage can take: a bound on what one caller makes us buffer."""
        return state_bytes_bound(self.core.spec, self.runtime.stage)

    def _limit_pushes(self, sender: str) -> None:
        """One accepted push per sibling per :data:`PUSH_EVERY_S`: a drain pushes once, so repeated bounded
        pulls from one sibling cannot add up to a large move. Holds only announced replicas' ids."""
        seen = self.pushed_at
        now = time.monotonic()
        for pid in [p for p, at in seen.items() if now - at > PUSH_EVERY_S]:
            del seen[pid]
        if sender in seen:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"peer {sender[-6:]} pushed its state {now - seen[sender]:.0f} s ago: one push per {PUSH_EVERY_S:.0f} s",
            )
        seen[sender] = now

    async def _check_pusher(self, state: StageState) -> None:
        """Only a replica announced on our stage may hand us its state, and only a version it could have."""
        if self.identity is not None and state.meta.get("signed_by") == self.identity.peer_id:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "a peer does not push state to itself")
        stage = self.runtime.stage
        members = await self.stage_peers(stage) if self.stage_peers is not None else {}
        code, problem = pusher_problem(state, stage, members)
        if problem:
            raise RequestError(code, problem)


def _bounded_blend(runtime: StageRuntime, state: StageState) -> tuple[float, float]:
    """Compute thread: blend ``state`` in with its pull clipped to our trust radius, then re-anchor."""
    weights = runtime.weights
    radius = weights.push_radius()
    scale = weights.blend(state, radius=radius)
    weights.set_anchor()
    return scale, radius
