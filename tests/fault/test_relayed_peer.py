"""A peer nobody can dial (issue 15), with real processes. It must notice, serve through a relay peer, run its
DHT node in client mode, be used by the trainer, and move to the second relay when its relay is SIGKILLed, with
nothing lost. With ``--relay off`` the same peer exits with advice. Two homes:

* ``namespaces``: the Compose ``nat`` topology without Docker (tests/netns_nat.py): the peer runs inside a home
  network namespace behind a MASQUERADE gateway, binds ``0.0.0.0`` and announces ``auto``, as a volunteer would
  start it; the swarm sees it at the gateway's address and cannot dial in. Needs root and iptables.
* ``loopback``: only where namespaces cannot be made (elsewhere it would repeat the above): the peer serves only on 127.0.0.5 and announces a documentation
  address (192.0.2.1) where nothing answers, so the dial-back fails at the announced and the observed address.

(The Compose suite runs the same scenario behind a NAT gateway container: tests/compose/test_nat_compose.py.)
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from netns_nat import NamespaceNat, unavailable_reason
from swarm_support import assert_trained, events_of, kill_tree, stop_trainer, wait_step

from swarmpipe.cli.launcher import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.timeout(420)]
# The trainer trains until the home peer (stage 1's only replica) has served AFTER_RELAY_LOST_S through its
# second relay, then is stopped (SIGTERM): no fixed run time that a slow machine might end before the move.
# The relay's death broke the chain into stage 1, so that hop goes through the trainer for a 5 s cooldown before
# chains pass it again: three cooldowns leave most of the run chained (assert_trained checks it is).
UNTIL_STOPPED = 1_000_000
AFTER_RELAY_LOST_S = 15.0
NAMESPACES_UNAVAILABLE = unavailable_reason()


@dataclass
class Home:
    """Where the home peer runs and how it is started; ``public_host`` is what the rest of the swarm binds."""

    public_host: str
    peer_host: str
    peer_args: tuple[str, ...]
    prefix: list[str] = field(default_factory=list)
    nat: NamespaceNat | None = None


@pytest.fixture(
    params=[
        pytest.param(
            "namespaces",
            marks=pytest.mark.skipif(NAMESPACES_UNAVAILABLE is not None, reason=f"{NAMESPACES_UNAVAILABLE}"),
        ),
        pytest.param(  # the fallback: where the real NAT runs, this one would only repeat it (a minute of CI)
            "loopback",
            marks=pytest.mark.skipif(
                NAMESPACES_UNAVAILABLE is None, reason="the namespaces home runs here: the same scenario behind a NAT"
            ),
        ),
    ]
)
def home(request) -> Iterator[Home]:
    if request.param == "loopback":
        yield Home("127.0.0.1", "127.0.0.5", ("--announce-host", "192.0.2.1"))
        return
    nat = NamespaceNat()
    try:
        nat.create()
        yield Home(nat.public_ip, "0.0.0.0", ("--announce-host", "auto"), nat.prefix(), nat)
    finally:
        nat.delete()


def _relayed_events(swarm, peer_id: str) -> list[dict]:
    return [e for e in events_of(swarm, "relayed") if e["peer_id"] == peer_id]


def test_a_peer_nobody_can_dial_trains_through_relays_survives_losing_one_and_without_relays_gets_advice(
    swarm, home: Home
):
    if home.nat:  # the topology itself first: out through the gateway's address, nothing in
        assert home.nat.outbound_source() == home.nat.gateway_wan_ip
    swarm.host = home.public_host
    swarm.start_coordinator()
    relays = [swarm.start_peer(0, "--relay-capacity", "2", wait=False, name=f"relay{i}") for i in (1, 2)]
    ready = {swarm.wait_ready(r)["peer_id"]: r for r in relays}

    def start_home(name: str, *args: str, wait: bool = True):
        return swarm.start_peer(
            1, *home.peer_args, *args, host=home.peer_host, prefix=home.prefix, name=name, wait=wait, timeout=120
        )

    peer = start_home("home")
    home_id = swarm.wait_ready(peer)["peer_id"]
    checks = [e for e in events_of(swarm, "reachability") if e["peer_id"] == home_id]
    assert checks and checks[0]["outcome"] == "unreachable", checks
    if home.nat:
        assert checks[0]["observed"] == home.nat.gateway_wan_ip, checks  # the swarm sees the gateway
        assert not home.nat.can_dial_home(int(checks[0]["address"].rsplit(":", 1)[1]))  # its own gRPC port
    assert "runs its DHT node in client mode" in peer.log_text()
    first = _relayed_events(swarm, home_id)
    assert len(first) == 1, first
    address = swarm.wait_ready(peer)["address"]
    assert address == first[0]["address"] and not address.startswith(("192.0.2.1", "0.0.0.0", "10.215."))

    def listed() -> list[dict]:
        return [p for s in swarm.api()["stages"] for p in s.get("peers", []) if p.get("peer_id") == home_id]

    row = wait_for(listed, 60, "the home peer on the dashboard")[0]
    assert first[0]["relay"] and row["relay"].endswith(first[0]["relay"]), row  # shown as relayed

    trainer, report_path = swarm.start_trainer(UNTIL_STOPPED, "--call-timeout", "10")
    wait_step(swarm, 40, trainer)
    used = next(pid for pid in ready if pid.endswith(first[0]["relay"]))
    kill_tree(ready[used])  # the relay's machine vanishes
    wait_for(lambda: len(_relayed_events(swarm, home_id)) >= 2, 60, "the home peer on another relay", procs=[peer])
    second = _relayed_events(swarm, home_id)[1]
    assert not used.endswith(second["relay"]) and second["address"] != first[0]["address"]
    lost = [e for e in events_of(swarm, "relay_lost") if e["peer_id"] == home_id]
    assert lost, "the home peer did not notice its relay die"
    moved_at_step = wait_step(swarm, 0, trainer)
    time.sleep(max(0.0, second["time"] + AFTER_RELAY_LOST_S - time.time()))
    wait_step(swarm, moved_at_step + 50, trainer)  # stage 1 trains through the second relay
    report = stop_trainer(swarm, trainer, report_path)
    assert_trained(report, min_steps=60, stopped=True)
    assert peer.alive()

    # the same home with relays off (a relay with room is up): it exits with advice, never online
    norelay = start_home("home-norelay", "--relay", "off", wait=False)
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
