"""swarmpipe.peer.stage.runtime: exact pipeline gradients, weight stashing, staleness, bookkeeping."""

from __future__ import annotations

import copy
import time
import zlib

import pytest
import torch

from swarmpipe.peer.model.bytegpt import PipelineStage, lm_loss
from swarmpipe.peer.spec import ModelSpec, OptimizerSpec, RunSpec, UpdateSpec
from swarmpipe.peer.stage.runtime import StageRuntime, UnknownMicrobatch

pytestmark = pytest.mark.unit

B = 2


def make_spec(
    num_stages: int = 2,
    lr: float = 0.0,
    step_every: int = 1,
    max_staleness: int = 32,
    ttl: float = 120.0,
    kind: str = "adamw",
) -> RunSpec:
    return RunSpec(
        num_stages=num_stages,
        seed=1,
        microbatch_size=B,
        model=ModelSpec(vocab_size=64, d_model=32, n_layers=4, n_heads=2, seq_len=16, mlp_ratio=2),
        optimizer=OptimizerSpec(kind=kind, lr=lr, warmup_steps=0, clip_norm=0.0, weight_decay=0.0),
        update=UpdateSpec(step_every=step_every, max_staleness=max_staleness, pending_ttl_s=ttl),
    ).validate()


def canonical(module: PipelineStage, name: str) -> str:
    if name.startswith("blocks."):
        _, local, rest = name.split(".", 2)
        return f"blocks.{module.block_indices[int(local)]}.{rest}"
    return name


def perturb(module: PipelineStage) -> None:
    """Same deterministic noise for a parameter whatever the split; final norm weight set near 1.

    (At init the final LayerNorm weight is 0, which zeroes every gradient upstream of the head; see test_model.)
    """
    with torch.no_grad():
        for n, p in module.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(canonical(module, n).encode()))
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
            if n == "norm.weight":
                p.add_(1.0)


def runtime(spec: RunSpec, stage: int) -> StageRuntime:
    rt = StageRuntime(spec, stage)
    perturb(rt.weights.module)
    return rt


def data(spec: RunSpec, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.model.vocab_size, (B, spec.model.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def hidden(spec: RunSpec, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(B, spec.model.seq_len, spec.model.d_model, generator=gen)


def record_step_grads(rt: StageRuntime) -> list[dict[str, torch.Tensor]]:
    """Capture the gradients the optimizer sees at every step (names as in rt.weights.module)."""
    seen: list[dict[str, torch.Tensor]] = []
    step = rt.weights.optimizer.step
    names = {id(p): n for n, p in rt.weights.module.named_parameters()}

    def recording_step(*args, **kwargs):
        seen.append({names[id(p)]: p.grad.clone() for p in rt.weights.module.parameters() if p.grad is not None})
        return step(*args, **kwargs)

    rt.weights.optimizer.step = recording_step  # type: ignore[method-assign]
    return seen


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


# ------------------------------------------------------------------ exactness of the 2-stage pipeline


def test_two_stage_pipeline_matches_whole_model() -> None:
    spec = make_spec(2, lr=0.0)
    s0, s1 = runtime(spec, 0), runtime(spec, 1)
    g0, g1 = record_step_grads(s0), record_step_grads(s1)
    before0, before1 = weights(s0.weights.module), weights(s1.weights.module)

    whole = PipelineStage(make_spec(1), 0)
    perturb(whole)

    for i in range(3):
        x, y = data(spec, seed=i)
        h = s0.forward(f"mb{i}", x)
        r1 = s1.forward_backward(h, y)
        r0 = s0.backward(f"mb{i}", r1.grad_input)
        assert r1.applied and r0.applied and r0.delay == 0 and r1.delay == 0
        assert r0.grad_input is None and r1.grad_input.shape == h.shape

        whole.zero_grad(set_to_none=True)
        loss = lm_loss(whole(x), y)
        loss.backward()
        assert r1.loss == pytest.approx(loss.item(), rel=1e-6)
        ref = {n: p.grad for n, p in whole.named_parameters()}
        got = {canonical(s0.weights.module, n): g for n, g in g0[i].items()}
        got.update({canonical(s1.weights.module, n): g for n, g in g1[i].items()})
        assert set(got) == set(ref)
        for name, g in ref.items():
            assert g.abs().max() > 0, name
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)

    # lr = 0: the weights did not move although three steps were taken
    assert s0.version == s1.version == 3
    for n, w in weights(s0.weights.module).items():
        assert torch.equal(w, before0[n]), n
    for n, w in weights(s1.weights.module).items():
        assert torch.equal(w, before1[n]), n


def test_last_stage_forward_then_backward_matches_forward_backward() -> None:
    spec = make_spec(2, lr=0.0)
    a, b = runtime(spec, 1), runtime(spec, 1)
    ga, gb = record_step_grads(a), record_step_grads(b)
    h, (_, y) = hidden(spec), data(spec)
    fb = a.forward_backward(h, y)
    logits = b.forward("m", h).requires_grad_(True)
    loss = lm_loss(logits, y)
    (dlogits,) = torch.autograd.grad(loss, logits)
    r = b.backward("m", dlogits)
    assert r.applied and fb.loss == pytest.approx(loss.item())
    torch.testing.assert_close(r.grad_input, fb.grad_input)
    for n in ga[0]:
        torch.testing.assert_close(gb[0][n], ga[0][n], msg=n)


# ------------------------------------------------------------------ weight stashing


@pytest.mark.parametrize("stage, updates", [(0, 1), (0, 3), (1, 2)])
def test_weight_stashing_gradient_at_forward_version(stage: int, updates: int) -> None:
    spec = make_spec(3, lr=1e-2)
    rt = runtime(spec, stage)
    seen = record_step_grads(rt)
    x = data(spec)[0] if stage == 0 else hidden(spec)
    old = copy.deepcopy(rt.weights.module)  # the weights the forward will use

    out = rt.forward("A", x)
    for i in range(updates):  # other micro-batches update the live weights meanwhile
        xi = data(spec, seed=10 + i)[0] if stage == 0 else hidden(spec, seed=10 + i)
        oi = rt.forward(f"B{i}", xi)
        assert rt.backward(f"B{i}", torch.randn_like(oi)).applied
    assert rt.version == updates
    assert any(not torch.equal(p, old.get_parameter(n)) for n, p in rt.weights.module.named_parameters())

    g = torch.randn_like(out)
    live = copy.deepcopy(rt.weights.module)  # the live weights when the backward arrives
    result = rt.backward("A", g)
    assert result.applied and result.delay == updates
    assert rt.stats.delays[updates] == 1 and rt.stats.delays[0] == updates

    # reference: the gradient at the old weights
    x_ref = x if stage == 0 else x.clone().requires_grad_(True)
    out_ref = old(x_ref)
    torch.testing.assert_close(out, out_ref.detach())
    out_ref.backward(g)
    for n, p in old.named_parameters():
        torch.testing.assert_close(seen[-1][n], p.grad, rtol=1e-5, atol=1e-8, msg=n)
    if stage != 0:
        torch.testing.assert_close(result.grad_input, x_ref.grad, rtol=1e-5, atol=1e-8)
    # and it differs from the gradient at the live weights (the test would otherwise prove nothing)
    live(x if stage == 0 else x.clone()).backward(g)
    assert any(not torch.allclose(seen[-1][n], p.grad, rtol=1e-3, atol=1e-6) for n, p in live.named_parameters())


def test_stale_gradient_dropped() -> None:
    spec = make_spec(2, lr=1e-2, max_staleness=2)
    rt = runtime(spec, 0)
    out = rt.forward("A", data(spec)[0])
    for i in range(3):
        oi = rt.forward(f"B{i}", data(spec, seed=i + 1)[0])
        rt.backward(f"B{i}", torch.randn_like(oi))
    before = weights(rt.weights.module)
    result = rt.backward("A", torch.randn_like(out))
    assert result.applied is False and result.delay == 3
    assert "stale" in result.dropped_reason and "3" in result.dropped_reason and "2" in result.dropped_reason
    assert rt.stats.dropped_stale == 1 and rt.version == 3
    for n, w in weights(rt.weights.module).items():
        assert torch.equal(w, before[n]), n
    assert "A" not in rt.pending


def test_gradient_at_the_staleness_bound_is_applied() -> None:
    spec = make_spec(2, lr=1e-2, max_staleness=2)
    rt = runtime(spec, 1)
    out = rt.forward("A", hidden(spec))
    for i in range(2):
        oi = rt.forward(f"B{i}", hidden(spec, seed=i + 1))
        rt.backward(f"B{i}", torch.randn_like(oi))
    result = rt.backward("A", torch.randn_like(out))
    assert result.applied and result.delay == 2 and rt.stats.dropped_stale == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_dropped(bad: float) -> None:
    spec = make_spec(2, lr=1e-2)
    rt = runtime(spec, 1)
    out = rt.forward("A", hidden(spec))
    g = torch.randn_like(out)
    g[0, 0, 0] = bad
    before = weights(rt.weights.module)
    result = rt.backward("A", g)
    assert result.applied is False and result.dropped_reason == "non-finite gradient"
    assert result.grad_input is not None  # still returned to the caller
    assert rt.stats.dropped_nonfinite == 1 and rt.version == 0
    for n, w in weights(rt.weights.module).items():
        assert torch.equal(w, before[n]), n
    assert all(p.grad is None for p in rt.weights.module.parameters())  # nothing accumulated


def test_unknown_microbatch() -> None:
    spec = make_spec(2)
    rt = runtime(spec, 1)
    with pytest.raises(UnknownMicrobatch, match="no forward for micro-batch 'ghost'"):
        rt.backward("ghost", torch.zeros(B, spec.model.seq_len, spec.model.vocab_size))
    assert issubclass(UnknownMicrobatch, KeyError)
    out = rt.forward("A", hidden(spec))
    rt.backward("A", torch.zeros_like(out))
    with pytest.raises(UnknownMicrobatch):  # a second backward for the same micro-batch
        rt.backward("A", torch.zeros_like(out))


def test_wrong_grad_shape_keeps_record_for_retry() -> None:
    spec = make_spec(2)
    rt = runtime(spec, 0)
    out = rt.forward("A", data(spec)[0])
    with pytest.raises(ValueError, match="does not match output"):
        rt.backward("A", torch.zeros(1, 2, 3))
    assert "A" in rt.pending
    assert rt.backward("A", torch.zeros_like(out)).applied


def test_retried_forward_replaces_record() -> None:
    spec = make_spec(2)
    rt = runtime(spec, 1)
    rt.forward("A", hidden(spec, seed=1))
    out2 = rt.forward("A", hidden(spec, seed=2))
    assert len(rt.pending) == 1 and torch.equal(rt.pending["A"].output.detach(), out2)


# ------------------------------------------------------------------ housekeeping


def test_expire_by_ttl() -> None:
    spec = make_spec(2, ttl=10.0)
    rt = runtime(spec, 1)
    rt.forward("A", hidden(spec))
    rt.forward("B", hidden(spec))
    t0 = time.monotonic()
    assert rt.expire(now=t0 + 5.0) == 0 and len(rt.pending) == 2
    rt.pending["B"].created_at = t0 + 8.0  # B is younger
    assert rt.expire(now=t0 + 15.0) == 1
    assert list(rt.pending) == ["B"] and rt.stats.expired == 1
    assert rt.expire(now=t0 + 100.0) == 1 and not rt.pending and rt.stats.expired == 2
    with pytest.raises(UnknownMicrobatch):
        rt.backward("A", torch.zeros(B, spec.model.seq_len, spec.model.vocab_size))


def test_expire_by_version() -> None:
    spec = make_spec(2, lr=1e-3, max_staleness=1)
    rt = runtime(spec, 1)
    rt.forward("old", hidden(spec))
    for i in range(2):
        o = rt.forward(f"B{i}", hidden(spec, seed=i + 1))
        rt.backward(f"B{i}", torch.randn_like(o))
    assert rt.version == 2
    assert rt.expire() == 1 and "old" not in rt.pending


def test_averaging_in_a_newer_replica_does_not_make_held_forwards_stale() -> None:
    """A version jump from averaging is not local updates: the delay clock is this runtime's own steps."""

    spec = make_spec(2, lr=1e-3, max_staleness=2)
    rt, ahead = runtime(spec, 1), runtime(spec, 1)
    ahead.weights.version = 500  # a replica that has been training much longer
    out = rt.forward("held", hidden(spec))
    rt.weights.blend(ahead.weights.export_state())
    assert rt.version == 500
    assert rt.expire() == 0 and "held" in rt.pending
    result = rt.backward("held", torch.randn_like(out))
    assert result.applied and result.delay == 0


def test_forward_expires_old_records() -> None:
    spec = make_spec(2, ttl=0.0)
    rt = runtime(spec, 1)
    rt.forward("A", hidden(spec))
    time.sleep(0.01)
    rt.forward("B", hidden(spec))
    assert list(rt.pending) == ["B"] and rt.stats.expired == 1


def test_max_pending_evicts_oldest() -> None:
    spec = make_spec(2)
    rt = StageRuntime(spec, 1, max_pending=2)
    for name in "ABC":
        rt.forward(name, hidden(spec))
    assert list(rt.pending) == ["B", "C"] and rt.stats.expired == 1


def test_replay_backward() -> None:
    """A backward whose forward ran elsewhere: recomputed here on live weights, same result as fwd+bwd."""
    spec = make_spec(3, lr=1e-2)
    a, b = runtime(spec, 1), runtime(spec, 1)
    ga, gb = record_step_grads(a), record_step_grads(b)
    x = hidden(spec)
    g = torch.randn(B, spec.model.seq_len, spec.model.d_model)
    out = b.forward("m", x)
    rb = b.backward("m", g)
    ra = a.replay_backward(x, g)
    assert ra.applied and ra.delay == 0 and a.stats.replays == 1 and not a.pending
    torch.testing.assert_close(ra.grad_input, rb.grad_input)
    for n in gb[0]:
        torch.testing.assert_close(ga[0][n], gb[0][n], msg=n)
    assert a.version == b.version == 1
    for n, w in weights(a.weights.module).items():
        torch.testing.assert_close(w, weights(b.weights.module)[n], msg=n)
    with pytest.raises(ValueError, match="does not match output"):
        a.replay_backward(x, torch.zeros(1, 1, 1))
    assert out.shape == g.shape


def test_replay_backward_first_stage() -> None:
    spec = make_spec(2, lr=1e-2)
    rt = runtime(spec, 0)
    x = data(spec)[0]
    r = rt.replay_backward(x, torch.randn(B, spec.model.seq_len, spec.model.d_model))
    assert r.applied and r.grad_input is None and rt.version == 1


@pytest.mark.parametrize("stage", [0, 1])
def test_forward_backward_only_on_last_stage(stage: int) -> None:
    spec = make_spec(3)
    rt = runtime(spec, stage)
    x = data(spec)[0] if stage == 0 else hidden(spec)
    with pytest.raises(ValueError, match=f"stage {stage} is not the last stage"):
        rt.forward_backward(x, data(spec)[1])


def test_forward_backward_validates_targets() -> None:
    spec = make_spec(2)
    rt = runtime(spec, 1)
    h, (_, y) = hidden(spec), data(spec)
    with pytest.raises(ValueError, match="targets shape"):
        rt.forward_backward(h, y[:, :-1])
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 64\)"):
        rt.forward_backward(h, torch.full_like(y, 64))
    with pytest.raises(ValueError, match="targets must lie"):
        rt.forward_backward(h, torch.full_like(y, -1))
    assert rt.version == 0 and rt.stats.backwards == 0


def test_single_stage_forward_backward() -> None:
    spec = make_spec(1, lr=1e-2)
    rt = runtime(spec, 0)
    x, y = data(spec)
    r = rt.forward_backward(x, y)
    assert r.applied and r.grad_input is None and r.loss > 0 and rt.version == 1


def test_step_every_accumulates_and_averages() -> None:
    spec = make_spec(2, lr=1e-2, step_every=3)
    rt = runtime(spec, 1)
    ref = runtime(make_spec(2, lr=0.0), 1)  # same weights, gradients of each micro-batch alone
    seen, ref_seen = record_step_grads(rt), record_step_grads(ref)
    before = weights(rt.weights.module)
    for i in range(3):
        h, (_, y) = hidden(spec, seed=i), data(spec, seed=i)
        r = rt.forward_backward(h, y)
        ref.forward_backward(h, y)
        assert r.applied
        assert rt.version == (1 if i == 2 else 0)
        if i < 2:
            assert not seen and all(torch.equal(w, before[n]) for n, w in weights(rt.weights.module).items())
    assert rt.stats.steps == 1 and len(seen) == 1 and len(ref_seen) == 3
    for n, g in seen[0].items():
        mean = sum(step[n] for step in ref_seen) / 3
        torch.testing.assert_close(g, mean, rtol=1e-5, atol=1e-8, msg=n)
    assert any(not torch.equal(w, before[n]) for n, w in weights(rt.weights.module).items())
    assert all(p.grad is None for p in rt.weights.module.parameters())


def test_dropped_gradient_does_not_count_towards_step_every() -> None:
    spec = make_spec(2, lr=1e-2, step_every=2)
    rt = runtime(spec, 1)
    out = rt.forward("A", hidden(spec))
    rt.backward("A", torch.full_like(out, float("nan")))
    h, (_, y) = hidden(spec), data(spec)
    rt.forward_backward(h, y)
    assert rt.version == 0
    rt.forward_backward(h, y)
    assert rt.version == 1


def test_stats_and_throughput() -> None:
    spec = make_spec(2)
    rt = runtime(spec, 1)
    assert rt.throughput() == 0.0
    out = rt.forward("A", hidden(spec))
    rt.backward("A", torch.zeros_like(out))
    rt.forward_backward(hidden(spec), data(spec)[1])
    s = rt.stats
    assert (s.forwards, s.backwards, s.steps, s.samples) == (2, 2, 2, 2 * B)
    assert rt.throughput() > 0


def test_snapshot_shared_within_a_version() -> None:
    spec = make_spec(2, lr=1e-2)
    rt = runtime(spec, 1)
    rt.forward("A", hidden(spec))
    rt.forward("B", hidden(spec, seed=1))
    assert rt.pending["A"].params is rt.pending["B"].params
    rt.backward("B", torch.randn(B, spec.model.seq_len, spec.model.vocab_size))
    rt.forward("C", hidden(spec, seed=2))
    assert rt.pending["C"].params is not rt.pending["A"].params
    assert rt.pending["C"].version == 1 and rt.pending["A"].version == 0


@pytest.mark.parametrize("kind", ["nesterov", "basis_rotation"])
def test_other_optimizers_step(kind: str) -> None:
    spec = make_spec(2, lr=1e-2, kind=kind)
    rt = runtime(spec, 1)
    before = weights(rt.weights.module)
    r = rt.forward_backward(hidden(spec), data(spec)[1])
    assert r.applied and rt.version == 1
    assert any(not torch.equal(w, before[n]) for n, w in weights(rt.weights.module).items())


def test_without_stashing_the_backward_differentiates_the_live_weights():
    """optimizer.stash = false means it: nothing but the input is kept, and a backward that arrives after
    an update gets the gradient at the live weights (not at the ones its forward saw)."""
    from torch.func import functional_call

    from swarmpipe.peer.spec import load_spec

    spec = load_spec(
        num_stages=2,
        model={"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
        optimizer={"kind": "adamw", "warmup_steps": 0, "stash": False, "clip_norm": 0.0},
    )
    rt = StageRuntime(spec, 0)
    gen = torch.Generator().manual_seed(0)
    x_old, x_new = (torch.randint(0, 256, (2, 16), generator=gen) for _ in range(2))
    out_old = rt.forward("old", x_old)
    assert rt.pending["old"].params is None and not rt.pending["old"].output.requires_grad
    out_new = rt.forward("new", x_new)
    rt.backward("new", torch.randn(out_new.shape, generator=gen))  # one update: the weights moved
    assert rt.version == 1
    live = {n: p.detach().clone().requires_grad_(True) for n, p in rt.weights.module.named_parameters()}
    grad_out = torch.randn(out_old.shape, generator=gen)
    expected = torch.autograd.grad(
        functional_call(rt.weights.module, live, (x_old,)), list(live.values()), grad_out, allow_unused=True
    )
    captured = {}
    rt.weights.optimizer.step = lambda: captured.update(
        {n: p.grad.clone() for n, p in rt.weights.module.named_parameters() if p.grad is not None}
    )
    result = rt.backward("old", grad_out)
    assert result.applied and result.delay == 1
    for (name, _), g in zip(live.items(), expected):
        if g is not None and name in captured:
            assert torch.allclose(captured[name], g, atol=1e-6), name
    assert captured
