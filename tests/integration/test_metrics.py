"""Prometheus /metrics of peers (--metrics-port) and of the coordinator move while the swarm trains."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from swarmpipe.cli.launcher import wait_for
from swarmpipe.peer.transport.wire import encode
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 1000


class Scrape:
    """One parsed /metrics page: families by name, and sample lookups by name and label subset."""

    def __init__(self, url: str):
        with urllib.request.urlopen(url, timeout=10) as response:
            self.content_type = response.headers.get("Content-Type", "")
            text = response.read().decode()
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def type_of(self, family: str) -> str:
        assert family in self.families, f"{family} missing; have {sorted(self.families)}"
        return self.families[family].type

    def values(self, name: str, **labels: str) -> list[float]:
        return [
            s.value for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def total(self, name: str, **labels: str) -> float:
        return sum(self.values(name, **labels))

    def labels(self, name: str, label: str) -> set[str]:
        return {s.labels[label] for s in self.samples if s.name == name and label in s.labels}


PEER_COUNTERS = [
    "swarmpipe_requests_total",
    "swarmpipe_received_bytes_total",
    "swarmpipe_sent_bytes_total",
    "swarmpipe_optimizer_steps_total",
    "swarmpipe_compute_seconds_count",
    "swarmpipe_gradient_delay_steps_count",
]


def _peer_checks(first: Scrape, second: Scrape, stage: int) -> None:
    assert first.type_of("swarmpipe_requests") == "counter"
    assert first.type_of("swarmpipe_errors") == "counter"
    assert first.type_of("swarmpipe_received_bytes") == "counter"
    assert first.type_of("swarmpipe_sent_bytes") == "counter"
    assert first.type_of("swarmpipe_queue_depth") == "gauge"
    assert first.type_of("swarmpipe_compute_seconds") == "histogram"
    assert first.type_of("swarmpipe_gradient_delay_steps") == "histogram"
    assert first.type_of("swarmpipe_optimizer_steps") == "counter"
    for name in PEER_COUNTERS:
        assert second.total(name) > first.total(name) > 0, (stage, name, first.total(name), second.total(name))
    methods = ("forward", "backward", "evaluate") if stage == 0 else ("forward_backward", "evaluate")
    for method in methods:
        assert second.total("swarmpipe_requests_total", method=method) > first.total(
            "swarmpipe_requests_total", method=method
        )
        # Latency histogram per method: buckets up to +Inf, count matching it, positive sum.
        assert second.values("swarmpipe_compute_seconds_bucket", method=method, le="+Inf") == second.values(
            "swarmpipe_compute_seconds_count", method=method
        )
        assert second.total("swarmpipe_compute_seconds_sum", method=method) > 0
    # Bytes are labelled by codec.
    assert second.labels("swarmpipe_received_bytes_total", "codec"), second.samples
    assert second.labels("swarmpipe_sent_bytes_total", "codec"), second.samples
    assert second.values("swarmpipe_queue_depth") and min(second.values("swarmpipe_queue_depth")) >= 0
    assert second.total("swarmpipe_weight_version") > first.total("swarmpipe_weight_version") > 0


def test_peer_and_coordinator_metrics_move_while_training(swarm):
    swarm.start_coordinator(None, "--checkpoint-every", "3")
    launched = [swarm.start_peer(stage, "--metrics-port", "0", wait=False) for stage in (0, 1)]
    infos = [swarm.wait_ready(p) for p in launched]
    peer_urls = [f"http://{info['metrics_address']}/metrics" for info in infos]
    assert all(info["metrics_address"] for info in infos), infos

    # Before training: the families exist, nothing was computed yet.
    idle = Scrape(peer_urls[0])
    assert idle.total("swarmpipe_optimizer_steps_total") == 0
    coordinator_url = swarm.url + "/metrics"

    # A rejected request shows up as an error of its kind (a wrong run id: the caller's view is stale).
    with grpc.insecure_channel(infos[0]["address"]) as channel:
        bad = swarm_pb2.ForwardRequest(
            run_id="not-this-run", stage=0, microbatch_id="x", input=encode(torch.zeros(1, 4, dtype=torch.long))
        )
        with pytest.raises(grpc.RpcError):
            swarm_pb2_grpc.StageStub(channel).Forward(bad, timeout=10)
    errors = Scrape(peer_urls[0])
    assert errors.total("swarmpipe_errors_total", method="forward", kind="failed_precondition") == 1, errors.samples

    trainer, report_path = swarm.start_trainer(STEPS, "--eval-every", str(STEPS // 4), "--eval-batches", "2")
    # First sample while training: every peer did some work and the coordinator saw the trainer.
    wait_for(
        lambda: all(Scrape(u).total("swarmpipe_optimizer_steps_total") >= 20 for u in peer_urls),
        120,
        "peers to take optimizer steps",
        poll=0.5,
        procs=[trainer],
    )
    wait_for(
        lambda: Scrape(coordinator_url).total("swarmpipe_swarm_microbatches_completed_total") > 0,
        60,
        "the coordinator to count completed micro-batches",
        poll=0.5,
        procs=[trainer],
    )
    peers_first = [Scrape(u) for u in peer_urls]
    coord_first = Scrape(coordinator_url)
    assert trainer.alive(), "the trainer finished before the first sample; raise STEPS"

    # Second sample once training is over (and the coordinator polled the trainer again).
    report = swarm.wait_report(trainer, report_path, timeout=240)
    assert trainer.proc.returncode == 0 and report["microbatches_completed"] == STEPS, report
    done = coord_first.total("swarmpipe_swarm_microbatches_completed_total")
    wait_for(
        lambda: Scrape(coordinator_url).total("swarmpipe_swarm_microbatches_completed_total") > done,
        30,
        "the coordinator's completed counter to move",
        poll=0.5,
    )
    peers_second = [Scrape(u) for u in peer_urls]
    coord_second = Scrape(coordinator_url)

    for stage, (first, second) in enumerate(zip(peers_first, peers_second)):
        _peer_checks(first, second, stage)
    # Every backward on stage 0 and every forward_backward on stage 1 observed a delay; none was dropped.
    assert peers_second[0].total("swarmpipe_gradient_delay_steps_count") >= STEPS
    assert peers_second[0].total("swarmpipe_dropped_gradients_total") == 0

    # The coordinator's swarm-level view.
    c1, c2 = coord_first, coord_second
    assert c2.content_type.startswith("text/plain"), c2.content_type
    assert c2.total("swarmpipe_swarm_stages") == 2
    for stage in ("0", "1"):
        assert c2.total("swarmpipe_stage_peers", stage=stage, state="online") == 1
        assert c1.total("swarmpipe_stage_throughput_microbatches_per_second", stage=stage) > 0
        assert c2.total("swarmpipe_stage_weight_version_max", stage=stage) > c1.total(
            "swarmpipe_stage_weight_version_max", stage=stage
        )
    assert sum(c2.values("swarmpipe_stage_bottleneck")) == 1
    assert c1.type_of("swarmpipe_swarm_microbatches_completed") == "counter"
    assert c2.total("swarmpipe_swarm_microbatches_completed_total") > c1.total(
        "swarmpipe_swarm_microbatches_completed_total"
    )
    assert c2.total("swarmpipe_swarm_microbatches_lost_total") == 0
    assert c1.total("swarmpipe_swarm_samples_per_second") > 0
    assert 0 < c2.total("swarmpipe_swarm_loss_nats") < c1.total("swarmpipe_swarm_loss_nats") + 1.0
    assert c2.total("swarmpipe_swarm_trainer_step") >= c1.total("swarmpipe_swarm_trainer_step") > 0
    assert c2.type_of("swarmpipe_coordinator_events") == "counter"
    assert c2.total("swarmpipe_coordinator_events_total", kind="peer_joined") >= 2
    assert c2.total("swarmpipe_coordinator_events_total") >= c1.total("swarmpipe_coordinator_events_total")
    # Validation (--eval-every): the newest validation loss as a gauge, and a series in /api/history.
    val = wait_for(lambda: Scrape(coordinator_url).values("swarmpipe_val_loss"), 30, "the val_loss gauge", poll=0.5)
    assert Scrape(coordinator_url).type_of("swarmpipe_val_loss") == "gauge"
    assert 0 < val[0] < 10 and report["val_loss"] is not None, (val, report["val_loss"])
    assert any(h.get("val_loss") is not None for h in swarm.api("/api/history"))
    # --checkpoint-every 3: a checkpoint exists and is recent.
    wait_for(lambda: Scrape(coordinator_url).values("swarmpipe_checkpoint_age_seconds"), 30, "a checkpoint", poll=0.5)
    final = Scrape(coordinator_url)
    assert 0 <= final.total("swarmpipe_checkpoint_age_seconds") < 60
    assert final.total("swarmpipe_checkpoint_step") >= 1
    assert 0 <= final.total("swarmpipe_coordinator_snapshot_age_seconds") < 30
    # The API lists where each peer's metrics live.
    listed = {p["peer_id"]: p["metrics_address"] for s in swarm.api()["stages"] for p in s["peers"]}
    assert listed == {info["peer_id"]: info["metrics_address"] for info in infos}
