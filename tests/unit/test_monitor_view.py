"""The health page's pure parts: what a run's view shows when strangers announce thousands of replicas, which
peers a round dials, and the bounded reachability history."""

from __future__ import annotations

import pytest

from swarmpipe.coordinator.monitor import service, view
from swarmpipe.coordinator.monitor.reachability import ReachabilityHistory, probe_all
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.swarm.records import StageRecord

pytestmark = pytest.mark.unit


def _record(i: int, host: str = "10.0.0.1", relay: str = "") -> StageRecord:
    return StageRecord(
        address=f"{host}:{1000 + i}",
        state="online",
        throughput=1.0,
        queue=0,
        version=i,
        updated_at=float(i),
        relay=relay,
    )


def test_a_flood_of_replicas_is_counted_and_the_newest_are_listed() -> None:
    spec = RunSpec()
    flood = {f"Qm{i:044d}": _record(i) for i in range(view.MAX_PEERS_SHOWN + 40)}
    stages = [flood] + [{} for _ in range(spec.num_stages - 1)]
    run = view.run_view("r", None, spec, stages, {}, None)
    first = run["stages"][0]
    assert len(first["peers"]) == view.MAX_PEERS_SHOWN and first["peers_not_listed"] == 40
    assert first["peers"][0]["version"] == view.MAX_PEERS_SHOWN + 39  # newest first
    assert first["replicas"] == view.MAX_PEERS_SHOWN + 40 and run["empty_stages"] == list(range(1, spec.num_stages))
    assert run["help"]["neediest_stage"] == 1  # an empty stage before a crowded one
    assert all("tls_cert" not in p for p in first["peers"])


def test_a_round_dials_a_bounded_number_of_peers_per_host() -> None:
    peers = [{"peer_id": f"Qm{i}", "address": f"10.0.0.{i % 3}:{2000 + i}"} for i in range(100)]
    snapshot = {"runs": [{"stages": [{"peers": peers}]}]}
    targets = service._probe_targets(snapshot)
    hosts = [a.rsplit(":", 1)[0] for a in targets.values()]
    assert len(targets) == 3 * service.MAX_PROBES_PER_HOST
    assert all(hosts.count(h) == service.MAX_PROBES_PER_HOST for h in set(hosts))


def test_the_history_is_bounded_in_peers_and_outcomes() -> None:
    history = ReachabilityHistory(max_peers=3, history=4)
    for i in range(5):
        history.record(f"p{i}", "ok")
    assert len(history) == 3 and history.of("p0") == [] and history.of("p4")  # the least recently seen went
    for _ in range(10):
        history.record("p4", "unreachable")
    assert [o for _, o in history.of("p4")] == ["unreachable"] * 4
    history.mark_absent({"p2"})
    history.mark_absent({"p2"})  # absent once, not every round
    assert history.summary("p3")["history"] == "+." and history.summary("p2")["last"] == "ok"


async def test_probe_all_records_each_outcome_and_marks_the_unlisted_absent() -> None:
    history = ReachabilityHistory()
    history.record("gone", "ok")
    outcomes = {"a": "ok", "b": "unreachable", "c": "wrong_peer"}

    async def prober(address, peer_id, dial):
        return outcomes[peer_id]

    await probe_all({p: f"10.0.0.1:{i}" for i, p in enumerate(outcomes)}, history, dial=None, prober=prober)
    assert {p: history.summary(p)["last"] for p in (*outcomes, "gone")} == {**outcomes, "gone": "absent"}
    assert history.summary("a")["ok_fraction"] == 1.0 and history.summary("b")["ok_fraction"] == 0.0
