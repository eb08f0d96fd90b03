"""The state side of the ``Stage`` service: a joiner downloads a stage's state (or, in a LoRA run, its
frozen base) from this replica, and a draining replica pushes its newest state here to be averaged in.
Part of :class:`~swarmpipe.peer.stage.server.StageServicer`, which owns the fields used here."""

from __future__ import annotations

import asyncio

import grpc

from swarmpipe.peer.stage.request_checks import RequestError, check_header
from swarmpipe.peer.stage.state import to_chunks
from swarmpipe.peer.stage.state_transfer import receive_pushed
from swarmpipe.peer.swarm.records import PeerState
from swarmpipe.protos import swarm_pb2


class StateRPCs:
    """``DownloadState`` and ``PushState`` of the stage servicer (mixed into it)."""

    async def DownloadState(self, request: swarm_pb2.DownloadStateRequest, context: grpc.aio.ServicerContext):
        self.metrics.requests.labels("download_state").inc()
        try:
            check_header(self.spec, self.runtime.stage, request.run_id, request.stage)
            if not self.lifecycle.serves_state:
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE, "this peer is still joining; download from another replica"
                )
            if request.base:  # the frozen base weights of a LoRA run (full fine-tuning trains them)
                if self.spec.finetune.method != "lora":
                    raise RequestError(grpc.StatusCode.NOT_FOUND, "replicas serve base weights only in LoRA runs")
                state = await self._compute("download_state", self.runtime.export_base)
            else:
                # Exported on the compute thread (one consistent version, never mid-update) and kept a while,
                # so every shard of one joiner's download comes from the same snapshot.
                state = await self.donor.get(lambda: self._compute("download_state", self.runtime.export_state))
            chunks = await asyncio.to_thread(
                to_chunks, state, request.shard, request.num_shards or 1, self.spec.compression.state
            )
        except (RequestError, ValueError) as e:
            code = e.code if isinstance(e, RequestError) else grpc.StatusCode.INVALID_ARGUMENT
            self.metrics.errors.labels("download_state", code.name.lower()).inc()
            await context.abort(code, str(e))
            return
        for chunk in chunks:
            self._count_bytes(chunk.tensor, incoming=False)
            yield chunk

    async def PushState(self, request_iterator, context: grpc.aio.ServicerContext) -> swarm_pb2.PushStateResponse:
        """A draining replica hands over its newest state: average it into ours."""

        async def handle() -> swarm_pb2.PushStateResponse:
            state = await receive_pushed(request_iterator)
            check_header(self.spec, self.runtime.stage, state.meta.get("run_id", ""), int(state.meta.get("stage", -1)))
            if self.state is PeerState.DRAINING:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "this peer is draining too")
            await self._compute("push_state", lambda: self.runtime.blend(state))
            if self.on_state_pushed is not None:
                self.on_state_pushed(state)
            return swarm_pb2.PushStateResponse(
                accepted=True,
                version=self.runtime.version,
                detail=f"averaged state of version {state.version} into ours",
            )

        return await self._serve("push_state", context, handle)  # StateError is a ValueError: INVALID_ARGUMENT
