"""The coordinator is not on the data path: kill it, training goes on; restart it, it sees the swarm again."""

from __future__ import annotations

import time

import pytest
from swarm_support import assert_trained, events_of, kill_tree, wait_step

from swarmpipe.cli.launcher import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.timeout(360)]
STEPS = 1_000_000
RUN_S = 60


def test_kill_and_restart_coordinator(swarm):
    spec = swarm.write_spec()
    swarm.start_coordinator(spec, "--checkpoint-every", "3")
    first_maddr = swarm.maddr
    peers = [swarm.start_peer(stage, wait=False) for stage in (0, 1)]
    infos = [swarm.wait_ready(p) for p in peers]
    trainer, report_path = swarm.start_trainer(STEPS, "--max-time", str(RUN_S), "--call-timeout", "10")
    wait_step(swarm, 60, trainer)
    wait_for(lambda: swarm.api().get("checkpoint"), 30, "a first checkpoint")
    kill_tree(swarm.coordinator)
    down_at = wait_step(swarm, 0, trainer)
    time.sleep(8)
    assert wait_step(swarm, 0, trainer) > down_at + 20, "training must go on while the coordinator is down"

    swarm.start_coordinator(spec, "--checkpoint-every", "3")
    assert swarm.maddr == first_maddr, "same identity and saved port: same multiaddr after a restart"

    def sees_swarm():
        api = swarm.api()
        ids = {p["peer_id"] for s in api["stages"] for p in s["peers"]}
        return ids >= {i["peer_id"] for i in infos} and api["trainers"]

    wait_for(sees_swarm, 60, "the restarted coordinator to list every peer and the trainer")
    api = swarm.api()
    assert api["checkpoint"] and api["checkpoint"]["step"] >= 1, "it continues from its checkpoint folder"
    report = swarm.wait_report(trainer, report_path, timeout=300)
    assert_trained(report, min_steps=150)
    assert len(events_of(swarm, "started")) == 2
