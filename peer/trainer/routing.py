"""Choosing a replica per stage: expected finish time from the trainer's own measurements.

A peer's word (its announced throughput and queue) is only a prior; what this
trainer observed (an EMA of call latency) takes over once it exists. Failing
peers are banned with exponential backoff; unmeasured peers get an optimistic
estimate so new replicas are tried.

Old evidence is weak evidence. A peer whose only measurement is one slow call
(a warm-up, a call that straddled a freeze) must not be starved forever, so a
measurement fades with age toward the best fresh estimate of the stage, a peer
not measured for ``PROBE_AFTER_S`` gets one probing call, and a stale estimate
is replaced by the next measurement rather than blended with it. A banned peer
that announces itself again in the DHT is retried within a second.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from swarmpipe.peer.swarm.records import StageRecord

BAN_BASE_S = 2.0
BAN_MAX_S = 60.0
EMA_DECAY = 0.8
STALE_AFTER_S = 5.0  # a latency measured longer ago than this starts to fade
STALE_HALF_LIFE_S = 10.0
PROBE_AFTER_S = 15.0  # an idle replica gets one call this often, so its estimate stays current
RELAYED_PRIOR = 1.5  # until measured, a relayed replica is expected this much slower than it reports
REPROBE_AFTER_ANNOUNCE_S = 1.0  # a banned peer that announced itself again is tried this soon


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
    measured_at: float = 0.0  # clock time of the newest latency measurement
    last_seen: float = field(default_factory=time.monotonic)
    announced_at: float = 0.0  # the peer's own timestamp on its newest record (its clock, not ours)
    announced_at_ban: float = 0.0  # ... as it was when we banned it
    relayed: bool = False  # reached through a relay (its record says so): one more hop than it measured


class Router:
    def __init__(self, num_stages: int, rng: random.Random | None = None, clock=time.monotonic):
        self.num_stages = num_stages
        self.peers: dict[str, PeerView] = {}
        self.rng = rng or random.Random()
        self.clock = clock
        # peer id -> clock time until which it is not routed to: verification caught it lying (verification.py).
        # Kept apart from the views, which a fresh DHT record replaces: re-announcing does not lift it.
        self.distrusted: dict[str, float] = {}

    # ------------------------------------------------------------ membership
    def update_stage(self, stage: int, records: dict[str, StageRecord]) -> None:
        """Merge a fresh DHT view of one stage; peers absent from it are forgotten."""
        for peer_id, record in records.items():
            view = self.peers.get(peer_id)
            if view is None or view.stage != stage or view.address != record.address:
                view = PeerView(peer_id, stage, record.address)
                self.peers[peer_id] = view
            view.state = record.state
            view.relayed = bool(record.relay)
            view.reported_throughput = record.throughput
            view.reported_queue = record.queue
            view.last_seen = self.clock()
            view.announced_at = record.updated_at
            if view.banned_until > self.clock() and record.updated_at > view.announced_at_ban:
                # It announced itself after we banned it (a paused peer resumed, a stalled one recovered):
                # try it again soon instead of waiting out a backoff of up to BAN_MAX_S. A peer that keeps
                # announcing while failing costs one failed call per announcement.
                view.banned_until = min(view.banned_until, self.clock() + REPROBE_AFTER_ANNOUNCE_S)
        for peer_id in [p for p, v in self.peers.items() if v.stage == stage and p not in records and v.in_flight == 0]:
            del self.peers[peer_id]

    def replicas(self, stage: int) -> list[PeerView]:
        return [v for v in self.peers.values() if v.stage == stage]

    def available(self, stage: int, exclude: set[str] = frozenset()) -> list[PeerView]:
        t = self.clock()
        return [
            v
            for v in self.replicas(stage)
            if v.state == "online"
            and v.banned_until <= t
            and v.peer_id not in exclude
            and self.distrusted.get(v.peer_id, 0.0) <= t
        ]

    # ------------------------------------------------------------ choice
    def expected_finish(self, view: PeerView) -> float:
        per_call = self._per_call_estimate(view)
        return (view.in_flight + view.reported_queue + 1) * per_call

    def _per_call_estimate(self, view: PeerView) -> float:
        if view.latency_ema is not None:
            return self._measured_estimate(view)
        return self._unmeasured_estimate(view)

    def _measured_estimate(self, view: PeerView) -> float:
        age = self.clock() - view.measured_at
        if age <= STALE_AFTER_S:
            return view.latency_ema
        fresh = [
            v.latency_ema
            for v in self.replicas(view.stage)
            if v is not view and v.latency_ema is not None and self.clock() - v.measured_at <= STALE_AFTER_S
        ]
        if not fresh or view.latency_ema <= min(fresh):
            return view.latency_ema  # nothing better is known: keep what we saw
        target = min(fresh)
        weight = 0.5 ** ((age - STALE_AFTER_S) / STALE_HALF_LIFE_S)
        return target + weight * (view.latency_ema - target)

    def _unmeasured_estimate(self, view: PeerView) -> float:
        if view.reported_throughput > 0:  # its own compute speed; a relay's extra hop is not in it
            return (RELAYED_PRIOR if view.relayed else 1.0) / view.reported_throughput
        known = [v.latency_ema for v in self.replicas(view.stage) if v.latency_ema is not None]
        return 0.5 * min(known) if known else 0.01  # optimistic: make sure new peers get tried

    def choose(self, stage: int, exclude: set[str] = frozenset()) -> PeerView | None:
        candidates = self.available(stage, exclude)
        if not candidates:
            return None
        t = self.clock()
        overdue = [
            v
            for v in candidates
            if v.latency_ema is not None and v.in_flight == 0 and t - v.measured_at > PROBE_AFTER_S
        ]
        if overdue and len(candidates) > 1:
            return min(overdue, key=lambda v: v.measured_at)  # probe the longest-unmeasured replica
        # Small jitter spreads simultaneous choices across near-equal replicas.
        return min(candidates, key=lambda v: self.expected_finish(v) * (1 + 0.1 * self.rng.random()))

    def latency_ms(self) -> dict[int, dict[str, float]]:
        """Per stage, each measured replica's call latency as this trainer sees it (for the event log)."""
        out: dict[int, dict[str, float]] = {}
        for v in self.peers.values():
            if v.latency_ema is not None:
                out.setdefault(v.stage, {})[v.peer_id[-6:]] = round(1e3 * v.latency_ema, 1)
        return dict(sorted(out.items()))

    # ------------------------------------------------------------ feedback
    # A view's ``in_flight`` moves only here: every call counted by ``started`` ends in exactly one of
    # ``succeeded``, ``failed``, ``moved`` or ``released``; ``holding`` counts replicas we reach only through others.
    def started(self, view: PeerView) -> None:
        view.in_flight += 1
        view.calls += 1

    def succeeded(self, view: PeerView, seconds: float | None) -> None:
        """The call answered; ``seconds`` its latency, or None when that is no evidence for routing (validation's
        forward-only calls are cheaper than the training calls routing is planned for)."""
        self.released(view)
        view.failures = 0
        if seconds is None:
            return
        stale = view.latency_ema is None or self.clock() - view.measured_at > STALE_AFTER_S
        view.latency_ema = seconds if stale else EMA_DECAY * view.latency_ema + (1 - EMA_DECAY) * seconds
        view.measured_at = self.clock()

    def released(self, view: PeerView) -> None:
        """The call ended in a way that says nothing of the peer (a chain broke further down, or never went out
        for want of a route): it is no longer in flight, nothing else changes."""
        view.in_flight = max(0, view.in_flight - 1)

    @contextmanager
    def holding(self, views: list[PeerView]) -> Iterator[None]:
        """Count ``views`` as ours in flight while the block runs, though we do not call them ourselves: the
        replicas a chain we sent will reach first (else every chain would pick the same idle-looking replica)."""
        for view in views:
            view.in_flight += 1
        try:
            yield
        finally:
            for view in views:
                self.released(view)

    def distrust(self, peer_id: str, until: float) -> None:
        """Route nothing to ``peer_id`` until clock time ``until``, whatever it announces."""
        self.distrusted[peer_id] = max(until, self.distrusted.get(peer_id, 0.0))

    def moved(self, view: PeerView) -> None:
        """The peer answered that it no longer serves this stage (it rebalanced): drop the view now;
        the next DHT refresh files it under the stage it announces."""
        self.released(view)
        if self.peers.get(view.peer_id) is view:
            del self.peers[view.peer_id]

    def failed(self, view: PeerView, ban: bool = True) -> float:
        """Record a failure; returns the ban length (0 if not banned)."""
        self.released(view)
        if not ban:
            return 0.0
        view.failures += 1
        length = min(BAN_MAX_S, BAN_BASE_S * 2 ** (view.failures - 1))
        view.banned_until = self.clock() + length
        view.announced_at_ban = view.announced_at
        # Forget the latency estimate: after a stall it is no longer evidence of speed.
        view.latency_ema = None if view.failures > 1 else view.latency_ema
        return length
