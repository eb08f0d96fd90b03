"""The dashboard in a real browser: headless Chromium renders a training swarm's pipeline and loss curve."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from browser_support import Browser, Elements

from swarmpipe.cli.launcher import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

MIN_LOSS_POINTS = 5
MIN_VAL_POINTS = 2


def _rendered(browser: Browser, url: str, num_stages: int) -> Elements | None:
    page = Elements(browser.dom(url))
    stages = page.by_class("stage")
    loss = page.by_id("loss-chart") or {}
    if len(stages) != num_stages or any(s.get("data-replicas") in ("0", None) for s in stages):
        return None
    if int(loss.get("data-points", "0")) < MIN_LOSS_POINTS or int(loss.get("data-val-points", "0")) < MIN_VAL_POINTS:
        return None
    return page


def _check_status_shows_devices(swarm, capsys) -> None:
    """`swarmpipe status` from the coordinator (table and --json) and from the DHT: a device and memory column."""
    from swarmpipe.cli import main as cli
    from swarmpipe.cli.status import render

    def device_rows(table: str) -> list[str]:
        lines = table.splitlines()
        header = next(line for line in lines if " device " in line and line.rstrip().endswith("memory"))
        column = header.index(" device ") + 1
        return [line for line in lines if line[column : column + 3] == "cpu" and line.endswith(" GiB")]

    capsys.readouterr()
    assert cli.main(["status", "--coordinator", swarm.url]) == 0
    assert len(device_rows(capsys.readouterr().out)) == 3
    assert cli.main(["status", "--coordinator", swarm.url, "--json"]) == 0
    peers = [p for s in json.loads(capsys.readouterr().out)[0]["stages"] for p in s["peers"]]
    assert len(peers) == 3 and all(p["device"].startswith("cpu") and p["device_memory_total"] > 0 for p in peers)
    # The DHT mode once, as JSON (it starts a DHT node); its table is render() of the same data.
    assert cli.main(["status", "--initial-peers", swarm.maddr, "--run-id", swarm.run_id, "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)
    peers = [p for s in runs[0]["stages"] for p in s["peers"]]
    assert len(peers) == 3 and all(p["device"].startswith("cpu") and p["device_memory_total"] > 0 for p in peers)
    assert len(device_rows(render(runs))) == 3


def test_dashboard_shows_pipeline_and_loss(swarm, chromium, tmp_path, capsys):
    browser = Browser(chromium, tmp_path)
    swarm.start_coordinator()
    peers = [swarm.start_peer(stage, wait=False) for stage in (0, 0, 1)]
    for p in peers:
        swarm.wait_ready(p)
    # Far more steps than the test needs (it never waits for the end); a validation loss every 20.
    trainer, _report = swarm.start_trainer(5000, "--eval-every", "20", "--eval-batches", "2")

    def loss_points() -> int:
        points = [h for h in swarm.api("/api/history") if h.get("loss") is not None]
        return len(points) if len(points) >= MIN_LOSS_POINTS else 0

    wait_for(loss_points, 180, f"{MIN_LOSS_POINTS} loss points in /api/history", poll=1.0, procs=[trainer])

    def val_points() -> int:
        points = [h for h in swarm.api("/api/history") if h.get("val_loss") is not None]
        return len(points) if len(points) >= MIN_VAL_POINTS else 0

    wait_for(val_points, 120, f"{MIN_VAL_POINTS} val_loss points in /api/history", poll=1.0, procs=[trainer])
    url = swarm.url + "/"
    page = wait_for(
        lambda: _rendered(browser, url, 2), 120, "the dashboard to render every stage and a loss curve", poll=1.0
    )

    # Stage and replica counts match the API the page was drawn from (membership is stable here).
    api = swarm.api()
    stages = page.by_class("stage")
    assert [s["data-index"] for s in stages] == [str(s["index"]) for s in api["stages"]]
    assert [int(s["data-replicas"]) for s in stages] == [len(s["peers"]) for s in api["stages"]] == [2, 1]
    replicas = page.by_class("replica")
    assert len(replicas) == sum(len(s["peers"]) for s in api["stages"]) == 3
    assert {r["data-peer-id"] for r in replicas} == {p["peer_id"] for s in api["stages"] for p in s["peers"]}
    assert all(r["data-state"] in ("joining", "online", "draining") for r in replicas)
    pipeline = page.by_id("pipeline")
    assert pipeline is not None and pipeline["data-stages"] == "2" and pipeline["data-replicas"] == "3"
    # Exactly one stage is marked as the bottleneck, and the pipeline says which.
    bottlenecks = page.by_class("bottleneck")
    marked = [s for s in stages if "bottleneck" in s["class"].split()]
    assert len(marked) == 1 and marked[0]["data-bottleneck"] == "true", bottlenecks
    assert pipeline["data-bottleneck"] == marked[0]["data-index"]
    # Charts and events.
    assert int(page.by_id("loss-chart")["data-points"]) >= MIN_LOSS_POINTS
    assert int(page.by_id("loss-chart")["data-val-points"]) >= MIN_VAL_POINTS  # the second line: val_loss
    assert int(page.by_id("sps-chart")["data-points"]) >= 2
    joined = [e for e in page.by_class("event") if e.get("data-kind") == "peer_joined"]
    assert len(joined) >= 3, page.by_class("event")
    assert len(page.by_class("trainer")) >= 1
    assert page.by_class("val-loss"), "the trainers table has a val loss column"
    # Every peer's device: in /api/swarm, on its replica in the page, and in `swarmpipe status`.
    api_peers = [p for s in api["stages"] for p in s["peers"]]
    assert all(
        p["device"].startswith("cpu") and 0 < p["device_memory_used"] <= p["device_memory_total"] for p in api_peers
    )
    devices = page.by_class("device")
    assert len(devices) == 3 and all(d["data-device"].startswith("cpu") for d in devices), devices
    assert all(d["data-memory"].endswith(" GiB") and " / " in d["data-memory"] for d in devices), devices
    _check_status_shows_devices(swarm, capsys)

    shot = tmp_path / "dashboard.png"
    browser.screenshot(url, shot)
    assert shot.stat().st_size > 20_000, shot.stat().st_size  # a rendered page, not a blank one
    if os.environ.get("SWARMPIPE_SCREENSHOT_DIR"):
        shutil.copy(shot, Path(os.environ["SWARMPIPE_SCREENSHOT_DIR"]) / f"dashboard-{int(time.time())}.png")


def test_dashboard_assets_are_local(swarm):
    """Every script and stylesheet the page loads comes from the coordinator itself (no CDN)."""
    import urllib.request

    swarm.start_coordinator()
    with urllib.request.urlopen(swarm.url + "/", timeout=10) as response:
        html = response.read().decode()
    page = Elements(html)
    assets = [a.get("src") or a.get("href") for tag, a in page.tags if tag in ("script", "link")]
    assert assets and all(a and "//" not in a for a in assets), assets
    for asset in assets:
        with urllib.request.urlopen(f"{swarm.url}/{asset}", timeout=10) as response:
            assert response.status == 200 and response.read(), asset
