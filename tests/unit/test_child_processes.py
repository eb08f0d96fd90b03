"""Processes forked by a role die with it (peer/swarm/child_processes.py), with plain processes, no sockets.

The scenario every role has: the parent swallows SIGTERM the way an asyncio signal handler does, forks a
``multiprocessing`` child (hivemind's DHT) that runs a grandchild (p2pd; here ``sleep``). Each test runs that
family in a script of its own, so nothing is installed into the pytest process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from swarmpipe.peer.swarm.child_processes import alive, descendants, end_processes

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
linux_only = pytest.mark.skipif(not os.path.isdir("/proc"), reason="descendants are found through /proc")

FAMILY = textwrap.dedent(
    """
    import multiprocessing as mp, os, signal, subprocess, sys, time
    from swarmpipe.peer.swarm.child_processes import guard_forks

    def child():
        grandchild = subprocess.Popen(["sleep", "120"])
        print(os.getpid(), grandchild.pid, flush=True)
        time.sleep(120)

    if __name__ == "__main__":
        signal.signal(signal.SIGTERM, lambda *_: None)  # what an asyncio handler amounts to in a fork
        if sys.argv[1] == "guarded":
            guard_forks()
        mp.get_context("fork").Process(target=child, daemon=True).start()
        time.sleep(120)
    """
)


def _start_family(tmp_path, mode: str) -> tuple[subprocess.Popen, int, int]:
    script = tmp_path / "family.py"
    script.write_text(FAMILY)
    parent = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True)
    child, grandchild = map(int, parent.stdout.readline().split())
    return parent, child, grandchild


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def _cleanup(parent: subprocess.Popen, pids: list[int]) -> None:
    for p in [parent.pid, *pids]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    parent.wait(timeout=10)


@linux_only
def test_guarded_family_dies_with_a_sigkilled_parent(tmp_path):
    parent, child, grandchild = _start_family(tmp_path, "guarded")
    try:
        assert set(descendants(parent.pid)) >= {child, grandchild}
        parent.kill()  # the parent alone, as preemption does
        parent.wait(timeout=10)
        assert _gone_within([child, grandchild], 5.0)
    finally:
        _cleanup(parent, [child, grandchild])


@linux_only
def test_guarded_child_obeys_sigterm_and_takes_its_grandchild(tmp_path):
    parent, child, grandchild = _start_family(tmp_path, "guarded")
    try:
        os.kill(child, signal.SIGTERM)
        assert _gone_within([child, grandchild], 5.0)
        assert parent.poll() is None  # the signal was the child's, not the parent's
    finally:
        _cleanup(parent, [child, grandchild])


@linux_only
def test_unguarded_child_outlives_its_parent(tmp_path):
    """The bug the guard fixes: without it the forked child swallows SIGTERM and outlives a SIGKILLed parent."""
    parent, child, grandchild = _start_family(tmp_path, "unguarded")
    try:
        os.kill(child, signal.SIGTERM)
        parent.kill()
        parent.wait(timeout=10)
        assert not _gone_within([child], 1.5)
    finally:
        _cleanup(parent, [child, grandchild])


@linux_only
def test_descendants_and_end_processes():
    shell = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(descendants(shell.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        family = descendants(shell.pid)
        assert len(family) == 2 and all(alive(p) for p in family)
        assert end_processes([shell.pid, *family], grace=0.5) == []
        shell.wait(timeout=5)
        assert not any(alive(p) for p in [shell.pid, *family])
    finally:
        shell.kill()
        shell.wait(timeout=5)


def test_end_processes_escalates_to_sigkill():
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        stubborn.stdout.readline()  # SIGTERM is ignored from here on
        started = time.monotonic()
        end_processes([stubborn.pid], grace=0.3)
        assert stubborn.wait(timeout=5) == -signal.SIGKILL
        assert time.monotonic() - started < 3
    finally:
        stubborn.kill()
        stubborn.wait(timeout=5)


def test_alive_of_a_pid_that_never_was():
    assert not alive(2**22 + 12345)
