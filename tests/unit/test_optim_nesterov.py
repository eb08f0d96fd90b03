"""PipelineNesterov: hand-computed steps, NAdam equivalence, no-stash corrections, state round trip."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from swarmpipe.peer.model.bytegpt import PipelineStage, lm_loss
from swarmpipe.peer.optim import (
    DELAY_WINDOW,
    average_delay,
    build_optimizer,
    scheduled_lr,
    set_learning_rate,
    stage_lr_factor,
)
from swarmpipe.peer.optim.nesterov import PipelineNesterov, stage_beta1
from swarmpipe.peer.spec import ModelSpec, OptimizerSpec, RunSpec, SpecError, spec_from_dict

pytestmark = pytest.mark.unit
torch.set_num_threads(1)


def test_two_hand_computed_steps() -> None:
    lr, b1, b2, eps, wd, psi = 0.1, 0.9, 0.99, 1e-8, 0.1, 0.004
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = PipelineNesterov([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, momentum_decay=psi)
    x, m, v, prod = [1.0, -2.0], [0.0, 0.0], [0.0, 0.0], 1.0
    for t, g in enumerate(([0.5, -1.0], [-0.25, 2.0]), start=1):
        p.grad = torch.tensor(g)
        opt.step()
        mu = b1 * (1 - 0.5 * 0.96 ** (t * psi))
        mu_next = b1 * (1 - 0.5 * 0.96 ** ((t + 1) * psi))
        prod *= mu
        for i in range(2):
            x[i] *= 1 - lr * wd
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            denom = math.sqrt(v[i] / (1 - b2**t)) + eps
            x[i] -= lr * (1 - mu) / (1 - prod) * g[i] / denom + lr * mu_next / (1 - prod * mu_next) * m[i] / denom
        assert p.detach().tolist() == pytest.approx(x, rel=1e-6)


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_matches_torch_nadam(wd: float) -> None:
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(4, 3, generator=gen)
    ours = torch.nn.Parameter(init.clone())
    ref = torch.nn.Parameter(init.clone())
    kw = dict(lr=0.01, betas=(0.99, 0.999), eps=1e-8, weight_decay=wd, momentum_decay=0.004)
    opt = PipelineNesterov([ours], **kw)
    ref_opt = torch.optim.NAdam([ref], decoupled_weight_decay=True, **kw)
    for _ in range(6):
        g = torch.randn(4, 3, generator=gen)
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-5, atol=1e-7)


def test_build_uses_nesterov_beta1_and_stage_momentum() -> None:
    spec = RunSpec(num_stages=8, model=ModelSpec(d_model=16, n_layers=8, n_heads=2, seq_len=8))
    stage = PipelineStage(spec, 0)
    opt_spec = OptimizerSpec(kind="nesterov")
    opt = build_optimizer(stage.named_parameters(), opt_spec, 0, 8)
    assert isinstance(opt, PipelineNesterov)
    assert opt.param_groups[0]["betas"] == (0.99, 0.999)
    # No stash: the reference code's adaptive momentum, b + d_k (0.99 - b) / P from b = betas[0] = 0.9.
    nostash = OptimizerSpec(kind="nesterov", stash=False)
    betas0 = build_optimizer(stage.named_parameters(), nostash, 0, 8).param_groups[0]["betas"]
    assert betas0 == (pytest.approx(0.9 + 7 * 0.09 / 8), 0.999)  # 0.97875
    assert stage_beta1(0.9, 0.99, 7, 8) == 0.9  # the last stage has no delay: the base
    assert stage_beta1(0.9, 0.99, 6, 8) == pytest.approx(0.91125)
    assert stage_beta1(0.9, 0.99, 0, 64) == pytest.approx(0.9 + 63 * 0.09 / 64)
    assert all(stage_beta1(0.9, 0.99, k, 64) < 0.99 for k in range(64))  # approaches, never reaches
    assert all(stage_beta1(0.9, 0.99, k, 8) > stage_beta1(0.9, 0.99, k + 1, 8) for k in range(7))


def test_nostash_learning_rate_correction() -> None:
    spec = OptimizerSpec(kind="nesterov", stash=False, lr=1e-3, warmup_steps=0, total_steps=100)
    # lr_k(t) = lr(t) / tau_k ** (1 - min((t + 1) / T_c, 1)), tau_k = max(1, P-1-k), T_c = 14 % of 100 = 14.
    assert stage_lr_factor(spec, 0, 0, 4) == pytest.approx(3 ** -(1 - 1 / 14))
    assert stage_lr_factor(spec, 6, 0, 4) == pytest.approx(3**-0.5)
    assert stage_lr_factor(spec, 13, 0, 4) == 1.0  # (13 + 1) / 14: done after 14 % of the run
    assert stage_lr_factor(spec, 50, 0, 4) == 1.0
    assert stage_lr_factor(spec, 0, 2, 4) == 1.0  # tau = 1
    assert stage_lr_factor(spec, 0, 3, 4) == 1.0
    p = torch.nn.Parameter(torch.zeros(2))
    opt = PipelineNesterov([p])
    lr = set_learning_rate(opt, spec, 6, 0, 4)
    assert opt.param_groups[0]["lr"] == lr
    assert lr == pytest.approx(scheduled_lr(spec, 6) * 3**-0.5)
    # Stashing peers and other kinds get no correction; total_steps 0 falls back to a fixed horizon.
    assert stage_lr_factor(OptimizerSpec(kind="nesterov"), 0, 0, 4) == 1.0
    assert stage_lr_factor(OptimizerSpec(kind="adamw", stash=False), 0, 0, 4) == 1.0
    assert 1 / 3 < stage_lr_factor(OptimizerSpec(kind="nesterov", stash=False), 10, 0, 4) < 1.0


def test_nostash_stage_step_by_hand() -> None:
    """Stage 0 of P = 4 without stashing, two steps through the factory and set_learning_rate."""
    spec = OptimizerSpec(
        kind="nesterov",
        stash=False,
        lr=0.1,
        betas=(0.8, 0.99),
        nesterov_beta1=0.96,
        eps=1e-8,
        weight_decay=0.1,
        momentum_decay=0.004,
        warmup_steps=0,
        total_steps=50,
        clip_norm=0.0,
    )
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = build_optimizer([("w", p)], spec, 0, 4)
    b1, b2, psi, wd = 0.8 + 3 * (0.96 - 0.8) / 4, 0.99, 0.004, 0.1  # beta1_0 = 0.92
    x, m, v, prod = [1.0, -2.0], [0.0, 0.0], [0.0, 0.0], 1.0
    for t, g in enumerate(([0.5, -1.0], [-0.25, 2.0]), start=1):
        # cosine schedule at step t - 1 of 50, then the delay correction over T_c = 7 steps
        base = 0.1 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - 1) / 50)))
        lr = base / 3 ** (1 - t / 7)
        assert set_learning_rate(opt, spec, t - 1, 0, 4) == pytest.approx(lr)
        p.grad = torch.tensor(g)
        opt.step()
        mu = b1 * (1 - 0.5 * 0.96 ** (t * psi))
        mu_next = b1 * (1 - 0.5 * 0.96 ** ((t + 1) * psi))
        prod *= mu
        for i in range(2):
            x[i] *= 1 - lr * wd
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            denom = math.sqrt(v[i] / (1 - b2**t)) + 1e-8
            x[i] -= lr * (1 - mu) / (1 - prod) * g[i] / denom + lr * mu_next / (1 - prod * mu_next) * m[i] / denom
        assert p.detach().tolist() == pytest.approx(x, rel=1e-6)


def _train(stage: PipelineStage, opt: torch.optim.Optimizer, spec: OptimizerSpec, batches: list, start: int) -> None:
    for i, (x, y) in enumerate(batches):
        set_learning_rate(opt, spec, start + i, 0, 1)
        lm_loss(stage(x), y).backward()
        torch.nn.utils.clip_grad_norm_(stage.parameters(), spec.clip_norm)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("stash", [True, False])
def test_state_round_trip_continues_identically(stash: bool) -> None:
    spec = RunSpec(num_stages=1, model=ModelSpec(d_model=16, n_layers=1, n_heads=2, seq_len=8))
    opt_spec = OptimizerSpec(kind="nesterov", warmup_steps=2, stash=stash)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, 256, (2, 8), generator=gen), torch.randint(0, 256, (2, 8), generator=gen)) for _ in range(6)
    ]
    stage = PipelineStage(spec, 0)
    opt = build_optimizer(stage.named_parameters(), opt_spec, 0, 1)
    _train(stage, opt, opt_spec, batches[:3], 0)
    saved_model = copy.deepcopy(stage.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    for s in saved_opt["state"].values():  # only tensors and plain scalars travel
        assert all(isinstance(v, (torch.Tensor, float, int)) for v in s.values())
    _train(stage, opt, opt_spec, batches[3:], 3)

    clone = PipelineStage(spec, 0)
    clone.load_state_dict(saved_model)
    clone_opt = build_optimizer(clone.named_parameters(), opt_spec, 0, 1)
    clone_opt.load_state_dict(saved_opt)
    _train(clone, clone_opt, opt_spec, batches[3:], 3)
    for a, b in zip(stage.parameters(), clone.parameters()):
        assert torch.equal(a, b)


def test_measured_delay_running_average() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = PipelineNesterov([p])
    assert average_delay(opt, None, 7.0) == 7.0  # nothing measured yet: the formula's value
    assert [average_delay(opt, d, 7.0) for d in (3, 5, 10)] == [3.0, 4.0, 6.0]  # exact mean at first
    for _ in range(DELAY_WINDOW):
        average_delay(opt, 2.0, 7.0)
    before = opt.param_groups[0]["delay_avg"]
    assert average_delay(opt, 102.0, 7.0) == pytest.approx(before + (102.0 - before) / DELAY_WINDOW)  # then an EMA
    assert average_delay(opt, None, 7.0) == opt.param_groups[0]["delay_avg"]  # no measurement: unchanged


def test_measured_delay_drives_the_nostash_schedules() -> None:
    spec = OptimizerSpec(
        kind="nesterov", stash=False, lr=1e-3, warmup_steps=0, total_steps=100, delay_source="measured"
    )
    p = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([("w", p)], spec, 0, 8)
    for step, delay in enumerate((3, 3, 3)):  # stage 0 of P = 8, but its gradients are 3 steps old
        lr = set_learning_rate(opt, spec, step, 0, 8, delay=delay)
    # beta1 = 0.9 + 3 (0.99 - 0.9) / 8 by hand; lr / 3 ** (1 - 3 / 14) instead of / 7 ** (...)
    assert opt.param_groups[0]["betas"] == (pytest.approx(0.93375), 0.999)
    assert lr == pytest.approx(scheduled_lr(spec, 2) / 3 ** (1 - 3 / 14))
    # In 1F1B the measured and the formula schedules agree.
    formula = dataclasses.replace(spec, delay_source="formula")
    opt_f = build_optimizer([("w", torch.nn.Parameter(torch.zeros(2)))], formula, 0, 8)
    opt_m = build_optimizer([("w", torch.nn.Parameter(torch.zeros(2)))], spec, 0, 8)
    for step in range(5):
        assert set_learning_rate(opt_m, spec, step, 0, 8, delay=7) == pytest.approx(
            set_learning_rate(opt_f, formula, step, 0, 8, delay=7)
        )
    assert opt_m.param_groups[0]["betas"][0] == pytest.approx(opt_f.param_groups[0]["betas"][0])
    # Stashing peers keep beta1 and the full lr; the average still travels in state_dict.
    stash = dataclasses.replace(spec, stash=True)
    opt_s = build_optimizer([("w", torch.nn.Parameter(torch.zeros(2)))], stash, 0, 8)
    assert set_learning_rate(opt_s, stash, 0, 0, 8, delay=30) == scheduled_lr(stash, 0)
    assert opt_s.param_groups[0]["betas"] == (0.99, 0.999)
    saved = copy.deepcopy(opt.state_dict())
    fresh = build_optimizer([("w", torch.nn.Parameter(torch.zeros(2)))], spec, 0, 8)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["delay_avg"] == 3.0 and fresh.param_groups[0]["delay_seen"] == 3
    with pytest.raises(SpecError, match="delay_source"):
        RunSpec(optimizer=OptimizerSpec(delay_source="guess")).validate()


@pytest.mark.parametrize("value", [5, None, ["measured"], "measured" * 10_000, "formula\x00"])
def test_hostile_delay_source_in_a_spec_is_refused(value: object) -> None:
    with pytest.raises(SpecError, match="delay_source") as err:
        spec_from_dict({"optimizer": {"delay_source": value}})
    assert len(str(err.value)) < 200  # a short message, whatever was sent
    assert spec_from_dict({"optimizer": {"delay_source": "measured"}}).optimizer.delay_source == "measured"
