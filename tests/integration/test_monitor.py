"""``swarmpipe monitor``, the swarm-wide health page (issue 30, item 3), on real processes.

Three runs share one DHT: ``test`` (two stages, a peer on each, a trainer), ``other`` (a coordinator and no peers
yet) and ``stranger`` (listed by a coordinator nobody configured as trusted). The monitor trusts the first two
coordinators: its JSON and its page (rendered by headless Chromium) list exactly those runs with their stages,
replicas, trainers and where a GPU helps most; every announced peer gets a reachability history, and a peer
SIGKILLed while its record is still in the DHT turns from answering to unreachable.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from browser_support import Browser, Elements
from swarm_support import Swarm, kill_tree

from swarmpipe.cli.launcher import read_json, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _api(url: str) -> dict:
    with urllib.request.urlopen(url + "api/monitor", timeout=10) as response:
        return json.loads(response.read())


def _coordinator_id(swarm: Swarm) -> str:
    return swarm.maddr.rsplit("/p2p/", 1)[1]


@pytest.fixture
def side_runs(swarm, tmp_path):
    """Coordinators of the runs ``other`` and ``stranger`` in ``swarm``'s DHT (started by the test)."""
    sides = {run_id: Swarm(tmp_path / run_id, run_id=run_id) for run_id in ("other", "stranger")}
    try:
        yield sides
    finally:
        for side in sides.values():
            side.stop()


def test_the_health_page_lists_trusted_runs_their_stages_and_reachability(swarm, side_runs, tmp_path, chromium):
    swarm.start_coordinator()
    for run_id, side in side_runs.items():
        side.start_coordinator(None, "--run-id", run_id, "--num-stages", "3", "--initial-peers", swarm.maddr)
    others = side_runs
    peers = [swarm.start_peer(stage, wait=False) for stage in (0, 1)]
    infos = [swarm.wait_ready(p) for p in peers]
    trainer, _report = swarm.start_trainer(1_000_000, "--call-timeout", "10")

    ready = tmp_path / "monitor.json"
    trusted = [_coordinator_id(swarm), _coordinator_id(others["other"])]
    swarm.start_role(
        "monitor",
        "monitor",
        *("--initial-peers", swarm.maddr, "--http-port", "0", "--refresh", "1", "--ready-file", str(ready)),
        *("--coordinator-id", *trusted),
    )
    url = wait_for(lambda: (read_json(ready) or {}).get("url"), 90, "the health page")

    def settled() -> dict | None:
        view = _api(url)
        runs = {r["run_id"]: r for r in view["runs"]}
        test = runs.get("test")
        if set(runs) != {"test", "other"} or not test or not test["trainers"]:
            return None
        probed = [p.get("reachability", {}).get("last") for s in test["stages"] for p in s["peers"]]
        return runs if [s["replicas"] for s in test["stages"]] == [1, 1] and probed == ["ok", "ok"] else None

    runs = wait_for(settled, 90, "both trusted runs, the trainer and answering peers on the page", procs=[trainer])
    test, other = runs["test"], runs["other"]
    assert test["model"]["family"] == "bytegpt" and test["num_stages"] == 2 and not test["empty_stages"]
    assert {p["peer_id"] for s in test["stages"] for p in s["peers"]} == {i["peer_id"] for i in infos}
    assert other["num_stages"] == 3 and other["empty_stages"] == [0, 1, 2] and other["trainers"] == []
    assert other["help"]["neediest_stage"] == 0  # empty stages first
    assert set(test["help"]["by_gpu_memory_gib"]) == {"8", "12", "16", "24", "48", "80"}
    assert all(stage in (0, 1) for stage in test["help"]["by_gpu_memory_gib"].values())  # a tiny model fits all

    page = Elements(Browser(chromium, tmp_path).dom(url))
    assert {a["data-run"] for a in page.by_class("run")} == {"test", "other"}  # never the stranger's run
    assert {a["data-peer"] for a in page.by_class("peer")} == {i["peer_id"] for i in infos}
    assert sorted(a["data-replicas"] for a in page.by_class("stage")) == ["0", "0", "0", "1", "1"]  # other, test

    kill_tree(peers[1])  # its record outlives it for a while; the monitor's call does not get through

    def unreachable() -> bool:
        stage = {r["run_id"]: r for r in _api(url)["runs"]}["test"]["stages"][1]
        history = [p["reachability"] for p in stage["peers"] if p["peer_id"] == infos[1]["peer_id"]]
        return bool(history) and history[0]["last"] == "unreachable" and "+" in history[0]["history"]

    wait_for(unreachable, 60, "the killed peer to show as unreachable")
