"""Replicas of a stage average their weights: each pulls its online siblings' weights at clock-aligned rounds and
takes a robust aggregate (peer/stage/averaging.py); a lone replica has no one to average with."""

from __future__ import annotations

import pytest
from swarm_support import assert_trained, events_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_replicas_average_in_rounds(swarm):
    spec = swarm.write_spec(top="averaging_period = 5\naveraging_interval_s = 6.0")
    swarm.start_coordinator(spec)
    peers = [swarm.start_peer(stage, wait=False) for stage in (0, 1, 1)]
    infos = [swarm.wait_ready(p) for p in peers]
    trainer, report_path = swarm.start_trainer(1_000_000, "--max-time", "30")
    report = swarm.wait_report(trainer, report_path, timeout=120)
    assert_trained(report, min_steps=100)
    averaged = events_of(swarm, "averaged")
    by_peer = {e["peer_id"] for e in averaged if e["group_size"] == 2}
    assert by_peer == {infos[1]["peer_id"], infos[2]["peer_id"]}, (averaged, events_of(swarm, "averaging_failed"))
    assert not [e for e in averaged if e["peer_id"] == infos[0]["peer_id"]], "a lone replica has no one to average with"
