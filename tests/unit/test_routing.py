"""swarmpipe.peer.trainer.routing: replica choice by expected finish time, bans with backoff, membership."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from swarmpipe.peer.swarm.records import StageRecord
from swarmpipe.peer.trainer.routing import (
    BAN_BASE_S,
    BAN_MAX_S,
    EMA_DECAY,
    PROBE_AFTER_S,
    STALE_AFTER_S,
    STALE_HALF_LIFE_S,
    Router,
)

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class NoJitter(random.Random):
    def random(self) -> float:  # the router multiplies by (1 + 0.1 * random())
        return 0.0


def rec(port: int, throughput: float = 0.0, queue: int = 0, state: str = "online", at: float = 0.0) -> StageRecord:
    return StageRecord(
        address=f"127.0.0.1:{port}", state=state, throughput=throughput, queue=queue, version=0, updated_at=at
    )


def make_router(clock: FakeClock | None = None, num_stages: int = 2) -> Router:
    return Router(num_stages, rng=NoJitter(), clock=clock or FakeClock())


def test_lowest_expected_finish_from_reported_throughput() -> None:
    r = make_router()
    r.update_stage(0, {"slow": rec(1, throughput=10), "fast": rec(2, throughput=100)})
    assert r.choose(0).peer_id == "fast"
    assert r.expected_finish(r.peers["fast"]) == pytest.approx(0.01)
    assert r.expected_finish(r.peers["slow"]) == pytest.approx(0.1)


def test_reported_queue_counts() -> None:
    r = make_router()
    r.update_stage(0, {"slow": rec(1, throughput=10), "fast": rec(2, throughput=100, queue=20)})
    assert r.expected_finish(r.peers["fast"]) == pytest.approx(21 * 0.01)
    assert r.choose(0).peer_id == "slow"


def test_own_in_flight_calls_count() -> None:
    r = make_router()
    r.update_stage(0, {"a": rec(1, throughput=100), "b": rec(2, throughput=60)})
    a = r.choose(0)
    assert a.peer_id == "a"
    r.started(a)
    assert a.in_flight == 1 and a.calls == 1
    assert r.expected_finish(a) == pytest.approx(0.02)
    assert r.choose(0).peer_id == "b"  # 1/60 < 2/100


def test_own_latency_overrides_reported_throughput() -> None:
    r = make_router()
    r.update_stage(0, {"liar": rec(1, throughput=1000), "honest": rec(2, throughput=10)})
    assert r.choose(0).peer_id == "liar"
    liar = r.peers["liar"]
    r.started(liar)
    r.succeeded(liar, 1.0)  # we measured one second per call
    assert liar.latency_ema == 1.0 and liar.in_flight == 0
    assert r.expected_finish(liar) == pytest.approx(1.0)
    assert r.choose(0).peer_id == "honest"
    # a later refresh of the DHT record does not reset our own measurement
    r.update_stage(0, {"liar": rec(1, throughput=5000), "honest": rec(2, throughput=10)})
    assert r.peers["liar"].latency_ema == 1.0
    assert r.choose(0).peer_id == "honest"


def test_latency_ema() -> None:
    r = make_router()
    r.update_stage(0, {"a": rec(1)})
    a = r.peers["a"]
    for seconds in (1.0, 2.0, 4.0):
        r.started(a)
        r.succeeded(a, seconds)
    expected = EMA_DECAY * (EMA_DECAY * 1.0 + (1 - EMA_DECAY) * 2.0) + (1 - EMA_DECAY) * 4.0
    assert a.latency_ema == pytest.approx(expected)
    assert a.calls == 3 and a.in_flight == 0


def test_unmeasured_new_peer_gets_tried() -> None:
    r = make_router()
    r.update_stage(0, {"old": rec(1)})
    old = r.peers["old"]
    r.started(old)
    r.succeeded(old, 0.2)
    r.update_stage(0, {"old": rec(1), "new": rec(2)})  # no throughput reported yet
    new = r.peers["new"]
    assert r.expected_finish(new) == pytest.approx(0.1)  # optimistic: half the best measured
    assert r.choose(0) is new
    # once measured as slow, it loses
    r.started(new)
    r.succeeded(new, 5.0)
    assert r.choose(0) is old


def measure(r: Router, peer_id: str, seconds: float) -> None:
    view = r.peers[peer_id]
    r.started(view)
    r.succeeded(view, seconds)


def test_one_slow_call_does_not_starve_a_peer_forever() -> None:
    clock = FakeClock()
    r = make_router(clock)
    r.update_stage(0, {"warm": rec(1), "cold": rec(2)})
    measure(r, "cold", 2.0)  # its first call paid a warm-up
    measure(r, "warm", 0.02)
    chosen = []
    for _ in range(int(PROBE_AFTER_S) + 2):
        clock.t += 1.0
        view = r.choose(0)
        chosen.append(view.peer_id)
        measure(r, view.peer_id, 0.02)  # both are really fast now
    assert chosen[: int(PROBE_AFTER_S) - 1] == ["warm"] * (int(PROBE_AFTER_S) - 1)
    assert "cold" in chosen  # probed once its measurement was overdue
    assert r.peers["cold"].latency_ema == pytest.approx(0.02)  # the stale 2 s was replaced, not blended


def test_no_second_probe_while_one_is_in_flight() -> None:
    clock = FakeClock()
    r = make_router(clock)
    r.update_stage(0, {"a": rec(1), "b": rec(2)})
    measure(r, "a", 2.0)
    measure(r, "b", 0.02)
    clock.t += PROBE_AFTER_S + 1
    measure(r, "b", 0.02)
    r.started(r.peers["a"])  # a probe is already out
    assert r.choose(0).peer_id == "b"


def test_fading_follows_the_half_life() -> None:
    clock = FakeClock()
    r = make_router(clock)
    r.update_stage(0, {"a": rec(1), "b": rec(2)})
    measure(r, "a", 1.0)
    measure(r, "b", 0.1)
    clock.t += STALE_AFTER_S
    measure(r, "b", 0.1)  # b stays fresh
    assert r._per_call_estimate(r.peers["a"]) == pytest.approx(1.0)  # not stale yet
    clock.t += STALE_HALF_LIFE_S / 2
    measure(r, "b", 0.1)
    clock.t += STALE_HALF_LIFE_S / 2
    measure(r, "b", 0.1)
    assert r._per_call_estimate(r.peers["a"]) == pytest.approx(0.1 + 0.5 * 0.9)


def test_stale_estimate_kept_when_nothing_fresher_is_known() -> None:
    clock = FakeClock()
    r = make_router(clock)
    r.update_stage(0, {"a": rec(1), "b": rec(2)})
    measure(r, "a", 0.05)
    measure(r, "b", 0.5)
    clock.t += 100.0
    assert r._per_call_estimate(r.peers["a"]) == pytest.approx(0.05)
    assert r._per_call_estimate(r.peers["b"]) == pytest.approx(0.5)  # no fresh replica: no evidence to fade toward
    measure(r, "b", 0.5)
    assert r._per_call_estimate(r.peers["a"]) == pytest.approx(0.05)  # faster than the fresh one: never faded upward


def test_unmeasured_estimate_without_any_measurement() -> None:
    r = make_router()
    r.update_stage(0, {"a": rec(1), "b": rec(2, throughput=50)})
    assert r.expected_finish(r.peers["a"]) == pytest.approx(0.01)
    assert r.choose(0).peer_id == "a"


def test_estimates_are_per_stage() -> None:
    r = make_router()
    r.update_stage(0, {"s0": rec(1)})
    r.update_stage(1, {"s1": rec(2)})
    r.started(r.peers["s0"])
    r.succeeded(r.peers["s0"], 10.0)
    assert r.expected_finish(r.peers["s1"]) == pytest.approx(0.01)


def test_failing_peer_banned_with_exponential_backoff() -> None:
    clock = FakeClock()
    r = make_router(clock)
    r.update_stage(0, {"bad": rec(1, throughput=1000), "ok": rec(2, throughput=1)})
    bad = r.peers["bad"]
    expected_lengths = [BAN_BASE_S * 2**i for i in range(8)]
    for i, expected in enumerate(expected_lengths):
        assert r.choose(0) is bad
        r.started(bad)
        length = r.failed(bad)
        assert length == min(BAN_MAX_S, expected)
        assert bad.failures == i + 1 and bad.in_flight == 0
        assert bad.banned_until == pytest.approx(clock.t + length)
        assert r.choose(0).peer_id == "ok"
        assert [v.peer_id for v in r.available(0)] == ["ok"]
        clock.t += length - 0.01
        assert r.choose(0).peer_id == "ok"  # still banned just before the end
        clock.t += 0.01
        assert bad in r.available(0)  # unbanned exactly at the end
    assert r.failed(bad) == BAN_MAX_S  # capped


def test_success_resets_backoff() -> None:
    clock = FakeClock()
    r = make_router(clock)
    r.update_stage(0, {"p": rec(1)})
    p = r.peers["p"]
    r.started(p)
    assert r.failed(p) == BAN_BASE_S
    clock.t += BAN_BASE_S
    r.started(p)
    assert r.failed(p) == 2 * BAN_BASE_S
    clock.t += 2 * BAN_BASE_S
    r.started(p)
    r.succeeded(p, 0.1)
    assert p.failures == 0
    r.started(p)
    assert r.failed(p) == BAN_BASE_S


def test_latency_estimate_forgotten_after_repeated_failures() -> None:
    r = make_router()
    r.update_stage(0, {"p": rec(1)})
    p = r.peers["p"]
    r.started(p)
    r.succeeded(p, 0.3)
    r.started(p)
    r.failed(p)
    assert p.latency_ema == 0.3  # one failure: still evidence
    r.started(p)
    r.failed(p)
    assert p.latency_ema is None


def test_failure_without_ban() -> None:
    clock = FakeClock()
    r = make_router(clock)
    r.update_stage(0, {"p": rec(1)})
    p = r.peers["p"]
    r.started(p)
    assert r.failed(p, ban=False) == 0.0
    assert p.in_flight == 0 and p.failures == 0 and p.banned_until <= clock.t
    assert r.choose(0) is p


def test_in_flight_never_negative() -> None:
    r = make_router()
    r.update_stage(0, {"p": rec(1)})
    p = r.peers["p"]
    r.succeeded(p, 0.1)
    r.failed(p, ban=False)
    assert p.in_flight == 0


def test_a_call_that_says_nothing_of_the_peer_only_settles_its_count() -> None:
    r = make_router()
    r.update_stage(0, {"p": rec(1)})
    p = r.peers["p"]
    r.started(p)
    r.succeeded(p, 0.5)
    r.started(p)
    p.failures = 1
    r.succeeded(p, None)  # a validation call: it answered, its latency is no evidence for routing
    assert p.in_flight == 0 and p.failures == 0 and p.latency_ema == 0.5
    r.started(p)
    r.released(p)  # a chain through it broke further down: not its fault, nothing learned
    assert p.in_flight == 0 and p.calls == 3 and p.latency_ema == 0.5 and p.banned_until == 0.0


def test_replicas_a_chain_reaches_count_in_flight_while_it_runs() -> None:
    r = make_router()
    r.update_stage(1, {"a": rec(1, throughput=100), "b": rec(2, throughput=60)})
    a, b = r.peers["a"], r.peers["b"]
    with pytest.raises(RuntimeError):
        with r.holding([a]):
            assert a.in_flight == 1 and a.calls == 0  # ours in flight, though we did not call it
            assert r.choose(1) is b
            raise RuntimeError("the chain failed")
    assert a.in_flight == 0 and r.choose(1) is a


@pytest.mark.parametrize("state", ["draining", "joining"])
def test_non_online_peers_skipped(state: str) -> None:
    r = make_router()
    r.update_stage(0, {"fast": rec(1, throughput=1000, state=state), "slow": rec(2, throughput=1)})
    assert r.choose(0).peer_id == "slow"
    r.update_stage(0, {"fast": rec(1, throughput=1000, state=state)})
    assert r.choose(0) is None
    # it comes back when it announces online again
    r.update_stage(0, {"fast": rec(1, throughput=1000)})
    assert r.choose(0).peer_id == "fast"


def test_vanished_peers_forgotten_unless_in_flight() -> None:
    r = make_router()
    r.update_stage(0, {"a": rec(1), "b": rec(2), "c": rec(3)})
    r.update_stage(1, {"x": rec(9)})
    b = r.peers["b"]
    r.started(b)
    r.update_stage(0, {"a": rec(1)})
    assert set(r.peers) == {"a", "b", "x"}  # b kept: a call is in flight; stage 1 untouched
    r.succeeded(b, 0.1)
    r.update_stage(0, {"a": rec(1)})
    assert set(r.peers) == {"a", "x"}
    assert [v.peer_id for v in r.replicas(0)] == ["a"]


def test_peer_that_changes_address_or_stage_starts_fresh() -> None:
    r = make_router()
    r.update_stage(0, {"p": rec(1)})
    p = r.peers["p"]
    r.started(p)
    r.succeeded(p, 0.5)
    r.update_stage(0, {"p": rec(2)})  # restarted on another port
    assert r.peers["p"] is not p and r.peers["p"].latency_ema is None
    assert r.peers["p"].address == "127.0.0.1:2"
    r.update_stage(1, {"p": rec(2)})  # moved to stage 1
    assert r.peers["p"].stage == 1
    assert r.replicas(0) == [] and r.choose(1).peer_id == "p"


def test_update_refreshes_record_fields_and_last_seen() -> None:
    clock = FakeClock(5.0)
    r = make_router(clock)
    r.update_stage(0, {"p": rec(1, throughput=3, queue=2)})
    clock.t = 9.0
    r.update_stage(0, {"p": rec(1, throughput=4, queue=7, state="draining")})
    p = r.peers["p"]
    assert (p.reported_throughput, p.reported_queue, p.state, p.last_seen) == (4, 7, "draining", 9.0)


def test_exclude() -> None:
    r = make_router()
    r.update_stage(0, {"a": rec(1, throughput=100), "b": rec(2, throughput=10), "c": rec(3, throughput=1)})
    assert r.choose(0).peer_id == "a"
    assert r.choose(0, exclude={"a"}).peer_id == "b"
    assert r.choose(0, exclude={"a", "b"}).peer_id == "c"
    assert r.choose(0, exclude={"a", "b", "c"}) is None
    assert r.choose(1) is None  # empty stage


def test_jitter_spreads_between_equal_replicas() -> None:
    r = Router(1, rng=random.Random(0), clock=FakeClock())
    r.update_stage(0, {f"p{i}": rec(i + 1, throughput=10) for i in range(3)})
    counts = Counter(r.choose(0).peer_id for _ in range(300))
    assert set(counts) == {"p0", "p1", "p2"}
    assert min(counts.values()) > 50


def test_jitter_does_not_override_a_clear_winner() -> None:
    r = Router(1, rng=random.Random(0), clock=FakeClock())
    r.update_stage(0, {"fast": rec(1, throughput=12), "slow": rec(2, throughput=10)})
    assert {r.choose(0).peer_id for _ in range(200)} == {"fast"}  # 20 % apart > 10 % jitter


def test_latency_ms_per_stage_for_the_event_log() -> None:
    r = make_router()
    r.update_stage(0, {"peer-aaaaaa": rec(1), "peer-bbbbbb": rec(2)})
    r.update_stage(1, {"peer-cccccc": rec(3)})
    measure(r, "peer-aaaaaa", 0.0123)
    measure(r, "peer-cccccc", 0.5)
    assert r.latency_ms() == {0: {"aaaaaa": 12.3}, 1: {"cccccc": 500.0}}


def test_a_peer_that_moved_is_dropped_until_the_dht_files_it_elsewhere() -> None:
    r = make_router()
    r.update_stage(0, {"mover": rec(1), "stayer": rec(2)})
    mover = r.peers["mover"]
    r.started(mover)
    r.moved(mover)
    assert [v.peer_id for v in r.replicas(0)] == ["stayer"]
    assert mover.in_flight == 0 and mover.banned_until == 0.0  # not its fault: no ban
    r.update_stage(1, {"mover": rec(1)})  # the next refresh sees its new announcement
    assert r.choose(1).peer_id == "mover" and r.peers["mover"].stage == 1


def test_a_banned_peer_that_announces_again_is_retried_within_a_second() -> None:
    clock = FakeClock()
    r = make_router(clock)
    r.update_stage(0, {"paused": rec(1, at=100.0), "other": rec(2, at=100.0)})
    view = r.peers["paused"]
    for _ in range(6):  # calls time out while it is frozen: the backoff reaches its cap
        r.started(view)
        r.failed(view)
    assert view.banned_until - clock.t == BAN_MAX_S
    r.update_stage(0, {"paused": rec(1, at=100.0), "other": rec(2, at=105.0)})  # no new word from it
    assert view.banned_until - clock.t == BAN_MAX_S
    r.update_stage(0, {"paused": rec(1, at=131.0), "other": rec(2, at=131.0)})  # resumed: it announced
    assert view.banned_until - clock.t <= 1.0
    clock.t += 1.0
    assert "paused" in {v.peer_id for v in r.available(0)}
    r.started(view)
    r.failed(view)  # still failing: banned again, and the backoff goes on growing
    assert view.banned_until - clock.t == BAN_MAX_S


def test_a_relayed_replica_pays_for_its_extra_hop_until_measured() -> None:
    r = make_router()
    relayed = rec(1, throughput=100).model_copy(update={"relay": "QmRe1ay"})
    r.update_stage(0, {"relayed": relayed, "direct": rec(2, throughput=120)})
    assert r.expected_finish(r.peers["relayed"]) == pytest.approx(1.5 / 100)
    assert r.choose(0).peer_id == "direct"  # equal compute, one more hop
    r.succeeded(r.peers["relayed"], 0.001)  # measured: what we saw counts, hop included
    r.succeeded(r.peers["direct"], 0.005)
    assert r.choose(0).peer_id == "relayed"
