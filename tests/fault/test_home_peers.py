"""Volunteers from home at stages that pass chains on (issue 30, item 1), with real processes behind a real NAT.

Two home peers run in a home network behind a MASQUERADE gateway (tests/netns_nat.py), started as a volunteer
would (``--host 0.0.0.0 --announce-host auto``): one on stage 0, one on the middle stage of three. Nobody can dial
them; they dial out. The stage-0 one starts before any peer relays: it must wait for a relay, saying so, and join
once one has room (it used to exit). Then both serve through the relay, run their DHT nodes in client mode, see
the swarm as any peer does and pass their outputs to the next stage themselves: most micro-batches are chained end
to end and the trainer carries few hops (it used to carry every hop after a home peer: 56 of 60).
"""

from __future__ import annotations

import pytest
from netns_nat import NamespaceNat, unavailable_reason
from swarm_support import assert_trained, events_of

from swarmpipe.cli.launcher import wait_for

pytestmark = [
    pytest.mark.fault,
    pytest.mark.timeout(360),
    pytest.mark.skipif(unavailable_reason() is not None, reason=f"{unavailable_reason()}"),
]
STEPS = 200


def test_home_peers_on_the_first_and_a_middle_stage_chain_outbound_and_wait_for_a_relay(swarm, nat: NamespaceNat):
    swarm.host = nat.public_ip
    swarm.start_coordinator(swarm.write_spec(num_stages=3, n_layers=3))

    def start_home(stage: int, name: str):
        home = ("--announce-host", "auto")
        return swarm.start_peer(stage, *home, host="0.0.0.0", prefix=nat.prefix(), name=name, wait=False)

    first = start_home(0, "home-first")  # before any relay: it waits for one
    waiting = wait_for(
        lambda: events_of(swarm, "waiting_for_relay"), 90, "the home peer to wait for a relay", procs=[first]
    )
    assert "--relay-capacity" in waiting[0]["advice"], waiting[0]
    assert first.alive() and not first.ready_path.exists()

    relay = swarm.start_peer(1, "--relay-capacity", "2", wait=False, name="relay")
    last = swarm.start_peer(2, wait=False, name="last")
    middle = start_home(1, "home-middle")
    homes = {swarm.wait_ready(p, timeout=120)["peer_id"] for p in (first, middle)}
    for p in (relay, last):
        swarm.wait_ready(p)
    relayed = {e["peer_id"] for e in events_of(swarm, "relayed")}
    assert homes <= relayed, "both home peers serve through the relay"
    for p in (first, middle):
        assert "runs its DHT node in client mode" in p.log_text()

    trainer, report_path = swarm.start_trainer(STEPS, "--call-timeout", "10", "--verify-fraction", "0")
    report = swarm.wait_report(trainer, report_path, timeout=240)
    keys = ("microbatches_completed", "microbatches_chained", "hops_relayed", "chain_breaks")
    print("home peers:", {k: report[k] for k in (*keys, "trainer_bytes_per_microbatch")})
    assert_trained(report, min_steps=STEPS)
    assert report["microbatches_chained"] >= 0.9 * report["microbatches_completed"], {k: report[k] for k in keys}
    assert report["hops_relayed"] <= 0.1 * report["microbatches_completed"], {k: report[k] for k in keys}
