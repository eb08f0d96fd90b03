"""Three peers on a light stage, one on a heavy stage: a peer moves to the heavy stage and throughput rises."""

from __future__ import annotations

import statistics
import time

import pytest
from swarm_support import assert_trained, events_of, stop_trainer

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]
# The trainer trains until OBSERVE_S after the first move, then is stopped (SIGTERM): every peer checks again
# at least once (6 to 18 s apart), so a second move of the same peer or a stampede would show, and 15 s of
# capacity after the move settled (done + 5) to take the median of. A peer moves once measured, within ~20 s of
# training.
UNTIL_STOPPED = 1_000_000
OBSERVE_S = 20
MOVE_WITHIN_S = 150


def _rate_between(progress: list[dict], t_from: float, t_to: float) -> float:
    """Micro-batches per second the trainer completed between two wall-clock times."""
    inside = [e for e in progress if t_from <= e["time"] <= t_to]
    if len(inside) < 2:
        return 0.0
    return (inside[-1]["step"] - inside[0]["step"]) / (inside[-1]["time"] - inside[0]["time"])


def test_peer_moves_to_the_bottleneck_stage(swarm):
    # Stage 1 holds three blocks plus the head: far more work than stage 0's single block.
    spec = swarm.write_spec(num_stages=2, n_layers=4, top="layer_split = [1, 3]")
    swarm.start_coordinator(spec)
    peers = [swarm.start_peer(stage, "--rebalance-period", "12", wait=False) for stage in (0, 0, 0, 1)]
    for p in peers:
        swarm.wait_ready(p)
    trainer, report_path = swarm.start_trainer(UNTIL_STOPPED, "--call-timeout", "10")
    capacity = []  # (time, the pipeline's capacity: its slowest stage's total throughput, from the peers' records)
    give_up = time.monotonic() + MOVE_WITHIN_S
    while True:
        moves = events_of(swarm, "rebalanced")
        if moves and time.time() > min(m["time"] for m in moves) + OBSERVE_S:
            break
        assert trainer.alive(), trainer.log_text()[-3000:]
        assert time.monotonic() < give_up, f"no peer rebalanced; checks: {events_of(swarm, 'rebalance_failed')}"
        stages = swarm.api()["stages"]
        if stages:
            capacity.append((time.time(), min(s["throughput"] for s in stages)))
        time.sleep(1.0)
    report = stop_trainer(swarm, trainer, report_path)
    assert_trained(report, min_steps=150, stopped=True)

    moves = events_of(swarm, "rebalanced")
    assert moves[0]["from_stage"] == 0 and moves[0]["to_stage"] == 1, moves
    movers = [m["peer_id"] for m in moves]
    assert len(movers) == len(set(movers)) and len(moves) <= 3, f"hysteresis: no peer moves twice, no stampede: {moves}"
    starts = sorted(e["time"] for e in events_of(swarm, "rebalancing") if e["from_stage"] == 0)
    assert all(b - a > 1.0 for a, b in zip(starts, starts[1:])), f"stage 0's replicas left one per turn: {moves}"
    started = events_of(swarm, "training")[0]["time"]
    first_move = min(e["time"] for e in events_of(swarm, "rebalancing"))
    done = min(m["time"] for m in moves)  # the first move done: later ones only add to the heavy stage
    finished = events_of(swarm, "finished")[0]["time"]
    progress = events_of(swarm, "progress")
    rate_before = _rate_between(progress, started + 2, first_move)
    rate_after = _rate_between(progress, done + 3, finished)
    cap_before = statistics.median([c for t, c in capacity if started + 2 <= t <= first_move] or [0.0])
    cap_after = statistics.median([c for t, c in capacity if done + 5 <= t <= finished] or [0.0])
    # The bottleneck's capacity is what rebalancing raises, but a peer measures it as the wall time of its compute
    # calls, and on 2 cores shared by five processes (and the other worker's test) a second replica of the heavy
    # stage halves every replica's speed: a gain here is a timing, not a property (one clean move measured
    # 19.9 -> 18.5 mb/s). Speed-ups belong in bench/; the check is that training did not stall across the move.
    detail = f"capacity {cap_before:.1f} -> {cap_after:.1f} mb/s, trainer {rate_before:.1f} -> {rate_after:.1f} mb/s"
    print(detail)
    assert cap_after > 0 and rate_after > 0.5 * rate_before, detail
    api = swarm.api()
    live = [[p for p in s["peers"] if p["state"] == "online"] for s in api["stages"]]
    assert all(live), f"every stage keeps a live replica: {api['stages']}"
    assert len(live[1]) >= 2, "the heavy stage gained a replica"
