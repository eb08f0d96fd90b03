"""A replica dies in the middle of an averaging round: the others train on and average again."""

from __future__ import annotations

import signal
import time

import pytest
from swarm_support import assert_trained, events_of, kill_tree, wait_step

from swarmpipe.cli.launcher import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.timeout(420)]
INTERVAL_S = 6.0


def test_replica_killed_mid_round(swarm):
    spec = swarm.write_spec(top=f"averaging_period = 5\naveraging_interval_s = {INTERVAL_S}")
    swarm.start_coordinator(spec)
    peers = [swarm.start_peer(stage, wait=False) for stage in (0, 1, 1, 1)]
    infos = [swarm.wait_ready(p) for p in peers]
    # The trainer runs until the survivors have averaged again (a fixed run time is too short on a loaded machine).
    trainer, report_path = swarm.start_trainer(1_000_000, "--max-time", "240", "--call-timeout", "10")
    wait_step(swarm, 60, trainer)
    # Wait for a first round of three, then kill a member just before the next round pulls from it.
    wait_for(
        lambda: [e for e in events_of(swarm, "averaged") if e["group_size"] == 3],
        90,
        "a first averaging round of three",
        poll=1.0,
        procs=[trainer],
    )
    next_slot = (time.time() // INTERVAL_S + 1) * INTERVAL_S
    time.sleep(max(0.0, next_slot - 1.5 - time.time()))
    kill_tree(peers[3])
    killed_at = time.time()
    survivors = {infos[1]["peer_id"], infos[2]["peer_id"]}

    def survivors_averaged_again() -> list[dict]:
        later = [
            e for e in events_of(swarm, "averaged") if e["time"] > killed_at + INTERVAL_S and e["peer_id"] in survivors
        ]
        return later if {e["peer_id"] for e in later} == survivors else []

    try:
        later = wait_for(survivors_averaged_again, 120, "both survivors to average again", poll=1.0, procs=[trainer])
    finally:
        trainer.proc.send_signal(signal.SIGTERM)  # graceful: finish what is in flight, write the report
    report = swarm.wait_report(trainer, report_path, timeout=120)
    assert_trained(report, min_steps=100, stopped=True)
    assert all(e["group_size"] == 2 for e in later), later
    failed = [
        e
        for e in events_of(swarm, "averaging_failed") + events_of(swarm, "averaging_donor_skipped")
        if e["time"] > killed_at and e["peer_id"] in survivors
    ]
    print(f"rounds that failed, or pulls from the dead member skipped, after the kill: {len(failed)}")
    assert peers[1].alive() and peers[2].alive()
