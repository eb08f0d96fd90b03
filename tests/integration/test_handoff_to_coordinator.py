"""The only replica of a stage leaves before the coordinator's first checkpoint: its state goes to the coordinator,
and the next replica of that stage starts from it. (The coordinator used to publish where it takes states only
after its first periodic checkpoint, so such a replica logged ``handoff_skipped`` and its training was lost.)"""

from __future__ import annotations

import signal

import pytest
from swarm_support import events_of

from swarmpipe.cli.launcher import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_the_only_replica_hands_its_state_to_a_coordinator_without_checkpoints_yet(swarm):
    swarm.start_coordinator(None, "--checkpoint-every", "0")  # no periodic checkpoint in this run
    peers = [swarm.start_peer(stage, wait=False) for stage in (0, 1)]
    leaving = swarm.wait_ready(peers[1])
    swarm.wait_ready(peers[0])
    trainer, report_path = swarm.start_trainer(30)
    assert swarm.wait_report(trainer, report_path, timeout=120)["microbatches_completed"] == 30
    peers[1].signal(signal.SIGTERM)
    peers[1].proc.wait(timeout=60)
    handoffs = [e for e in events_of(swarm, "handoff") if e["peer_id"] == leaving["peer_id"]]
    assert handoffs and handoffs[0]["target"] == "coordinator", events_of(swarm, "handoff_skipped")
    version = handoffs[0]["version"]
    assert version > 0
    saved = wait_for(
        lambda: [e for e in events_of(swarm, "checkpoint") if "handoff" in e.get("reason", "")],
        30,
        "the coordinator to checkpoint the handed-off state",
    )
    assert saved[0]["versions"]["1"] == version

    joiner = swarm.wait_ready(swarm.start_peer(1, name="joiner"))
    loaded = [e for e in events_of(swarm, "state_loaded") if e["peer_id"] == joiner["peer_id"]]
    assert loaded and loaded[0]["source"] == "checkpoint" and loaded[0]["version"] == version, loaded
