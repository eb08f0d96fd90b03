"""Replica averaging: replicas of one stage average their weights now and then.

Built on hivemind's DecentralizedAverager (all-reduce in groups found through the
DHT, tolerant of a member that vanishes mid-round). Rounds are aligned to the
wall clock (every ``averaging_interval_s``) so replicas that train at different
speeds still look for a group at the same moment; a round is skipped unless
this replica made at least ``averaging_period`` local steps since the last one
and the DHT lists another online replica.

Training goes on during a round: we average a snapshot and then add the
difference (average - snapshot) to the live weights, so the local updates made
meanwhile are kept rather than overwritten.

The averager runs in a forked process: create it before the gRPC server starts.
"""

from __future__ import annotations

import asyncio
import logging
import time

import hivemind
from hivemind.utils import get_dht_time

from swarmpipe.peer.events import EventLog
from swarmpipe.peer.stage.runtime import StageRuntime
from swarmpipe.peer.swarm.dht import SwarmDHT
from swarmpipe.peer.swarm.records import PeerState

log = logging.getLogger("swarmpipe.averaging")
MATCHMAKING_S = 3.0


class ReplicaAverager:
    def __init__(self, dht: hivemind.DHT, runtime: StageRuntime, events: EventLog):
        self.runtime = runtime
        self.events = events
        spec = runtime.spec
        self.interval = spec.averaging_interval_s
        self.min_steps = spec.averaging_period
        self.averager = hivemind.averaging.DecentralizedAverager(
            runtime.weights(),
            dht,
            start=True,
            prefix=f"{spec.run_id}_stage{runtime.stage}_averaging".replace(".", "_"),
            target_group_size=16,
            min_group_size=2,
            min_matchmaking_time=MATCHMAKING_S,
            request_timeout=1.0,
            allreduce_timeout=30.0,
        )
        self.last_version = runtime.version
        self.rounds = 0
        self.failures = 0

    def shutdown(self) -> None:
        self.averager.shutdown()

    def next_round_at(self, now: float | None = None) -> float:
        now = get_dht_time() if now is None else now
        return (now // self.interval + 1) * self.interval

    async def run(self, swarm: SwarmDHT) -> None:
        while True:
            start_at = self.next_round_at()
            # Begin matchmaking a few seconds before the slot so every replica is looking at the slot.
            await asyncio.sleep(max(0.0, start_at - MATCHMAKING_S - get_dht_time()))
            if self.runtime.version - self.last_version < self.min_steps:
                continue
            peers = await swarm.stage_peers(self.runtime.stage)
            others = [pid for pid, r in peers.items() if pid != self.events.peer_id and r.state is PeerState.ONLINE]
            if not others:
                continue
            try:
                await self.average_once(scheduled_time=start_at)
            except Exception as e:  # a vanished member or a timeout: training goes on, next slot tries again
                self.failures += 1
                self.events.emit("averaging_failed", level=logging.WARNING, error=str(e)[:200])
            await asyncio.sleep(max(0.0, start_at - get_dht_time()) + 0.5)

    async def average_once(self, scheduled_time: float) -> bool:
        started = time.monotonic()
        runtime = self.runtime
        snapshot = await runtime.run(runtime.weights)
        with self.averager.get_tensors() as tensors:
            for buf, value in zip(tensors, snapshot):
                buf.copy_(value)
        version = self.runtime.version
        result = await asyncio.to_thread(
            lambda: self.averager.step(
                scheduled_time=scheduled_time, timeout=scheduled_time - get_dht_time() + 20.0, allow_retries=False
            )
        )
        if result is None:
            self.failures += 1
            self.events.emit("averaging_skipped", level=logging.INFO, reason="no group formed or all-reduce failed")
            return False
        with self.averager.get_tensors() as tensors:
            averaged = [t.clone() for t in tensors]
        await runtime.run(runtime.add_correction, snapshot, averaged)
        self.last_version = self.runtime.version
        self.rounds += 1
        self.events.emit(
            "averaged",
            stage=self.runtime.stage,
            group_size=len(result),
            version=version,
            seconds=round(time.monotonic() - started, 2),
        )
        return True
