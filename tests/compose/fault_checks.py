"""What every Compose fault scenario shares: bringing the stack up, sizing and starting the trainer,
waiting for peers to come back, and the end-of-run invariants (see test_faults.py)."""

from __future__ import annotations

import time

from compose_harness import ANNOUNCE_PERIOD_S, HarnessError, wait_until

LOSS_FALL = 0.85  # loss_last < LOSS_FALL * loss_first
FRESH_S = 3 * ANNOUNCE_PERIOD_S + 5
SERVE_TIMEOUT_S = 240  # a whole stack starting on two busy cores


def progress_during(sc, seconds: float, at_least: int, what: str) -> int:
    """Sleep ``seconds``; check the trainer advanced at least ``at_least`` micro-batches meanwhile."""
    before = sc.stack.trainer_step()
    time.sleep(seconds)
    gained = sc.stack.trainer_step() - before
    sc.check(f"training progressed {what}", gained >= at_least, f"+{gained} micro-batches in {seconds:.0f} s")
    return gained


def version_of(sc, peer_id: str) -> int:
    p = sc.stack.listed().get(peer_id)
    return int(p["version"]) if p else -1


def wait_listed(sc, peer_id: str, timeout: float) -> float | None:
    """Seconds until the coordinator lists ``peer_id`` online with a record announced from now on; None on timeout."""
    t0, since = time.monotonic(), time.time()

    def renewed() -> bool:
        p = sc.stack.listed().get(peer_id)
        return bool(p) and p["updated_at"] >= since

    try:
        wait_until(renewed, timeout, f"{peer_id[-6:]} listed online", poll=1.0)
    except HarnessError:
        return None
    return time.monotonic() - t0


def wait_takes_work(sc, peer_id: str, timeout: float) -> float | None:
    """Seconds until ``peer_id``'s announced version grows (it is on the data path again)."""
    t0 = time.monotonic()
    start = version_of(sc, peer_id)
    try:
        wait_until(lambda: version_of(sc, peer_id) > max(start, 0), timeout, f"{peer_id[-6:]} to take work", poll=1.0)
    except HarnessError:
        return None
    return time.monotonic() - t0


def finish_training(sc, steps: int, survivors: list[str], gone: tuple[str, ...] = ()) -> dict:
    """Wait for the trainer, then check the invariants every scenario shares."""
    st = sc.stack
    exit_code = st.wait_trainer(timeout=max(300, 4 * steps / max(1.0, sc.facts.get("rate_mb_s", 10))))
    sc.check("trainer exited 0", exit_code == 0, f"exit {exit_code}")
    report = st.report()
    sc.learn_rate(report)
    completed, dropped = report.get("microbatches_completed", 0), report.get("microbatches_dropped_stale", 0)
    sc.facts.update(
        steps=completed,
        lost=report.get("microbatches_lost"),
        loss_first=report.get("loss_first"),
        loss_last=report.get("loss_last"),
        retried=report.get("microbatches_retried"),
        dropped_stale=dropped,
    )
    sc.check(
        "training progressed: every micro-batch ended",
        completed + dropped == steps and completed >= 0.9 * steps,
        f"{completed} completed + {dropped} dropped stale of {steps}, {report.get('microbatches_retried')} retried",
    )
    sc.check("microbatches_lost == 0", report.get("microbatches_lost") == 0, f"lost {report.get('microbatches_lost')}")
    first, last = report.get("loss_first"), report.get("loss_last")
    sc.check(
        "loss fell",
        isinstance(first, float) and isinstance(last, float) and last < LOSS_FALL * first,
        f"{first} -> {last}",
    )
    survivor_ids = {st.peer_id(cid): st.short(cid) for cid in survivors}
    try:
        wait_until(lambda: set(survivor_ids) <= set(st.listed()), 45, "every surviving peer listed", poll=2.0)
        ok = True
    except HarnessError:
        ok = False
    listed = st.listed()
    missing = [name for pid, name in survivor_ids.items() if pid not in listed]
    sc.check(
        "every surviving peer listed online",
        ok,
        f"{len(survivor_ids) - len(missing)}/{len(survivor_ids)} listed"
        + (f", missing {', '.join(missing)}" if missing else ""),
    )
    if gone:
        try:
            wait_until(
                lambda: (
                    not set(gone)
                    & set(p for s in (st.api() or {}).get("stages", []) for p in (x["peer_id"] for x in s["peers"]))
                ),
                FRESH_S + 15,
                "dead peers to expire",
            )
            ok = True
        except HarnessError:
            ok = False
        sc.check("killed peers no longer listed", ok)
    stall = st.monitor.longest_stall(since=st.trainer_started_at or 0)
    sc.facts["longest_stall_s"] = round(stall, 1)
    sc.note(f"longest stall of the trainer's announced step: {stall:.0f} s")
    return report


def healed_while_training(sc) -> None:
    """The fault and its healing must fall inside the training run, or the scenario proves nothing."""
    training = sc.stack.running(sc.stack.ids("trainer")[0])
    sc.check(
        "fault healed while the trainer was still training",
        training,
        "" if training else "the trainer run was too short for this machine's speed now",
    )


def start_training(sc, seconds: float) -> int:
    """Start the trainer sized for ``seconds`` of training and wait until it is under way."""
    steps = sc.steps_for(seconds)
    sc.note(f"trainer: {steps} micro-batches (~{seconds:.0f} s at the estimated {sc.rate} micro-batches/s)")
    sc.stack.start_trainer(steps)
    sc.stack.wait_step(30, 180)
    time.sleep(5)
    sc.measure_rate()
    return steps


def bring_up(sc) -> None:
    t0 = time.monotonic()
    sc.stack.up(timeout=SERVE_TIMEOUT_S)
    sc.facts["up_s"] = round(time.monotonic() - t0)
    sc.note(f"stack up, 4 peers serving after {sc.facts['up_s']} s")
