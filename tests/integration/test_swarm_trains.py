"""A real swarm on 127.0.0.1: coordinator, two stages with two replicas each, a trainer."""

from __future__ import annotations

import pytest

from swarmpipe.cli.launcher import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_two_stages_two_replicas_train(swarm):
    swarm.start_coordinator()
    peers = [swarm.start_peer(stage, wait=False) for stage in (0, 0, 1, 1)]
    infos = [swarm.wait_ready(p) for p in peers]
    trainer, report_path = swarm.start_trainer(80)
    report = swarm.wait_report(trainer, report_path, timeout=240)
    assert trainer.proc.returncode == 0, trainer.log_text()[-3000:]

    for field in (
        "steps",
        "microbatches_started",
        "microbatches_completed",
        "microbatches_retried",
        "microbatches_lost",
        "loss_first",
        "loss_last",
        "samples_per_s",
    ):
        assert field in report, field
    assert report["steps"] >= 80
    assert report["microbatches_lost"] == 0
    assert report["microbatches_completed"] + report["microbatches_dropped_stale"] == report["microbatches_started"]
    assert report["loss_last"] < report["loss_first"] - 0.5, (report["loss_first"], report["loss_last"])
    assert report["samples_per_s"] > 0

    def listed() -> dict | None:
        api = swarm.api()
        ids = {p["peer_id"] for stage in api["stages"] for p in stage["peers"]}
        # Records are re-announced every second: wait for the trainer's final record and for records that
        # show the replicas' work (a batched call makes one step for several micro-batches, so versions
        # do not add up to the micro-batch count).
        done = any(t["step"] >= report["microbatches_completed"] for t in api["trainers"])
        worked = sum(p["version"] > 0 for s in api["stages"] for p in s["peers"]) >= 3
        return api if ids >= {i["peer_id"] for i in infos} and done and worked else None

    api = wait_for(listed, 30, "/api/swarm to list every peer and the trainer")
    assert api["run_id"] == "test"
    assert [s["index"] for s in api["stages"]] == [0, 1]
    assert all(len(s["peers"]) == 2 for s in api["stages"])
    assert api["spec"]["num_stages"] == 2
    for stage in api["stages"]:
        for p in stage["peers"]:
            assert {"peer_id", "address", "state", "throughput", "queue", "version"} <= set(p)
    trainer_row = api["trainers"][0]
    assert {"peer_id", "step", "loss", "samples_per_s"} <= set(trainer_row)
    # Both replicas of each stage did work: routing spreads the load.
    versions = [p["version"] for s in api["stages"] for p in s["peers"]]
    assert sum(v > 0 for v in versions) >= 3, versions


def test_peer_picks_emptiest_stage_and_runs_index(swarm):
    spec = swarm.write_spec(num_stages=3, n_layers=3)
    swarm.start_coordinator(spec)
    first = swarm.wait_ready(swarm.start_peer(0))
    auto = swarm.wait_ready(swarm.start_peer(None))  # stages 1 and 2 are empty: it must take one of them
    assert first["stage"] == 0 and auto["stage"] in (1, 2)
    # No --run-id: a volunteer joins the run the swarm index lists.
    launched = swarm.group.start(
        "volunteer", "peer", "--initial-peers", swarm.maddr, "--ready-file", str(swarm.workdir / "volunteer.ready")
    )
    launched.ready_path = swarm.workdir / "volunteer.ready"
    info = swarm.wait_ready(launched)
    assert info["run_id"] == "test"
    assert info["stage"] in ({1, 2} - {auto["stage"]})


def test_a_tight_stash_bound_drops_old_versions_and_loses_nothing(swarm):
    """update.max_stash_mb far below what many micro-batches in flight want: peers drop the oldest stashed
    version's forwards (counted on /metrics), the trainer replays their backwards, nothing is lost.

    Stage 0's snapshot (d_model 128, two blocks: ~1.7 MB) is over the 1 MB bound, so any forward at a new version
    while an older one is pending drops it; stage 1 (four blocks) is the bottleneck, so backwards reach stage 0 a
    batch at a time and new forwards land between them. With even stages and half the bound per snapshot, chained
    micro-batches could settle into waves (12 forwards at one version, 12 backwards, repeat) and drop nothing."""
    spec = swarm.write_spec(
        num_stages=2, n_layers=6, d_model=128, settings={"update": {"max_stash_mb": 1}, "layer_split": [2, 4]}
    )
    swarm.start_coordinator(spec)
    peers = [swarm.wait_ready(swarm.start_peer(stage, "--metrics-port", "0")) for stage in (0, 1)]
    trainer, report_path = swarm.start_trainer(60, "--in-flight", "12")
    report = swarm.wait_report(trainer, report_path, timeout=240)
    assert trainer.proc.returncode == 0, trainer.log_text()[-3000:]
    assert report["microbatches_lost"] == 0 and report["microbatches_completed"] == 60, report
    import urllib.request

    metrics = urllib.request.urlopen(f"http://{peers[0]['metrics_address']}/metrics", timeout=10).read().decode()
    dropped = [line for line in metrics.splitlines() if 'reason="stash_bound"' in line and not line.startswith("#")]
    assert dropped and float(dropped[0].split()[-1]) > 0, metrics[-2000:]
    assert report["microbatches_retried"] > 0  # the dropped ones came back as replays
    assert "swarmpipe_stash_bytes" in metrics and "swarmpipe_device_memory_bytes" in metrics
