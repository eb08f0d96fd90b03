"""Rebalancing: a peer moves to the slowest stage when that clearly raises the pipeline's throughput.

Every randomized period (so peers do not decide in lockstep), a peer reads every
stage's total throughput; :func:`swarmpipe.peer.swarm.balance.rebalance_target` applies the
hysteresis, and lets one replica per stage leave in each turn (a window of one period): three replicas of a light
stage that all saw the same heavy stage once moved within half a second and left their stage empty. A move: announce ``joining`` on the target stage at once (so other
peers count us there and do not pile on), load the target's state while still
serving the old stage, then drain the old stage, hand its state to a replica,
and switch. A cooldown after each move stops flapping.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from swarmpipe.peer.stage.handoff import hand_off_state, load_initial_state
from swarmpipe.peer.stage.lifecycle import StageHost
from swarmpipe.peer.stage.runtime import StageRuntime
from swarmpipe.peer.swarm.balance import rebalance_target, stage_cost
from swarmpipe.peer.swarm.records import PeerState

log = logging.getLogger("swarmpipe.rebalance")
COOLDOWN_PERIODS = 4


class Rebalancer:
    def __init__(self, host: StageHost, period: float, rng: random.Random | None = None):
        self.host = host
        self.period = period
        self.rng = rng or random.Random()
        self.cooldown = 0

    async def run(self) -> None:
        period = self.period
        while True:
            await asyncio.sleep(period * self.rng.uniform(0.5, 1.5))
            if self.cooldown > 0:
                self.cooldown -= 1
                continue
            try:
                turn = int(time.time() // period)
                target = await self.check(turn)
                if target is not None:
                    # Look again after a random pause: a peer of another stage that decided at the same moment
                    # has announced itself at the target by then, and the second look sees it.
                    await asyncio.sleep(self.rng.uniform(1.0, 4.0))
                    if await self.check(turn) == target:
                        await self.move(target)
                        self.cooldown = COOLDOWN_PERIODS
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a failed check or move leaves us serving where we are
                self.host.events.emit("rebalance_failed", level=logging.WARNING, error=str(e)[:300])

    async def check(self, turn: int | None = None) -> int | None:
        if self.host.lifecycle.state is not PeerState.ONLINE:
            return None
        runtime = self.host.runtime
        spec = runtime.spec
        stages = await self.host.swarm.all_stages(spec.num_stages)
        mine = runtime.throughput()
        if mine <= 0:
            return None  # not measured yet

        # What we would do there: our measured speed scaled by the relative cost of the stages.
        def estimate(target: int) -> float:
            return mine * stage_cost(spec, runtime.stage) / stage_cost(spec, target)

        return rebalance_target(stages, runtime.stage, self.host.events.peer_id, mine, estimate=estimate, turn=turn)

    async def move(self, target: int) -> None:
        host = self.host
        old = host.runtime
        spec = old.spec
        estimate = old.throughput() * stage_cost(spec, old.stage) / stage_cost(spec, target)
        host.events.emit("rebalancing", from_stage=old.stage, to_stage=target, estimate=round(estimate, 2))
        await host.announce_as(target, host.record(state=PeerState.JOINING, throughput=estimate))
        # built off the event loop; it owns its own thread
        new = await old.run(
            lambda: StageRuntime(
                spec, target, base_dir=old.base_dir, device=old.device, stash_bound_bytes=old.pending.bound_bytes
            )
        )
        new.assume_throughput(estimate)  # others must count us at the new stage right away, not as zero
        await load_initial_state(host.swarm, new, host.events)
        await host.finish_in_flight()  # old stage: refuse new work, finish what we hold
        await hand_off_state(host.swarm, old, host.events)
        host.switch_runtime(new)
        await host.announce_as(old.stage, host.record(state=PeerState.DRAINING, throughput=0.0))
        await host.announce_as(target, host.record())
        host.events.emit("rebalanced", from_stage=old.stage, to_stage=target, version=new.version)
