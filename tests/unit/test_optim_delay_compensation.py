"""Basis rotation's delay compensation (issue 16, 3c) and one-sided rotation (item 6), by hand."""

from __future__ import annotations

import math

import pytest
import torch

from swarmpipe.peer.model.bytegpt import PipelineStage
from swarmpipe.peer.optim import build_optimizer
from swarmpipe.peer.optim.basis_rotation import BasisRotationAdam
from swarmpipe.peer.plan.memory import optimizer_bytes
from swarmpipe.peer.spec import ModelSpec, OptimizerSpec, RunSpec

pytestmark = pytest.mark.unit
torch.set_num_threads(1)
F64 = torch.float64
LR, EPS, B1, B2 = 0.1, 1e-3, 0.9, 0.99


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


W0 = t([[1.0, 2.0], [-1.0, 0.5]])
G1, G2 = t([[0.3, -0.2], [0.1, 0.4]]), t([[0.2, 0.1], [-0.3, 0.2]])
DRIFT = t([[0.05, -0.02], [0.01, 0.03]])  # live - stashed weights of the second gradient


def two_steps(lam: float, cap: float, drift: torch.Tensor | None = DRIFT, **kw: object) -> BasisRotationAdam:
    p = torch.nn.Parameter(W0.clone())
    opt = BasisRotationAdam(
        [p],
        lr=LR,
        eps=EPS,
        betas=(B1, B2),
        weight_decay=0.0,
        rotate=True,
        rotation_every=0,
        compensation=lam,
        compensation_cap=cap,
        **kw,
    )
    for g, d in ((G1, None), (G2, drift)):
        p.grad = g.clone()
        if d is not None:
            opt.set_drift({p: d})
        opt.step()
    return opt


@pytest.mark.parametrize("cap", [100.0, 0.1])
def test_compensated_second_step_by_hand_in_the_identity_basis(cap: float) -> None:
    """Identity basis: the eigenbasis is the coordinate one, so every product is per entry."""
    lam = 0.5
    opt = two_steps(lam, cap, init_basis="identity")
    p = opt.param_groups[0]["params"][0]
    m1, v1 = (1 - B1) * G1, (1 - B2) * G1**2
    w1 = W0 - LR * math.sqrt(1 - B2) / (1 - B1) * m1 / (v1.sqrt() + EPS)
    d_prev = (v1.sqrt() + EPS) / math.sqrt(1 - B2)  # the curvature the preconditioner implies, times lr
    corr = lam * d_prev / LR * DRIFT
    if cap < 100:
        assert corr.norm() > cap * G2.norm()  # the cap bites in this case
        corr = corr * cap * G2.norm() / corr.norm()
    m2 = B1 * m1 + (1 - B1) * (G2 + corr)
    v2 = B2 * v1 + (1 - B2) * G2**2  # the raw gradient: the curvature estimate never sees its correction
    w2 = w1 - LR * math.sqrt(1 - B2**2) / (1 - B1**2) * m2 / (v2.sqrt() + EPS)
    torch.testing.assert_close(p.detach(), w2)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], v2)


def test_compensation_happens_in_the_eigenbasis() -> None:
    """With the real eigenbasis: the drift is rotated in, multiplied by d_prev / lr, rotated back."""
    lam, cap = 0.5, 100.0
    plain = two_steps(0.0, cap, drift=None)  # same bases, no compensation: step 1's state
    p0 = plain.param_groups[0]["params"][0]
    st = plain.state[p0]
    ql, qr = st["q_left"], st["q_right"]
    opt = two_steps(lam, cap)
    p = opt.param_groups[0]["params"][0]
    m1, v1 = (1 - B1) * G1, (1 - B2) * (ql.T @ G1 @ qr) ** 2
    w1 = W0 - LR * math.sqrt(1 - B2) / (1 - B1) * ql @ ((ql.T @ m1 @ qr) / (v1.sqrt() + EPS)) @ qr.T
    corr = lam * (v1.sqrt() + EPS) / math.sqrt(1 - B2) / LR * (ql.T @ DRIFT @ qr)
    m2 = B1 * m1 + (1 - B1) * (G2 + ql @ corr @ qr.T)
    g2r = ql.T @ G2 @ qr
    v2 = B2 * v1 + (1 - B2) * g2r**2
    w2 = w1 - LR * math.sqrt(1 - B2**2) / (1 - B1**2) * ql @ ((ql.T @ m2 @ qr) / (v2.sqrt() + EPS)) @ qr.T
    torch.testing.assert_close(p.detach(), w2)
    assert not torch.allclose(p.detach(), p0.detach())  # the correction moved the step


def test_no_drift_or_first_step_is_the_plain_step() -> None:
    plain, told_nothing = two_steps(0.0, 1.0, drift=None), two_steps(0.5, 1.0, drift=None)
    a, b = plain.param_groups[0]["params"][0], told_nothing.param_groups[0]["params"][0]
    assert torch.equal(a.detach(), b.detach())
    p = torch.nn.Parameter(W0.clone())
    opt = BasisRotationAdam([p], lr=LR, eps=EPS, rotate=True, compensation=0.5)
    q = torch.nn.Parameter(W0.clone())
    ref = BasisRotationAdam([q], lr=LR, eps=EPS, rotate=True)
    p.grad, q.grad = G1.clone(), G1.clone()
    opt.set_drift({p: DRIFT})  # step 1 has no curvature yet: nothing to compensate with
    opt.step()
    ref.step()
    assert torch.equal(p.detach(), q.detach()) and opt._drift == {}  # the drift is for one step only


# ------------------------------------------------------------------ one-sided rotation (rotation_max_dim)


def test_a_side_over_max_dim_keeps_the_identity_and_no_factor() -> None:
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(6, 2, generator=gen, dtype=F64))
    w0 = p.detach().clone()
    opt = BasisRotationAdam([p], lr=LR, eps=EPS, betas=(B1, B2), weight_decay=0.0, rotate=True, max_dim=4)
    g = torch.randn(6, 2, generator=gen, dtype=F64)
    p.grad = g.clone()
    opt.step()
    state = opt.state[p]
    assert "q_left" not in state and "gg_left" not in state and state["q_right"].shape == (2, 2)
    qr = state["q_right"]
    torch.testing.assert_close(qr.T @ qr, torch.eye(2, dtype=F64))
    gr = g @ qr  # only the right side rotates
    step = math.sqrt(1 - B2) / (1 - B1) * ((1 - B1) * gr / (((1 - B2) * gr**2).sqrt() + EPS)) @ qr.T
    torch.testing.assert_close(p.detach(), w0 - LR * step)


def test_rotation_max_dim_bounds_the_state_and_its_estimate() -> None:
    spec = RunSpec(num_stages=1, model=ModelSpec(d_model=16, n_layers=1, n_heads=2, seq_len=8))
    named = list(PipelineStage(spec, 0).named_parameters())
    full = build_optimizer(named, OptimizerSpec(kind="basis_rotation"), 0, 1)
    bounded = build_optimizer(named, OptimizerSpec(kind="basis_rotation", rotation_max_dim=16), 0, 1)
    for p in dict(named).values():
        p.grad = torch.randn_like(p)
    full.step()
    bounded.step()

    def floats(opt: torch.optim.Optimizer) -> int:
        return sum(v.numel() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))

    assert floats(bounded) < floats(full)
    # qkv 48x16, fc 64x16 and fc_out 16x64 rotate only their 16-wide side
    saved = sum(2 * k * k for n, p in named if n.startswith("blocks.") and p.dim() == 2 for k in p.shape if k > 16)
    assert floats(full) - floats(bounded) == saved
    assert optimizer_bytes(named, "basis_rotation", 4, 16) == optimizer_bytes(named, "basis_rotation", 4) - 4 * saved
