"""swarmpipe.peer.model.bytegpt: the pipeline split computes exactly what the whole model computes."""

from __future__ import annotations

import zlib

import pytest
import torch

from swarmpipe.peer.model.bytegpt import ByteGPT, PipelineStage, build_stage, lm_loss
from swarmpipe.peer.spec import ModelSpec, RunSpec

pytestmark = pytest.mark.unit

N_LAYERS = 4


def make_spec(num_stages: int, seed: int = 3, **kw) -> RunSpec:
    model = ModelSpec(vocab_size=64, d_model=32, n_layers=N_LAYERS, n_heads=2, seq_len=16, mlp_ratio=2)
    return RunSpec(num_stages=num_stages, seed=seed, model=model, **kw).validate()


def canonical(stage: PipelineStage, name: str) -> str:
    """Stage-local parameter name -> name independent of the split (global block index)."""
    if name.startswith("blocks."):
        _, local, rest = name.split(".", 2)
        return f"blocks.{stage.block_indices[int(local)]}.{rest}"
    return name


def perturb(stages: list[PipelineStage]) -> None:
    """Add the same deterministic noise (keyed by canonical name) to every parameter, whatever the split.

    Needed because at init the final LayerNorm's weight is 0 (see test_final_norm_weight_initialised_to_one),
    which makes the logits 0 and every gradient upstream of the head exactly 0: comparing those would prove nothing.
    """
    with torch.no_grad():
        for s in stages:
            for n, p in s.named_parameters():
                gen = torch.Generator().manual_seed(zlib.crc32(canonical(s, n).encode()))
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
                if n == "norm.weight":
                    p.add_(1.0)


def batch(spec: RunSpec, b: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    t = spec.model.seq_len
    tokens = torch.randint(0, spec.model.vocab_size, (b, t + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def run(stages: list[PipelineStage], inputs: torch.Tensor, targets: torch.Tensor):
    """Forward through a chain of stages, backward from the loss; returns logits, loss, grads by canonical name."""
    for s in stages:
        s.zero_grad(set_to_none=True)
    x = inputs
    for s in stages:
        x = s(x)
    loss = lm_loss(x, targets)
    loss.backward()
    grads = {canonical(s, n): p.grad.clone() for s in stages for n, p in s.named_parameters()}
    params = {canonical(s, n): p.detach().clone() for s in stages for n, p in s.named_parameters()}
    return x.detach(), loss.detach(), grads, params


@pytest.fixture(scope="module")
def whole():
    spec = make_spec(1)
    inputs, targets = batch(spec)
    stage = PipelineStage(spec, 0)
    perturb([stage])
    return run([stage], inputs, targets)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_split_matches_whole_model(whole, num_stages: int) -> None:
    spec = make_spec(num_stages)
    inputs, targets = batch(spec)
    stages = [PipelineStage(spec, s) for s in range(num_stages)]
    assert [i for s in stages for i in s.block_indices] == list(range(N_LAYERS))
    perturb(stages)
    logits, loss, grads, params = run(stages, inputs, targets)
    w_logits, w_loss, w_grads, w_params = whole
    assert set(params) == set(w_params)
    for name in w_params:
        assert torch.equal(params[name], w_params[name]), name
    assert logits.shape == (3, spec.model.seq_len, spec.model.vocab_size)
    torch.testing.assert_close(logits, w_logits, rtol=0, atol=0)  # same ops, same order: bitwise
    torch.testing.assert_close(loss, w_loss, rtol=1e-6, atol=1e-7)
    assert set(grads) == set(w_grads)
    for name in w_grads:
        assert w_grads[name].abs().max() > 0, f"{name}: zero gradient, the comparison would be vacuous"
        torch.testing.assert_close(grads[name], w_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_fresh_split_weights_equal_whole_model(num_stages: int) -> None:
    whole = PipelineStage(make_spec(1), 0)
    w = {n: p for n, p in whole.named_parameters()}
    spec = make_spec(num_stages)
    for s in range(num_stages):
        stage = PipelineStage(spec, s)
        for n, p in stage.named_parameters():
            assert torch.equal(p, w[canonical(stage, n)]), (s, n)


def test_split_with_explicit_layer_split_matches(whole) -> None:
    spec = make_spec(3, layer_split=[1, 3, 0])
    inputs, targets = batch(spec)
    stages = [PipelineStage(spec, s) for s in range(3)]
    assert [s.block_indices for s in stages] == [[0], [1, 2, 3], []]
    perturb(stages)
    logits, loss, grads, _ = run(stages, inputs, targets)
    torch.testing.assert_close(logits, whole[0], rtol=1e-6, atol=1e-6)
    for name, g in whole[2].items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_gradient_of_loss_wrt_hidden_state_matches_across_boundary() -> None:
    """The gradient a stage sends upstream equals d loss / d hidden state in the whole model."""
    spec2 = make_spec(2)
    inputs, targets = batch(spec2)
    s0, s1 = PipelineStage(spec2, 0), PipelineStage(spec2, 1)
    perturb([s0, s1])
    h = s0(inputs)
    h_in = h.detach().requires_grad_(True)
    loss = lm_loss(s1(h_in), targets)
    (grad_h,) = torch.autograd.grad(loss, h_in)
    assert grad_h.abs().max() > 0
    # reference: same hidden state inside the one-piece graph
    h_ref = s0(inputs)
    h_ref.retain_grad()
    lm_loss(s1(h_ref), targets).backward()
    torch.testing.assert_close(grad_h, h_ref.grad)
    # and the upstream gradients obtained by feeding grad_h back into stage 0 match
    s0.zero_grad()
    s0(inputs).backward(grad_h)
    g_split = {n: p.grad.clone() for n, p in s0.named_parameters()}
    whole = ByteGPT(make_spec(1))
    perturb(list(whole.stages))
    lm_loss(whole(inputs), targets).backward()
    for n, g in g_split.items():
        torch.testing.assert_close(g, whole.stages[0].get_parameter(canonical(s0, n)).grad, rtol=1e-5, atol=1e-7)


def test_stage_roles_and_parameters() -> None:
    spec = make_spec(3)
    first, middle, last = (PipelineStage(spec, s) for s in range(3))
    assert first.is_first and not first.is_last
    assert not middle.is_first and not middle.is_last
    assert last.is_last and not last.is_first
    assert hasattr(first, "tok_emb") and not hasattr(middle, "tok_emb")
    assert hasattr(last, "head") and not hasattr(middle, "head")
    assert first.input_spec() == (torch.int64, 2)
    assert middle.input_spec() == (torch.float32, 3)
    h = first(batch(spec)[0])
    assert h.shape == (3, spec.model.seq_len, spec.model.d_model)
    assert middle(h).shape == h.shape


@pytest.mark.parametrize("stage", [-1, 2])
def test_stage_out_of_range(stage: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        PipelineStage(make_spec(2), stage)


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_fresh_replicas_identical(num_stages: int) -> None:
    spec = make_spec(num_stages)
    torch.manual_seed(123)  # global RNG state must not matter
    for s in range(num_stages):
        a = build_stage(spec, s)
        torch.rand(17)
        b = PipelineStage(make_spec(num_stages), s)
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), (s, k)


def test_different_seed_gives_different_weights() -> None:
    a = PipelineStage(make_spec(1, seed=1), 0)
    b = PipelineStage(make_spec(1, seed=2), 0)
    assert not torch.equal(a.blocks[0].fc.weight, b.blocks[0].fc.weight)
    assert not torch.equal(a.tok_emb.weight, b.tok_emb.weight)


def test_blocks_get_distinct_weights() -> None:
    m = PipelineStage(make_spec(1), 0)
    assert not torch.equal(m.blocks[0].fc.weight, m.blocks[1].fc.weight)


def test_bytegpt_is_chain_of_stages() -> None:
    spec = make_spec(2)
    inputs, _ = batch(spec)
    model = ByteGPT(spec)
    s0, s1 = PipelineStage(spec, 0), PipelineStage(spec, 1)
    torch.testing.assert_close(model(inputs), s1(s0(inputs)), rtol=0, atol=0)


def test_causality() -> None:
    """Changing a later token must not change earlier logits."""
    spec = make_spec(2)
    model = ByteGPT(spec)
    perturb(list(model.stages))
    inputs, _ = batch(spec, b=1)
    changed = inputs.clone()
    changed[0, -1] = (changed[0, -1] + 1) % spec.model.vocab_size
    a, b = model(inputs), model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_lm_loss_of_uniform_logits_is_log_vocab() -> None:
    logits = torch.zeros(2, 5, 64)
    targets = torch.randint(0, 64, (2, 5))
    assert lm_loss(logits, targets).item() == pytest.approx(torch.log(torch.tensor(64.0)).item())


def test_final_norm_weight_initialised_to_one() -> None:
    last = PipelineStage(make_spec(2), 1)
    assert torch.equal(last.norm.weight, torch.ones_like(last.norm.weight))
    assert torch.equal(last.norm.bias, torch.zeros_like(last.norm.bias))


def test_fresh_model_gives_gradient_to_blocks() -> None:
    spec = make_spec(1)
    model = PipelineStage(spec, 0)
    inputs, targets = batch(spec)
    lm_loss(model(inputs), targets).backward()
    assert model.blocks[0].fc.weight.grad.abs().max() > 0
