"""Choosing a replica per stage: expected finish time from the trainer's own measurements.

A peer's word (its announced throughput and queue) is only a prior; what this
trainer observed (an EMA of call latency) takes over once it exists. Failing
peers are banned with exponential backoff; unmeasured peers get an optimistic
estimate so new replicas are tried.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from peer.records import StageRecord

BAN_BASE_S = 2.0
BAN_MAX_S = 60.0
EMA_DECAY = 0.8


@dataclass
class PeerView:
    peer_id: str
    stage: int
    address: str
    state: str = "online"
    reported_throughput: float = 0.0
    reported_queue: int = 0
    latency_ema: float | None = None  # seconds per call, observed by us
    in_flight: int = 0  # our calls outstanding to it
    failures: int = 0  # consecutive
    banned_until: float = 0.0
    calls: int = 0
    last_seen: float = field(default_factory=time.monotonic)


class Router:
    def __init__(self, num_stages: int, rng: random.Random | None = None, clock=time.monotonic):
        self.num_stages = num_stages
        self.peers: dict[str, PeerView] = {}
        self.rng = rng or random.Random()
        self.clock = clock

    # ------------------------------------------------------------ membership
    def update_stage(self, stage: int, records: dict[str, StageRecord]) -> None:
        """Merge a fresh DHT view of one stage; peers absent from it are forgotten."""
        for peer_id, record in records.items():
            view = self.peers.get(peer_id)
            if view is None or view.stage != stage or view.address != record.address:
                view = PeerView(peer_id, stage, record.address)
                self.peers[peer_id] = view
            view.state = record.state
            view.reported_throughput = record.throughput
            view.reported_queue = record.queue
            view.last_seen = self.clock()
        for peer_id in [p for p, v in self.peers.items() if v.stage == stage and p not in records and v.in_flight == 0]:
            del self.peers[peer_id]

    def replicas(self, stage: int) -> list[PeerView]:
        return [v for v in self.peers.values() if v.stage == stage]

    def available(self, stage: int, exclude: set[str] = frozenset()) -> list[PeerView]:
        t = self.clock()
        return [v for v in self.replicas(stage)
                if v.state == "online" and v.banned_until <= t and v.peer_id not in exclude]

    # ------------------------------------------------------------ choice
    def expected_finish(self, view: PeerView) -> float:
        per_call = self._per_call_estimate(view)
        return (view.in_flight + view.reported_queue + 1) * per_call

    def _per_call_estimate(self, view: PeerView) -> float:
        if view.latency_ema is not None:
            return view.latency_ema
        if view.reported_throughput > 0:
            return 1.0 / view.reported_throughput
        known = [v.latency_ema for v in self.replicas(view.stage) if v.latency_ema is not None]
        return 0.5 * min(known) if known else 0.01  # optimistic: make sure new peers get tried

    def choose(self, stage: int, exclude: set[str] = frozenset()) -> PeerView | None:
        candidates = self.available(stage, exclude)
        if not candidates:
            return None
        # Small jitter spreads simultaneous choices across near-equal replicas.
        return min(candidates, key=lambda v: self.expected_finish(v) * (1 + 0.1 * self.rng.random()))

    # ------------------------------------------------------------ feedback
    def started(self, view: PeerView) -> None:
        view.in_flight += 1
        view.calls += 1

    def succeeded(self, view: PeerView, seconds: float) -> None:
        view.in_flight = max(0, view.in_flight - 1)
        view.failures = 0
        view.latency_ema = seconds if view.latency_ema is None else EMA_DECAY * view.latency_ema + (1 - EMA_DECAY) * seconds

    def failed(self, view: PeerView, ban: bool = True) -> float:
        """Record a failure; returns the ban length (0 if not banned)."""
        view.in_flight = max(0, view.in_flight - 1)
        if not ban:
            return 0.0
        view.failures += 1
        length = min(BAN_MAX_S, BAN_BASE_S * 2 ** (view.failures - 1))
        view.banned_until = self.clock() + length
        # Forget the latency estimate: after a stall it is no longer evidence of speed.
        view.latency_ema = None if view.failures > 1 else view.latency_ema
        return length
