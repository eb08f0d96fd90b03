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
again (:mod:`chain_results`). Gradients this peer sends upstream in an 8-bit codec carry error feedback, kept by
this peer (the link's sender).
"""

from __future__ import annotations

import logging
import time

import grpc
import torch

from swarmpipe.peer.stage.chain.handover import Abandoned, Handovers
from swarmpipe.peer.stage.chain.link import ChainLink, LinkAnswer
from swarmpipe.peer.stage.chain.results import ChainDone, ChainResults, result_key
from swarmpipe.peer.stage.chain.route import AnnouncedHops, check_route, check_ticket, decode_targets
from swarmpipe.peer.stage.request_checks import (
    FLOAT_DTYPES,
    RequestError,
    check_header,
    decode_stage_input,
    pending_key,
    reply_codec,
)
from swarmpipe.peer.stage.runtime import UnknownMicrobatch
from swarmpipe.peer.transport.chain_protocol import MAX_HOP_TIMEOUT_S, ChainBroken
from swarmpipe.peer.transport.codec_policy import ErrorFeedback
from swarmpipe.peer.transport.error_contract import caller_key
from swarmpipe.peer.transport.wire import decode, encode_parts
from swarmpipe.protos import swarm_pb2

log = logging.getLogger("swarmpipe.server")
LOSSY_8BIT = ("uint8", "blockwise8")


class ChainState:
    """What a servicer keeps for chained calls: its link to next stages, results, the DHT's hops, residuals."""

    def __init__(self, servicer) -> None:
        self.link = ChainLink(servicer.spec)
        self.results = ChainResults()
        self.handovers = Handovers()
        self.announced = AnnouncedHops(servicer.chain_members)
        self.error_feedback = ErrorFeedback()


class ChainRPCs:
    """Mixed into :class:`~swarmpipe.peer.stage.server.StageServicer` (which provides the compute plumbing)."""

    # stage -> that stage's signed records (``SwarmDHT.stage_peers``); set by the daemon. None: dial nobody.
    chain_members = None
    _chain_state: ChainState | None = None

    @property
    def chain(self) -> ChainState:
        if self._chain_state is None:
            self._chain_state = ChainState(self)
        return self._chain_state

    async def Chain(
        self, request: swarm_pb2.ChainRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.ChainResponse:
        async def handle() -> swarm_pb2.ChainResponse:
            started = time.perf_counter()
            runtime = self.runtime
            check_header(self.spec, runtime.stage, request.run_id, request.stage, request.microbatch_id)
            self._require_accepting()
            route, end = check_route(self.spec, runtime.stage, request)
            reply = reply_codec(request.reply_codec, self.spec.compression.gradients)
            self._count_bytes(request.input, incoming=True)
            x = decode_stage_input(self.spec, runtime.is_first, request.input)
            targets = decode_targets(self.spec, request.targets, x.shape[0], x.shape[1])
            caller = caller_key(context.peer() or "")
            mb = pending_key(caller, request.microbatch_id, request.ticket)
            hop_timeout = float(request.hop_timeout_s)

            async def work() -> ChainDone:
                return await self._chain_work(request, mb, x, targets, route, hop_timeout, end)

            try:
                done = await self.chain.results.once(result_key(request.ticket, request.microbatch_id), caller, work)
            except ChainBroken as e:
                self.metrics.errors.labels("chain", "broken").inc()
                await context.abort(grpc.StatusCode.ABORTED, e.detail())
            response = swarm_pb2.ChainResponse(loss=done.loss, version=done.version, stages=done.stages)
            if done.grad_input is not None:
                response.grad_input.CopyFrom(self._chain_reply(done.grad_input, reply, sink, caller))
            response.handler_seconds = time.perf_counter() - started  # the caller times its link without it
            return response

        return await self._serve("chain", context, handle)

    def _chain_reply(self, grad: torch.Tensor, codec: str, sink: dict | None, caller: str) -> swarm_pb2.Tensor:
        """The input gradient in the caller's codec; an 8-bit one carries what quantization lost last time."""
        if codec not in LOSSY_8BIT:
            return self._encode(grad, codec, sink, "grad_input")
        msg = self.chain.error_feedback.encode((caller, tuple(grad.shape)), grad, codec)
        self._count_bytes(msg, incoming=False)
        return msg

    async def _chain_work(
        self,
        request: swarm_pb2.ChainRequest,
        mb: str,
        x: torch.Tensor,
        targets: torch.Tensor,
        route: list[list[tuple[str, str]]],
        hop_timeout: float,
        end: int,
    ) -> ChainDone:
        runtime = self.runtime
        shape_key = (tuple(x.shape[1:]), x.dtype)
        if runtime.is_last:
            result = await self._queued(
                "forward_backward", lambda: self.forward_backwards.submit((x, targets), shape_key)
            )
            self._after_backward(result)
            here = self._stage_result(result.applied, result.dropped_reason, 0)
            return ChainDone(result.grad_input, float(result.loss or 0.0), [here], runtime.version)
        out, siblings = await self._queued("forward", lambda: self.forwards.submit((mb, x), key=shape_key))
        self.siblings.remember(mb, siblings)
        try:
            if runtime.stage == end:  # the trainer relays the next hop: it takes our output from here
                answer = await self._chain_park(request, out, hop_timeout)
            else:
                answer = await self._chain_next(request, out, targets, route, hop_timeout, end)
        except BaseException:
            # nothing comes back for this forward: drop it now rather than when the stash expires
            runtime.submit(lambda: runtime._forget(mb))
            raise
        await self.siblings.wait(mb)
        replays = 0
        try:
            result = await self._queued("backward", lambda: self.backwards.submit((mb, answer.grad)))
        except UnknownMicrobatch:  # the stash bound dropped our forward meanwhile: recompute from the input
            result = await self._compute("backward", lambda: runtime.replay_backward(x, answer.grad))
            replays = 1
        self._after_backward(result)
        here = self._stage_result(result.applied, result.dropped_reason, answer.failed + replays)
        return ChainDone(result.grad_input, answer.response.loss, [here, *answer.response.stages], runtime.version)

    async def _chain_park(self, request, out: torch.Tensor, hop_timeout: float) -> LinkAnswer:
        """Park our output for the trainer and wait for its gradient (chain_handover.py); a chain the trainer
        abandons breaks at the next stage, as if no candidate of it had answered."""
        key = result_key(request.ticket, request.microbatch_id)
        left = self.spec.num_stages - self.runtime.stage
        try:
            grad = await self.chain.handovers.park(key, out, self.runtime.version, hop_timeout * left)
        except Abandoned as e:
            raise ChainBroken(self.runtime.stage + 1, str(e), unreachable=False) from None
        return LinkAnswer(swarm_pb2.ChainResponse(), grad, "", 0)

    async def _chain_next(self, request, out: torch.Tensor, targets, route, hop_timeout: float, end: int):
        """Send our output on to the next stage (the first candidate that takes it)."""
        nxt = self.runtime.stage + 1
        allowed, refused = await self.chain.announced.allowed(nxt, route[0])
        if refused:
            self.metrics.errors.labels("chain", "unannounced_hop").inc(len(refused))
        if not allowed:
            raise ChainBroken(nxt, f"none of {len(route[0])} candidates is announced online for it in the DHT", False)
        rest = [
            swarm_pb2.ChainCandidates(hops=[swarm_pb2.ChainHop(peer_id=p, address=a) for p, a in hops])
            for hops in route[1:]
        ]
        targets_msg, targets_bytes = encode_parts(targets)

        def build(act_codec: str, reply: str) -> tuple[swarm_pb2.ChainRequest, list]:
            header, payload = encode_parts(out, act_codec)
            self._count_bytes(header, incoming=False, nbytes=memoryview(payload).nbytes)
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

        left = self.spec.num_stages - nxt
        return await self.chain.link.call(nxt, allowed, build, tuple(out.shape), hop_timeout * left, end)

    # ------------------------------------------------------------ a segment's end, and the trainer
    async def ChainHandover(
        self, request: swarm_pb2.HandoverRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.HandoverResponse:
        """The output a chain parked here for the trainer (waiting ``wait_s`` for the chain to arrive)."""

        async def handle() -> swarm_pb2.HandoverResponse:
            check_header(self.spec, self.runtime.stage, request.run_id, request.stage, request.microbatch_id)
            check_ticket(request.ticket)
            if not 0 < request.wait_s <= MAX_HOP_TIMEOUT_S:  # also refuses NaN
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"wait_s must lie in (0, {MAX_HOP_TIMEOUT_S:g}]")
            codec = reply_codec(request.output_codec, self.spec.compression.activations)
            key = result_key(request.ticket, request.microbatch_id)
            parked = await self.chain.handovers.handover(key, caller_key(context.peer() or ""), request.wait_s)
            output = self._encode(parked.output, codec, sink, "output")
            return swarm_pb2.HandoverResponse(output=output, version=parked.version)

        return await self._serve("chain_handover", context, handle)

    async def ChainResume(
        self, request: swarm_pb2.ResumeRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.ResumeResponse:
        """The gradient of a handed-over output (or ``abandon``): the parked chain goes on with its backward.
        A gradient of the wrong shape or dtype is refused and the chain keeps waiting."""

        async def handle() -> swarm_pb2.ResumeResponse:
            check_header(self.spec, self.runtime.stage, request.run_id, request.stage, request.microbatch_id)
            check_ticket(request.ticket)
            key = result_key(request.ticket, request.microbatch_id)
            parked = self.chain.handovers.waiting_for(key)
            grad = None
            if not request.abandon:
                self._count_bytes(request.grad_output, incoming=True)
                grad = decode(
                    request.grad_output,
                    max_elements=self.spec.limits.max_tensor_elements,
                    allowed_dtypes=FLOAT_DTYPES,
                    expect_shape=tuple(parked.output.shape),
                    what="grad_output",
                ).float()
            self.chain.handovers.resume(key, grad)
            return swarm_pb2.ResumeResponse(version=self.runtime.version)

        return await self._serve("chain_resume", context, handle)

    def _stage_result(self, applied: bool, dropped_reason: str, retries: int) -> swarm_pb2.ChainStageResult:
        return swarm_pb2.ChainStageResult(
            stage=self.runtime.stage,
            peer_id=self.peer_id,
            version=self.runtime.version,
            applied=applied,
            dropped_reason=dropped_reason[:200],
            retries=retries,
        )

    async def close_chain(self) -> None:
        if self._chain_state is not None:
            self._chain_state.handovers.close()
            await self._chain_state.results.close()
            await self._chain_state.link.close()
