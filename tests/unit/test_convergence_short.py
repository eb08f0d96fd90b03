"""A short real training run: large gradient delays slow naive asynchronous AdamW down."""

from __future__ import annotations

import pytest
import torch

from swarmpipe.peer.data import BatchSampler, CorpusSplit, load_corpus
from swarmpipe.peer.optim.delay_simulator import simulate
from swarmpipe.peer.spec import ModelSpec, OptimizerSpec, RunSpec

pytestmark = pytest.mark.unit
torch.set_num_threads(1)


def _run(delays: list[int]) -> tuple[float, float]:
    split = CorpusSplit.from_bytes(load_corpus(max_bytes=1 << 20))
    spec = RunSpec(
        num_stages=4,
        model=ModelSpec(d_model=32, n_layers=4, n_heads=2, seq_len=32),
        optimizer=OptimizerSpec(kind="adamw", lr=1e-2, warmup_steps=5),
    )
    train = BatchSampler(split.train, 16, 32, seed=0)  # same data order for every run
    evals = BatchSampler(split.valid, 16, 32, seed=123).fixed_batches(4)
    result = simulate(spec, 60, train.next, delays=delays, eval_batches=evals)
    return sum(result.train_losses[-10:]) / 10, result.eval_losses[-1]


def test_large_delay_async_adamw_is_worse_than_sync() -> None:
    sync_train, sync_eval = _run([0, 0, 0, 0])
    async_train, async_eval = _run([12, 8, 4, 0])
    assert sync_eval < 3.0  # it does learn (uniform bytes: ln 256 = 5.5)
    assert async_eval > sync_eval + 0.15
    assert async_train > sync_train


def test_factor_bench_switches_one_thing_and_scores_the_gap() -> None:
    """bench/convergence_factors.py in-process: settings, the gap closed, a tiny run of each init."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from convergence import RunConfig, Setting, run_one
    from convergence_factors import FACTORS, factor_setting, jobs_for, table

    assert factor_setting(FACTORS["horizon_2x"][1], 300).steps == 600
    assert factor_setting(FACTORS["init_torch"][1], 300) == Setting(steps=300, init="torch")
    jobs = jobs_for(["baseline", "psi_1"], 10, [0])
    assert [(f, c.name) for f, c, _, _ in jobs][-1] == ("psi_1", "async_nesterov") and len(jobs) == 4
    rec = lambda name, loss: {"name": name, "seed": 0, "final_eval": loss}  # noqa: E731
    records = {
        "baseline": [rec("sync_adamw", 2.0), rec("async_adamw", 3.0), rec("async_nesterov", 2.5)],
        "psi_1": [rec("async_nesterov", 2.75)],
    }
    assert [round(r["closed"], 3) for r in table(records)] == [0.5, 0.25]
    cfg = RunConfig("async_nesterov", "nesterov", "stash", 2, 0)
    for init in ("gpt2", "torch_embedding"):
        out = run_one(cfg, Setting(steps=3, init=init, vocab="compact"), eval_every=0, eval_batches=1)
        assert out["updates"] == 3 and out["final_eval"] > 0


def test_bench_delay_models_by_name(tmp_path) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from convergence import delay_model

    from swarmpipe.peer.optim.delay_models import RecordedDelays, SlowReplica, Stragglers

    assert delay_model("1f1b", 4, 0) == [3, 2, 1, 0]
    assert isinstance(delay_model("stragglers:0.5", 4, 0), Stragglers)
    assert delay_model("slow_replica:2", 4, 0).delays(0) == [6, 5, 4, 0]
    assert isinstance(delay_model("slow_replica", 4, 0), SlowReplica)
    scrape = tmp_path / "stage.prom"
    scrape.write_text('swarmpipe_gradient_delay_steps_bucket{le="2.0"} 3\n')
    recorded = delay_model(f"recorded:{scrape}+{scrape}", 2, 0)
    assert isinstance(recorded, RecordedDelays) and all(0 <= d <= 2 for d in recorded.delays(0))  # "le 2": 0..2
    with pytest.raises(ValueError):
        delay_model("poisson", 4, 0)
