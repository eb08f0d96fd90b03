"""A peer nobody can dial (issue 15), with real processes on loopback: it serves only on 127.0.0.5 and
announces a documentation address (192.0.2.1) where nothing answers, so the coordinator's dial-back fails at
the announced address and at the address it observed (127.0.0.1). It must notice, serve through a relay
peer, run its DHT node in client mode, be used by the trainer, and move to the second relay when its relay
is SIGKILLed, with nothing lost. With ``--relay off`` the same peer exits with advice. (The Compose suite
runs the same scenario behind a real NAT gateway: tests/compose/test_nat.py.)"""

from __future__ import annotations

import subprocess

import pytest
from swarm_support import assert_trained, events_of, kill_tree, wait_step

from swarmpipe.cli.launcher import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.timeout(360)]
HOME = ("--host", "127.0.0.5", "--announce-host", "192.0.2.1")  # behind "NAT": no inbound route
STEPS = 1_000_000
RUN_S = 40


def _relayed_events(swarm, peer_id: str) -> list[dict]:
    return [e for e in events_of(swarm, "relayed") if e["peer_id"] == peer_id]


def test_a_peer_nobody_can_dial_trains_through_relays_survives_losing_one_and_without_relays_gets_advice(swarm):
    swarm.start_coordinator()
    relays = [swarm.start_peer(0, "--relay-capacity", "2", wait=False, name=f"relay{i}") for i in (1, 2)]
    ready = {swarm.wait_ready(r)["peer_id"]: r for r in relays}
    home = swarm.start_peer(1, *HOME, name="home")
    home_id = swarm.wait_ready(home)["peer_id"]
    checks = [e for e in events_of(swarm, "reachability") if e["peer_id"] == home_id]
    assert checks and checks[0]["outcome"] == "unreachable", checks
    first = _relayed_events(swarm, home_id)
    assert len(first) == 1, first
    address = swarm.wait_ready(home)["address"]
    assert address == first[0]["address"] and not address.startswith("192.0.2.1")

    def listed() -> list[dict]:
        return [p for s in swarm.api()["stages"] for p in s.get("peers", []) if p.get("peer_id") == home_id]

    row = wait_for(listed, 60, "the home peer on the dashboard")[0]
    assert first[0]["relay"] and row["relay"].endswith(first[0]["relay"]), row  # shown as relayed

    trainer, report_path = swarm.start_trainer(STEPS, "--max-time", str(RUN_S), "--call-timeout", "10")
    wait_step(swarm, 40, trainer)
    used = next(pid for pid in ready if pid.endswith(first[0]["relay"]))
    kill_tree(ready[used])  # the relay's machine vanishes
    wait_for(lambda: len(_relayed_events(swarm, home_id)) >= 2, 60, "the home peer on another relay", procs=[home])
    second = _relayed_events(swarm, home_id)[1]
    assert not used.endswith(second["relay"]) and second["address"] != first[0]["address"]
    lost = [e for e in events_of(swarm, "relay_lost") if e["peer_id"] == home_id]
    assert lost, "the home peer did not notice its relay die"
    report = swarm.wait_report(trainer, report_path, timeout=300)
    assert_trained(report, min_steps=60)
    assert home.alive()

    # the same home with relays off (a relay with room is up): it exits with advice, never online
    norelay = swarm.start_peer(1, *HOME, "--relay", "off", name="home-norelay", wait=False)
    try:
        norelay.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        kill_tree(norelay)
        pytest.fail("an unreachable peer with --relay off kept running")
    assert norelay.proc.returncode == 2
    log = norelay.log_text()
    assert "the swarm cannot dial this peer" in log and "forward TCP port" in log and "--relay" in log, log[-2000:]
    unreachable = events_of(swarm, "unreachable")
    assert len(unreachable) == 1 and "forward TCP port" in unreachable[0]["advice"]
    assert not norelay.ready_path.exists()
