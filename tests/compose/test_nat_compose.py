"""Volunteering from home in Compose (issue 15): the only stage-1 peer sits in a home network behind a NAT gateway
container (tests/compose/home_network.py): it must find out that nobody can dial it, serve through a relay
(the two stage-0 peers relay, SWARMPIPE_PEER_RELAY_CAPACITY), be used by the trainer, and survive its relay
being killed (the other takes over); nothing lost, the loss falls. A second home peer with relays off exits
with the advice message."""

from __future__ import annotations

import os
import time

import pytest
from compose_harness import HarnessError, sh, wait_until
from fault_checks import bring_up, finish_training, start_training
from home_network import HomeNetwork

pytestmark = [pytest.mark.compose, pytest.mark.slow]


def _events(st, cid: str, kind: str) -> list[str]:
    return [line for line in st.logs(cid).splitlines() if f" {kind} " in line]


@pytest.mark.timeout(1200)
def test_a_peer_behind_nat_trains_through_a_relay_and_survives_losing_it(scenario):
    sc = scenario(
        "nat",
        "the only stage-1 peer is behind a NAT gateway; two stage-0 peers relay; its relay is killed mid-run",
        replicas=(2, 0),
        env_overrides={"SWARMPIPE_PEER_RELAY_CAPACITY": "2"},
    )
    st = sc.stack
    bring_up(sc)
    home = HomeNetwork(st, os.environ.get("SWARMPIPE_IMAGE", "swarmpipe:local"))
    try:
        home.create()
        peer = home.start_peer(1, "home1")
        try:
            st.wait_serving([peer], 240)
        except HarnessError as e:
            sc.check("the home peer serves", False, f"{e}; log: {st.logs(peer)[-1500:]}")
            sc.assert_passed()
        checks = _events(st, peer, "reachability")
        sc.check(
            "the home peer found it cannot be dialled",
            any("outcome=unreachable" in c for c in checks),
            " ".join(checks[-1:])[-200:],
        )
        relayed = _events(st, peer, "relayed")
        sc.check("it serves through a relay", bool(relayed), " ".join(relayed[-1:])[-200:])
        # the peer's own gRPC port (the image's SWARMPIPE_PORT) answers inside the home (the probe works) and is
        # closed from the swarm network (the NAT holds); so is the DHT port it was given (in client mode its DHT
        # node listens on a port of its own choosing, for outbound use)
        grpc_open_at_home = home.can_reach(peer, 7000, from_home=True)
        open_to_swarm = [p for p in (7000, 31337) if home.can_reach(peer, p)]
        sc.check("its gRPC port answers inside the home", grpc_open_at_home)
        sc.check("nothing on the swarm network can dial into the home", not open_to_swarm, f"open: {open_to_swarm}")
        client_mode = "runs its DHT node in client mode" in st.logs(peer)
        sc.check("its DHT node runs in client mode", client_mode)
        home_id = st.peer_id(peer)
        relays = {st.peer_id(cid): cid for cid in st.ids("peer0")}
        steps = start_training(sc, 150)
        wait_until(lambda: _version(st, home_id) > 0, 120, "the trainer to use the home peer", poll=2.0)
        sc.check("the trainer uses the home peer", _version(st, home_id) > 0)
        used = next(
            (cid for pid, cid in relays.items() if relayed and pid.endswith(relayed[-1].split("relay=")[1][:6])), None
        )
        if used is None:
            sc.check("the relay in use is known", False, " ".join(relayed[-1:])[-200:])
            sc.assert_passed()
        st.kill(used)
        t0 = time.monotonic()
        try:
            wait_until(lambda: len(_events(st, peer, "relayed")) >= 2, 90, "the home peer on the other relay", poll=1.0)
            moved = time.monotonic() - t0
        except HarnessError:
            moved = None
        sc.check(
            "it moved to the other relay", moved is not None, f"{moved:.0f} s after the kill" if moved else "never"
        )
        sc.recovery = f"on the second relay {moved:.0f} s after the kill" if moved is not None else "never moved"
        survivors = [cid for cid in st.ids("peer0") if cid != used]
        report = finish_training(sc, steps, survivors, gone=(next(p for p, c in relays.items() if c == used),))
        sc.check("the home peer still listed", home_id in st.listed())

        # relays off: the same home, and the peer exits with the advice
        norelay = home.start_peer(1, "home2", SWARMPIPE_RELAY="off")
        wait_until(lambda: not st.running(norelay), 180, "the home peer without relays to exit", poll=2.0)
        code = sh(["docker", "inspect", "-f", "{{.State.ExitCode}}", norelay]).stdout.strip()
        log = st.logs(norelay)
        sc.check("without relays it exits with advice", code == "2" and "forward TCP port" in log, f"exit {code}")
        sc.note(f"trainer: {report.get('microbatches_completed')} completed, lost {report.get('microbatches_lost')}")
    finally:
        for cid in list(home.containers):
            try:
                (st.logdir / f"{cid.rsplit('_', 1)[-1]}.log").write_text(
                    sh(["docker", "logs", cid], check=False).stdout
                )
            except OSError:
                pass
        home.remove()
    sc.assert_passed()


def _version(st, peer_id: str) -> int:
    p = st.listed().get(peer_id)
    return int(p["version"]) if p else -1
