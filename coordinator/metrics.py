"""Swarm-level Prometheus metrics of the coordinator (``GET /metrics``).

Built at scrape time from what the coordinator already observes: its snapshot
of the DHT (stages, replicas, trainers), its recent events and its last
checkpoint. Gauges describe the swarm as last polled; counters are kept
monotonic here, so a trainer that leaves (and takes its cumulative counts with
it) never makes a ``_total`` go down.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from swarmpipe.peer.swarm.records import PeerState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PEER_STATES = tuple(state.value for state in PeerState)
TRAINER_COUNTERS = {
    "microbatches_completed": "Micro-batches whose backward reached stage 0, summed over trainers",
    "microbatches_retried": "Micro-batch calls retried on another replica, summed over trainers",
    "microbatches_lost": "Micro-batches that ended neither completed nor dropped, summed over trainers",
}


def bottleneck_stage(stages: list[dict[str, Any]]) -> int | None:
    """The stage with the least total throughput (the first on a tie); None without stages."""
    if not stages:
        return None
    return min(stages, key=lambda s: (s.get("throughput", 0.0), s.get("index", 0)))["index"]


class SwarmCollector(Collector):
    def __init__(self, coordinator: Any):
        self.coordinator = coordinator
        self._lock = threading.Lock()
        self._trainer_last: dict[tuple[str, str], float] = {}
        self._trainer_totals: dict[str, float] = {name: 0.0 for name in TRAINER_COUNTERS}
        self._event_totals: dict[str, int] = {}
        self._last_event: dict[str, Any] | None = None

    # ---------------------------------------------------------------- monotonic counters
    def _update_trainer_totals(self, trainers: list[dict[str, Any]]) -> None:
        for t in trainers:
            for name in TRAINER_COUNTERS:
                value = float(t.get(name) or 0)
                key = (t["peer_id"], name)
                before = self._trainer_last.get(key, 0.0)
                # A restarted trainer under the same id starts from zero again.
                self._trainer_totals[name] += value - before if value >= before else value
                self._trainer_last[key] = value

    def _update_event_totals(self, events: list[dict[str, Any]]) -> None:
        # The coordinator appends event dicts to a bounded deque: the new ones follow the last one counted.
        new = events
        if self._last_event is not None:
            for i in range(len(events) - 1, -1, -1):
                if events[i] is self._last_event:
                    new = events[i + 1 :]
                    break
        for e in new:
            kind = str(e.get("kind", "unknown"))
            self._event_totals[kind] = self._event_totals.get(kind, 0) + 1
        if events:
            self._last_event = events[-1]

    # ---------------------------------------------------------------- collection
    def collect(self) -> Iterable[Any]:
        c = self.coordinator
        snapshot: dict[str, Any] = dict(c.snapshot)
        stages: list[dict[str, Any]] = list(snapshot.get("stages") or [])
        trainers: list[dict[str, Any]] = list(snapshot.get("trainers") or [])
        events = list(getattr(c, "recent_events", []))
        polled_at = float(snapshot.get("updated_at") or 0.0)
        now = time.time()
        with self._lock:
            self._update_trainer_totals(trainers)
            self._update_event_totals(events)
            trainer_totals = dict(self._trainer_totals)
            event_totals = dict(self._event_totals)

        spec = snapshot.get("spec") or {}
        g = GaugeMetricFamily("swarmpipe_swarm_stages", "Pipeline stages in the run spec")
        g.add_metric([], float(spec.get("num_stages", len(stages))))
        yield g

        peers = GaugeMetricFamily(
            "swarmpipe_stage_peers", "Replicas announced per stage and state", labels=["stage", "state"]
        )
        throughput = GaugeMetricFamily(
            "swarmpipe_stage_throughput_microbatches_per_second",
            "Total throughput of a stage's non-draining replicas",
            labels=["stage"],
        )
        queue = GaugeMetricFamily(
            "swarmpipe_stage_queue_depth", "Requests queued on a stage's replicas", labels=["stage"]
        )
        version = GaugeMetricFamily(
            "swarmpipe_stage_weight_version_max", "Newest weight version among a stage's replicas", labels=["stage"]
        )
        spread = GaugeMetricFamily(
            "swarmpipe_stage_version_lag_max_steps",
            "Largest lag of a replica behind its stage's newest version",
            labels=["stage"],
        )
        bottleneck = GaugeMetricFamily(
            "swarmpipe_stage_bottleneck", "1 for the stage with the least total throughput", labels=["stage"]
        )
        p_tp = GaugeMetricFamily(
            "swarmpipe_peer_throughput_microbatches_per_second",
            "A replica's announced throughput",
            labels=["stage", "peer"],
        )
        p_age = GaugeMetricFamily(
            "swarmpipe_peer_record_age_seconds",
            "Age of a replica's DHT record when the coordinator last polled",
            labels=["stage", "peer"],
        )
        slowest = bottleneck_stage(stages)
        for s in stages:
            label = str(s["index"])
            rows = s.get("peers") or []
            for state in PEER_STATES:
                peers.add_metric([label, state], float(sum(1 for p in rows if p.get("state") == state)))
            throughput.add_metric([label], float(s.get("throughput", 0.0)))
            queue.add_metric([label], float(sum(p.get("queue", 0) for p in rows)))
            top = max((p.get("version", 0) for p in rows), default=0)
            version.add_metric([label], float(top))
            spread.add_metric([label], float(max((top - p.get("version", 0) for p in rows), default=0)))
            bottleneck.add_metric([label], 1.0 if s["index"] == slowest else 0.0)
            for p in rows:
                peer = str(p.get("peer_id", ""))
                p_tp.add_metric([label, peer], float(p.get("throughput", 0.0)))
                p_age.add_metric([label, peer], max(0.0, (polled_at or now) - float(p.get("updated_at") or 0.0)))
        yield from (peers, throughput, queue, version, spread, bottleneck, p_tp, p_age)

        g = GaugeMetricFamily("swarmpipe_swarm_trainers", "Trainers announcing progress")
        g.add_metric([], float(len(trainers)))
        yield g
        losses = [t["loss"] for t in trainers if t.get("loss") is not None]
        if losses:
            g = GaugeMetricFamily(
                "swarmpipe_swarm_loss_nats", "Mean recent training loss over trainers (cross-entropy, nats)"
            )
            g.add_metric([], sum(losses) / len(losses))
            yield g
        val_losses = [t["val_loss"] for t in trainers if t.get("val_loss") is not None]
        if val_losses:
            g = GaugeMetricFamily(
                "swarmpipe_val_loss",
                "Newest validation loss, mean over trainers that measured one (cross-entropy, nats)",
            )
            g.add_metric([], sum(val_losses) / len(val_losses))
            yield g
        g = GaugeMetricFamily("swarmpipe_swarm_samples_per_second", "Training samples per second, summed over trainers")
        g.add_metric([], float(sum(t.get("samples_per_s") or 0.0 for t in trainers)))
        yield g
        g = GaugeMetricFamily("swarmpipe_swarm_trainer_step", "Newest step reported by any trainer")
        g.add_metric([], float(max((t.get("step") or 0 for t in trainers), default=0)))
        yield g
        for name, help_text in TRAINER_COUNTERS.items():
            counter = CounterMetricFamily(f"swarmpipe_swarm_{name}", help_text)  # exposed with the _total suffix
            counter.add_metric([], trainer_totals[name])
            yield counter

        events_counter = CounterMetricFamily(
            "swarmpipe_coordinator_events", "Events the coordinator recorded, by kind", labels=["kind"]
        )
        for kind, count in sorted(event_totals.items()):
            events_counter.add_metric([kind], float(count))
        yield events_counter

        checkpoint = getattr(c, "last_checkpoint", None)
        if checkpoint:
            created = float(checkpoint.get("created_at") or 0.0)
            g = GaugeMetricFamily("swarmpipe_checkpoint_age_seconds", "Seconds since the newest checkpoint was written")
            g.add_metric([], max(0.0, now - created))
            yield g
            g = GaugeMetricFamily("swarmpipe_checkpoint_timestamp_seconds", "Unix time of the newest checkpoint")
            g.add_metric([], created)
            yield g
            g = GaugeMetricFamily("swarmpipe_checkpoint_step", "Sequence number of the newest checkpoint")
            g.add_metric([], float(checkpoint.get("step") or 0))
            yield g

        g = GaugeMetricFamily(
            "swarmpipe_coordinator_snapshot_age_seconds",
            "Seconds since the coordinator last polled the DHT (-1 before the first poll)",
        )
        g.add_metric([], now - polled_at if polled_at else -1.0)
        yield g


class CoordinatorMetrics:
    """A private registry holding the swarm collector and the coordinator's own counters; ``render()`` is the
    /metrics body."""

    def __init__(self, coordinator: Any):
        self.registry = CollectorRegistry()
        self.collector = SwarmCollector(coordinator)
        self.registry.register(self.collector)
        # calls its checkpoint server refused (garbage, no credentials, a method it does not serve, overload),
        # labelled like a peer's
        self.errors = Counter(
            "swarmpipe_errors_total", "RPCs rejected or failed", ["method", "kind"], registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
