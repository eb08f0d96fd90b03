"""BasisRotationAdam: hand-computed first step, float32 first step, orthogonal bases, AdamW equivalence, state round trip."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from swarmpipe.peer.model.bytegpt import PipelineStage, lm_loss
from swarmpipe.peer.optim import build_optimizer, set_learning_rate
from swarmpipe.peer.optim.basis_rotation import BasisRotationAdam, is_rotated_param
from swarmpipe.peer.spec import ModelSpec, OptimizerSpec, RunSpec

pytestmark = pytest.mark.unit
torch.set_num_threads(1)


def _rotation(angle: float) -> torch.Tensor:
    c, s = math.cos(angle), math.sin(angle)
    return torch.tensor([[c, -s], [s, c]], dtype=torch.float64)


def test_first_step_is_adam_in_the_singular_basis() -> None:
    # G = U diag(3, 1) V^T: the eigenbases of G G^T and G^T G are U and V, so the rotated
    # gradient is diag(3, 1). The reference code's first step there, by hand: m = (1 - b1) G',
    # v = (1 - b2) G'^2, step lr sqrt(1 - b2) / (1 - b1) * m / (sqrt(v) + eps).
    u, v = _rotation(0.3), _rotation(-1.1)
    g = u @ torch.diag(torch.tensor([3.0, 1.0], dtype=torch.float64)) @ v.T
    lr, eps, wd, b1, b2 = 0.1, 1e-3, 0.5, 0.9, 0.999
    w0 = torch.tensor([[1.0, 2.0], [-1.0, 0.5]], dtype=torch.float64)
    p = torch.nn.Parameter(w0.clone())
    opt = BasisRotationAdam([p], lr=lr, eps=eps, weight_decay=wd, betas=(b1, b2), rotate=True)
    p.grad = g.clone()
    opt.step()
    step = [lr * math.sqrt(1 - b2) / (1 - b1) * (1 - b1) * s / (math.sqrt(1 - b2) * s + eps) for s in (3.0, 1.0)]
    assert step[1] == pytest.approx(lr / (1 + eps / math.sqrt(1 - b2)))  # eps counts 31.6x at step 1
    direction = u @ torch.diag(torch.tensor(step, dtype=torch.float64)) @ v.T
    torch.testing.assert_close(p.detach(), w0 * (1 - lr * wd) - direction)
    # Plain Adam would have stepped by sign(G) instead, which differs.
    assert not torch.allclose(direction / lr, torch.sign(g), atol=0.1)


def test_float32_first_step_stays_in_the_gradients_singular_basis() -> None:
    """Issue 16: right after the first eigendecomposition the rotated gradient is diagonal up to
    float32 residue; Adam's first step divides each entry by its own magnitude, so with eps on
    v / bc2 (the old code) that residue became off-diagonal updates of 0.2 to 0.4 lr (RMS)."""
    gen = torch.Generator().manual_seed(0)
    for m, n in ((64, 64), (96, 32)):
        k = min(m, n)
        u = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))[0][:, :k]
        v = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0][:, :k]
        s = torch.logspace(math.log10(5e-2), -3, k, dtype=torch.float64)  # gradient-sized, full rank
        p = torch.nn.Parameter(torch.zeros(m, n))
        p.grad = ((u * s) @ v.T).float()
        BasisRotationAdam([p], lr=1.0, eps=1e-8, weight_decay=0.0, betas=(0.9, 0.999), rotate=True).step()
        update = -(u.T @ p.detach().double() @ v)  # in the exact singular bases, in units of lr
        off = update - torch.diag(torch.diagonal(update))
        assert off.pow(2).mean().sqrt() < 0.05, (m, n, float(off.pow(2).mean().sqrt()))
        torch.testing.assert_close(torch.diagonal(update), torch.ones(k, dtype=torch.float64), atol=0.05, rtol=0)


def test_bases_stay_orthogonal_and_sorted() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6, 4, generator=gen))
    opt = BasisRotationAdam([p], lr=1e-2, rotation_every=2, rotate=True)
    mix = torch.randn(6, 6, generator=gen)
    for step in range(1, 8):
        previous = {k: v.clone() for k, v in opt.state[p].items() if k.startswith("q_")}
        p.grad = mix @ torch.randn(6, 4, generator=gen)
        opt.step()
        state = opt.state[p]
        for side in ("left", "right"):
            q, gg = state[f"q_{side}"], state[f"gg_{side}"]
            torch.testing.assert_close(q.T @ q, torch.eye(q.shape[0]), atol=1e-5, rtol=0)
            if step == 1:  # just decomposed: sorted by eigenvalue
                estimates = torch.diag(q.T @ gg @ q)
                assert torch.all(estimates[:-1] >= estimates[1:] - 1e-6)
            elif step % 2 == 0:  # refreshed: the old basis sorted by its estimates, then QR(M Q)
                old = previous[f"q_{side}"]
                order = torch.argsort(torch.diag(old.T @ gg @ old), descending=True)
                expected = torch.linalg.qr(gg @ old[:, order])[0]
                torch.testing.assert_close(q.abs(), expected.abs(), atol=1e-5, rtol=0)


def test_power_step_permutes_second_moment_with_basis() -> None:
    p = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    opt = BasisRotationAdam([p], lr=1e-3, weight_decay=0.0, rotation_every=2, rotate=True, betas=(0.9, 0.5))
    p.grad = torch.ones(3, 2, dtype=torch.float64)
    opt.step()
    state = opt.state[p]
    # Plant a diagonal left statistic whose eigenvalues the current (identity) basis lists
    # in ascending order; the refresh must sort them and carry the rows of v along.
    state["gg_left"] = torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)) / 0.5
    state["q_left"] = torch.eye(3, dtype=torch.float64)
    state["gg_right"] = torch.eye(2, dtype=torch.float64) * 4
    state["q_right"] = torch.eye(2, dtype=torch.float64)
    state["exp_avg_sq"] = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]], dtype=torch.float64)
    p.grad = torch.zeros(3, 2, dtype=torch.float64)
    opt.step()  # step 2: refresh
    q = state["q_left"]
    torch.testing.assert_close(q.abs(), torch.eye(3, dtype=torch.float64).flip(1))
    # v decayed by beta2 = 0.5 (zero gradient), rows reversed with the basis.
    torch.testing.assert_close(state["exp_avg_sq"][:, 0], torch.tensor([1.5, 1.0, 0.5], dtype=torch.float64))


def test_identity_basis_is_adamw() -> None:
    gen = torch.Generator().manual_seed(2)
    init = [torch.randn(5, 3, generator=gen), torch.randn(3, generator=gen)]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    kw = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    opt = BasisRotationAdam(
        [{"params": [ours[0]], "rotate": True}, {"params": [ours[1]]}], init_basis="identity", rotation_every=0, **kw
    )
    ref_opt = torch.optim.AdamW(ref, **kw)
    for _ in range(5):
        grads = [torch.randn_like(t) for t in init]
        for a, b, g in zip(ours, ref, grads):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-7)


def test_build_rotates_attention_and_mlp_matrices_only() -> None:
    spec = RunSpec(num_stages=1, model=ModelSpec(d_model=16, n_layers=1, n_heads=2, seq_len=8))
    stage = PipelineStage(spec, 0)
    opt = build_optimizer(stage.named_parameters(), OptimizerSpec(kind="basis_rotation"), 0, 1)
    rotated = {id(p) for p in opt.param_groups[0]["params"]}
    names = sorted(n for n, p in stage.named_parameters() if id(p) in rotated)
    assert names == [
        "blocks.0.attn.proj.weight",
        "blocks.0.attn.qkv.weight",
        "blocks.0.fc.weight",
        "blocks.0.fc_out.weight",
    ]
    assert opt.param_groups[0]["rotate"] and not opt.param_groups[1]["rotate"]
    assert opt.param_groups[0]["rotation_every"] == 10
    assert not is_rotated_param("head.weight", stage.head.weight)


def _train(stage: PipelineStage, opt: torch.optim.Optimizer, spec: OptimizerSpec, batches: list, start: int) -> None:
    for i, (x, y) in enumerate(batches):
        set_learning_rate(opt, spec, start + i, 0, 1)
        lm_loss(stage(x), y).backward()
        torch.nn.utils.clip_grad_norm_(stage.parameters(), spec.clip_norm)
        opt.step()
        opt.zero_grad()


def test_state_round_trip_continues_identically() -> None:
    spec = RunSpec(num_stages=1, model=ModelSpec(d_model=16, n_layers=1, n_heads=2, seq_len=8))
    opt_spec = OptimizerSpec(kind="basis_rotation", rotation_every=2, warmup_steps=2)
    gen = torch.Generator().manual_seed(3)
    batches = [
        (torch.randint(0, 256, (2, 8), generator=gen), torch.randint(0, 256, (2, 8), generator=gen)) for _ in range(8)
    ]
    stage = PipelineStage(spec, 0)
    opt = build_optimizer(stage.named_parameters(), opt_spec, 0, 1)
    _train(stage, opt, opt_spec, batches[:3], 0)
    saved_model = copy.deepcopy(stage.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    for s in saved_opt["state"].values():
        assert all(isinstance(v, (torch.Tensor, float, int)) for v in s.values())
    _train(stage, opt, opt_spec, batches[3:], 3)  # crosses two basis refreshes

    clone = PipelineStage(spec, 0)
    clone.load_state_dict(saved_model)
    clone_opt = build_optimizer(clone.named_parameters(), opt_spec, 0, 1)
    clone_opt.load_state_dict(saved_opt)
    _train(clone, clone_opt, opt_spec, batches[3:], 3)
    for a, b in zip(stage.parameters(), clone.parameters()):
        assert torch.equal(a, b)
