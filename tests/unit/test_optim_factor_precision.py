"""Basis rotation with bfloat16 factors (issue 16, item 6): stochastic rounding keeps the EMAs moving where
round-to-nearest freezes them; the first step equals float32's; the state halves and survives a state_dict."""

from __future__ import annotations

import copy

import pytest
import torch

from swarmpipe.peer.model.bytegpt import PipelineStage
from swarmpipe.peer.optim import build_optimizer
from swarmpipe.peer.optim.basis_rotation import BasisRotationAdam, stochastic_round_bf16
from swarmpipe.peer.plan.memory import optimizer_bytes
from swarmpipe.peer.spec import ModelSpec, OptimizerSpec, RunSpec

pytestmark = pytest.mark.unit
torch.set_num_threads(1)
FACTORS = ("gg_left", "gg_right", "q_left", "q_right")


def test_stochastic_rounding_is_unbiased_and_lands_on_the_two_neighbours() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.full((200_000,), 1.0 + 1.0 / 512)  # a quarter of the way from 1 to the next bfloat16 (1 + 1/128)
    rounded = stochastic_round_bf16(x, gen).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 1.0 / 128}
    assert abs(rounded.mean().item() - x[0].item()) < 2e-5  # round-to-nearest would say 1.0: off by 2e-3
    neg = stochastic_round_bf16(-x, gen).float()
    assert abs(neg.mean().item() + x[0].item()) < 2e-5
    exact = torch.tensor([0.0, -2.0, 1.5, 2.0**100])  # already bfloat16 values: kept as they are
    torch.testing.assert_close(stochastic_round_bf16(exact, gen).float(), exact, rtol=0, atol=0)
    special = stochastic_round_bf16(torch.tensor([float("inf"), float("-inf"), float("nan")]), gen)
    assert special[0] == float("inf") and special[1] == float("-inf") and special[2].isnan()


def _one_matrix(factor_dtype: str, seed: int = 0) -> tuple[torch.nn.Parameter, BasisRotationAdam]:
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(12, 8))
    opt = BasisRotationAdam([p], lr=1e-2, rotate=True, rotation_every=5, factor_dtype=factor_dtype)
    return p, opt


def test_the_first_step_equals_float32_and_the_factors_are_then_stored_in_bfloat16() -> None:
    (p32, o32), (p16, o16) = _one_matrix("float32"), _one_matrix("bfloat16")
    g = torch.randn(12, 8, generator=torch.Generator().manual_seed(3))
    for p, o in ((p32, o32), (p16, o16)):
        p.grad = g.clone()
        o.step()
    torch.testing.assert_close(p16.detach(), p32.detach(), rtol=0, atol=0)  # computed wide, stored narrow after
    s16, s32 = o16.state[p16], o32.state[p32]
    assert all(s16[k].dtype == torch.bfloat16 for k in FACTORS)
    assert s16["exp_avg"].dtype == s16["exp_avg_sq"].dtype == torch.float32  # the moments stay float32
    for k in FACTORS:
        torch.testing.assert_close(s16[k].float(), s32[k], rtol=1e-2, atol=1e-2 * s32[k].abs().max().item())
    for _ in range(30):  # later steps stay close to float32's
        g = torch.randn(12, 8)
        for p, o in ((p32, o32), (p16, o16)):
            p.grad = g.clone()
            o.step()
    assert ((p16 - p32).norm() / p32.norm()).item() < 1e-2


def test_stochastic_rounding_keeps_a_slow_ema_moving_where_nearest_freezes_it() -> None:
    """beta2 = 0.999: each step moves L by a relative 1e-3, under bfloat16's resolution (2^-8)."""
    torch.manual_seed(0)
    g0 = torch.randn(6, 4)
    p, opt = _one_matrix("bfloat16")
    p.data = torch.zeros(6, 4)
    opt.param_groups[0]["lr"] = 0.0  # only the statistics move
    wide = torch.zeros(6, 6)
    nearest = torch.zeros(6, 6, dtype=torch.bfloat16)
    for step in range(1500):
        g = g0 * (1.0 if step < 300 else 3.0)  # the gradient's scale changes: L must follow it
        p.grad = g.clone()
        opt.step()
        wide.mul_(0.999).addmm_(g, g.T, alpha=0.001)
        nearest = (nearest.float() * 0.999 + 0.001 * (g @ g.T)).to(torch.bfloat16)
    stored = opt.state[p]["gg_left"].float()
    err = ((stored - wide).norm() / wide.norm()).item()
    frozen = ((nearest.float() - wide).norm() / wide.norm()).item()
    assert err < 0.05, err
    assert frozen > 0.3, frozen  # the experiment can fail: round-to-nearest storage would not track it


def test_a_state_dict_round_trip_keeps_training_in_bfloat16() -> None:
    p, opt = _one_matrix("bfloat16")
    for _ in range(3):
        p.grad = torch.randn(12, 8)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())  # as a state travels: copies, not the live moments
    q, fresh = _one_matrix("bfloat16")
    q.data.copy_(p.data)
    fresh.load_state_dict(saved)  # torch casts floating state to the parameter's dtype on load
    g = torch.randn(12, 8)
    p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    fresh.step()
    torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-3, atol=1e-5)
    assert all(fresh.state[q][k].dtype == torch.bfloat16 for k in FACTORS)


def test_the_spec_option_halves_the_factors_and_the_estimate_agrees() -> None:
    spec = RunSpec(num_stages=1, model=ModelSpec(d_model=16, n_layers=1, n_heads=2, seq_len=8))
    named = list(PipelineStage(spec, 0).named_parameters())
    full = build_optimizer(named, OptimizerSpec(kind="basis_rotation"), 0, 1)
    half = build_optimizer(named, OptimizerSpec(kind="basis_rotation", rotation_factor_dtype="bfloat16"), 0, 1)
    for p in dict(named).values():
        p.grad = torch.randn_like(p)
    full.step()
    half.step()

    def state_bytes(opt: torch.optim.Optimizer) -> int:
        return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))

    factors = sum(v.numel() * 4 for s in full.state.values() for k, v in s.items() if k in FACTORS)
    assert state_bytes(full) - state_bytes(half) == factors // 2
    assert (
        optimizer_bytes(named, "basis_rotation", 4, 0, 2) == optimizer_bytes(named, "basis_rotation", 4) - factors // 2
    )
