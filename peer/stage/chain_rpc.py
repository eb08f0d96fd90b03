"""The ``Chain`` RPC: a micro-batch passes from peer to peer, and its gradient comes back the same way.

Stage k takes the input (tokens on stage 0), the targets and the route; it runs its forward exactly as a
``Forward`` would (server-side batching, weight stash, the same pending-forward bounds), calls stage k+1 itself
with its output and the rest of the route (:mod:`chain_link`: the candidates in turn, only those the DHT lists,
:mod:`chain_route`), runs its backward with the gradient that call answers (the stashed forward; if the stash
bound dropped it meanwhile, recomputed from the input it still holds, counted as a replay), and answers its
caller with its input gradient, the loss and what every stage from here on did. The last stage runs a
``ForwardBackward``. So a peer keeps what it sent downstream exactly until the downstream answer (= the
backward) comes back, and the trainer's traffic per micro-batch is tokens in, loss out.

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

from swarmpipe.peer.stage.chain_link import ChainLink
from swarmpipe.peer.stage.chain_results import ChainDone, ChainResults, result_key
from swarmpipe.peer.stage.chain_route import AnnouncedHops, check_route, decode_targets
from swarmpipe.peer.stage.error_contract import caller_key
from swarmpipe.peer.stage.request_checks import (
    check_header,
    decode_stage_input,
    pending_key,
    reply_codec,
)
from swarmpipe.peer.stage.runtime import UnknownMicrobatch
from swarmpipe.peer.transport.chain_protocol import ChainBroken
from swarmpipe.peer.transport.codec_policy import ErrorFeedback
from swarmpipe.peer.transport.wire import encode_parts
from swarmpipe.protos import swarm_pb2

log = logging.getLogger("swarmpipe.server")
LOSSY_8BIT = ("uint8", "blockwise8")


class ChainState:
    """What a servicer keeps for chained calls: its link to next stages, results, the DHT's hops, residuals."""

    def __init__(self, servicer) -> None:
        self.link = ChainLink(servicer.spec)
        self.results = ChainResults()
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
            route = check_route(self.spec, runtime.stage, request)
            reply = reply_codec(request.reply_codec, self.spec.compression.gradients)
            self._count_bytes(request.input, incoming=True)
            x = decode_stage_input(self.spec, runtime.is_first, request.input)
            targets = decode_targets(self.spec, request.targets, x.shape[0], x.shape[1])
            caller = caller_key(context.peer() or "")
            mb = pending_key(caller, request.microbatch_id, request.ticket)
            hop_timeout = float(request.hop_timeout_s)

            async def work() -> ChainDone:
                return await self._chain_work(request, mb, x, targets, route, hop_timeout)

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
            answer = await self._chain_next(request, out, targets, route, hop_timeout)
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

    async def _chain_next(self, request, out: torch.Tensor, targets, route, hop_timeout: float):
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
            )
            return next_request, [payload, targets_bytes]

        left = self.spec.num_stages - nxt
        return await self.chain.link.call(nxt, allowed, build, tuple(out.shape), hop_timeout * left)

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
            await self._chain_state.results.close()
            await self._chain_state.link.close()
