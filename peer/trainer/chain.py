"""The trainer's side of chained micro-batches: routes, chain calls, and the hops it relays itself.

In ``route = "chain"`` mode the trainer sends stage j (0, unless it relays some hops) the micro-batch's input,
its targets and a route: for each later stage up to ``MAX_CANDIDATES`` replicas from its own routing (best
expected finish first). The stages pass activations and gradients among themselves (peer/stage/chain/service.py);
stage j answers with the loss, its input gradient (none on stage 0), and what each stage did, from which the
trainer counts stale drops and retries exactly as in hub mode. Its traffic per micro-batch: tokens and targets
in, a loss out.

When the chain breaks at stage b, hop b alone goes through the trainer for a while (peer/trainer/relayed_hops.py):
chains end at stage b-1, which parks its output; the trainer takes it, chains on from stage b, and gives the
gradient back (peer/trainer/chain_segments.py). Every other hop stays peer to peer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch

from swarmpipe.peer.client.chain_answer import read_chain_answer
from swarmpipe.peer.events import EventLog, short_id
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.trainer.chain_segments import ChainResult, OpenSegment, SegmentHandovers
from swarmpipe.peer.trainer.relayed_hops import RelayedHops
from swarmpipe.peer.trainer.routing import PeerView, Router
from swarmpipe.peer.trainer.stage_calls import StageCalls
from swarmpipe.peer.transport.chain_protocol import MAX_CANDIDATES, ChainBroken
from swarmpipe.peer.transport.wire import encode, encode_parts
from swarmpipe.protos import swarm_pb2

ROUTES = ("chain", "hub")


class ChainCalls:
    def __init__(
        self,
        spec: RunSpec,
        calls: StageCalls,
        router: Router,
        events: EventLog,
        hop_timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.spec = spec
        self.calls = calls
        self.router = router
        self.events = events
        self.hop_timeout = hop_timeout
        self.relays = RelayedHops(spec.num_stages, events, clock)  # where chains end for now
        self.chained = 0  # micro-batches chained from stage 0: every hop peer to peer
        self.split = 0  # micro-batches chained with some hops relayed by the trainer
        self.hops_relayed = 0  # those hops, summed
        self.handovers = SegmentHandovers(spec, calls, router, events, hop_timeout)

    @staticmethod
    def counters(chain: ChainCalls | None) -> dict[str, int]:
        """The report's chain counters (all 0 in hub mode)."""
        if chain is None:
            return dict(chain_breaks=0, microbatches_chained=0, microbatches_split=0, hops_relayed=0)
        return dict(
            chain_breaks=chain.relays.breaks,
            microbatches_chained=chain.chained,
            microbatches_split=chain.split,
            hops_relayed=chain.hops_relayed,
        )

    def relayed(self, hops: int) -> None:
        """A micro-batch went through with ``hops`` hops carried by the trainer."""
        self.split += hops > 0
        self.hops_relayed += hops

    def deadline(self, stage: int) -> float:
        """The whole chain from ``stage``: a hop's time per stage left, and one more for a retry on the way."""
        return self.hop_timeout * (self.spec.num_stages - stage + 1)

    # ------------------------------------------------------------ the call
    def _spread(self, view: PeerView) -> float:
        return self.router.expected_finish(view) * (1.0 + 0.1 * self.router.rng.random())

    def route(self, stage: int, end: int) -> list[swarm_pb2.ChainCandidates]:
        """Candidates for every stage after ``stage`` up to ``end``, best expected finish first; ChainBroken when
        a stage has none."""
        route = []
        for s in range(stage + 1, end + 1):
            # jittered like the hub's choice, and counting our chains in flight through each replica (below):
            # else every chain would name the same first candidate and its siblings would idle
            views = sorted(self.router.available(s), key=self._spread)[:MAX_CANDIDATES]
            if not views:
                raise ChainBroken(s, f"no live replica of stage {s} is known", unreachable=False)
            route.append(
                swarm_pb2.ChainCandidates(
                    hops=[swarm_pb2.ChainHop(peer_id=v.peer_id, address=v.address) for v in views]
                )
            )
        return route

    async def call(self, view: PeerView, stage: int, mb_id: str, x: torch.Tensor, targets: torch.Tensor) -> ChainResult:
        """The micro-batch from ``stage`` to the last stage, through ``view``. ChainBroken: a later hop broke
        (not ``view``'s fault: its in-flight count is settled here); any other error is ``view``'s, as for a hub
        call."""
        result = await self._send(view, stage, self.spec.num_stages - 1, mb_id, x, targets)
        self.chained += stage == 0
        return result

    async def open(
        self, view: PeerView, stage: int, end: int, mb_id: str, x: torch.Tensor, targets: torch.Tensor
    ) -> OpenSegment:
        """A chain from ``stage`` to ``end`` (< the last stage), through ``view``, with the output ``end`` parked
        taken (``seg.output``; or ``seg.finished`` when the chain answered without parking). Errors as ``call``."""
        route = self._route_or_settle(view, stage, end)
        holders = [view]
        if end > stage:
            holders = [self.router.peers[h.peer_id] for h in route[-1].hops if h.peer_id in self.router.peers]
        task = asyncio.ensure_future(self._send(view, stage, end, mb_id, x, targets, route))
        seg = OpenSegment(stage, end, view, x, task, holders)
        try:
            await self.handovers.take(seg, mb_id, self.deadline(stage))
        except BaseException:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        return seg

    def _route_or_settle(self, view: PeerView, stage: int, end: int) -> list[swarm_pb2.ChainCandidates]:
        """``route``; when a stage has no replica, ``view`` was counted in flight for nothing: settle it."""
        try:
            return self.route(stage, end)
        except ChainBroken:
            self.router.released(view)
            raise

    async def _send(
        self,
        view: PeerView,
        stage: int,
        end: int,
        mb_id: str,
        x: torch.Tensor,
        targets: torch.Tensor,
        route: list[swarm_pb2.ChainCandidates] | None = None,
    ) -> ChainResult:
        if route is None:
            route = self._route_or_settle(view, stage, end)
        nbytes = 4 * x.numel()
        codec = self.calls.codec("activations", view, nbytes) if stage > 0 else "none"
        header, payload = encode_parts(x, codec)
        request = swarm_pb2.ChainRequest(
            run_id=self.spec.run_id,
            stage=stage,
            microbatch_id=mb_id,
            input=header,
            targets=encode(targets),
            route=route,
            ticket=self.calls.ticket(mb_id),
            reply_codec=self.calls.codec("gradients", view, nbytes) if stage > 0 else "",
            hop_timeout_s=self.hop_timeout,
            segment_stages=0 if end == self.spec.num_stages - 1 else end - stage + 1,
        )
        firsts = [self.router.peers.get(c.hops[0].peer_id) for c in route]
        # the peer before tries its first candidate first: count it as ours in flight
        downstream = [v for v in firsts if v is not None]
        # a segment's call also spans the rest of the micro-batch (its end waits for the gradient)
        timeout = self.deadline(stage) + (self.hop_timeout if end < self.spec.num_stages - 1 else 0.0)
        try:
            with self.router.holding(downstream):
                response = await self.calls.call(view, "Chain", request, payloads=[payload, None], timeout=timeout)
        except ChainBroken:  # a later hop broke: not this peer's failure, its count is settled here
            self.router.released(view)
            raise
        result = self._read(stage, end, x, response)
        self.relays.passed(stage, end)
        return result

    def _read(self, stage: int, end: int, x: torch.Tensor, response: swarm_pb2.ChainResponse) -> ChainResult:
        """Stage ``stage``'s answer (peer/client/chain_answer.py), its stale drops logged."""
        grad_shape = (x.shape[0], x.shape[1], self.spec.model.d_model)
        answer = read_chain_answer(self.calls.answers, response, stage, end, grad_shape)
        for s in answer.stages:
            if s.dropped_reason and not s.applied:
                self.events.emit(
                    "chain_dropped",
                    level=logging.DEBUG,
                    stage=s.stage,
                    peer=short_id(s.peer_id),
                    reason=s.dropped_reason[:80],
                )
        return ChainResult(
            loss=answer.loss if end == self.spec.num_stages - 1 else None,
            grad=answer.grad,
            stale=[s.stage for s in answer.stages if not s.applied],
            retries=sum(max(0, min(s.retries, 1000)) for s in answer.stages),
        )
