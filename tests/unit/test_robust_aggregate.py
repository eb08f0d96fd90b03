"""Robust aggregates of replica weights (peer/state/robust_aggregate.py): honest replicas average to their mean,
a Byzantine one at 1e6 x the weights moves the result by about tau at most, NaN/Inf and misshapen donors are
refused; and the bounded blend a pushed state gets."""

from __future__ import annotations

import pytest
import torch

from swarmpipe.peer.spec import RunSpec, SpecError, spec_from_dict
from swarmpipe.peer.state.format import StageState, StateError
from swarmpipe.peer.state.robust_aggregate import (
    TAU_FLOOR,
    TAU_MULTIPLE,
    AggregateError,
    aggregate,
    centered_clip,
    check_contribution,
    flatten,
    trim_count,
    trimmed_mean,
    trust_radius,
    unflatten,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
N = 10_000


def _honest(count: int, spread: float = 0.01, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Our weights and ``count - 1`` honest siblings': one point plus small independent drifts."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(N, generator=g)
    points = [base + spread * torch.randn(N, generator=g) for _ in range(count)]
    return points[0], points[1:]


def _tau(own: torch.Tensor, others: list[torch.Tensor]) -> float:
    return 2 * max(float((x - own).norm()) for x in others)  # every honest sibling inside the radius


def test_honest_replicas_average_to_their_mean():
    own, others = _honest(5)
    mean = torch.stack([own, *others]).mean(0)
    tau = _tau(own, others)
    result = centered_clip(own, others, tau)
    assert torch.allclose(result.vector, mean, atol=1e-5)
    assert result.clipped == 0 and result.far == 0
    trimmed = trimmed_mean(own, others, tau)
    # a trimmed mean of honest drifts stays close to their mean (within one drift's size per coordinate)
    assert float((trimmed.vector - mean).abs().max()) < 0.02
    assert torch.allclose(aggregate("mean", own, others, tau).vector, mean, atol=1e-5)


def test_a_byzantine_replica_at_1e6_times_the_weights_has_no_pull():
    own, others = _honest(4)
    honest_mean = torch.stack([own, *others]).mean(0)
    tau = _tau(own, others)
    byzantine = own * 1e6
    result = centered_clip(own, [*others, byzantine], tau)
    assert torch.allclose(result.vector, honest_mean, atol=1e-5)  # an outlier: left out, as if it never came
    assert result.clipped == 1 and result.outliers == 1 and result.far == 1 and result.farthest > 1e4
    plain = aggregate("mean", own, [*others, byzantine], tau)
    assert float((plain.vector - honest_mean).norm()) > 1e4 * tau  # what the all-reduce's mean would have done


@pytest.mark.parametrize("distance", [1.5, 10.0, 99.0])  # in units of tau: a careful attacker stays inside
def test_a_careful_byzantine_replica_moves_centered_clip_by_about_tau_over_the_honest_count(distance):
    own, others = _honest(4)
    honest_mean = torch.stack([own, *others]).mean(0)
    tau = _tau(own, others)
    direction = own / own.norm()
    byzantine = own + distance * tau * direction
    result = centered_clip(own, [*others, byzantine], tau)
    shift = float((result.vector - honest_mean).norm())
    assert shift <= tau / len(others) * 1.05, (shift, tau)  # about tau / (n - 1), n = 5 contributions
    assert result.clipped >= 1 and result.outliers == 0


def test_however_many_byzantine_siblings_one_round_moves_us_at_most_iterations_times_tau():
    own, _ = _honest(1)
    tau = 0.5
    pushes = [torch.ones(N), -torch.ones(N), own]  # three careful attackers, 10 to 90 tau away
    result = centered_clip(own, [own + d / d.norm() * tau * r for d, r in zip(pushes, (10, 50, 90))], tau)
    assert result.outliers == 0 and result.clipped == 3
    assert float((result.vector - own).norm()) <= 3 * tau + 1e-4


def test_trimmed_mean_drops_the_byzantine_replica_with_three_or_more():
    own, others = _honest(3)
    tau = _tau(own, others)
    points = torch.stack([own, *others])
    low, high = points.min(0).values, points.max(0).values
    for byzantine in (own * 1e6, own + 10 * tau * own / own.norm()):  # an outlier, and a careful one
        result = trimmed_mean(own, [*others, byzantine], tau)
        # coordinate-wise the result stays within the honest values' range
        assert bool(((result.vector >= low - 1e-6) & (result.vector <= high + 1e-6)).all())
        assert result.clipped == 1
    assert [trim_count(n) for n in (2, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2]


def test_trimmed_mean_with_one_sibling_is_a_plain_mean():
    own, others = _honest(2)
    result = trimmed_mean(own, others, tau=1.0)
    assert torch.allclose(result.vector, (own + others[0]) / 2, atol=1e-6)
    assert result.clipped == 0


def test_trimmed_mean_works_in_blocks(monkeypatch):
    import swarmpipe.peer.state.robust_aggregate as ra

    own, others = _honest(5)
    whole = trimmed_mean(own, others, 1.0).vector
    monkeypatch.setattr(ra, "TRIM_BLOCK", 333)  # not a divisor of N: the last block is short
    assert torch.equal(trimmed_mean(own, others, 1.0).vector, whole)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_donors_are_refused(bad):
    own = [torch.ones(3, 4), torch.zeros(5)]
    donor = [torch.ones(3, 4), torch.zeros(5)]
    donor[1][2] = bad
    with pytest.raises(AggregateError, match="NaN or Inf"):
        check_contribution(own, donor)
    with pytest.raises(AggregateError, match="NaN or Inf"):
        aggregate("centered_clip", flatten(own), [flatten(donor)], 1.0)


def test_shapes_and_counts_are_checked():
    own = [torch.ones(3, 4), torch.zeros(5)]
    with pytest.raises(AggregateError, match="shape"):
        check_contribution(own, [torch.ones(4, 3), torch.zeros(5)])
    with pytest.raises(AggregateError, match="2 tensors"):
        check_contribution([*own, torch.ones(1)], own)
    with pytest.raises(AggregateError, match="not floating point"):
        check_contribution(own, [torch.ones(3, 4, dtype=torch.int64), torch.zeros(5)])
    with pytest.raises(AggregateError, match="values"):
        aggregate("trimmed_mean", flatten(own), [torch.ones(7)], 1.0)
    with pytest.raises(ValueError, match="unknown aggregate"):
        aggregate("median", flatten(own), [], 1.0)


def test_tau_comes_from_our_own_movement_with_a_floor():
    own = torch.ones(100)  # ||own|| = 10
    assert trust_radius(own, None) == pytest.approx(TAU_FLOOR * 10)
    moved = own + 0.1  # moved by 1
    assert trust_radius(moved, own) == pytest.approx(TAU_MULTIPLE * 1.0)
    assert trust_radius(own, own) == pytest.approx(TAU_FLOOR * 10)


def test_flatten_and_unflatten_round_trip():
    tensors = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 1, 2)]
    views = unflatten(flatten(tensors), tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, views))


def test_the_spec_names_the_aggregate():
    assert RunSpec().averaging_aggregate == "centered_clip"
    assert spec_from_dict({"averaging_aggregate": "trimmed_mean"}).averaging_aggregate == "trimmed_mean"
    with pytest.raises(SpecError, match="averaging_aggregate"):
        spec_from_dict({"averaging_aggregate": "median" * 20})
    with pytest.raises(SpecError, match="must be a string"):
        spec_from_dict({"averaging_aggregate": 3})


# ---------------------------------------------------------------- a pushed state's bounded blend
def _runtime():
    from swarmpipe.peer.stage.runtime import StageRuntime

    spec = spec_from_dict({"num_stages": 2, "model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8}})
    return StageRuntime(spec, 1)


def _params(rt) -> torch.Tensor:
    return flatten([p.detach() for p in rt.weights.trainable().values()])


def test_a_pushed_state_is_clipped_to_our_own_movement_and_an_outlier_has_no_pull():
    rt = _runtime()
    start = _params(rt)
    assert rt.weights.push_radius() == pytest.approx(TAU_FLOOR * float(start.norm()))  # no anchor yet: the floor
    rt.weights.set_anchor()
    with torch.no_grad():  # "training": we move by 5 % of ||w||
        step = torch.randn_like(start)
        step *= 0.05 * float(start.norm()) / float(step.norm())
        for p, d in zip(rt.weights.trainable().values(), unflatten(step, list(rt.weights.trainable().values()))):
            p.add_(d)
    before = _params(rt)
    radius = rt.weights.push_radius()
    assert radius == pytest.approx(TAU_MULTIPLE * 0.05 * float(start.norm()), rel=1e-4)
    far = rt.weights.export_params()
    far.tensors = {k: v * 3 for k, v in far.tensors.items()}  # 2 ||w|| away: 20 radii
    scale = rt.weights.blend(far, radius=radius)
    moved = float((_params(rt) - before).norm())
    assert 0 < scale < 0.06 and moved == pytest.approx(0.5 * radius, rel=1e-3)
    hostile = rt.weights.export_params()
    hostile.tensors = {k: v * 1e6 for k, v in hostile.tensors.items()}
    now = _params(rt)
    assert rt.weights.blend(hostile, radius=rt.weights.push_radius()) == 0.0 and torch.equal(_params(rt), now)
    rt.weights.set_anchor()  # after a push: the next one gets only what we moved since
    assert rt.weights.push_radius() == pytest.approx(TAU_FLOOR * float(now.norm()))


def test_a_near_pushed_state_is_blended_half_way_and_nan_is_refused():
    rt = _runtime()
    before = _params(rt)
    near = rt.weights.export_params()
    near.tensors = {k: v + 1e-4 for k, v in near.tensors.items()}
    assert rt.weights.blend(near, radius=1.0) == 1.0
    assert torch.allclose(_params(rt), before + 0.5e-4, atol=1e-6)
    bad = StageState({k: v.clone() for k, v in near.tensors.items()}, dict(near.meta))
    next(iter(bad.tensors.values()))[0] = float("nan")
    with pytest.raises(StateError, match="NaN or Inf"):
        rt.weights.blend(bad, radius=1.0)


def test_export_params_carries_only_the_trainable_weights():
    rt = _runtime()
    state = rt.weights.export_params()
    assert set(state.tensors) == {f"param.{n}" for n in rt.weights.trainable()}
    assert state.meta["params_only"] is True and state.meta["stage"] == 1
    assert state.digest() == rt.weights.export_state().digest()  # the same weights: the same digest
