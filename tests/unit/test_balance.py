"""swarmpipe.peer.swarm.balance: which stage a joining peer serves, and when a peer should move (hysteresis)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from swarmpipe.peer.swarm.balance import (
    NEW_PEER_THROUGHPUT,
    choose_stage,
    mover,
    rebalance_target,
    stage_throughputs,
)
from swarmpipe.peer.swarm.records import StageRecord

pytestmark = pytest.mark.unit

_port = iter(range(1000, 60000))


def rec(throughput: float, state: str = "online") -> StageRecord:
    return StageRecord(
        address=f"10.0.0.1:{next(_port)}", state=state, throughput=throughput, queue=0, version=0, updated_at=0.0
    )


def stage(*throughputs: float, prefix: str = "p", draining: tuple[float, ...] = ()) -> dict[str, StageRecord]:
    out = {f"{prefix}{i}": rec(t) for i, t in enumerate(throughputs)}
    out.update({f"{prefix}d{i}": rec(t, "draining") for i, t in enumerate(draining)})
    return out


# ------------------------------------------------------------------ stage_throughputs


def test_stage_throughputs() -> None:
    stages = [stage(2.0, 3.0), stage(0.0, 0.0, prefix="q"), {}, stage(5.0, draining=(100.0,))]
    assert stage_throughputs(stages) == [5.0, 2 * NEW_PEER_THROUGHPUT, 0.0, 5.0]
    assert stage_throughputs(stages, exclude="p0") == [3.0, 2.0, 0.0, 0.0]


# ------------------------------------------------------------------ choose_stage


def test_empty_stage_first() -> None:
    stages = [stage(1.0), stage(50.0), {}, stage(0.5)]
    assert all(choose_stage(stages, random.Random(seed)) == 2 for seed in range(20))


def test_stage_with_only_draining_peers_counts_as_empty() -> None:
    stages = [stage(1.0), stage(draining=(50.0,)), stage(3.0)]
    assert all(choose_stage(stages, random.Random(seed)) == 1 for seed in range(20))


def test_least_throughput_otherwise() -> None:
    stages = [stage(10.0, 10.0), stage(3.0), stage(4.0, 4.0)]
    assert all(choose_stage(stages, random.Random(seed)) == 1 for seed in range(20))


def test_unmeasured_peer_counts_as_new_peer_throughput() -> None:
    stages = [stage(0.0, 0.0), stage(1.5)]  # 2 * 1.0 > 1.5
    assert all(choose_stage(stages, random.Random(seed)) == 1 for seed in range(20))


def test_random_tie_break_spreads_peers() -> None:
    stages = [{}, {}, {}, {}]
    counts = Counter(choose_stage(stages, random.Random(seed)) for seed in range(400))
    assert set(counts) == {0, 1, 2, 3}
    assert min(counts.values()) > 50


def test_near_ties_within_five_percent_are_ties() -> None:
    stages = [stage(10.0), stage(10.4), stage(11.0)]
    picks = {choose_stage(stages, random.Random(seed)) for seed in range(100)}
    assert picks == {0, 1}


def test_default_rng() -> None:
    assert choose_stage([stage(5.0), {}]) == 1


# ------------------------------------------------------------------ rebalance_target


def with_me(my_tp: float, *others: float, draining: tuple[float, ...] = ()) -> dict[str, StageRecord]:
    out = {"me": rec(my_tp)}
    out.update(stage(*others, prefix="o", draining=draining))
    return out


def test_moves_to_slowest_stage_when_it_clearly_helps() -> None:
    stages = [with_me(10.0, 10.0, 10.0), stage(5.0, prefix="x")]  # totals 30 / 5 -> 20 / 15
    assert rebalance_target(stages, 0, "me", 10.0) == 1


def test_moves_to_the_slowest_of_several() -> None:
    stages = [stage(8.0, prefix="a"), with_me(10.0, 10.0, 10.0), stage(2.0, prefix="c"), stage(6.0, prefix="d")]
    assert rebalance_target(stages, 1, "me", 10.0) == 2


def test_moves_into_an_empty_stage() -> None:
    stages = [with_me(10.0, 10.0), {}]
    assert rebalance_target(stages, 0, "me", 10.0) == 1


def test_no_move_when_margin_not_met() -> None:
    # 20 / 9 -> 10 / 19: the slowest stage would rise from 9 to 10, less than 1.25 x 9
    stages = [with_me(10.0, 10.0), stage(9.0, prefix="x")]
    assert rebalance_target(stages, 0, "me", 10.0) is None
    # the same move passes with a smaller margin
    assert rebalance_target(stages, 0, "me", 10.0, margin=1.1) == 1


def test_no_move_when_the_stage_left_becomes_the_bottleneck() -> None:
    stages = [with_me(10.0, 1.0), stage(5.0, prefix="x")]  # 11 / 5 -> 1 / 15
    assert rebalance_target(stages, 0, "me", 10.0) is None


def test_margin_boundary() -> None:
    # 30 / 8 -> 20 / 18 ... min 18 vs 1.25 * 8 = 10: moves; with margin 2.25 (18 >= 18) still moves; 2.3 not
    stages = [with_me(10.0, 10.0, 10.0), stage(8.0, prefix="x")]
    assert rebalance_target(stages, 0, "me", 10.0, margin=2.25) == 1
    assert rebalance_target(stages, 0, "me", 10.0, margin=2.3) is None


def test_never_leaves_a_stage_with_one_replica() -> None:
    stages = [with_me(100.0), {}]
    assert rebalance_target(stages, 0, "me", 100.0) is None
    stages = [with_me(100.0), stage(0.01, prefix="x")]
    assert rebalance_target(stages, 0, "me", 100.0) is None


def test_no_move_when_already_on_the_slowest_stage() -> None:
    stages = [with_me(1.0, 1.0), stage(50.0, prefix="x")]
    assert rebalance_target(stages, 0, "me", 1.0) is None


def test_no_flapping_between_balanced_stages() -> None:
    """Two peers on each side of equal stages: neither side wants to move."""
    stages = [with_me(10.0, 10.0), stage(10.0, 10.0, prefix="x")]
    assert rebalance_target(stages, 0, "me", 10.0) is None


def test_after_a_move_the_peer_does_not_move_back() -> None:
    stages = [with_me(10.0, 10.0, 10.0), stage(5.0, prefix="x")]
    assert rebalance_target(stages, 0, "me", 10.0) == 1
    moved = [stage(10.0, 10.0, prefix="o"), {**stage(5.0, prefix="x"), "me": rec(10.0)}]  # 20 / 15
    assert rebalance_target(moved, 1, "me", 10.0) is None


def test_never_leaves_a_stage_whose_other_replicas_are_draining() -> None:
    stages = [with_me(10.0, draining=(10.0,)), {}]
    assert rebalance_target(stages, 0, "me", 10.0) is None


def test_one_replica_of_a_stage_may_leave_per_turn() -> None:
    """Three replicas of a light stage see the same heavy stage at once (a fault run saw all three move within
    half a second and empty their stage): in any turn exactly one of them is the mover, every one of them agrees
    which, and over turns each gets its chance."""
    ids = ["a", "b", "c"]
    movers = set()
    for turn in range(40):
        wanting = []
        for me in ids:
            stages = [{pid: rec(10.0) for pid in ids}, stage(5.0, prefix="x")]
            if rebalance_target(stages, 0, me, 10.0, turn=turn) == 1:
                wanting.append(me)
        assert wanting == [mover(ids, turn)]
        movers.add(wanting[0])
    assert movers == set(ids)
    assert mover(ids, 7) == mover(list(reversed(ids)), 7)  # the order a peer lists them in does not matter
