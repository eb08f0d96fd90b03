"""One micro-batch's journey: forwards through every stage, loss, backwards, with retries.

The trainer keeps each stage's input until that stage acknowledged the backward, so any step can be redone on
another replica: a failed Forward / ForwardBackward is retried on another replica, a failed Backward (peer gone,
record expired, draining) is replayed on a live replica from the kept input and output gradient (``replay=True``).
A micro-batch ends ``completed`` (stage 0 acknowledged its backward), ``dropped_stale`` (a stage refused the
gradient: too old, or an outlier), or ``failed`` (a stage had no live replica for ``wait_timeout``, or every
replica rejected it as invalid). A replica that moved to another stage is dropped from the view.

The runner only reports: ``run`` returns a ``MicrobatchOutcome`` and the trainer folds it into its progress.
``evaluate`` takes a validation batch forward only (``evaluate`` flag: peers keep nothing, step nothing) with the
same routing and retries, and returns its loss. While waiting for a replica it asks the ``SwarmView`` it holds for
a fresh read of the DHT.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import torch

from swarmpipe.peer.client.stage_client import StageClient
from swarmpipe.peer.events import EventLog, short_id
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.trainer.chain import ChainCalls
from swarmpipe.peer.trainer.chain_segments import ChainResult, OpenSegment
from swarmpipe.peer.trainer.outcome import (
    Journey,
    MicrobatchOutcome,
    MicrobatchStatus,
    NoReplica,
    Rejected,
)
from swarmpipe.peer.trainer.routing import PeerView
from swarmpipe.peer.trainer.stage_calls import StageCalls
from swarmpipe.peer.trainer.swarm_view import SwarmView
from swarmpipe.peer.trainer.verification import ReplicaVerifier
from swarmpipe.peer.transport.chain_protocol import ChainBroken
from swarmpipe.peer.transport.wire import WireError

log = logging.getLogger("swarmpipe.trainer")

# Errors that say "this request is wrong", not "this peer is unwell": do not ban for them.
CALLER_ERRORS = (grpc.StatusCode.INVALID_ARGUMENT,)
# "I serve another stage now": the peer rebalanced since our last DHT refresh. Not its fault, not ours.
MOVED = grpc.StatusCode.FAILED_PRECONDITION
WAIT_LOG_PERIOD_S = 10.0
T = TypeVar("T")
# Set in a micro-batch's own task: it goes the hub way and every stage's answer is verified (chain mode's sample).
_VERIFY_ALL: contextvars.ContextVar[bool] = contextvars.ContextVar("verify_all", default=False)


class MicrobatchRunner:
    def __init__(
        self,
        spec: RunSpec,
        view: SwarmView,
        events: EventLog,
        call_timeout: float,
        wait_timeout: float,
        verify_fraction: float = 0.0,
        ban_after: int = 2,
        route: str = "hub",
    ):
        self.spec = spec
        self.view = view
        self.router = view.router
        self.events = events
        self.call_timeout = call_timeout
        self.wait_timeout = wait_timeout
        self.calls = StageCalls(spec, StageClient(spec), call_timeout)
        self.verifier = ReplicaVerifier(spec, self.calls, self.router, events, verify_fraction, ban_after)
        # route "chain": activations pass peer to peer (peer/trainer/chain.py); "hub": every hop through us
        self.chain = ChainCalls(spec, self.calls, self.router, events, call_timeout) if route == "chain" else None
        self._waiting_since: dict[int, float] = {}
        self._evaluations = 0

    async def close(self) -> None:
        await self.calls.close()

    # ------------------------------------------------------------ the journey
    async def run(self, mb_id: str, tokens: torch.Tensor, targets: torch.Tensor) -> MicrobatchOutcome:
        """Take one micro-batch through every stage and back. Never raises for a micro-batch's own failure:
        that is an outcome; only a bug or cancellation escapes. Chain mode: chained from stage 0, the hops the
        trainer relays for now taken by it; a micro-batch sampled for verification goes the hub way, every
        stage checked."""
        journey = Journey()
        try:
            if self.chain is not None and not self.verifier.sampled():
                result = await self._chained(0, mb_id, tokens, targets, journey)
                loss = result.loss
                journey.retries += result.retries
                journey.stale_stages += result.stale
                self.chain.relayed(journey.relayed_hops)
            else:
                token = _VERIFY_ALL.set(self.chain is not None)
                try:
                    loss = await self._hub(mb_id, tokens, targets, journey)
                finally:
                    _VERIFY_ALL.reset(token)
        except (NoReplica, Rejected) as e:
            self.events.emit("microbatch_failed", level=logging.ERROR, microbatch=mb_id, reason=str(e))
            return MicrobatchOutcome(mb_id, MicrobatchStatus.FAILED, retries=journey.retries, reason=str(e))
        if journey.stale_stages:
            stages = ", ".join(map(str, journey.stale_stages))
            return MicrobatchOutcome(
                mb_id,
                MicrobatchStatus.DROPPED_STALE,
                loss=loss,
                retries=journey.retries,
                reason=f"gradient dropped as stale by stage {stages}",
            )
        return MicrobatchOutcome(mb_id, MicrobatchStatus.COMPLETED, loss=loss, retries=journey.retries)

    async def _hub(self, mb_id: str, tokens: torch.Tensor, targets: torch.Tensor, journey: Journey) -> float:
        """Every hop through the trainer: forwards, the last stage's ForwardBackward, backwards; the loss."""
        P = self.spec.num_stages
        inputs: list[torch.Tensor] = [tokens]
        peers: list[PeerView] = []
        for stage in range(P - 1):
            out, view = await self._with_retries(
                stage,
                lambda v, s=stage: self.calls.forward(v, s, mb_id, inputs[s]),
                journey,
                check=lambda v, y, s=stage: self._check_output(v, s, inputs[s], y, mb_id),
            )
            inputs.append(out)
            peers.append(view)
        (loss, grad, dropped), _ = await self._with_retries(
            P - 1,
            lambda v: self.calls.forward_backward(v, P - 1, mb_id, inputs[P - 1], targets),
            journey,
            check=lambda v, r: self._check_gradient(v, P - 1, inputs[P - 1], r[1], None, targets, r[0], mb_id),
        )
        journey.stale_stages += [P - 1] if dropped else []
        for stage in range(P - 2, -1, -1):
            grad, dropped = await self._backward(stage, mb_id, peers[stage], inputs[stage], grad, journey)
            if dropped:
                journey.stale_stages.append(stage)
        return loss

    async def _chained(
        self,
        stage: int,
        mb_id: str,
        x: torch.Tensor,
        targets: torch.Tensor,
        journey: Journey,
        upto: int | None = None,
        grad_out: torch.Tensor | None = None,
        per_hop: bool = False,
    ) -> ChainResult:
        """Stages ``stage``..``upto`` (the last when None) from input ``x``, peer to peer except the hops the
        trainer relays for now (a chain ends before each; its end parks the output, which we carry on). With
        ``upto``, ``grad_out`` is the gradient of its output: a segment run again after its chain failed, then
        ``per_hop`` (every hop through us: nothing in it can break again)."""
        P = self.spec.num_stages
        last = P - 1 if upto is None else upto
        while True:
            end = stage if per_hop else min(last, self.chain.relays.segment_end(stage))
            deadline = self.chain.deadline(stage)
            try:
                if end == P - 1:
                    result, _ = await self._with_retries(
                        stage, lambda v: self.chain.call(v, stage, mb_id, x, targets), journey, timeout=deadline
                    )
                    return result
                seg, _ = await self._with_retries(
                    stage, lambda v, e=end: self.chain.open(v, stage, e, mb_id, x, targets), journey, timeout=deadline
                )
                break
            except ChainBroken as e:  # hop e.stage goes through us from now on: chains end before it
                self.chain.relays.broke(e, mb_id)
                journey.retries += 1
        if seg.finished is not None:  # every stage of it had done its part already (a segment run again)
            return seg.finished
        journey.relayed_hops += 1
        try:
            if end < last:
                later = await self._chained(end + 1, mb_id, seg.output, targets, journey, upto, grad_out, per_hop)
            else:
                later = ChainResult(None, grad_out, [], 0)
        except BaseException:
            await self.chain.handovers.abandon(seg, mb_id)
            raise
        here = await self._close(seg, mb_id, later.grad, targets, journey)
        return ChainResult(later.loss, here.grad, here.stale + later.stale, here.retries + later.retries)

    async def _close(
        self, seg: OpenSegment, mb_id: str, grad: torch.Tensor, targets: torch.Tensor, journey: Journey
    ) -> ChainResult:
        """A segment's backward: its end gets the gradient, the chain answers. When that fails (a peer of the
        segment died meanwhile), the segment runs again hop by hop through us from its kept input: stages that
        already did their part answer from what they kept, the others recompute (a replay)."""
        self.router.started(seg.view)
        try:
            close = self.chain.handovers.close(seg, mb_id, grad)
            return await self._timed(seg.view, close, measure=False, timeout=self.chain.deadline(seg.start))
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, WireError, ChainBroken) as e:
            if not isinstance(e, ChainBroken):  # a break settled the replica's count already; it is not to blame
                self._failed(seg.view, e)
            reason = _reason(e)
        await self.chain.handovers.abandon(seg, mb_id)
        journey.retries += 1
        self.events.emit(
            "replay", level=logging.WARNING, stage=seg.start, microbatch=mb_id, upto=seg.end, reason=reason[:160]
        )
        return await self._chained(seg.start, mb_id, seg.x, targets, journey, seg.end, grad, per_hop=True)

    async def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """Validation loss of one batch: forward-only through every stage on the live weights, each hop on
        a replica chosen and retried like a training call. None when it could not complete (no replica
        within ``wait_timeout``, or every replica rejected it). Its latencies do not feed the router's
        estimates: a forward-only call is cheaper than the training calls routing is planned for."""
        P = self.spec.num_stages
        self._evaluations += 1
        mb_id = f"eval-{self._evaluations}"
        journey = Journey()
        x = inputs
        try:
            for stage in range(P - 1):
                x, _ = await self._with_retries(
                    stage,
                    lambda v, s=stage, x=x: self.calls.forward(v, s, mb_id, x, evaluate=True),
                    journey,
                    measure=False,
                )
            (loss, _, _), _ = await self._with_retries(
                P - 1,
                lambda v, x=x: self.calls.forward_backward(v, P - 1, mb_id, x, targets, evaluate=True),
                journey,
                measure=False,
            )
        except (NoReplica, Rejected) as e:
            self.events.emit("evaluation_failed", level=logging.WARNING, microbatch=mb_id, reason=str(e))
            return None
        return loss

    async def _backward(
        self, stage: int, mb_id: str, view: PeerView, inputs: torch.Tensor, grad: torch.Tensor, journey: Journey
    ) -> tuple[torch.Tensor | None, bool]:
        """Backward on the replica that ran the forward (it kept the activations); when that fails,
        replay it elsewhere from the kept input. A replay counts as a retry."""
        try:
            self.router.started(view)
            result = await self._timed(view, self.calls.backward(view, stage, mb_id, grad, None))
            await self._check_gradient(view, stage, inputs, result[0], grad, mb_id=mb_id)
            return result
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, WireError) as e:
            reason = _reason(e)
            self._failed(view, e)
            journey.retries += 1
            self.events.emit(
                "replay",
                level=logging.WARNING,
                stage=stage,
                microbatch=mb_id,
                peer=short_id(view.peer_id),
                reason=reason,
            )
        (grad_in, dropped), _ = await self._with_retries(
            stage,
            lambda v: self.calls.backward(v, stage, mb_id, grad, inputs),
            journey,
            check=lambda v, r: self._check_gradient(v, stage, inputs, r[0], grad, mb_id=mb_id),
        )
        return grad_in, dropped

    # ------------------------------------------------------------ verification
    async def _check_output(self, view: PeerView, stage: int, x: torch.Tensor, y: torch.Tensor, mb_id: str) -> None:
        if _VERIFY_ALL.get() or self.verifier.sampled():
            await self.verifier.check_output(view, stage, x, y, mb_id)

    async def _check_gradient(
        self,
        view: PeerView,
        stage: int,
        x: torch.Tensor,
        grad_input: torch.Tensor | None,
        grad_output: torch.Tensor | None,
        targets: torch.Tensor | None = None,
        loss: float | None = None,
        mb_id: str = "",
    ) -> None:
        if grad_input is not None and (_VERIFY_ALL.get() or self.verifier.sampled()):
            await self.verifier.check_gradient(view, stage, x, grad_input, grad_output, targets, loss, mb_id)

    # ------------------------------------------------------------ retries
    async def _with_retries(
        self,
        stage: int,
        call: Callable[[PeerView], Awaitable[T]],
        journey: Journey,
        measure: bool = True,
        check: Callable[[PeerView, T], Awaitable[None]] | None = None,
        timeout: float | None = None,
    ) -> tuple[T, PeerView]:
        """Run ``call(view)`` on the best replica; on failure, ban and try another; wait when none is alive.
        Every attempt after the first counts as a retry in ``journey``. ``measure``: see :meth:`_timed`.
        ``check(view, result)``: verification (outside the call's deadline and latency); its ``Disputed``
        fails the attempt like any error."""
        tried: set[str] = set()
        rejected: set[str] = set()  # replicas that called the request invalid
        first_attempt = True
        while True:
            view = self.router.choose(stage, exclude=tried) or self.router.choose(stage, exclude=rejected)
            if view is None:
                await self._wait_for_replica(stage)
                tried.clear()
                continue
            self._waiting_since.pop(stage, None)
            if not first_attempt:
                journey.retries += 1
            first_attempt = False
            self.router.started(view)
            try:
                result = await self._timed(view, call(view), measure, timeout)
                if check is not None:
                    await check(view, result)
                return result, view
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, WireError) as e:
                ban = self._failed(view, e)
                tried.add(view.peer_id)
                self.events.emit(
                    "call_failed",
                    level=logging.WARNING,
                    stage=stage,
                    peer=short_id(view.peer_id),
                    reason=_reason(e),
                    banned_s=round(ban, 1),
                )
                if isinstance(e, grpc.aio.AioRpcError) and e.code() in CALLER_ERRORS:
                    # Usually our request is bad and nobody will take it; but one faulty peer must not be
                    # able to fail micro-batches that its sibling replicas would serve.
                    rejected.add(view.peer_id)
                    if not self.router.available(stage, exclude=rejected):
                        raise Rejected(f"stage {stage}: every replica rejected the request ({_reason(e)})") from e

    def _failed(self, view: PeerView, e: Exception) -> float:
        """Tell the router; returns the ban length (0 when the peer is not to blame)."""
        if isinstance(e, grpc.aio.AioRpcError) and e.code() == MOVED:
            self.router.moved(view)
            return 0.0
        return self.router.failed(view, ban=_should_ban(e))

    async def _timed(
        self, view: PeerView, awaitable: Awaitable[T], measure: bool = True, timeout: float | None = None
    ) -> T:
        """Await one call under the deadline (``call_timeout`` unless given). ``measure=False`` (validation):
        the call ends without its latency entering the replica's estimate, which is for training calls."""
        started = time.monotonic()
        result = await asyncio.wait_for(awaitable, timeout or self.call_timeout)
        self.router.succeeded(view, time.monotonic() - started if measure else None)
        return result

    async def _wait_for_replica(self, stage: int) -> None:
        t = time.monotonic()
        since = self._waiting_since.setdefault(stage, t)
        if t - since > self.wait_timeout:
            raise NoReplica(f"stage {stage} has had no live replica for {self.wait_timeout:.0f}s")
        if int(t - since) % WAIT_LOG_PERIOD_S < 1.0:
            self.events.emit("waiting_for_replica", level=logging.WARNING, stage=stage, waited_s=round(t - since))
        await self.view.refresh_now()  # a replica may have joined (or moved here) since the last read
        await asyncio.sleep(1.0)


def _should_ban(e: Exception) -> bool:
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code() not in CALLER_ERRORS + (grpc.StatusCode.NOT_FOUND,)
    return True


def _reason(e: Exception) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    if isinstance(e, asyncio.TimeoutError):
        return "deadline exceeded"
    return str(e)
