"""Convergence of asynchronous pipeline optimizers under exact 1F1B gradient delays.

A byte-level GPT (8 blocks, width 64, context 64, micro-batch 16) on the stdlib
corpus, split into P = 8 stages, trained in the delay simulator
(peer/optim/delay_simulator.py). Every run sees the same micro-batches in the same
order and is scored on the same held-out batches.

Quick set (default, < 10 min on one thread): sync AdamW, GPipe-equivalent AdamW,
async AdamW, async Nesterov, async basis rotation, all with weight stashing at P = 8.
``--full`` adds P = 4, the no-stash variants (AdamW, Nesterov) and a second seed.
``--delay-aware`` adds issue 16's delay-adaptive runs (P = 8): basis rotation with delay
compensation (``--compensation`` lambda), 4-micro-batch accumulated steps without and with delay
weights (``--weight-power``), and the cost bounds (one-sided rotation, a slower refresh).

    python bench/convergence.py [--steps 1000] [--lr 3e-3] [--full] [--delay-aware] [--jobs 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmpipe.peer.data import BatchSampler, CorpusSplit, load_corpus  # noqa: E402
from swarmpipe.peer.model.bytegpt import PipelineStage  # noqa: E402
from swarmpipe.peer.optim.delay_models import (  # noqa: E402
    DelayModel,
    Jitter,
    RecordedDelays,
    Replays,
    SlowReplica,
    Stragglers,
)
from swarmpipe.peer.optim.delay_simulator import one_f_one_b_delays, simulate  # noqa: E402
from swarmpipe.peer.spec import ModelSpec, OptimizerSpec, RunSpec  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "convergence.json"
TEXT_CORPUS_ROOT = Path("/usr/share/doc")  # English prose (READMEs, changelogs) on Debian-like machines
TEXT_NAMES = ("README", "NEWS", "AUTHORS", "THANKS", "TODO")


@dataclass(frozen=True)
class Setting:
    """Everything the bench holds fixed across runs; issue 16 switches these one at a time."""

    lr: float = 3e-3
    steps: int = 1000  # micro-batches per run
    warmup: int = 20
    clip: float = 1.0  # per-stage gradient clipping (0: off)
    schedule: str = "cosine"  # cosine (to 10 %) | constant
    psi: float = 0.004  # nesterov momentum_decay (NAdam's mu schedule)
    init: str = "gpt2"  # gpt2 (the model's own) | torch | torch_embedding | torch_linear (see torch_init)
    vocab: str = "bytes"  # bytes (256 ids) | compact (only the bytes the corpus has)
    corpus: str = "stdlib"  # stdlib (Python source) | text (English prose under /usr/share/doc)
    delays: str = "1f1b"  # async runs' delays: see delay_model


def delay_model(text: str, stages: int, seed: int) -> DelayModel | list[int]:
    """``1f1b`` | ``jitter[:spread]`` | ``stragglers[:p]`` (Pareto 1.5, scale 3) | ``slow_replica[:stage]``
    (2 replicas, one 4x slower) | ``replays[:p]`` | ``recorded:SCRAPE[+SCRAPE...]`` (one per stage)."""
    kind, _, arg = text.partition(":")
    if kind == "1f1b":
        return one_f_one_b_delays(stages)
    if kind == "jitter":
        return Jitter(stages, spread=int(arg or 2), seed=seed)
    if kind == "stragglers":
        return Stragglers(stages, p=float(arg or 0.25), alpha=1.5, scale=3.0, seed=seed)
    if kind == "slow_replica":
        return SlowReplica(stages, stage=int(arg or 0), replicas=2, slowdown=4.0)
    if kind == "replays":
        return Replays(stages, p=float(arg or 0.05), seed=seed)
    if kind == "recorded" and arg:
        return RecordedDelays(stages, [Path(p).read_text() for p in arg.split("+")], seed=seed)
    raise ValueError(f"unknown delay model {text!r}")


def _text_corpus(max_bytes: int = 11 << 20) -> bytes:
    files = sorted(
        p for p in TEXT_CORPUS_ROOT.rglob("*") if p.is_file() and (p.suffix in (".txt", ".md") or p.name in TEXT_NAMES)
    )
    chunks, total = [], 0
    for f in files:
        chunks.append(f.read_bytes())
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return b"\n".join(chunks)[:max_bytes]


def load_data(setting: Setting) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train, valid, vocab size) for the setting's corpus and vocabulary."""
    raw = load_corpus() if setting.corpus == "stdlib" else _text_corpus()
    split = CorpusSplit.from_bytes(raw)
    if setting.vocab == "bytes":
        return split.train, split.valid, 256
    present = torch.unique(torch.cat([split.train, split.valid]))
    table = torch.zeros(256, dtype=torch.uint8)
    table[present.long()] = torch.arange(len(present), dtype=torch.uint8)
    return table[split.train.long()], table[split.valid.long()], len(present)


INIT_LAYERS = {"torch": (nn.Linear, nn.Embedding), "torch_embedding": (nn.Embedding,), "torch_linear": (nn.Linear,)}


def torch_init(kind: str) -> Callable[[PipelineStage, int], None] | None:
    """The layers' own ``reset_parameters`` (Linear: kaiming-uniform, std 1/sqrt(3 fan_in); Embedding:
    N(0, 1)) in place of GPT-2's N(0, 0.02), for all of them or one kind; None for ``gpt2``."""
    if kind == "gpt2":
        return None
    layers = INIT_LAYERS[kind]

    def init(stage: PipelineStage, _: int) -> None:
        for module in stage.modules():
            if isinstance(module, layers):
                module.reset_parameters()

    return init


@dataclass
class RunConfig:
    name: str
    kind: str  # optimizer kind
    mode: str  # simulator mode: stash | nostash | gpipe
    stages: int
    seed: int
    synchronous: bool = False  # zero delays
    delay_source: str = "formula"  # OptimizerSpec.delay_source: formula | measured
    accumulate: int = 1  # micro-batches per update (the lr schedule spans the same samples)
    delay_weight_power: float = 0.0  # OptimizerSpec.delay_weight_power (3b)
    delay_compensation: float = 0.0  # OptimizerSpec.delay_compensation (3c)
    rotation_max_dim: int = 0  # OptimizerSpec.rotation_max_dim (item 6: one-sided rotation)
    rotation_every: int = 10  # OptimizerSpec.rotation_every (item 6: a slower refresh)
    rotation_factor_dtype: str = "float32"  # OptimizerSpec.rotation_factor_dtype (item 6: lower-precision factors)

    @property
    def label(self) -> str:
        return f"{self.name} P={self.stages} seed={self.seed}"


def delay_aware_set(seeds: tuple[int, ...], delays: str, compensation: float, power: float) -> list[RunConfig]:
    """Issue 16's delay-adaptive runs at P = 8. Under 1F1B every micro-batch of a stage has the same delay,
    so delay weights and the measured delay change nothing (left out); the cost bounds of item 6 (one-sided
    rotation, a slower refresh) run there. Under other delays the synchronous run is the same (left out)."""
    runs: list[RunConfig] = []
    for seed in seeds:
        br = RunConfig("async_basis_rotation", "basis_rotation", "stash", 8, seed)
        runs += [RunConfig("async_adamw", "adamw", "stash", 8, seed), br]
        runs += [replace(br, name="async_basis_rotation_dc", delay_compensation=compensation)]
        runs += [RunConfig("nostash_nesterov", "nesterov", "nostash", 8, seed)]
        if delays == "1f1b":
            runs.insert(len(runs) - 4, RunConfig("sync_adamw", "adamw", "stash", 8, seed, synchronous=True))
            runs += [
                replace(br, name="async_basis_rotation_onesided64", rotation_max_dim=64),
                replace(br, name="async_basis_rotation_f50", rotation_every=50),
                replace(br, name="async_basis_rotation_bf16factors", rotation_factor_dtype="bfloat16"),
            ]
        else:
            runs += [
                RunConfig("nostash_nesterov_measured", "nesterov", "nostash", 8, seed, delay_source="measured"),
                replace(br, name="async_basis_rotation_acc4", accumulate=4),
                replace(br, name="async_basis_rotation_acc4_weighted", accumulate=4, delay_weight_power=power),
            ]
    return runs


def run_set(full: bool) -> list[RunConfig]:
    runs: list[RunConfig] = []
    for seed in (0, 1) if full else (0,):
        for stages in (8, 4) if full else (8,):
            runs += [
                RunConfig("sync_adamw", "adamw", "stash", stages, seed, synchronous=True),
                RunConfig("gpipe_adamw", "adamw", "gpipe", stages, seed),
                RunConfig("async_adamw", "adamw", "stash", stages, seed),
                RunConfig("async_nesterov", "nesterov", "stash", stages, seed),
                RunConfig("async_basis_rotation", "basis_rotation", "stash", stages, seed),
            ]
            if full:
                runs += [
                    RunConfig("nostash_adamw", "adamw", "nostash", stages, seed),
                    RunConfig("nostash_nesterov", "nesterov", "nostash", stages, seed),
                    RunConfig(
                        "nostash_nesterov_measured", "nesterov", "nostash", stages, seed, delay_source="measured"
                    ),
                ]
    return runs


def make_spec(cfg: RunConfig, setting: Setting, vocab_size: int = 256) -> RunSpec:
    opt = OptimizerSpec(
        kind=cfg.kind,
        lr=setting.lr,
        warmup_steps=setting.warmup,
        total_steps=setting.steps if setting.schedule == "cosine" else 0,
        clip_norm=setting.clip,
        momentum_decay=setting.psi,
        stash=cfg.mode != "nostash",
        delay_source=cfg.delay_source,
        delay_weight_power=cfg.delay_weight_power,
        delay_compensation=cfg.delay_compensation,
        rotation_max_dim=cfg.rotation_max_dim,
        rotation_every=cfg.rotation_every,
        rotation_factor_dtype=cfg.rotation_factor_dtype,
    )
    model = ModelSpec(vocab_size=vocab_size, d_model=64, n_layers=8, n_heads=4, seq_len=64)
    return RunSpec(num_stages=cfg.stages, seed=cfg.seed, microbatch_size=16, model=model, optimizer=opt).validate()


def run_one(cfg: RunConfig, setting: Setting, eval_every: int = 50, eval_batches: int = 8) -> dict:
    """One simulated training run; its record (final and curve of validation losses, time)."""
    torch.set_num_threads(1)
    train, valid, vocab = load_data(setting)
    evals = BatchSampler(valid, 16, 64, seed=1234).fixed_batches(eval_batches)
    spec = make_spec(cfg, setting, vocab)
    sampler = BatchSampler(train, 16, 64, seed=cfg.seed)  # same data order for every run of a seed
    # the same delay draws for every run of a seed
    delays = [0] * cfg.stages if cfg.synchronous else delay_model(setting.delays, cfg.stages, 1000 + cfg.seed)
    init = torch_init(setting.init)
    res = simulate(
        spec,
        setting.steps,
        sampler.next,
        delays,
        cfg.mode,
        evals,
        eval_every,
        accumulate=cfg.accumulate if cfg.mode != "gpipe" else None,
        init=init,  # type: ignore[arg-type]
    )
    return {
        **asdict(cfg),
        "delays": [0] * cfg.stages if cfg.mode == "gpipe" or cfg.synchronous else setting.delays,
        "mean_delays": [round(d, 2) for d in res.mean_delays],
        "capped": res.capped,
        "final_eval": res.eval_losses[-1],
        "eval_micro": res.eval_micro,
        "eval_losses": res.eval_losses,
        "train_last50": sum(res.train_losses[-50:]) / min(50, len(res.train_losses)),
        "updates": res.updates,
        "seconds": round(res.seconds, 1),
    }


def _work(job: tuple[RunConfig, Setting, int, int]) -> dict:
    return run_one(*job)


def steps_to_reach(eval_micro: list[int], eval_losses: list[float], target: float) -> int | None:
    return next((m for m, loss in zip(eval_micro, eval_losses) if loss <= target), None)


def summarize(results: list[dict], steps: int, lr: float) -> None:
    """Add targets to the records and print the table.

    ``steps``: micro-batches to reach sync AdamW's validation loss at 50 % of the budget;
    ``vs async``: micro-batches to reach async AdamW's final loss (same P and seed).
    """
    half = steps // 2

    def peer_run(rec: dict, name: str) -> dict | None:
        return next(
            (r for r in results if r["name"] == name and r["stages"] == rec["stages"] and r["seed"] == rec["seed"]),
            None,
        )

    for rec in results:
        sync, naive = peer_run(rec, "sync_adamw"), peer_run(rec, "async_adamw")
        if sync is not None:
            rec["target"] = next(loss for m, loss in zip(sync["eval_micro"], sync["eval_losses"]) if m >= half)
            rec["steps_to_target"] = steps_to_reach(rec["eval_micro"], rec["eval_losses"], rec["target"])
        if naive is not None:
            rec["steps_to_async_final"] = steps_to_reach(rec["eval_micro"], rec["eval_losses"], naive["final_eval"])

    def show(value: int | None) -> str:
        return "never" if value is None else str(value)

    print(
        f"\nvalidation loss after {steps} micro-batches of 16 (lr {lr}); steps = micro-batches to reach "
        f"sync AdamW's loss at {half}; vs async = micro-batches to reach async AdamW's final loss"
    )
    print(f"{'run':<26} {'P':>2} {'seed':>4} {'val loss':>9} {'steps':>6} {'vs async':>8} {'time s':>7}")
    for rec in results:
        print(
            f"{rec['name']:<26} {rec['stages']:>2} {rec['seed']:>4} {rec['final_eval']:>9.4f} "
            f"{show(rec.get('steps_to_target')):>6} {show(rec.get('steps_to_async_final')):>8} {rec['seconds']:>7}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Setting()
    parser.add_argument("--steps", type=int, default=defaults.steps, help="micro-batches per run (GPipe: /4 updates)")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--clip", type=float, default=defaults.clip, help="per-stage gradient clipping, 0: off")
    parser.add_argument("--schedule", choices=("cosine", "constant"), default=defaults.schedule)
    parser.add_argument("--psi", type=float, default=defaults.psi, help="nesterov momentum_decay")
    parser.add_argument("--init", choices=("gpt2", *INIT_LAYERS), default=defaults.init)
    parser.add_argument("--vocab", choices=("bytes", "compact"), default=defaults.vocab)
    parser.add_argument("--corpus", choices=("stdlib", "text"), default=defaults.corpus)
    parser.add_argument(
        "--delays",
        default=defaults.delays,
        help="async delays: 1f1b | jitter[:spread] | stragglers[:p] | slow_replica[:stage] | replays[:p] | recorded:FILE[+FILE]",
    )
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--full", action="store_true", help="add P=4, no-stash variants and a second seed")
    parser.add_argument("--delay-aware", action="store_true", help="issue 16's delay-adaptive set instead (P=8)")
    parser.add_argument("--compensation", type=float, default=1.0, help="delay compensation lambda (--delay-aware)")
    parser.add_argument("--weight-power", type=float, default=1.0, help="delay weight power (--delay-aware)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel, one torch thread each")
    parser.add_argument("--only", default="", help="comma-separated run names to keep (for quick checks)")
    parser.add_argument("--stages", default="", help="comma-separated stage counts to keep, e.g. 8")
    parser.add_argument("--seeds", default="", help="comma-separated seeds to keep, e.g. 0")
    parser.add_argument("--report", type=Path, help="reprint the table of a saved JSON and exit")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.report:
        saved = json.loads(args.report.read_text())
        summarize(saved["runs"], saved["config"]["steps"], saved["config"]["lr"])
        return 0

    setting = Setting(
        lr=args.lr,
        steps=args.steps,
        warmup=args.warmup,
        clip=args.clip,
        schedule=args.schedule,
        psi=args.psi,
        init=args.init,
        vocab=args.vocab,
        corpus=args.corpus,
        delays=args.delays,
    )
    runs = run_set(args.full)
    if args.delay_aware:
        runs = delay_aware_set((0, 1), args.delays, args.compensation, args.weight_power)
    if args.only:
        keep = set(args.only.split(","))
        runs = [r for r in runs if r.name in keep or r.name == "sync_adamw"]
    if args.stages:
        runs = [r for r in runs if str(r.stages) in args.stages.split(",")]
    if args.seeds:
        runs = [r for r in runs if str(r.seed) in args.seeds.split(",")]
    started = time.perf_counter()
    results = []
    work = [(cfg, setting, args.eval_every, args.eval_batches) for cfg in runs]
    with get_context("spawn").Pool(max(1, args.jobs)) as pool:  # one torch thread per run
        for record in pool.imap(_work, work):
            results.append(record)
            label = f"{record['name']} P={record['stages']} seed={record['seed']}"
            print(f"{label:<46} val {record['final_eval']:.4f}  {record['seconds']:6.1f}s", flush=True)

    summarize(results, args.steps, args.lr)
    total = time.perf_counter() - started
    print(f"total {total:.0f}s")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "setting": asdict(setting),
        "model": asdict(ModelSpec(d_model=64, n_layers=8, n_heads=4, seq_len=64)),
        "torch_threads": torch.get_num_threads(),
        "seconds": round(total, 1),
        "runs": results,
    }
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
