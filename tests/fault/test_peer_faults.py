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
from swarm_support import assert_trained, events_of, kill_tree, wait_step

from swarmpipe.cli.launcher import wait_for
from swarmpipe.peer.state.transfer import download_state

pytestmark = [pytest.mark.fault, pytest.mark.timeout(360)]

# The trainer runs for RUN_S seconds whatever the machine's speed, so every fault lands mid-run.
STEPS = 1_000_000
RUN_S = 45


def test_sigkill_one_replica(swarm):
    swarm.start_coordinator()
    swarm.start_peer(0, wait=False)
    victim = swarm.start_peer(1, wait=False)
    survivor = swarm.start_peer(1, wait=False)
    for p in swarm.group.procs[1:]:
        swarm.wait_ready(p)
    trainer, report_path = swarm.start_trainer(STEPS, "--max-time", str(RUN_S), "--call-timeout", "10")
    wait_step(swarm, 60, trainer)
    kill_tree(victim)
    report = swarm.wait_report(trainer, report_path, timeout=300)
    assert_trained(report, min_steps=150)
    assert survivor.alive()


def test_sigkill_only_replica_recovers_from_checkpoint(swarm):
    swarm.start_coordinator(None, "--checkpoint-every", "2")
    swarm.start_peer(0, wait=False)
    victim = swarm.start_peer(1, wait=False)
    for p in swarm.group.procs[1:]:
        swarm.wait_ready(p)
    trainer, report_path = swarm.start_trainer(STEPS, "--max-time", str(RUN_S), "--call-timeout", "10")
    wait_step(swarm, 60, trainer)
    wait_for(
        lambda: (swarm.api().get("checkpoint") or {}).get("stages", {}).get("1", {}).get("version", 0) > 10,
        60,
        "a checkpoint of stage 1",
    )
    kill_tree(victim)
    killed_at = time.monotonic()
    time.sleep(10)
    replacement = swarm.start_peer(1, name="replacement")
    loaded = [e for e in events_of(swarm, "state_loaded") if e["peer_id"] == swarm.wait_ready(replacement)["peer_id"]]
    assert loaded and loaded[0]["source"] == "checkpoint", events_of(swarm, "state_loaded")
    assert loaded[0]["version"] > 10
    report = swarm.wait_report(trainer, report_path, timeout=300)
    assert_trained(report, min_steps=150)
    waits = [
        e
        for e in events_of(swarm, "waiting_for_replica")
        if e["time"] > time.time() - (time.monotonic() - killed_at) - 5
    ]
    assert waits, "the trainer should have said it was waiting for stage 1"


def test_sigstop_replica_is_routed_around_and_rejoins(swarm):
    swarm.start_coordinator()
    swarm.start_peer(0, wait=False)
    frozen = swarm.start_peer(1, wait=False)
    swarm.start_peer(1, wait=False)
    infos = [swarm.wait_ready(p) for p in swarm.group.procs[1:]]
    trainer, report_path = swarm.start_trainer(STEPS, "--max-time", str(RUN_S), "--call-timeout", "5")
    wait_step(swarm, 60, trainer)
    os.killpg(frozen.proc.pid, signal.SIGSTOP)
    stopped_at_step = wait_step(swarm, 0, trainer)
    time.sleep(20)
    progressed = wait_step(swarm, 0, trainer)
    assert progressed > stopped_at_step + 10, "training must go on while a replica is frozen"
    os.killpg(frozen.proc.pid, signal.SIGCONT)
    frozen_id = infos[1]["peer_id"]

    def rejoined():
        peers = {p["peer_id"]: p for s in swarm.api()["stages"] for p in s["peers"]}
        return peers.get(frozen_id, {}).get("state") == "online"

    wait_for(rejoined, 60, "the frozen replica to be listed online again")
    report = swarm.wait_report(trainer, report_path, timeout=300)
    assert_trained(report, min_steps=150)
    assert report["microbatches_retried"] > 0


def test_sigterm_drains_and_hands_state_to_replica(swarm):
    swarm.start_coordinator()
    swarm.start_peer(0, wait=False)
    leaving = swarm.start_peer(1, wait=False, name="leaving")
    swarm.start_peer(1, wait=False, name="staying")
    infos = {p.name: swarm.wait_ready(p) for p in swarm.group.procs[1:]}
    trainer, report_path = swarm.start_trainer(STEPS, "--max-time", str(RUN_S), "--call-timeout", "10")
    wait_step(swarm, 60, trainer)
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
    assert_trained(report, min_steps=150)


def test_peer_joins_mid_run_with_replica_weights(swarm):
    swarm.start_coordinator()
    swarm.start_peer(0, wait=False)
    donor = swarm.start_peer(1, wait=False)
    donor_info = [swarm.wait_ready(p) for p in swarm.group.procs[1:]][1]
    trainer, report_path = swarm.start_trainer(STEPS, "--max-time", str(RUN_S), "--call-timeout", "10")
    wait_step(swarm, 60, trainer)
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
    assert_trained(report, min_steps=150)
    assert donor.alive()
