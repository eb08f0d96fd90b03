"""NormGuard: a gradient far above the stage's running norm is refused; honest drift and spikes pass."""

from __future__ import annotations

import random

import pytest
import torch

from swarmpipe.peer.norm_guard import NormGuard
from swarmpipe.peer.spec import load_spec
from swarmpipe.peer.stage.runtime import StageRuntime

pytestmark = pytest.mark.unit


def _warm(guard: NormGuard, norm: float = 1.0, n: int = 40, jitter: float = 0.3, seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        assert guard.check(norm * (1 + rng.uniform(-jitter, jitter))) == ""


def test_nothing_is_judged_during_warm_up() -> None:
    guard = NormGuard(warmup=5)
    for norm in (1.0, 1e4, 1e-3, 50.0, 1.0):
        assert guard.check(norm) == ""


def test_a_scaled_gradient_is_refused_and_not_learned() -> None:
    guard = NormGuard()
    _warm(guard)
    before = guard.typical_norm
    reason = guard.check(1e4)
    assert reason.startswith("outlier gradient") and "x the typical" in reason
    assert guard.typical_norm == before  # an attacker cannot drag the statistics up with its outliers
    assert guard.check(1.2) == ""
    assert guard.check(2e3).startswith("outlier gradient")


def test_ordinary_spikes_and_slow_drift_pass() -> None:
    guard = NormGuard()
    _warm(guard)
    assert guard.check(5.0) == ""  # 5x: a loss spike, not an attack
    assert guard.check(600.0) == ""  # what an async swarm's stage 0 saw after a membership change
    for step in range(300):  # norms falling 100x over training, as they do
        assert guard.check(1.0 * 0.985**step) == "", step


def test_non_finite_and_negative_norms_are_refused() -> None:
    guard = NormGuard()
    assert guard.check(float("nan")) and guard.check(float("inf")) and guard.check(-1.0)


def test_a_stage_drops_a_poisoned_gradient_and_keeps_its_weights() -> None:
    spec = load_spec(
        num_stages=2,
        model={"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8},
        optimizer={"kind": "adamw", "warmup_steps": 0},
    )
    rt = StageRuntime(spec, 0)
    gen = torch.Generator().manual_seed(0)
    for i in range(30):
        out = rt.forward(f"mb{i}", torch.randint(0, 256, (2, 8), generator=gen))
        assert rt.backward(f"mb{i}", torch.randn(out.shape, generator=gen) * 0.01).applied
    weights = [p.detach().clone() for p in rt.weights.module.parameters()]
    out = rt.forward("evil", torch.randint(0, 256, (2, 8), generator=gen))
    result = rt.backward("evil", torch.randn(out.shape, generator=gen) * 1e3)  # finite, 1e5x the usual
    assert not result.applied and result.dropped_reason.startswith("outlier gradient")
    assert rt.stats.dropped_outlier == 1
    assert all(torch.equal(a, b) for a, b in zip(weights, rt.weights.module.parameters()))
