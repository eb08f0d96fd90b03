"""swarmpipe.peer.stage.runtime batched calls: one forward / backward / forward+backward over several micro-batches
gives exactly what separate calls give (input gradients, losses, and the update of accumulated gradients)."""

from __future__ import annotations

import pytest
import torch
from test_stage_runtime import data, make_spec, runtime

from swarmpipe.peer.stage.runtime import StageRuntime, UnknownMicrobatch

pytestmark = pytest.mark.unit
LR = 1e-2


def hidden(spec, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + seed)
    return torch.randn(2, spec.model.seq_len, spec.model.d_model, generator=gen)


def assert_same_accumulated_gradients(a: StageRuntime, b: StageRuntime) -> None:
    """Compared before the step: Adam's first step is about lr * sign(g), so weights would amplify float noise."""
    ga = {n: p.grad for n, p in a.weights.module.named_parameters()}
    gb = {n: p.grad for n, p in b.weights.module.named_parameters()}
    for name in ga:
        assert (ga[name] is None) == (gb[name] is None), name
        if ga[name] is not None:
            torch.testing.assert_close(ga[name], gb[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_batched_forward_and_backward_match_accumulated_separate_calls(stage: int) -> None:
    # step_every=3: both hold the summed gradients of the two micro-batches, unstepped, for comparison
    batched = runtime(make_spec(num_stages=4, lr=LR, step_every=3), stage)
    separate = runtime(make_spec(num_stages=4, lr=LR, step_every=3), stage)
    inputs = [data(batched.spec, k)[0] if stage == 0 else hidden(batched.spec, k) for k in range(2)]
    grads = [torch.randn(2, batched.spec.model.seq_len, batched.spec.model.d_model) for _ in range(2)]

    outs = batched.forward_many([("a", inputs[0]), ("b", inputs[1])])
    expected_outs = [separate.forward(mb, x) for mb, x in zip("ab", inputs)]
    for out, expected in zip(outs, expected_outs):
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)

    results = batched.backward_many([("a", grads[0]), ("b", grads[1])])
    expected = [separate.backward(mb, g) for mb, g in zip("ab", grads)]
    for got, want in zip(results, expected):
        assert got.applied and got.delay == 0
        if stage == 0:
            assert got.grad_input is None
        else:
            torch.testing.assert_close(got.grad_input, want.grad_input, rtol=1e-5, atol=1e-6)
    assert batched.version == separate.version == 0 and batched.accumulator.count == separate.accumulator.count == 2
    assert batched.stats.recomputed == 0 and batched.stats.backwards == 2 and not batched.pending
    assert_same_accumulated_gradients(batched, separate)


def test_siblings_that_come_apart_are_exact_for_the_snapshot() -> None:
    batched = runtime(make_spec(lr=LR), 0)
    separate = runtime(make_spec(lr=LR), 0)
    xs = [data(batched.spec, k)[0] for k in range(3)]
    grads = [torch.randn(2, batched.spec.model.seq_len, batched.spec.model.d_model) for _ in range(3)]
    batched.forward_many([(mb, x) for mb, x in zip("abc", xs)])
    for mb, x in zip("abc", xs):
        separate.forward(mb, x)
    # "b" comes alone (recomputed), then "c" and "a" together (the group's graph)
    order = [["b"], ["c", "a"]]
    for wave in order:
        got = batched.backward_many([(mb, grads["abc".index(mb)]) for mb in wave])
        want = [separate.backward(mb, grads["abc".index(mb)]) for mb in wave]
        assert [r.delay for r in got] == [w.delay for w in want][:1] * len(got)
    assert batched.stats.recomputed == 1
    assert batched.version == 2 and separate.version == 3  # the second wave was one update of two
    assert not batched.pending


def test_recomputed_gradient_uses_the_stashed_snapshot() -> None:
    rt = runtime(make_spec(num_stages=4, lr=LR), 1)
    reference = runtime(make_spec(num_stages=4, lr=LR), 1)
    xs = [hidden(rt.spec, k) for k in range(2)]
    g = torch.randn(2, rt.spec.model.seq_len, rt.spec.model.d_model)
    rt.forward_many([("a", xs[0]), ("b", xs[1])])
    reference.forward("b", xs[1])
    rt.forward("other", xs[0])
    rt.backward("other", g)  # the live weights move on
    got = rt.backward("b", g)  # its sibling "a" is still out: recomputed on the old snapshot
    want = reference.backward("b", g)
    assert got.delay == 1 and rt.stats.recomputed == 1
    torch.testing.assert_close(got.grad_input, want.grad_input, rtol=1e-5, atol=1e-6)
    assert set(rt.pending) == {"a"}


def test_forward_backward_many_matches_separate_calls() -> None:
    batched = runtime(make_spec(lr=LR, step_every=3), 1)
    separate = runtime(make_spec(lr=LR, step_every=3), 1)
    items = [(hidden(batched.spec, k), data(batched.spec, k)[1]) for k in range(2)]
    got = batched.forward_backward_many(items)
    want = [separate.forward_backward(x, t) for x, t in items]
    for g, w in zip(got, want):
        assert g.loss == pytest.approx(w.loss, rel=1e-5)
        torch.testing.assert_close(g.grad_input, w.grad_input, rtol=1e-5, atol=1e-6)
    assert batched.accumulator.count == separate.accumulator.count == 2
    assert_same_accumulated_gradients(batched, separate)


def test_one_batch_is_one_step_of_the_mean_gradient() -> None:
    rt = runtime(make_spec(lr=LR), 1)
    items = [(hidden(rt.spec, k), data(rt.spec, k)[1]) for k in range(3)]
    assert all(r.applied for r in rt.forward_backward_many(items))
    assert rt.version == 1 and rt.stats.steps == 1 and rt.stats.backwards == 3


def test_bad_items_fail_alone() -> None:
    rt = runtime(make_spec(lr=LR), 1)
    x = hidden(rt.spec, 0)
    _, targets = data(rt.spec, 0)
    bad_targets = targets.clone()
    bad_targets[0, 0] = rt.spec.model.vocab_size
    got = rt.forward_backward_many([(x, targets), (x, bad_targets), (x, targets[:, :-1])])
    assert got[0].loss is not None and got[0].applied
    assert isinstance(got[1], ValueError) and "lie in" in str(got[1])
    assert isinstance(got[2], ValueError) and "targets shape" in str(got[2])
    assert rt.version == 1


def test_backward_many_reports_unknown_and_misshapen_items_and_keeps_records() -> None:
    rt = runtime(make_spec(num_stages=4, lr=LR), 1)
    xs = [hidden(rt.spec, k) for k in range(2)]
    rt.forward_many([("a", xs[0]), ("b", xs[1])])
    g = torch.randn(2, rt.spec.model.seq_len, rt.spec.model.d_model)
    got = rt.backward_many([("nope", g), ("a", g[:1]), ("b", g), ("b", g)])
    assert isinstance(got[0], UnknownMicrobatch)
    assert isinstance(got[1], ValueError)  # wrong shape: "a" stays for a correct retry
    assert got[2].applied
    assert isinstance(got[3], UnknownMicrobatch)  # the same id twice in one batch
    assert set(rt.pending) == {"a"}
    assert rt.backward("a", g).applied


def test_forward_many_rejects_duplicates_and_mixed_shapes() -> None:
    rt = runtime(make_spec(num_stages=4), 1)
    x = hidden(rt.spec, 0)
    with pytest.raises(ValueError, match="twice"):
        rt.forward_many([("a", x), ("a", x)])
    with pytest.raises(ValueError, match="trailing shape"):
        rt.forward_many([("a", x), ("b", x[:, :-1])])
    assert not rt.pending


def test_expired_member_leaves_its_group() -> None:
    rt = runtime(make_spec(num_stages=4, lr=LR, ttl=10.0), 1)
    xs = [hidden(rt.spec, k) for k in range(2)]
    rt.forward_many([("a", xs[0]), ("b", xs[1])])
    group = rt.pending["a"]
    rt.pending["a"].created_at -= 20.0  # both share the record: both expire
    assert rt.expire() == 2 and not group.outstanding and not rt.pending


def test_a_retried_forward_leaves_its_old_group() -> None:
    rt = runtime(make_spec(num_stages=4, lr=LR), 1)
    xs = [hidden(rt.spec, k) for k in range(2)]
    rt.forward_many([("a", xs[0]), ("b", xs[1])])
    old = rt.pending["a"]
    rt.forward("a", xs[0])
    assert old.outstanding == {"b"} and rt.pending["a"] is not old
    g = torch.randn(2, rt.spec.model.seq_len, rt.spec.model.d_model)
    assert rt.backward("b", g).applied and rt.stats.recomputed == 0  # "b" was the last one owed: graph path


def test_throughput_estimate_comes_from_unbatched_calls() -> None:
    rt = runtime(make_spec(num_stages=4, lr=LR), 1)
    xs = [hidden(rt.spec, k) for k in range(4)]
    rt.forward("solo", xs[0])
    solo = rt.throughput()
    assert solo > 0
    rt.forward_many([(f"b{k}", x) for k, x in enumerate(xs)])
    assert rt.throughput() == solo  # a batch's cheaper cost per sample is not mistaken for a faster peer
    assert rt.stats.busy_seconds > 0
    for k in range(25):  # only batches for a long while: then they are the only evidence there is
        rt.forward_many([(f"c{k}-{j}", x) for j, x in enumerate(xs[:2])])
    assert rt.throughput() != solo
