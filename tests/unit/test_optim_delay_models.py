"""Delay models of the delay simulator: random, heavy-tailed, slow replica, replays, recorded histograms."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from swarmpipe.peer.optim.delay_models import (
    MAX_SCRAPE_BYTES,
    FixedDelays,
    Jitter,
    RecordedDelays,
    Replays,
    SlowReplica,
    Stragglers,
    one_f_one_b,
    parse_delay_histograms,
)
from swarmpipe.peer.optim.delay_simulator import DelaySimulator, StageEvent
from swarmpipe.peer.spec import ModelSpec, OptimizerSpec, RunSpec
from swarmpipe.peer.stage.metrics import PeerMetrics

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
torch.set_num_threads(1)


def _scrape(observations: list[float]) -> str:
    """A real peer's /metrics page after these delays (the stage server's histogram)."""
    metrics = PeerMetrics(CollectorRegistry())
    for d in observations:
        metrics.delay.observe(d)
    return generate_latest(metrics.registry).decode()


def test_fixed_is_one_f_one_b() -> None:
    model = FixedDelays(4)
    assert model.delays(0) == model.delays(99) == one_f_one_b(4) == [3, 2, 1, 0]
    assert model.max_delay == 3 and FixedDelays(3, [0, 5, 1]).max_delay == 5
    with pytest.raises(ValueError):
        FixedDelays(3, [1, 0])


def test_jitter_stays_within_its_spread_and_is_seeded() -> None:
    model = Jitter(8, spread=2, seed=3, max_delay=8)
    draws = [model.delays(i) for i in range(2000)]
    for row in draws:
        assert all(max(0, b - 2) <= d <= min(8, b + 2) for d, b in zip(row, one_f_one_b(8)))
    means = [sum(col) / len(col) for col in zip(*draws)]
    assert means[3] == pytest.approx(4, abs=0.15)  # symmetric noise around 1F1B away from the bounds
    again = Jitter(8, spread=2, seed=3, max_delay=8)
    assert draws[:5] == [again.delays(i) for i in range(5)]


def test_stragglers_hold_up_the_stages_before_them_with_a_heavy_tail() -> None:
    base = one_f_one_b(8)
    assert Stragglers(8, p=0.0).delays(0) == base
    model = Stragglers(8, p=1.0, alpha=1.1, scale=2.0, seed=1, max_delay=32)
    extras = []
    for i in range(3000):
        row = model.delays(i)
        extra = [d - b for d, b in zip(row, base)]
        held = [e for e in extra if e]
        assert all(e >= 0 for e in extra)
        # one hold-up: equal extra on a prefix 0..s of the stages, nothing after it
        if held:
            s = max(k for k, e in enumerate(extra) if e)
            assert all(extra[k] == extra[0] for k in range(s + 1)) or row[0] == 32
        extras.append(max(extra))
    assert model.capped > 0  # Pareto(1.1) draws past the cap
    assert max(extras) >= 25 and sorted(extras)[len(extras) // 2] <= 3  # heavy tail, small median


def test_slow_replica_delays_every_other_microbatch_up_to_its_stage() -> None:
    model = SlowReplica(4, stage=2, replicas=2, slowdown=4.0)
    assert model.max_delay == 3 + 3
    assert model.delays(0) == [6, 5, 4, 0]  # routed to the slow replica: +3 at stages 0..2
    assert model.delays(1) == [3, 2, 1, 0]
    assert model.delays(2) == [6, 5, 4, 0]
    with pytest.raises(ValueError):
        SlowReplica(4, stage=4)


def test_replays_add_a_round_trip() -> None:
    model = Replays(4, p=1.0, seed=0, max_delay=32)
    for i in range(50):
        row = model.delays(i)
        extra = [d - b for d, b in zip(row, one_f_one_b(4))]
        assert set(extra) <= {0, 6} and extra[0] == 6  # 2 (P - 1) more at stages 0..s
    assert Replays(4, p=0.0).delays(0) == [3, 2, 1, 0]


def test_recorded_histogram_is_replayed_per_stage() -> None:
    # stage 0 saw delays 3 and 5..6, stage 1 always 1; a bucket (4, 6] gives 5 or 6
    stage0 = _scrape([3.0] * 300 + [5.0] * 200 + [6.0] * 500)
    stage1 = _scrape([1.0] * 10)
    model = RecordedDelays(2, [stage0, stage1], seed=0, max_delay=32)
    draws = [model.delays(i) for i in range(4000)]
    first = [row[0] for row in draws]
    assert {row[1] for row in draws} == {1}
    assert set(first) == {3, 5, 6}
    assert first.count(3) / len(first) == pytest.approx(0.3, abs=0.03)
    assert model.mean(0) == pytest.approx(0.3 * 3 + 0.7 * 5.5)
    # one scrape for every stage is cycled
    assert RecordedDelays(3, [stage1]).delays(0) == [1, 1, 1]


def test_recorded_overflow_and_stage_labels() -> None:
    overflow = _scrape([100.0] * 5)  # past the last bucket (64): replayed as 64, then capped
    model = RecordedDelays(1, [overflow], max_delay=32)
    assert model.delays(0) == [32] and model.capped == 1
    labelled = "\n".join(
        [
            "# TYPE swarmpipe_gradient_delay_steps histogram",
            'swarmpipe_gradient_delay_steps_bucket{stage="0",le="2.0"} 4',
            'swarmpipe_gradient_delay_steps_bucket{stage="0",le="+Inf"} 4',
            'swarmpipe_gradient_delay_steps_bucket{stage="1",le="0.0"} 7',
            'swarmpipe_gradient_delay_steps_bucket{stage="1",le="+Inf"} 7',
            "",
        ]
    )
    model = RecordedDelays(2, [labelled], seed=1)
    rows = [model.delays(i) for i in range(200)]
    assert {r[1] for r in rows} == {0} and {r[0] for r in rows} == {0, 1, 2}
    with pytest.raises(ValueError, match='stage="2"'):
        RecordedDelays(3, [labelled])


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "no swarmpipe_gradient_delay_steps"),
        ("this is { not prometheus", "not a Prometheus"),
        ('# TYPE other histogram\nother_bucket{le="1"} 3\n', "no swarmpipe_gradient_delay_steps"),
        (
            'swarmpipe_gradient_delay_steps_bucket{le="1"} 5\nswarmpipe_gradient_delay_steps_bucket{le="2"} 3\n',
            "cumulative",
        ),
        ('swarmpipe_gradient_delay_steps_bucket{le="1"} -1\n', "cumulative"),
        ('swarmpipe_gradient_delay_steps_bucket{le="1"} NaN\n', "cumulative"),
        ('swarmpipe_gradient_delay_steps_bucket{le="+Inf"} 4\n', "finite bound"),
        ('swarmpipe_gradient_delay_steps_bucket{le="1"} 0\n', "no observations"),
        ('swarmpipe_gradient_delay_steps_bucket{le="x"} 3\n', "not a Prometheus"),
        ("#" * (MAX_SCRAPE_BYTES + 1), "over"),
    ],
)
def test_hostile_scrapes_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_delay_histograms(text)


def test_too_many_buckets_are_refused() -> None:
    lines = [f'swarmpipe_gradient_delay_steps_bucket{{le="{i}"}} {i}' for i in range(300)]
    with pytest.raises(ValueError, match="buckets"):
        parse_delay_histograms("\n".join(lines) + "\n")


def _spec(stages: int = 4) -> RunSpec:
    return RunSpec(
        num_stages=stages,
        model=ModelSpec(d_model=16, n_layers=stages, n_heads=2, seq_len=8),
        optimizer=OptimizerSpec(kind="adamw", lr=1e-2, warmup_steps=2),
    )


def test_simulator_uses_each_microbatchs_sampled_delay() -> None:
    events: list[StageEvent] = []
    model = Stragglers(4, p=0.5, alpha=1.2, scale=2.0, seed=4, max_delay=9)
    keep = lambda e: events.append(  # noqa: E731
        dataclasses.replace(e, forward_params={n: t.detach().clone() for n, t in e.forward_params.items()})
    )
    sim = DelaySimulator(_spec(), delays=model, observer=keep)
    history = [{n: p.detach().clone() for n, p in s.named_parameters()} for s in sim.stages]
    histories = [[h] for h in history]
    gen = torch.Generator().manual_seed(0)
    sampled = []
    for _ in range(24):
        x, y = torch.randint(0, 256, (2, 8), generator=gen), torch.randint(0, 256, (2, 8), generator=gen)
        sim.train_micro(x, y)
        sampled.append(list(sim.delays))
        for k, s in enumerate(sim.stages):
            histories[k].append({n: p.detach().clone() for n, p in s.named_parameters()})
    assert any(max(row) > 3 for row in sampled)  # some micro-batches really were held up
    for e in events:
        expected = max(0, e.update - sampled[e.micro][e.stage])
        assert e.forward_version == expected
        assert all(torch.equal(t, histories[e.stage][expected][n]) for n, t in e.forward_params.items())
    assert all(len(r) <= 10 for r in sim.rings)
    with pytest.raises(ValueError):
        DelaySimulator(_spec(), delays=Jitter(3, spread=1))
    assert math.isfinite(sim.evaluate([(x, y)]))
