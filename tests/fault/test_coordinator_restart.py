"""The coordinator is not on the data path: kill it, training goes on; restart it, it sees the swarm again."""

from __future__ import annotations

import time

import pytest
from swarm_support import assert_trained, events_of, kill_tree, stop_trainer, wait_step

from swarmpipe.cli.launcher import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.timeout(360)]
# The trainer trains until the restarted coordinator lists it, then is stopped (SIGTERM): no fixed run time
# that a slow machine might end before the restart.
UNTIL_STOPPED = 1_000_000


def test_kill_and_restart_coordinator(swarm):
    spec = swarm.write_spec()
    swarm.start_coordinator(spec, "--checkpoint-every", "3")
    first_maddr = swarm.maddr
    peers = [swarm.start_peer(stage, wait=False) for stage in (0, 1)]
    infos = [swarm.wait_ready(p) for p in peers]
    trainer, report_path = swarm.start_trainer(UNTIL_STOPPED, "--call-timeout", "10")
    wait_step(swarm, 60, trainer)
    wait_for(lambda: swarm.api().get("checkpoint"), 30, "a first checkpoint")
    kill_tree(swarm.coordinator)
    down_at = wait_step(swarm, 0, trainer)
    # Down for longer than a record lives in the DHT (10 s): these 5 s, then the new one's start (5 s or more).
    time.sleep(5)
    assert wait_step(swarm, 0, trainer) > down_at + 20, "training must go on while the coordinator is down"

    swarm.start_coordinator(spec, "--checkpoint-every", "3")
    assert swarm.maddr == first_maddr, "same identity and saved port: same multiaddr after a restart"

    def sees_swarm():
        api = swarm.api()
        ids = {p["peer_id"] for s in api["stages"] for p in s["peers"]}
        return ids >= {i["peer_id"] for i in infos} and api["trainers"]

    wait_for(sees_swarm, 60, "the restarted coordinator to list every peer and the trainer", procs=[trainer])
    api = swarm.api()
    assert api["checkpoint"] and api["checkpoint"]["step"] >= 1, "it continues from its checkpoint folder"
    wait_step(swarm, wait_step(swarm, 0, trainer) + 20, trainer)  # training goes on with it back
    report = stop_trainer(swarm, trainer, report_path)
    assert_trained(report, min_steps=150, stopped=True)
    assert len(events_of(swarm, "started")) == 2
