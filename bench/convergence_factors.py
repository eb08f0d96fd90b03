"""Why async Nesterov closes less of the staleness gap in bench/convergence.py than elsewhere (issue 16).

An independent P = 8 simulation found `nesterov` closing 58 to 60 % of the gap between async
AdamW and synchronous AdamW; bench/convergence.py measured 14 to 22 %. This bench switches
one ingredient of convergence.py at a time (initialisation, vocabulary, corpus, horizon,
warm-up, clipping, lr schedule, lr, NAdam's momentum schedule) and, for each, runs
synchronous AdamW, async AdamW and async Nesterov (weight stashing, P = 8) on the same
micro-batches, then reports the share of the gap Nesterov closes:
``(async AdamW - Nesterov) / (async AdamW - sync AdamW)`` on the final validation loss.
A factor that only changes Nesterov (psi) reuses the baseline's AdamW runs.

    python bench/convergence_factors.py [--steps 1000] [--jobs 2] [--seeds 0,1] [--only baseline,init_torch]
    python bench/convergence_factors.py --report bench/results/convergence_factors.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convergence import RunConfig, Setting, run_one  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "convergence_factors.json"
NESTEROV_ONLY = {"psi"}  # Setting fields that AdamW ignores

# name -> (what changes, Setting fields relative to the bench's defaults)
FACTORS: dict[str, tuple[str, dict]] = {
    "baseline": ("bench defaults: GPT-2 init, 256 bytes, stdlib, 1000 steps, warm-up 20, clip 1, cosine, lr 3e-3", {}),
    "init_torch": ("torch's default layer init instead of GPT-2's (std 0.02)", {"init": "torch"}),
    "init_torch_embedding": ("torch's init for the embeddings only (N(0, 1))", {"init": "torch_embedding"}),
    "init_torch_linear": ("torch's init for the linear layers only (std 1/sqrt(3 fan_in))", {"init": "torch_linear"}),
    "vocab_compact": ("only the bytes the corpus has (171 ids) instead of 256", {"vocab": "compact"}),
    "corpus_text": ("English prose (/usr/share/doc) instead of Python source", {"corpus": "text"}),
    "horizon_2x": ("2000 micro-batches instead of 1000 (cosine over the longer run)", {"steps": 2}),
    "warmup_100": ("100 warm-up steps instead of 20", {"warmup": 100}),
    "clip_off": ("no per-stage gradient clipping (was 1.0)", {"clip": 0.0}),
    "schedule_constant": ("constant lr after warm-up instead of cosine decay to 10 %", {"schedule": "constant"}),
    "lr_1e-3": ("lr 1e-3 instead of 3e-3", {"lr": 1e-3}),
    "psi_0.1": ("NAdam momentum_decay 0.1 instead of 0.004 (mu 0.77 at step 200, 0.98 at 1000)", {"psi": 0.1}),
    "psi_1": ("NAdam momentum_decay 1 (mu 0.98 from step 100 on: nearly constant look-ahead)", {"psi": 1.0}),
}
RUNS = (
    RunConfig("sync_adamw", "adamw", "stash", 8, 0, synchronous=True),
    RunConfig("async_adamw", "adamw", "stash", 8, 0),
    RunConfig("async_nesterov", "nesterov", "stash", 8, 0),
)


def factor_setting(changes: dict, steps: int) -> Setting:
    fields = dict(changes)
    fields["steps"] = steps * fields.get("steps", 1)  # "steps" in a factor is a multiple of the base
    return dataclasses.replace(Setting(), **fields)


def _work(job: tuple[str, RunConfig, Setting, int]) -> tuple[str, dict]:
    factor, cfg, setting, seed = job
    record = run_one(dataclasses.replace(cfg, seed=seed), setting)
    print(
        f"{factor:<22} {cfg.name:<16} seed {seed} val {record['final_eval']:.4f} {record['seconds']:6.1f}s", flush=True
    )
    return factor, record


def jobs_for(factors: list[str], steps: int, seeds: list[int]) -> list[tuple[str, RunConfig, Setting, int]]:
    jobs = []
    for factor in factors:
        changes = FACTORS[factor][1]
        only_nesterov = factor != "baseline" and set(changes) <= NESTEROV_ONLY
        for cfg in RUNS:
            if only_nesterov and cfg.kind != "nesterov":
                continue  # AdamW runs are the baseline's
            jobs += [(factor, cfg, factor_setting(changes, steps), seed) for seed in seeds]
    return jobs


def table(records: dict[str, list[dict]]) -> list[dict]:
    """One row per factor and seed: the three final losses and the share of the gap closed."""
    rows = []
    for factor, runs in records.items():
        for seed in sorted({r["seed"] for r in runs}):
            pick = {r["name"]: r["final_eval"] for r in runs if r["seed"] == seed}
            base = {r["name"]: r["final_eval"] for r in records.get("baseline", []) if r["seed"] == seed}
            sync = pick.get("sync_adamw", base.get("sync_adamw"))
            naive = pick.get("async_adamw", base.get("async_adamw"))
            nest = pick.get("async_nesterov")
            if None in (sync, naive, nest):
                continue
            gap = naive - sync
            closed = (naive - nest) / gap if abs(gap) > 1e-9 else float("nan")
            rows.append(
                {"factor": factor, "seed": seed, "sync": sync, "async": naive, "nesterov": nest, "closed": closed}
            )
    return rows


def show(rows: list[dict]) -> None:
    print(f"\n{'factor':<22} {'seed':>4} {'sync':>7} {'async':>7} {'nesterov':>8} {'gap':>6} {'closed':>7}")
    for r in rows:
        gap = r["async"] - r["sync"]
        print(
            f"{r['factor']:<22} {r['seed']:>4} {r['sync']:>7.3f} {r['async']:>7.3f} {r['nesterov']:>8.3f} "
            f"{gap:>6.3f} {100 * r['closed']:>6.0f}%"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="micro-batches per run at the base horizon")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--only", default="", help="comma-separated factors (psi ones bring the baseline)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel, one torch thread each")
    parser.add_argument("--report", type=Path, help="reprint the table of a saved JSON and exit")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.report:
        show(table(json.loads(args.report.read_text())["records"]))
        return 0
    factors = list(FACTORS) if not args.only else list(dict.fromkeys(args.only.split(",")))
    if any(set(FACTORS.get(f, ("", {}))[1]) & NESTEROV_ONLY for f in factors) and "baseline" not in factors:
        factors.insert(0, "baseline")  # a Nesterov-only factor is measured against the baseline's AdamW
    unknown = [f for f in factors if f not in FACTORS]
    if unknown:
        parser.error(f"unknown factors {unknown}; known: {', '.join(FACTORS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = jobs_for(factors, args.steps, seeds)
    started = time.perf_counter()
    records: dict[str, list[dict]] = {f: [] for f in factors}
    with get_context("spawn").Pool(max(1, args.jobs)) as pool:
        for factor, record in pool.imap_unordered(_work, jobs):
            records[factor].append(record)
    rows = table(records)
    show(rows)
    total = time.perf_counter() - started
    print(f"total {total:.0f}s for {len(jobs)} runs")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"steps": args.steps, "seeds": seeds, "seconds": round(total, 1), "records": records, "rows": rows}
    payload["factors"] = {f: FACTORS[f][0] for f in factors}
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
