"""Shared fixtures: a real swarm of subprocesses on 127.0.0.1 that is always torn down."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
from browser_support import chromium_path
from swarm_support import Swarm

# Roles fork from one warm server per test process instead of importing torch and hivemind again each time
# (swarmpipe/cli/warm_start.py): about 7 CPU-seconds saved per role started. SWARMPIPE_WARM_START=0 runs cold.
os.environ.setdefault("SWARMPIPE_WARM_START", "1")


@pytest.fixture
def swarm(tmp_path: Path):
    s = Swarm(tmp_path)
    try:
        yield s
    finally:
        s.stop()
        leftovers = [p for p in s.group.procs if p.alive()]
        assert not leftovers, f"processes left behind: {[p.name for p in leftovers]}"


@pytest.fixture(autouse=True)
def _collect_grpc_leftovers(request):
    """After a test that ran grpc.aio servers or channels in this process, free them now: a hivemind DHT the
    next test forks would otherwise inherit them and spin forever freeing them without grpc's threads."""
    yield
    if request.node.get_closest_marker("unit") is None:
        gc.collect()


@pytest.fixture(scope="session")
def chromium() -> str:
    """Headless Chromium for the page tests (tests/browser_support.py)."""
    return chromium_path()
