"""The trainer's side of a hop it relays inside a chained micro-batch: a segment's parked output, taken and resumed.

When the hop into stage e+1 broke (stage e reached none of its candidates; peer/trainer/chain.py relays that hop
for a cooldown), the micro-batch still goes peer to peer everywhere else: the trainer sends a chain that ends at
stage e (``segment_stages``), takes the output stage e parks (``ChainHandover``), sends it on from stage e+1, and
gives the gradient of that output back (``ChainResume``); the segment then runs its backward peer to peer and
answers its chain call. Only the relayed hop crosses the trainer's link: an activation in and out, a gradient in
and out.

The trainer does not know which replica of stage e the chain reached (stage e-1 tries the route's candidates in
turn), so it asks every candidate at once; the one that parked the output answers, the other calls are cancelled.
When the chain still runs a hop's time after the gradient was given, the holder may have died and stage e-1 sent
the micro-batch to another candidate, which parked again: the trainer looks again and gives that one the same
gradient (as a replayed backward would).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
import torch

from swarmpipe.peer.events import EventLog, short_id
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.trainer.routing import PeerView, Router
from swarmpipe.peer.trainer.stage_calls import StageCalls
from swarmpipe.peer.transport.chain_protocol import MAX_HOP_TIMEOUT_S
from swarmpipe.peer.transport.wire import WireError
from swarmpipe.protos import swarm_pb2

ABANDON_WAIT_S = 5.0  # how long an abandoned segment's chain may take to unwind before its call is cancelled


@dataclass
class ChainResult:
    """What a chain from some stage came to (a whole chain's, or a segment's once its gradient was given)."""

    loss: float | None  # the last stage's loss; None for a segment that ends before it
    grad: torch.Tensor | None  # the gradient of the chain's input (None from stage 0)
    stale: list[int]  # stages that dropped the gradient
    retries: int  # candidates that failed on the way, plus replays, summed over stages


@dataclass
class OpenSegment:
    """A chain from ``start`` to ``end`` whose end parked its output and waits for the gradient."""

    start: int
    end: int
    view: PeerView  # the replica of ``start`` the trainer called
    x: torch.Tensor  # its input, kept for a rerun
    task: asyncio.Future  # the chain call: a ChainResult once the gradient was given
    holders: list[PeerView]  # the candidates of ``end`` the route named
    output: torch.Tensor | None = None
    holder: PeerView | None = None  # the replica of ``end`` that parked the output
    finished: ChainResult | None = None  # answered without parking: every stage of it had done its part before


class SegmentHandovers:
    def __init__(self, spec: RunSpec, calls: StageCalls, router: Router, events: EventLog, hop_timeout: float):
        self.spec = spec
        self.calls = calls
        self.router = router
        self.events = events
        self.hop_timeout = hop_timeout

    async def take(self, seg: OpenSegment, mb_id: str, wait: float) -> None:
        """Fill ``seg.output`` and ``seg.holder`` from the replica that parked it, or ``seg.finished`` when the
        chain answered without parking; raises the chain's own error, or WireError when no candidate has it."""
        got = await self._park_or_answer(seg, mb_id, wait)
        if seg.task.done():
            seg.finished = seg.task.result()  # the chain's error, if it failed
            return
        if got is None:
            raise WireError(f"no replica of stage {seg.end} handed over micro-batch {mb_id}'s output")
        seg.output, seg.holder = got

    async def close(self, seg: OpenSegment, mb_id: str, grad: torch.Tensor) -> ChainResult:
        """Give the parked output its gradient and wait for the segment's answer; if the chain still runs a
        hop's time later, look for a new park (the holder died, another candidate took the micro-batch)."""
        if seg.finished is not None:
            return seg.finished
        given = await self._give(seg.holder, seg.end, mb_id, grad)
        while True:
            done, _ = await asyncio.wait({seg.task}, timeout=self.hop_timeout)
            if done:
                return seg.task.result()
            got = await self._park_or_answer(seg, mb_id, self.hop_timeout)
            if seg.task.done():
                return seg.task.result()
            if got is not None and (got[1] is not seg.holder or not given):
                if got[1] is not seg.holder:
                    self.events.emit(
                        "handover_moved",
                        level=logging.INFO,
                        microbatch=mb_id,
                        stage=seg.end,
                        peer=short_id(got[1].peer_id),
                    )
                seg.holder = got[1]
                given = await self._give(seg.holder, seg.end, mb_id, grad)

    async def _park_or_answer(self, seg: OpenSegment, mb_id: str, wait: float) -> tuple[torch.Tensor, PeerView] | None:
        """Whichever comes first: a candidate hands over the parked output (returned), or the chain answers
        (``seg.task`` done; None). None too when no candidate had it within ``wait``."""
        rows, seq = seg.x.shape[0], seg.x.shape[1]
        fetch = asyncio.ensure_future(self._take_any(seg.holders, seg.end, mb_id, rows, seq, wait))
        try:
            await asyncio.wait({seg.task, fetch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not fetch.done():
                fetch.cancel()
                await asyncio.gather(fetch, return_exceptions=True)
        return None if fetch.cancelled() else fetch.result()

    async def abandon(self, seg: OpenSegment, mb_id: str) -> None:
        """The rest of the micro-batch failed: the parked chain drops its forwards and ends; never raises."""
        if seg.holder is not None and not seg.task.done():
            await self._give(seg.holder, seg.end, mb_id, None)
        await asyncio.wait({seg.task}, timeout=ABANDON_WAIT_S)
        seg.task.cancel()
        await asyncio.gather(seg.task, return_exceptions=True)

    # ------------------------------------------------------------ the two calls
    async def _take_any(
        self, holders: list[PeerView], stage: int, mb_id: str, rows: int, seq: int, wait: float
    ) -> tuple[torch.Tensor, PeerView] | None:
        """(output, holder) from whichever candidate parked it; None when none did."""
        calls = {asyncio.ensure_future(self._take(h, stage, mb_id, rows, seq, wait)): h for h in holders}
        try:
            for next_done in asyncio.as_completed(calls):
                try:
                    return await next_done
                except (grpc.aio.AioRpcError, asyncio.TimeoutError, WireError):
                    continue  # not parked there (NOT_FOUND), gone, or a bad answer: the others may have it
            return None
        finally:
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)

    async def _take(
        self, holder: PeerView, stage: int, mb_id: str, rows: int, seq: int, wait: float
    ) -> tuple[torch.Tensor, PeerView]:
        width = self.spec.model.d_model
        nbytes = 4 * rows * seq * width
        codec = self.calls.codec("activations", holder, nbytes)
        request = swarm_pb2.HandoverRequest(
            run_id=self.spec.run_id,
            stage=stage,
            microbatch_id=mb_id,
            ticket=self.calls.ticket(mb_id),
            output_codec=codec,
            wait_s=min(wait, MAX_HOP_TIMEOUT_S),
        )
        response = await self.calls.call(holder, "ChainHandover", request, timeout=wait + 5.0, expected_bytes=nbytes)
        out = self.calls.answers.tensor(
            response.output, kind="activations", stage=stage, shape=(rows, seq, width), what="handed-over output"
        )
        return out, holder

    async def _give(self, holder: PeerView, stage: int, mb_id: str, grad: torch.Tensor | None) -> bool:
        """Resume the chain parked at ``holder`` with ``grad`` (None: abandon it); False when it no longer waits."""
        request = swarm_pb2.ResumeRequest(
            run_id=self.spec.run_id, stage=stage, microbatch_id=mb_id, ticket=self.calls.ticket(mb_id)
        )
        if grad is None:
            request.abandon = True
        else:
            request.grad_output.CopyFrom(self.calls.encode_grad(stage, holder, grad))
        try:
            await self.calls.call(holder, "ChainResume", request, timeout=self.hop_timeout if grad is not None else 2.0)
            return True
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as e:
            reason = f"{e.code().name}" if isinstance(e, grpc.aio.AioRpcError) else "deadline exceeded"
            self.events.emit(
                "resume_failed",
                level=logging.INFO,
                microbatch=mb_id,
                stage=stage,
                peer=short_id(holder.peer_id),
                reason=reason,
                abandon=grad is None,
            )
            return False
