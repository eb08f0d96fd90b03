"""The ``Chain`` RPC: a micro-batch passes from peer to peer, and its gradient comes back the same way.

Stage k takes the input (tokens on stage 0), the targets and the route; it runs its forward exactly as a
``Forward`` would (server-side batching, weight stash, the same pending-forward bounds), calls stage k+1 itself
with its output and the rest of the route (:mod:`chain_link`: the candidates in turn, only those the DHT lists,
:mod:`chain_route`), runs its backward with the gradient that call answers (the stashed forward; if the stash
bound dropped it meanwhile, recomputed from the input it still holds, counted as a replay), and answers its
caller with its input gradient, the loss and what every stage from here on did. The last stage runs a
``ForwardBackward``. So a peer keeps what it sent downstream exactly until the downstream answer (= the
backward) comes back, and the trainer's traffic per micro-batch is tokens in, loss out. A chain may end before
the last stage (``segment_stages``: the trainer carries the next hop): its end parks the output for the
trainer's ``ChainHandover`` and runs its backward when ``ChainResume`` brings the gradient (:mod:`chain_handover`).

Every check of ``Forward`` applies before any work (header, draining, input tensor, reply codec), plus the
route's and the targets'. A chain that cannot go on (no candidate of some later stage answered) is answered
with ABORTED, ``chain broke at stage j (unreachable|failed): ...``, after this peer dropped its pending forward;
the trainer takes that hop itself (peer/trainer/chain.py). Each micro-batch runs once per peer, whoever asks
again (:mod:`chain_results`). Gradients this peer sends upstream in a codec that takes error feedback (the
codec registry's ``error_feedback``: the 8-bit ones) carry it, kept by this peer (the link's sender).
:class:`ChainService` serves these RPCs for :class:`~swarmpipe.peer.stage.server.StageServicer` on the
serving core the other services share.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import grpc
import torch

from swarmpipe.peer.stage.chain.handover import Abandoned, Handovers
from swarmpipe.peer.stage.chain.link import ChainLink, LinkAnswer
from swarmpipe.peer.stage.chain.results import ChainDone, ChainResults, result_key
from swarmpipe.peer.stage.chain.route import AnnouncedHops, check_route, check_ticket, decode_targets
from swarmpipe.peer.stage.request_checks import (
    RequestError,
    check_header,
    decode_stage_input,
    pending_key,
    reply_codec,
)
from swarmpipe.peer.stage.runtime import UnknownMicrobatch
from swarmpipe.peer.stage.service.core import ServingCore
from swarmpipe.peer.swarm.records import StageRecord
from swarmpipe.peer.transport import codecs
from swarmpipe.peer.transport.chain_protocol import MAX_HOP_TIMEOUT_S, ChainBroken
from swarmpipe.peer.transport.codec_policy import ErrorFeedback
from swarmpipe.peer.transport.error_contract import caller_key
from swarmpipe.peer.transport.wire import FLOAT_DTYPES, decode, encode_parts
from swarmpipe.protos import swarm_pb2

log = logging.getLogger("swarmpipe.server")


class ChainService:
    """``Chain``, ``ChainHandover`` and ``ChainResume`` on the runtime the core serves. It keeps its link to
    next stages, each micro-batch's result, the parked segment ends and the residuals of error feedback.

    ``members`` reads a stage's signed records (``SwarmDHT.stage_peers``): the only hops a chained call may
    dial (None: nothing is announced to us, dial nobody)."""

    def __init__(self, core: ServingCore, members: Callable[[int], Awaitable[dict[str, StageRecord]]] | None = None):
        self.core = core
        self.link = ChainLink(core.spec)
        self.results = ChainResults()
        self.handovers = Handovers()
        self.announced = AnnouncedHops(members)
        self.error_feedback = ErrorFeedback()

    async def Chain(
        self, request: swarm_pb2.ChainRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.ChainResponse:
        core = self.core

        async def handle() -> swarm_pb2.ChainResponse:
            started = time.perf_counter()
            runtime, spec = core.runtime, core.spec
            check_header(spec, runtime.stage, request.run_id, request.stage, request.microbatch_id)
            core.require_accepting()
            route, end = check_route(spec, runtime.stage, request)
            reply = reply_codec(request.reply_codec, spec.compression.gradients)
            core.count_bytes(request.input, incoming=True)
            x = decode_stage_input(spec, runtime.is_first, request.input)
            targets = decode_targets(spec, request.targets, x.shape[0], x.shape[1])
            caller = caller_key(context.peer() or "")
            mb = pending_key(caller, request.microbatch_id, request.ticket)
            hop_timeout = float(request.hop_timeout_s)

            async def work() -> ChainDone:
                return await self._work(request, mb, x, targets, route, hop_timeout, end)

            try:
                done = await self.results.once(result_key(request.ticket, request.microbatch_id), caller, work)
            except ChainBroken as e:
                core.metrics.errors.labels("chain", "broken").inc()
                await context.abort(grpc.StatusCode.ABORTED, e.detail())
            response = swarm_pb2.ChainResponse(loss=done.loss, version=done.version, stages=done.stages)
            if done.grad_input is not None:
                response.grad_input.CopyFrom(self._reply(done.grad_input, reply, sink, caller))
            response.handler_seconds = time.perf_counter() - started  # the caller times its link without it
            return response

        return await core.serve("chain", context, handle)

    def _reply(self, grad: torch.Tensor, codec: str, sink: dict | None, caller: str) -> swarm_pb2.Tensor:
        """The input gradient in the caller's codec; one that takes error feedback carries what it lost last time."""
        if not codecs.get(codec).error_feedback:
            return self.core.encode(grad, codec, sink, "grad_input")
        msg = self.error_feedback.encode((caller, tuple(grad.shape)), grad, codec)
        self.core.count_bytes(msg, incoming=False)
        return msg

    async def _work(
        self,
        request: swarm_pb2.ChainRequest,
        mb: str,
        x: torch.Tensor,
        targets: torch.Tensor,
        route: list[list[tuple[str, str]]],
        hop_timeout: float,
        end: int,
    ) -> ChainDone:
        core = self.core
        runtime = core.runtime
        shape_key = (tuple(x.shape[1:]), x.dtype)
        if runtime.is_last:
            result = await core.queued(
                "forward_backward", lambda: core.forward_backwards.submit((x, targets), shape_key)
            )
            core.after_backward(result)
            here = self._stage_result(result.applied, result.dropped_reason, 0)
            return ChainDone(result.grad_input, float(result.loss or 0.0), [here], runtime.version)
        out, siblings = await core.queued("forward", lambda: core.forwards.submit((mb, x), key=shape_key))
        core.siblings.remember(mb, siblings)
        try:
            if runtime.stage == end:  # the trainer relays the next hop: it takes our output from here
                answer = await self._park(request, out, hop_timeout)
            else:
                answer = await self._call_next(request, out, targets, route, hop_timeout, end)
        except BaseException:
            # nothing comes back for this forward: drop it now rather than when the stash expires
            runtime.submit(lambda: runtime.pending.forget(mb))
            raise
        await core.siblings.wait(mb)
        replays = 0
        try:
            result = await core.queued("backward", lambda: core.backwards.submit((mb, answer.grad)))
        except UnknownMicrobatch:  # the stash bound dropped our forward meanwhile: recompute from the input
            result = await core.compute("backward", lambda: runtime.replay_backward(x, answer.grad))
            replays = 1
        core.after_backward(result)
        here = self._stage_result(result.applied, result.dropped_reason, answer.failed + replays)
        return ChainDone(result.grad_input, answer.response.loss, [here, *answer.response.stages], runtime.version)

    async def _park(self, request: swarm_pb2.ChainRequest, out: torch.Tensor, hop_timeout: float) -> LinkAnswer:
        """Park our output for the trainer and wait for its gradient (chain_handover.py); a chain the trainer
        abandons breaks at the next stage, as if no candidate of it had answered."""
        runtime = self.core.runtime
        key = result_key(request.ticket, request.microbatch_id)
        left = self.core.spec.num_stages - runtime.stage
        try:
            grad = await self.handovers.park(key, out, runtime.version, hop_timeout * left)
        except Abandoned as e:
            raise ChainBroken(runtime.stage + 1, str(e), unreachable=False) from None
        return LinkAnswer(swarm_pb2.ChainResponse(), grad, "", 0)

    async def _call_next(
        self,
        request: swarm_pb2.ChainRequest,
        out: torch.Tensor,
        targets: torch.Tensor,
        route: list[list[tuple[str, str]]],
        hop_timeout: float,
        end: int,
    ) -> LinkAnswer:
        """Send our output on to the next stage (the first candidate that takes it)."""
        core = self.core
        nxt = core.runtime.stage + 1
        allowed, refused = await self.announced.allowed(nxt, route[0])
        if refused:
            core.metrics.errors.labels("chain", "unannounced_hop").inc(len(refused))
        if not allowed:
            raise ChainBroken(nxt, f"none of {len(route[0])} candidates is announced online for it in the DHT", False)
        rest = [
            swarm_pb2.ChainCandidates(hops=[swarm_pb2.ChainHop(peer_id=p, address=a) for p, a in hops])
            for hops in route[1:]
        ]
        targets_msg, targets_bytes = encode_parts(targets)

        def build(act_codec: str, reply: str) -> tuple[swarm_pb2.ChainRequest, list]:
            header, payload = encode_parts(out, act_codec)
            core.count_bytes(header, incoming=False, nbytes=memoryview(payload).nbytes)
            next_request = swarm_pb2.ChainRequest(
                run_id=request.run_id,
                stage=nxt,
                microbatch_id=request.microbatch_id,
                input=header,
                targets=targets_msg,
                route=rest,
                ticket=request.ticket,
                reply_codec=reply,
                hop_timeout_s=request.hop_timeout_s,
                segment_stages=max(0, request.segment_stages - 1),
            )
            return next_request, [payload, targets_bytes]

        left = core.spec.num_stages - nxt
        return await self.link.call(nxt, allowed, build, tuple(out.shape), hop_timeout * left, end)

    # ------------------------------------------------------------ a segment's end, and the trainer
    async def ChainHandover(
        self, request: swarm_pb2.HandoverRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.HandoverResponse:
        """The output a chain parked here for the trainer (waiting ``wait_s`` for the chain to arrive)."""
        core = self.core

        async def handle() -> swarm_pb2.HandoverResponse:
            check_header(core.spec, core.runtime.stage, request.run_id, request.stage, request.microbatch_id)
            check_ticket(request.ticket)
            if not 0 < request.wait_s <= MAX_HOP_TIMEOUT_S:  # also refuses NaN
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"wait_s must lie in (0, {MAX_HOP_TIMEOUT_S:g}]")
            codec = reply_codec(request.output_codec, core.spec.compression.activations)
            key = result_key(request.ticket, request.microbatch_id)
            parked = await self.handovers.handover(key, caller_key(context.peer() or ""), request.wait_s)
            output = core.encode(parked.output, codec, sink, "output")
            return swarm_pb2.HandoverResponse(output=output, version=parked.version)

        return await core.serve("chain_handover", context, handle)

    async def ChainResume(
        self, request: swarm_pb2.ResumeRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.ResumeResponse:
        """The gradient of a handed-over output (or ``abandon``): the parked chain goes on with its backward.
        A gradient of the wrong shape or dtype is refused and the chain keeps waiting."""
        core = self.core

        async def handle() -> swarm_pb2.ResumeResponse:
            check_header(core.spec, core.runtime.stage, request.run_id, request.stage, request.microbatch_id)
            check_ticket(request.ticket)
            key = result_key(request.ticket, request.microbatch_id)
            parked = self.handovers.waiting_for(key)
            grad = None
            if not request.abandon:
                core.count_bytes(request.grad_output, incoming=True)
                grad = decode(
                    request.grad_output,
                    max_elements=core.spec.limits.max_tensor_elements,
                    allowed_dtypes=FLOAT_DTYPES,
                    expect_shape=tuple(parked.output.shape),
                    what="grad_output",
                ).float()
            self.handovers.resume(key, grad)
            return swarm_pb2.ResumeResponse(version=core.runtime.version)

        return await core.serve("chain_resume", context, handle)

    def _stage_result(self, applied: bool, dropped_reason: str, retries: int) -> swarm_pb2.ChainStageResult:
        runtime = self.core.runtime
        return swarm_pb2.ChainStageResult(
            stage=runtime.stage,
            peer_id=self.core.peer_id,
            version=runtime.version,
            applied=applied,
            dropped_reason=dropped_reason[:200],
            retries=retries,
        )

    async def close(self) -> None:
        """The peer is leaving: parked chains end abandoned, running ones are cancelled, the link closes."""
        self.handovers.close()
        await self.results.close()
        await self.link.close()
