"""A peer started while the coordinator (its only bootstrap peer) is down waits, then joins once it is back."""

from __future__ import annotations

import pytest
from swarm_support import assert_trained, events_of, kill_tree

from swarmpipe.cli.launcher import read_json, wait_for

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]


def test_peer_started_while_coordinator_is_down_joins_when_it_returns(swarm):
    spec = swarm.write_spec()
    swarm.start_coordinator(spec)
    swarm.start_peer(0)
    kill_tree(swarm.coordinator)
    late = swarm.start_peer(1, "--spec-timeout", "180", wait=False, name="late")
    # It says so when it finds its initial peer down, and again at each retry (every 5 s): a second notice is a
    # peer that kept waiting (a fixed sleep would be too short on a loaded machine, where it starts slower).
    wait_for(
        lambda: late.log_text().count("initial peers answers yet") >= 2,
        90,
        "the late peer to retry its initial peer",
        procs=[late],
    )
    assert late.alive(), late.log_text()[-3000:]
    assert read_json(late.ready_path) is None, "it cannot serve before it has the spec"
    swarm.start_coordinator(spec)
    info = swarm.wait_ready(late, timeout=120)
    assert info["stage"] == 1
    trainer, report_path = swarm.start_trainer(150, "--call-timeout", "10")
    report = swarm.wait_report(trainer, report_path, timeout=200)
    assert_trained(report, min_steps=150)
    assert [e for e in events_of(swarm, "online") if e["peer_id"] == info["peer_id"]]
