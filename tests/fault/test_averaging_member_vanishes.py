"""A replica dies in the middle of an averaging round: the others train on and average again."""
from __future__ import annotations

import time

import pytest

from swarm_support import assert_trained, events_of, kill_tree, wait_step

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]
INTERVAL_S = 6.0


def test_replica_killed_mid_round(swarm):
    spec = swarm.write_spec(top=f"averaging_period = 5\naveraging_interval_s = {INTERVAL_S}")
    swarm.start_coordinator(spec)
    peers = [swarm.start_peer(stage, wait=False) for stage in (0, 1, 1, 1)]
    infos = [swarm.wait_ready(p) for p in peers]
    trainer, report_path = swarm.start_trainer(1_000_000, "--max-time", "45", "--call-timeout", "10")
    wait_step(swarm, 60, trainer)
    # Wait for a first round of three, then kill a member while the next round is matchmaking.
    deadline = time.time() + 60
    while not [e for e in events_of(swarm, "averaged") if e["group_size"] == 3] and time.time() < deadline:
        time.sleep(0.5)
    assert [e for e in events_of(swarm, "averaged") if e["group_size"] == 3], events_of(swarm, "averaging_failed")
    next_slot = (time.time() // INTERVAL_S + 1) * INTERVAL_S
    time.sleep(max(0.0, next_slot - 1.5 - time.time()))
    kill_tree(peers[3])
    killed_at = time.time()
    report = swarm.wait_report(trainer, report_path, timeout=200)
    assert_trained(report, min_steps=100)
    survivors = {infos[1]["peer_id"], infos[2]["peer_id"]}
    later = [e for e in events_of(swarm, "averaged") if e["time"] > killed_at + INTERVAL_S and e["peer_id"] in survivors]
    assert {e["peer_id"] for e in later} == survivors, (later, events_of(swarm, "averaging_failed"))
    assert all(e["group_size"] == 2 for e in later)
    assert peers[1].alive() and peers[2].alive()
