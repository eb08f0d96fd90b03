"""What a stage tells its optimizer (issue 16): measured delays, delay-weighted steps, the stashed weights' drift.

The accumulator's rule by hand, then the stage runtime passing each gradient's measured delay and
drift through it to the optimizer (items 3a to 3c wired into the real runtime, not only the simulator).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarmpipe.peer.optim import StepAccumulator
from swarmpipe.peer.optim.accumulate import delay_weight
from swarmpipe.peer.spec import ModelSpec, OptimizerSpec, RunSpec, SpecError, UpdateSpec, spec_from_dict
from swarmpipe.peer.stage.runtime import StageRuntime

pytestmark = pytest.mark.unit
torch.set_num_threads(1)


def test_delay_weight_rule() -> None:
    assert delay_weight(0, 1.0) == 1.0 and delay_weight(7, 0.0) == 1.0
    assert delay_weight(3, 1.0) == 0.25 and delay_weight(3, 0.5) == 0.5
    assert delay_weight(-2, 1.0) == 1.0  # never more than a fresh gradient


def test_weighted_step_by_hand() -> None:
    """Call 1: one micro-batch, delay 0, G1; call 2: two micro-batches summed, delay 3, G2. With power 1,
    w = 1 and 1/4: g = (G1 + G2 / 4) / (1 + 2 / 4), delay = (0 + 2 * 3 / 4) / 1.5 = 1; drift likewise."""
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    g1, g2 = torch.tensor([0.5, -1.0]), torch.tensor([2.0, 4.0])
    stash1, stash2 = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 1.0])  # drifts (0, 0) and (1, 1)
    acc = StepAccumulator(OptimizerSpec(delay_weight_power=1.0, delay_compensation=0.5))
    acc.add({"w": p}, {"w": g1}, delay=0, count=1, stashed={"w": stash1})
    acc.add({"w": p}, {"w": g2}, delay=3, count=2, stashed={"w": stash2})
    assert acc.count == 3
    inputs = acc.finish({"w": p})
    torch.testing.assert_close(p.grad, torch.tensor([(0.5 + 0.5) / 1.5, (-1.0 + 1.0) / 1.5]))
    assert inputs.delay == pytest.approx(1.0)
    torch.testing.assert_close(inputs.drift[p], torch.tensor([0.5 / 1.5, 0.5 / 1.5]))
    assert acc.count == 0 and acc.finish({"w": p}).delay is None  # reset; nothing accumulated: no delay


def test_unweighted_step_is_the_plain_mean_and_keeps_no_drift() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    acc = StepAccumulator(OptimizerSpec())
    acc.add({"w": p}, {"w": torch.tensor([3.0, 0.0])}, delay=1, stashed={"w": torch.ones(2)})
    acc.add({"w": p}, {"w": torch.tensor([0.0, 3.0])}, delay=5, count=2, stashed={"w": torch.ones(2)})
    inputs = acc.finish({"w": p})
    torch.testing.assert_close(p.grad, torch.tensor([1.0, 1.0]))
    assert inputs.delay == pytest.approx(11 / 3) and inputs.drift == {}  # no compensation: no drift copy


# ------------------------------------------------------------------ the stage runtime passes them on


def make_spec(num_stages: int = 2, step_every: int = 1, **opt: object) -> RunSpec:
    optimizer = OptimizerSpec(**{"kind": "adamw", "lr": 1e-2, "warmup_steps": 0, "clip_norm": 0.0, **opt})
    return RunSpec(
        num_stages=num_stages,
        seed=1,
        microbatch_size=2,
        model=ModelSpec(vocab_size=64, d_model=16, n_layers=num_stages, n_heads=2, seq_len=8, mlp_ratio=2),
        optimizer=optimizer,
        update=UpdateSpec(step_every=step_every),
    ).validate()


def hidden(spec: RunSpec, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, spec.model.seq_len, spec.model.d_model, generator=gen)


def tokens(spec: RunSpec, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.model.vocab_size, (2, spec.model.seq_len), generator=gen)


def test_runtime_feeds_the_measured_delays_to_the_running_average() -> None:
    """delay_source = measured in a real stage: the optimizer's average is the delays the stage measured."""
    spec = make_spec(delay_source="measured")
    rt = StageRuntime(spec, 0)
    outs = {mb: rt.forward(mb, tokens(spec, i)) for i, mb in enumerate("ABC")}
    delays = [rt.backward(mb, torch.randn_like(outs[mb])).delay for mb in "ABC"]
    assert delays == [0, 1, 2]
    group = rt.weights.optimizer.param_groups[0]
    assert group["delay_seen"] == 3 and group["delay_avg"] == pytest.approx(1.0)


def test_runtime_weights_an_accumulated_step_by_delay() -> None:
    """step_every = 2, power 1: the second step holds A (delay 1, taken before the first step) and D
    (delay 0): the optimizer sees (G_A / 2 + G_D) / 1.5, each G as the stage computed it."""
    spec = make_spec(3, step_every=2, delay_weight_power=1.0)
    rt = StageRuntime(spec, 1)
    seen_adds: list[tuple[dict, float]] = []
    add = rt.accumulator.add

    def spy(params, grads, delay, count=1, stashed=None):
        seen_adds.append(({n: g.clone() for n, g in grads.items() if g is not None}, delay))
        return add(params, grads, delay, count, stashed)

    rt.accumulator.add = spy  # type: ignore[method-assign]
    seen_steps: list[dict] = []
    step = rt.weights.optimizer.step

    def recording_step(*args, **kwargs):
        seen_steps.append({n: p.grad.clone() for n, p in rt.weights.module.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    rt.weights.optimizer.step = recording_step  # type: ignore[method-assign]
    out = {mb: rt.forward(mb, hidden(spec, i)) for i, mb in enumerate("ABC")}
    for mb in "BCA":
        rt.backward(mb, torch.randn_like(out[mb]))
    out["D"] = rt.forward("D", hidden(spec, 3))
    assert rt.backward("D", torch.randn_like(out["D"])).delay == 0
    assert [d for _, d in seen_adds] == [0, 0, 1, 0] and len(seen_steps) == 2
    (g_a, _), (g_d, _) = seen_adds[2], seen_adds[3]
    for name, g in seen_steps[1].items():
        torch.testing.assert_close(g, (g_a[name] / 2 + g_d[name]) / 1.5, msg=name)


def test_runtime_tells_basis_rotation_the_drift_of_the_stashed_weights() -> None:
    """A backward whose forward ran one update ago: drift = live weights - the snapshot it ran on."""
    spec = make_spec(kind="basis_rotation", delay_compensation=0.5)
    rt = StageRuntime(spec, 0)
    told: list[dict] = []
    set_drift = rt.weights.optimizer.set_drift

    def spy(drift):
        told.append({p: d.clone() for p, d in drift.items()})
        return set_drift(drift)

    rt.weights.optimizer.set_drift = spy  # type: ignore[method-assign]
    out_a, out_b = rt.forward("A", tokens(spec, 0)), rt.forward("B", tokens(spec, 1))
    snapshot = {n: t.detach().clone() for n, t in rt.pending["B"].params.items()}
    rt.backward("A", torch.randn_like(out_a))  # delay 0: the weights have not moved
    assert all(float(d.abs().max()) == 0 for d in told[0].values())
    live_before_step = {n: p.detach().clone() for n, p in rt.weights.trainable().items()}
    assert rt.backward("B", torch.randn_like(out_b)).delay == 1
    params = rt.weights.trainable()
    assert set(told[1]) == set(params.values())
    for name, p in params.items():
        torch.testing.assert_close(told[1][p], live_before_step[name] - snapshot[name], msg=name)
    assert any(float(d.abs().max()) > 0 for d in told[1].values())


def test_last_stage_and_replays_have_no_drift() -> None:
    spec = make_spec(kind="basis_rotation", delay_compensation=0.5)
    rt = StageRuntime(spec, 1)
    told: list[dict] = []
    rt.weights.optimizer.set_drift = lambda drift: told.append(dict(drift))  # type: ignore[method-assign]
    h = hidden(spec, 0)
    rt.forward_backward(h, tokens(spec, 1))
    rt.replay_backward(h, torch.randn(2, spec.model.seq_len, spec.model.vocab_size))
    assert told == [{}, {}]


# ------------------------------------------------------------------ the spec's new fields


@pytest.mark.parametrize(
    "field,value",
    [
        ("delay_weight_power", -1),
        ("delay_weight_power", 1e9),
        ("delay_weight_power", float("nan")),
        ("delay_weight_power", "1"),
        ("delay_weight_power", True),
        ("delay_compensation", -0.1),
        ("delay_compensation", float("inf")),
        ("delay_compensation", [1.0]),
        ("compensation_cap", 0),
        ("compensation_cap", 1e6),
        ("rotation_max_dim", -1),
        ("rotation_max_dim", 2.5),
        ("rotation_max_dim", 1 << 40),
        ("rotation_max_dim", "64" * 1000),
        ("rotation_factor_dtype", "float16"),
        ("rotation_factor_dtype", "x" * 10_000),
        ("rotation_factor_dtype", 16),
    ],
)
def test_hostile_optimizer_fields_are_refused(field: str, value: object) -> None:
    with pytest.raises(SpecError) as err:
        spec_from_dict({"optimizer": {"kind": "basis_rotation", field: value}})
    assert len(str(err.value)) < 300  # short, whatever was sent


def test_delay_compensation_needs_basis_rotation_with_stashing() -> None:
    ok = spec_from_dict({"optimizer": {"kind": "basis_rotation", "delay_compensation": 0.5}})
    assert ok.optimizer.delay_compensation == 0.5
    for opt in ({"kind": "adamw"}, {"kind": "nesterov"}, {"kind": "basis_rotation", "stash": False}):
        with pytest.raises(SpecError, match="delay_compensation needs"):
            spec_from_dict({"optimizer": {**opt, "delay_compensation": 0.5}})
    base = RunSpec().validate()
    assert dataclasses.replace(base.optimizer, delay_weight_power=2.0).delay_weight_power == 2.0
