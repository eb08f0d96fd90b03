"""The delay simulator: each stage really computes on the version from tau_k updates before."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarmpipe.peer.model.bytegpt import PipelineStage, lm_loss
from swarmpipe.peer.optim import build_optimizer, set_learning_rate
from swarmpipe.peer.optim.delay_simulator import DelaySimulator, StageEvent, one_f_one_b_delays, simulate
from swarmpipe.peer.spec import ModelSpec, OptimizerSpec, RunSpec

pytestmark = pytest.mark.unit
torch.set_num_threads(1)


def _spec(stages: int = 4, kind: str = "adamw", warmup: int = 2) -> RunSpec:
    return RunSpec(
        num_stages=stages,
        model=ModelSpec(d_model=16, n_layers=stages, n_heads=2, seq_len=8),
        optimizer=OptimizerSpec(kind=kind, lr=1e-2, warmup_steps=warmup),
    )


def _batches(count: int, batch: int = 2, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 256, (batch, 8), generator=gen), torch.randint(0, 256, (batch, 8), generator=gen))
        for _ in range(count)
    ]


def _live(sim: DelaySimulator) -> list[dict[str, torch.Tensor]]:
    return [{n: p.detach().clone() for n, p in s.named_parameters()} for s in sim.stages]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("delays", [None, [2, 0, 3, 1]])
def test_stash_uses_version_from_tau_updates_before(delays: list[int] | None) -> None:
    events: list[StageEvent] = []
    sim = DelaySimulator(
        _spec(),
        delays=delays,
        observer=lambda e: events.append(
            dataclasses.replace(e, forward_params={n: t.detach().clone() for n, t in e.forward_params.items()})
        ),
    )
    taus = delays or one_f_one_b_delays(4)
    assert taus == (delays or [3, 2, 1, 0])
    history = [_live(sim)]  # history[u]: live weights after u updates
    for x, y in _batches(8):
        sim.train_micro(x, y)
        history.append(_live(sim))
    assert len(events) == 8 * 4
    for e in events:
        expected = max(0, e.update - taus[e.stage])
        assert e.forward_version == e.backward_version == expected
        assert _same(e.forward_params, history[expected][e.stage])
        if e.update > taus[e.stage]:  # after fill, stale weights really differ from live ones
            assert taus[e.stage] == 0 or not _same(e.forward_params, history[e.update][e.stage])


def test_nostash_forward_stale_backward_live() -> None:
    events: list[StageEvent] = []
    sim = DelaySimulator(
        _spec(),
        mode="nostash",
        observer=lambda e: events.append(
            dataclasses.replace(
                e,
                forward_params={n: t.detach().clone() for n, t in e.forward_params.items()},
                backward_params={n: t.detach().clone() for n, t in e.backward_params.items()},
            )
        ),
    )
    history = [_live(sim)]
    for x, y in _batches(6):
        sim.train_micro(x, y)
        history.append(_live(sim))
    for e in events:
        tau = 3 - e.stage
        assert e.forward_version == max(0, e.update - tau) and e.backward_version == e.update
        assert _same(e.forward_params, history[e.forward_version][e.stage])
        assert _same(e.backward_params, history[e.update][e.stage])


@pytest.mark.parametrize("mode", ["stash", "nostash"])
def test_zero_delays_is_plain_synchronous_training(mode: str) -> None:
    spec = _spec(kind="nesterov")
    batches = _batches(5)
    sim = DelaySimulator(spec, delays=[0, 0, 0, 0], mode=mode)
    losses = [sim.train_micro(x, y) for x, y in batches]
    # Reference: the stage runtime's loop on one process.
    stages = [PipelineStage(spec, k) for k in range(4)]
    opts = [build_optimizer(s.named_parameters(), spec.optimizer, k, 4) for k, s in enumerate(stages)]
    ref_losses = []
    for step, (x, y) in enumerate(batches):
        h = x
        for s in stages:
            h = s(h)
        loss = lm_loss(h, y)
        loss.backward()
        ref_losses.append(float(loss.detach()))
        for k, (s, o) in enumerate(zip(stages, opts)):
            set_learning_rate(o, spec.optimizer, step, k, 4)
            torch.nn.utils.clip_grad_norm_(s.parameters(), spec.optimizer.clip_norm)
            o.step()
            o.zero_grad()
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for a, b in zip(sim.stages, stages):
        for pa, pb in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_gpipe_accumulates_four_microbatches_per_update() -> None:
    batches = _batches(8, batch=2)
    gpipe = DelaySimulator(_spec(warmup=4), mode="gpipe")
    for x, y in batches:
        gpipe.train_micro(x, y)
    assert gpipe.updates == 2 and gpipe.spec.optimizer.warmup_steps == 1
    # Same samples as two synchronous updates on batches of 8 (mean of equal-size means).
    sync = DelaySimulator(_spec(warmup=1), delays=[0, 0, 0, 0])
    for i in range(0, 8, 4):
        chunk = batches[i : i + 4]
        sync.train_micro(torch.cat([c[0] for c in chunk]), torch.cat([c[1] for c in chunk]))
    for a, b in zip(gpipe.stages, sync.stages):
        for pa, pb in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-5)  # float summation order differs


def test_simulate_reports_losses_and_evaluations() -> None:
    batches = iter(_batches(10))
    result = simulate(_spec(), 10, lambda: next(batches), eval_batches=_batches(2, seed=9), eval_every=4)
    assert len(result.train_losses) == 10 and result.updates == 10
    assert result.eval_micro == [4, 8, 10] and len(result.eval_losses) == 3
    with pytest.raises(ValueError):
        DelaySimulator(_spec(), delays=[1, 0])
    with pytest.raises(ValueError):
        DelaySimulator(_spec(), mode="pipedream")


def test_init_hook_reinitialises_stages_before_the_first_snapshot() -> None:
    seen: list[int] = []

    def zero_linear(stage: PipelineStage, k: int) -> None:
        seen.append(k)
        with torch.no_grad():
            for module in stage.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.fill_(0.01 * (k + 1))

    sim = DelaySimulator(_spec(), init=zero_linear)
    assert seen == [0, 1, 2, 3]
    for k, stage in enumerate(sim.stages):
        weight = stage.blocks[0].fc.weight
        assert torch.all(weight == 0.01 * (k + 1))
        assert torch.equal(sim.stashed(k, 0)["blocks.0.fc.weight"], weight)  # version 0 is the re-initialised one


def test_measured_delays_reach_the_optimizer() -> None:
    from swarmpipe.peer.optim.delay_models import Stragglers

    spec = _spec(kind="nesterov")
    spec = dataclasses.replace(
        spec, optimizer=dataclasses.replace(spec.optimizer, stash=False, delay_source="measured", total_steps=100)
    )
    sim = DelaySimulator(spec, delays=Stragglers(4, p=0.5, seed=2, max_delay=12), mode="nostash")
    applied: list[list[int]] = []
    for x, y in _batches(12):
        before = sim.updates
        sim.train_micro(x, y)
        applied.append([min(d, before) for d in sim.delays])
    for k, opt in enumerate(sim.optimizers):
        mean = sum(row[k] for row in applied) / len(applied)
        assert opt.param_groups[0]["delay_avg"] == pytest.approx(mean)  # the running average of what it was told
    stage0_beta1 = sim.optimizers[0].param_groups[0]["betas"][0]
    assert stage0_beta1 == pytest.approx(0.9 + min(sum(r[0] for r in applied) / 12, 3) * 0.09 / 4)
