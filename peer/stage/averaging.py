"""Replica averaging: replicas of one stage pull each other's weights now and then and take a robust aggregate.

Pull-based, so no sibling computes anything for us: in each round a replica downloads the trainable weights
(no optimizer state) of up to :data:`MAX_DONORS` other online replicas of its stage, chosen at random, over
``DownloadState(params_only=true)``: signed by the peer that announced the address, digest-checked, bounded in
bytes. A donor that cannot be reached, or whose weights fail validation (signature, names, shapes, NaN/Inf),
is skipped and logged, never averaged in. The rest are combined with our own weights by the spec's
``averaging_aggregate`` (:mod:`.robust_aggregate`; CenteredClip by default, centred on our weights with a
radius from our own movement since the previous round), so one Byzantine sibling moves us by about that
radius at most, however far off its weights are. (hivemind's butterfly all-reduce, used before, had every
member reduce a shard for the others: a Byzantine reducer could return anything for its part.)

Rounds are aligned to the wall clock (every ``averaging_interval_s``) so replicas that train at different
speeds pull at the same moment; a round is skipped unless this replica made at least ``averaging_period``
local steps since the last one and the DHT lists another online replica. Training goes on during a round:
the aggregate of a snapshot is applied as ``aggregate - snapshot`` to the live weights, so local updates
made meanwhile are kept.

Cost per round per replica: up to ``k`` downloads of the stage's trainable weights (the all-reduce moved
about twice their size), and about ``k + 3`` fp32 copies of them in host memory while the round runs (twice
that for a moment while the downloads are decoded); between rounds one copy, the anchor our movement counts from.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import torch

from swarmpipe.peer.events import EventLog
from swarmpipe.peer.plan.memory import state_bytes_bound
from swarmpipe.peer.stage.runtime import StageRuntime
from swarmpipe.peer.state.format import StageState, StateError
from swarmpipe.peer.state.robust_aggregate import (
    AggregateError,
    aggregate,
    check_contribution,
    flatten,
    trust_radius,
    unflatten,
)
from swarmpipe.peer.state.transfer import announced_signers, download_state
from swarmpipe.peer.swarm.dht import SwarmDHT
from swarmpipe.peer.swarm.records import PeerState, StageRecord

MAX_DONORS = 4  # siblings pulled per round (chosen at random when more are online)


class ReplicaAverager:
    def __init__(self, runtime: StageRuntime, events: EventLog, max_donors: int = MAX_DONORS):
        self.runtime = runtime
        self.events = events
        spec = runtime.spec
        self.interval = spec.averaging_interval_s
        self.min_steps = spec.averaging_period
        self.kind = spec.averaging_aggregate
        self.max_donors = max_donors
        self.last_version = runtime.version
        self.rounds = 0
        self.failures = 0

    def next_round_at(self, now: float | None = None) -> float:
        now = time.time() if now is None else now
        return (now // self.interval + 1) * self.interval

    @property
    def donor_timeout(self) -> float:
        return min(120.0, max(10.0, 2 * self.interval))

    async def run(self, swarm: SwarmDHT) -> None:
        runtime = self.runtime
        if runtime.weights.anchor() is None:  # our movement is measured from where we started serving
            await runtime.run(runtime.weights.set_anchor)
        while True:
            start_at = self.next_round_at()
            await asyncio.sleep(max(0.0, start_at - time.time()))
            if runtime.version - self.last_version < self.min_steps:
                continue
            try:
                peers = await swarm.stage_peers(runtime.stage)
                others = {
                    pid: r for pid, r in peers.items() if pid != self.events.peer_id and r.state is PeerState.ONLINE
                }
                if others:
                    await self.average_once(others, peers, swarm.coordinators)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the DHT hiccups, every donor failed: training goes on, next slot tries again
                self.failures += 1
                self.events.emit("averaging_failed", level=logging.WARNING, error=str(e)[:200])

    async def average_once(
        self, others: dict[str, StageRecord], peers: dict[str, StageRecord], coordinators: frozenset[str] = frozenset()
    ) -> bool:
        """One round against ``others`` (online siblings' records; ``peers``: every record of the stage, for
        who signed which address). Returns whether anything was applied."""
        started = time.monotonic()
        runtime = self.runtime
        weights = runtime.weights
        chosen = random.sample(sorted(others), min(self.max_donors, len(others)))
        names, snapshot, anchor = await runtime.run(
            lambda: (list(weights.trainable()), weights.copies(), weights.anchor())
        )
        version = runtime.version
        own = flatten(snapshot)
        tau = trust_radius(own, anchor)
        signers = announced_signers(peers, coordinators)
        pulled = await asyncio.gather(
            *(self._pull(pid, others[pid].address, names, snapshot, signers) for pid in chosen)
        )
        contributions = [c for c in pulled if c is not None]
        if not contributions:
            raise StateError(f"none of {len(chosen)} sibling(s) gave usable weights")
        result = await asyncio.to_thread(aggregate, self.kind, own, contributions, tau)
        group_size = 1 + len(contributions)
        del contributions, pulled

        def apply() -> None:  # our next movement counts from the aggregate: what we add now is not ours
            weights.add_correction(snapshot, unflatten(result.vector, snapshot))
            weights.set_anchor(result.vector)

        await runtime.run(apply)
        moved = float((result.vector - own).norm())
        self.last_version = runtime.version
        self.rounds += 1
        self.events.emit(
            "averaged",
            stage=runtime.stage,
            group_size=group_size,
            version=version,
            seconds=round(time.monotonic() - started, 2),
            aggregate=self.kind,
            clipped=result.clipped,
            outliers=result.outliers,
            far=result.far,
            tau=float(f"{tau:.4g}"),
            farthest=float(f"{result.farthest:.4g}"),
            moved=float(f"{moved:.4g}"),
            norm=float(f"{float(own.norm()):.4g}"),  # ||w|| before the round: moved / norm is the relative change
        )
        return True

    async def _pull(
        self,
        pid: str,
        address: str,
        names: list[str],
        own: list[torch.Tensor],
        signers: dict[str, frozenset[str]],
    ) -> torch.Tensor | None:
        """One sibling's trainable weights as a flat vector, or None (skipped and logged) when it failed."""
        spec = self.runtime.spec
        try:
            state = await asyncio.wait_for(
                download_state(
                    [address],
                    spec.run_id,
                    self.runtime.stage,
                    spec.limits.max_message_mb,
                    signers=signers,
                    params_only=True,
                    max_bytes=state_bytes_bound(spec, self.runtime.stage),
                ),
                self.donor_timeout,
            )
            tensors = self._check(state, names, own, pid)
        except Exception as e:  # unreachable, too slow, or refused by our checks: this round goes on without it
            self.events.emit(
                "averaging_donor_skipped",
                level=logging.WARNING,
                donor=pid[-6:],
                reason=type(e).__name__,
                error=(str(e) or "timed out")[:200],
            )
            return None
        return flatten(tensors)

    def _check(self, state: StageState, names: list[str], own: list[torch.Tensor], pid: str) -> list[torch.Tensor]:
        """The donor's weights in our order, after checking they are this stage's and nothing else."""
        meta, spec = state.meta, self.runtime.spec
        if meta.get("run_id") != spec.run_id or int(meta.get("stage", -1)) != self.runtime.stage:
            raise AggregateError(f"weights of run {str(meta.get('run_id'))[:40]!r} stage {meta.get('stage')}")
        params = {k[len("param.") :]: v for k, v in state.tensors.items() if k.startswith("param.")}
        if set(params) != set(names):  # an older donor may add its optimizer state: ignored, never a parameter
            extra = sorted(set(params) - set(names))[:1] or sorted(set(names) - set(params))[:1]
            raise AggregateError(f"its parameters differ from this stage's (e.g. {extra[0][:64]})")
        tensors = [params[n] for n in names]
        check_contribution(own, tensors, who=f"sibling {pid[-6:]}")
        return tensors
