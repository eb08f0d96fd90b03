"""Peers die, freeze, drain and join while a trainer runs: nothing is lost, the loss still falls.

Real processes on 127.0.0.1, real signals: SIGKILL to the whole process group
(the peer, its DHT process and p2pd) is a machine vanishing; SIGSTOP is a freeze.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from swarm_support import assert_trained, events_of, kill_tree, stop_trainer, wait_step

from swarmpipe.cli.launcher import wait_for
from swarmpipe.peer.state.transfer import download_state

pytestmark = [pytest.mark.fault, pytest.mark.timeout(360)]

# Runs are sized in work, not time, so a loaded machine makes them slower, never shorter. The fault lands at
# FAULT_STEP or soon after; the trainer (--steps STEPS) then has ~300 micro-batches to go, and must complete at
# least AFTER_FAULT past the fault: ~10 s of training with the fault in place on an idle 2-core machine (~35 a
# second), past the retries and bans up to the dead record's lapse (10 s). Where a scenario waits for something
# outside the trainer (a checkpoint, the coordinator to see a freeze), the trainer gets UNTIL_STOPPED steps and
# is stopped (SIGTERM) once the test has seen it.
FAULT_STEP = 60
STEPS = 400
AFTER_FAULT = 200
UNTIL_STOPPED = 1_000_000


def _wait_gone(swarm, peer_id: str, since: float, trainer) -> None:
    """Until the coordinator drops ``peer_id`` (its record lapsed: 10 s without an announcement) after ``since``."""
    wait_for(
        lambda: [e for e in events_of(swarm, "peer_gone") if e["peer"] == peer_id and e["time"] > since],
        60,
        f"the coordinator to see {peer_id[-6:]} gone",
        procs=[trainer],
    )


def test_sigkill_one_replica(swarm):
    swarm.start_coordinator()
    swarm.start_peer(0, wait=False)
    victim = swarm.start_peer(1, wait=False)
    survivor = swarm.start_peer(1, wait=False)
    for p in swarm.group.procs[1:]:
        swarm.wait_ready(p)
    trainer, report_path = swarm.start_trainer(STEPS, "--call-timeout", "10")
    killed_at = wait_step(swarm, FAULT_STEP, trainer)
    kill_tree(victim)
    assert trainer.alive(), "the replica must die mid-run"
    report = swarm.wait_report(trainer, report_path, timeout=300)
    assert_trained(report, min_steps=killed_at + AFTER_FAULT)  # trained on well past the kill
    assert survivor.alive()


def test_sigkill_only_replica_recovers_from_checkpoint(swarm):
    # A peer serves the state it exported to every pull for 30 s, so the coordinator's checkpoints repeat the
    # state of its first pull that long. Pulls every 2 s would first get the untrained state, before the trainer
    # starts; the first pull 15 s after the coordinator's start mostly finds training under way (else the one
    # 30 s later, at 45 s, gets trained weights).
    swarm.start_coordinator(None, "--checkpoint-every", "15")
    swarm.start_peer(0, wait=False)
    victim = swarm.start_peer(1, wait=False)
    for p in swarm.group.procs[1:]:
        swarm.wait_ready(p)
    victim_id = swarm.wait_ready(victim)["peer_id"]
    trainer, report_path = swarm.start_trainer(UNTIL_STOPPED, "--call-timeout", "10")
    wait_step(swarm, FAULT_STEP, trainer)
    wait_for(
        lambda: (swarm.api().get("checkpoint") or {}).get("stages", {}).get("1", {}).get("version", 0) > 10,
        90,
        "a checkpoint of stage 1",
        procs=[trainer],
    )
    killed_at = wait_step(swarm, 0, trainer)
    kill_tree(victim)
    killed_time = time.time()
    assert trainer.alive(), "the only replica must die mid-run"
    # The replacement starts once the victim's record has lapsed (the coordinator drops it 10 s after its last
    # announcement), so it finds no replica to download from; the trainer waits for stage 1 meanwhile.
    _wait_gone(swarm, victim_id, killed_time, trainer)
    # the trainer reads the DHT on its own schedule: it may see the record lapse a moment after the coordinator
    wait_for(
        lambda: [e for e in events_of(swarm, "waiting_for_replica") if e["stage"] == 1 and e["time"] > killed_time],
        30,
        "the trainer to say it waits for stage 1",
        procs=[trainer],
    )
    replacement = swarm.start_peer(1, name="replacement")
    loaded = [e for e in events_of(swarm, "state_loaded") if e["peer_id"] == swarm.wait_ready(replacement)["peer_id"]]
    assert loaded and loaded[0]["source"] == "checkpoint", events_of(swarm, "state_loaded")
    assert loaded[0]["version"] > 10
    wait_step(swarm, killed_at + AFTER_FAULT, trainer)  # trained on well past the kill, on the replacement
    report = stop_trainer(swarm, trainer, report_path)
    assert_trained(report, min_steps=killed_at + AFTER_FAULT, stopped=True)


def test_sigstop_replica_is_routed_around_and_rejoins(swarm):
    swarm.start_coordinator()
    swarm.start_peer(0, wait=False)
    frozen = swarm.start_peer(1, wait=False)
    swarm.start_peer(1, wait=False)
    infos = [swarm.wait_ready(p) for p in swarm.group.procs[1:]]
    trainer, report_path = swarm.start_trainer(UNTIL_STOPPED, "--call-timeout", "5")
    wait_step(swarm, FAULT_STEP, trainer)
    frozen_id = infos[1]["peer_id"]
    os.killpg(frozen.proc.pid, signal.SIGSTOP)
    stopped_at_step = wait_step(swarm, 0, trainer)
    frozen_time = time.time()
    # Frozen until the coordinator has dropped it (its record lapsed: 10 s without an announcement), well past
    # the 5 s call deadline that the trainer's calls to it hit.
    _wait_gone(swarm, frozen_id, frozen_time, trainer)
    progressed = wait_step(swarm, 0, trainer)
    assert progressed > stopped_at_step + 10, "training must go on while a replica is frozen"
    os.killpg(frozen.proc.pid, signal.SIGCONT)

    def rejoined():
        peers = {p["peer_id"]: p for s in swarm.api()["stages"] for p in s["peers"]}
        return peers.get(frozen_id, {}).get("state") == "online"

    wait_for(rejoined, 60, "the frozen replica to be listed online again")
    wait_step(swarm, wait_step(swarm, 0, trainer) + 50, trainer)  # and training goes on with it back
    report = stop_trainer(swarm, trainer, report_path)
    assert_trained(report, min_steps=150, stopped=True)
    assert report["microbatches_retried"] > 0


def test_sigterm_drains_and_hands_state_to_replica(swarm):
    swarm.start_coordinator()
    swarm.start_peer(0, wait=False)
    leaving = swarm.start_peer(1, wait=False, name="leaving")
    swarm.start_peer(1, wait=False, name="staying")
    infos = {p.name: swarm.wait_ready(p) for p in swarm.group.procs[1:]}
    trainer, report_path = swarm.start_trainer(STEPS, "--call-timeout", "10")
    left_at = wait_step(swarm, FAULT_STEP, trainer)
    leaving.signal(signal.SIGTERM)
    t0 = time.monotonic()
    leaving.proc.wait(timeout=40)
    assert leaving.proc.returncode == 0, leaving.log_text()[-2000:]
    assert time.monotonic() - t0 < 30, "drain must finish within the grace period"
    handoff = [e for e in events_of(swarm, "handoff") if e["peer_id"] == infos["leaving"]["peer_id"]]
    assert handoff and handoff[0]["target"] == "replica", events_of(swarm, "handoff_failed")
    received = [e for e in events_of(swarm, "state_received") if e["peer_id"] == infos["staying"]["peer_id"]]
    assert received and received[0]["from_version"] == handoff[0]["version"] > 0
    report = swarm.wait_report(trainer, report_path, timeout=300)
    assert_trained(report, min_steps=left_at + AFTER_FAULT)  # trained on well past the departure


def test_peer_joins_mid_run_with_replica_weights(swarm):
    swarm.start_coordinator()
    swarm.start_peer(0, wait=False)
    donor = swarm.start_peer(1, wait=False)
    donor_info = [swarm.wait_ready(p) for p in swarm.group.procs[1:]][1]
    trainer, report_path = swarm.start_trainer(STEPS, "--call-timeout", "10")
    joined_at = wait_step(swarm, FAULT_STEP, trainer)
    os.killpg(trainer.proc.pid, signal.SIGSTOP)  # hold training still so both weights can be compared
    try:
        time.sleep(1.0)
        t0 = time.monotonic()
        joiner = swarm.start_peer(1, name="joiner")
        served_after = time.monotonic() - t0
        joiner_info = swarm.wait_ready(joiner)
        loaded = [e for e in events_of(swarm, "state_loaded") if e["peer_id"] == joiner_info["peer_id"]]
        joiner_events = [e for e in swarm.read_events() if e.get("peer_id") == joiner_info["peer_id"]]
        assert loaded and loaded[0]["source"] == "replicas" and loaded[0]["seconds"] < 10, joiner_events[:10]
        digests = [
            asyncio.run(download_state([info["address"]], "test", 1)).digest() for info in (donor_info, joiner_info)
        ]
        assert digests[0] == digests[1] == loaded[0]["digest"]
        assert served_after < 60
    finally:
        os.killpg(trainer.proc.pid, signal.SIGCONT)
    report = swarm.wait_report(trainer, report_path, timeout=300)
    assert_trained(report, min_steps=joined_at + AFTER_FAULT)  # trained on well past the join, with both replicas
    assert donor.alive()
