"""Nothing left behind: every role's processes die with it, and a signalled trainer stops within seconds.

Real processes on 127.0.0.1. Each role forks hivemind's DHT process, which runs p2pd; SIGKILL to the role's
pid alone (not its process group, as preemption or the OOM killer does it) must take both along. SIGTERM
to a trainer whose micro-batches are stuck (a frozen replica, or a stage with no reachable replica) must end
it within seconds, with what was in flight reported as unfinished, not lost.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from swarm_support import events_of, kill_tree, wait_step

from swarmpipe.cli.launcher import Launched, wait_for
from swarmpipe.peer.swarm.child_processes import alive, descendants

pytestmark = [
    pytest.mark.fault,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not os.path.isdir("/proc"), reason="descendants are found through /proc"),
]

STEPS = 1_000_000
GONE_WITHIN_S = 10.0  # the "a few seconds", with room for a loaded 2-core machine
STOPPED_WITHIN_S = 10.0
# A peer whose trainer was killed (or stopped) holds forwards whose backward never comes: its drain on SIGTERM
# runs to --drain-timeout (20 s by default) whatever it is, so 5 s here; the drain, the hand-off and the exit
# are the same.
DRAIN_TIMEOUT = ("--drain-timeout", "5")


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _family(launched: Launched) -> dict[int, str]:
    """The role's descendants by pid, once its DHT process and p2pd are both there."""

    def complete() -> dict[int, str] | None:
        kids = {p: _comm(p) for p in descendants(launched.proc.pid)}
        return kids if "p2pd" in kids.values() else None

    found = wait_for(complete, 30, f"{launched.name}'s DHT process and p2pd", procs=[launched])
    assert len(found) >= 2, found  # the forked DHT process and its p2pd
    return found


def _survivors(pids: dict[int, str], within: float) -> dict[int, str]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        left = {p: name for p, name in pids.items() if alive(p)}
        if not left:
            return {}
        time.sleep(0.1)
    return {p: name for p, name in pids.items() if alive(p)}


def _swarm_training(swarm, *trainer_args: str) -> tuple[Launched, Launched, Launched, object]:
    swarm.start_coordinator()
    first = swarm.start_peer(0, *DRAIN_TIMEOUT, wait=False)
    second = swarm.start_peer(1, *DRAIN_TIMEOUT, wait=False)
    for p in (first, second):
        swarm.wait_ready(p)
    trainer, report = swarm.start_trainer(STEPS, "--max-time", "120", *trainer_args)
    wait_step(swarm, 5, trainer)
    return first, second, trainer, report


def test_sigkilled_peer_and_trainer_leave_no_process(swarm):
    first, second, trainer, _ = _swarm_training(swarm)
    peer_family, trainer_family = _family(second), _family(trainer)
    started = time.monotonic()
    os.kill(second.proc.pid, signal.SIGKILL)  # the role alone: its group is left for the guard to handle
    os.kill(trainer.proc.pid, signal.SIGKILL)
    second.proc.wait(timeout=10)
    trainer.proc.wait(timeout=10)
    left = _survivors({**peer_family, **trainer_family}, GONE_WITHIN_S)
    assert not left, f"still running {time.monotonic() - started:.1f}s after SIGKILL: {left}"
    print(f"{len(peer_family) + len(trainer_family)} processes gone {time.monotonic() - started:.1f}s after SIGKILL")

    # The roles still standing exit within seconds of a SIGTERM, and take their processes along too.
    # (the peer first: it drains, then hands its state to the coordinator)
    for role in (first, swarm.coordinator):
        family = _family(role)
        started = time.monotonic()
        role.signal(signal.SIGTERM)
        wait_for(lambda r=role: not r.alive(), 60, f"{role.name} to exit after SIGTERM", poll=0.2)
        print(f"{role.name} exited {time.monotonic() - started:.1f}s after SIGTERM")
        assert role.proc.returncode == 0, role.log_text()[-2000:]
        assert not _survivors(family, GONE_WITHIN_S), f"{role.name} left processes behind"


def _stop_trainer(trainer: Launched) -> float:
    family = _family(trainer)
    started = time.monotonic()
    trainer.signal(signal.SIGTERM)
    wait_for(lambda: not trainer.alive(), 60, "the trainer to exit after SIGTERM", poll=0.1)
    took = time.monotonic() - started
    assert not _survivors(family, GONE_WITHIN_S), "the trainer left processes behind"
    return took


def _assert_unfinished_not_lost(swarm, report: dict) -> None:
    counts = {k: v for k, v in report.items() if k.startswith("microbatches_")}
    assert counts["microbatches_lost"] == 0, counts
    assert counts["microbatches_unfinished"] >= 1, counts  # what was in flight when the signal came
    ended = counts["microbatches_completed"] + counts["microbatches_dropped_stale"]
    assert ended + counts["microbatches_unfinished"] == counts["microbatches_started"], counts
    assert events_of(swarm, "unfinished"), "the trainer did not say it left micro-batches unfinished"


def test_sigterm_stops_a_trainer_whose_calls_hang(swarm):
    """A frozen replica holds the calls in flight (deadline 120 s): SIGTERM must not wait for them."""
    _, second, trainer, report_path = _swarm_training(swarm, "--call-timeout", "120", "--in-flight", "4")
    second.signal(signal.SIGSTOP)
    time.sleep(3)  # every micro-batch in flight is now stuck at stage 1
    took = _stop_trainer(trainer)
    print(f"trainer exited {took:.1f}s after SIGTERM")
    second.signal(signal.SIGCONT)
    assert took < STOPPED_WITHIN_S, f"the trainer took {took:.1f}s to exit after SIGTERM"
    assert trainer.proc.returncode == 0, trainer.log_text()[-3000:]
    _assert_unfinished_not_lost(swarm, swarm.wait_report(trainer, report_path, timeout=5))


def test_trainer_names_the_unreachable_stage_and_stops_on_sigterm(swarm):
    """The only stage-1 replica vanishes: the trainer says which stage it waits for, and SIGTERM ends the wait."""
    _, second, trainer, report_path = _swarm_training(swarm, "--call-timeout", "10", "--in-flight", "4")
    kill_tree(second)
    notice = wait_for(
        lambda: [e for e in events_of(swarm, "no_reachable_replica") if e.get("stage") == 1],
        60,
        "the trainer to name stage 1 as unreachable",
        procs=[trainer],
    )
    assert not [e for e in events_of(swarm, "no_reachable_replica") if e.get("stage") == 0], notice
    took = _stop_trainer(trainer)
    print(f"trainer exited {took:.1f}s after SIGTERM")
    assert took < STOPPED_WITHIN_S, f"the trainer took {took:.1f}s to exit after SIGTERM"
    assert trainer.proc.returncode == 0, trainer.log_text()[-3000:]
    _assert_unfinished_not_lost(swarm, swarm.wait_report(trainer, report_path, timeout=5))


def test_sigterm_ends_a_peer_still_joining(swarm):
    """A peer waiting for a spec that never comes (120 s by default) leaves at once on SIGTERM."""
    swarm.start_coordinator()
    joiner = swarm.start_peer(0, "--run-id", "no-such-run", wait=False)
    family = _family(joiner)
    time.sleep(3)  # its DHT is up (the family is complete): it now polls for the spec
    assert joiner.alive(), joiner.log_text()[-2000:]
    started = time.monotonic()
    joiner.signal(signal.SIGTERM)
    wait_for(lambda: not joiner.alive(), 60, "the joining peer to exit after SIGTERM", poll=0.1)
    took = time.monotonic() - started
    print(f"joining peer exited {took:.1f}s after SIGTERM")
    assert took < STOPPED_WITHIN_S and joiner.proc.returncode == 0, joiner.log_text()[-2000:]
    assert not _survivors(family, GONE_WITHIN_S)
