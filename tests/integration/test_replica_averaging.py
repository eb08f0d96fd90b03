"""Replicas of a stage average their weights: each pulls its online siblings' weights at clock-aligned rounds and
takes a robust aggregate (peer/stage/averaging.py); a lone replica has no one to average with."""

from __future__ import annotations

import pytest
from swarm_support import assert_trained, events_of, stop_trainer, wait_step

from swarmpipe.cli.launcher import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_replicas_average_in_rounds(swarm):
    spec = swarm.write_spec(top="averaging_period = 5\naveraging_interval_s = 6.0")
    swarm.start_coordinator(spec)
    peers = [swarm.start_peer(stage, wait=False) for stage in (0, 1, 1)]
    infos = [swarm.wait_ready(p) for p in peers]
    trainer, report_path = swarm.start_trainer(1_000_000, "--max-time", "90")

    def stage_1_averaged() -> bool:  # both stage-1 replicas took part in a round of two
        return {e["peer_id"] for e in events_of(swarm, "averaged") if e["group_size"] == 2} >= {
            infos[1]["peer_id"],
            infos[2]["peer_id"],
        }

    wait_for(stage_1_averaged, 90, "both stage-1 replicas to average", poll=0.5, procs=[trainer])
    wait_step(swarm, 110, trainer)
    report = stop_trainer(swarm, trainer, report_path)
    assert_trained(report, min_steps=100, stopped=True)
    averaged = events_of(swarm, "averaged")
    by_peer = {e["peer_id"] for e in averaged if e["group_size"] == 2}
    assert by_peer == {infos[1]["peer_id"], infos[2]["peer_id"]}, (averaged, events_of(swarm, "averaging_failed"))
    assert not [e for e in averaged if e["peer_id"] == infos[0]["peer_id"]], "a lone replica has no one to average with"
