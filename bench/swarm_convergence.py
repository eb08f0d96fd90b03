"""Convergence inside a real swarm (issue 16, item 5): each optimizer trains the same model on the same data
through a local swarm of real processes, against synchronous AdamW in one process.

    python bench/swarm_convergence.py [--steps 1000] [--stages 4] [--only adamw,basis_rotation] [--out FILE]
    python bench/swarm_convergence.py --quick      # 2 stages, a tiny model, one optimizer: a smoke check

For every optimizer a fresh swarm (``LocalSwarm``, the launcher of ``swarmpipe demo`` and the tests: a
coordinator, one peer per stage, a trainer; separate processes talking gRPC over 127.0.0.1, hivemind DHT)
trains ``--steps`` micro-batches of the stdlib corpus with the trainer's defaults (two micro-batches in
flight per stage, server-side batching, no flush) and measures validation loss on the trainer's 8 held-out
batches every ``--eval-every`` micro-batches. The model is bench/convergence.py's (8 blocks, width 64,
context 64, micro-batch 16), split into ``--stages`` stages; lr 3e-3, 20 warm-up steps, cosine decay over
``--steps`` optimizer steps, clip 1, as the simulator bench. Byzantine verification is off (it changes
nothing in training and costs compute). The synchronous reference runs the same spec, initial weights,
micro-batches (the trainer's data order, seed 1) and validation batches in one process (the delay
simulator with zero delays, the stage runtime's optimizer code).

Reported per run: validation loss against micro-batches and against wall time (from the step-0 evaluation,
so start-up and corpus loading are left out; an evaluation beside training is in it), every stage's optimizer steps and mean measured delay (scraped from the peers'
``swarmpipe_gradient_delay_steps`` histograms, saved next to the JSON so ``bench/convergence.py --delays
recorded:...`` can replay them in the simulator), and the run's wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmpipe.cli.local_swarm import LocalSwarm  # noqa: E402
from swarmpipe.peer.data import open_dataset  # noqa: E402
from swarmpipe.peer.optim.delay_models import RecordedDelays, parse_delay_histograms  # noqa: E402
from swarmpipe.peer.optim.delay_simulator import DelaySimulator  # noqa: E402
from swarmpipe.peer.spec import load_spec  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "swarm_convergence.json"
TRAINER_SEED = 1  # swarmpipe train's default data seed
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adamw": {"kind": "adamw"},
    "nesterov": {"kind": "nesterov"},
    "basis_rotation": {"kind": "basis_rotation"},
    "basis_rotation_dc": {"kind": "basis_rotation", "delay_compensation": 1.0},
    "nostash_nesterov_measured": {"kind": "nesterov", "stash": False, "delay_source": "measured"},
}


@dataclass
class Sizes:
    stages: int = 4
    n_layers: int = 8
    d_model: int = 64
    n_heads: int = 4
    seq_len: int = 64
    microbatch_size: int = 16
    steps: int = 1000
    eval_every: int = 100
    eval_batches: int = 8


QUICK = Sizes(stages=2, n_layers=2, d_model=32, n_heads=2, seq_len=32, microbatch_size=8, steps=24, eval_every=12)


def spec_knobs(sizes: Sizes, optimizer: dict[str, Any]) -> dict[str, Any]:
    """The swarm's spec: the simulator bench's model and schedule, no averaging, no checkpoints."""
    opt = {"lr": 3e-3, "warmup_steps": 20, "total_steps": sizes.steps, "clip_norm": 1.0, **optimizer}
    return dict(
        n_layers=sizes.n_layers,
        d_model=sizes.d_model,
        n_heads=sizes.n_heads,
        seq_len=sizes.seq_len,
        microbatch_size=sizes.microbatch_size,
        lr=opt["lr"],
        warmup_steps=opt["warmup_steps"],
        settings={"averaging_interval_s": 0, "update": {"max_staleness": 64}, "optimizer": opt},
    )


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return response.read().decode()


def counter(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def swarm_run(name: str, sizes: Sizes, workdir: Path, timeout: float) -> dict[str, Any]:
    """One optimizer through a fresh local swarm; its curve, wall times, steps and delays per stage."""
    started = time.time()
    swarm = LocalSwarm(workdir, run_id=f"conv-{name.replace('_', '-')}", log_level="WARNING", checkpoints=False)
    swarm.trainer_announce_period = None
    with swarm:
        spec = swarm.write_spec(sizes.stages, **spec_knobs(sizes, OPTIMIZERS[name]))
        swarm.start_coordinator(spec)
        peers = [swarm.start_peer(s, "--metrics-port", "0", wait=False) for s in range(sizes.stages)]
        ready = [swarm.wait_ready(p, timeout=180) for p in peers]
        trainer, report_path = swarm.start_trainer(
            sizes.steps,
            "--eval-every",
            str(sizes.eval_every),
            "--eval-batches",
            str(sizes.eval_batches),
            "--verify-fraction",
            "0",
            "--seed",
            str(TRAINER_SEED),
        )
        report = swarm.wait_report(trainer, report_path, timeout)
        scrapes = [scrape(r["metrics_address"]) for r in ready]
    evaluated = [e for e in swarm.events_of("evaluated") if e.get("role") == "trainer"]
    t0 = next((e["time"] for e in evaluated if e.get("step") == 0), evaluated[0]["time"] if evaluated else started)
    for k, text in enumerate(scrapes):
        (workdir / f"stage{k}.prom").write_text(text)
    recorded = RecordedDelays(sizes.stages, scrapes) if all(parse_delay_histograms(t) for t in scrapes) else None
    return {
        "name": name,
        "optimizer": OPTIMIZERS[name],
        "eval_micro": [int(s) for s, _ in report["val_losses"]],
        "eval_losses": [float(v) for _, v in report["val_losses"]],
        "eval_wall_s": [round(e["time"] - t0, 1) for e in evaluated],
        "final_eval": float(report["val_losses"][-1][1]) if report["val_losses"] else None,
        "completed": report["microbatches_completed"],
        "dropped_stale": report["microbatches_dropped_stale"],
        "lost": report["microbatches_lost"],
        "samples_per_s": report.get("samples_per_s"),
        "train_seconds": round(report.get("elapsed_s", 0.0), 1),
        "optimizer_steps": [int(counter(t, "swarmpipe_optimizer_steps_total")) for t in scrapes],
        "mean_delays": [round(recorded.mean(k), 2) for k in range(sizes.stages)] if recorded else [],
        "seconds": round(time.time() - started, 1),
    }


def sync_reference(sizes: Sizes, workdir: Path) -> dict[str, Any]:
    """Synchronous AdamW in one process on the swarm's spec, data order and validation batches."""
    started = time.time()
    spec_path = LocalSwarm(workdir, run_id="conv-sync").write_spec(
        sizes.stages, **spec_knobs(sizes, OPTIMIZERS["adamw"])
    )
    spec = load_spec(spec_path)
    dataset = open_dataset(None, spec.model.seq_len, spec.model.vocab_size, None, TRAINER_SEED)
    valid = dataset.validation(spec.microbatch_size)[: sizes.eval_batches]
    batches = dataset.batches(spec.microbatch_size)  # the trainer's stream: shard 0 of 1, from the start
    sim = DelaySimulator(spec, [0] * spec.num_stages)
    t0 = time.time()  # as the swarm runs: from the first evaluation, after loading and start-up
    micro, losses, walls = [0], [sim.evaluate(valid)], [0.0]
    for i in range(1, sizes.steps + 1):
        inputs, targets, _ = batches.next()
        sim.train_micro(inputs, targets)
        if i % sizes.eval_every == 0 or i == sizes.steps:
            micro.append(i)
            losses.append(sim.evaluate(valid))
            walls.append(round(time.time() - t0, 1))
    return {
        "name": "sync_adamw (one process)",
        "optimizer": OPTIMIZERS["adamw"],
        "eval_micro": micro,
        "eval_losses": losses,
        "eval_wall_s": walls,
        "final_eval": losses[-1],
        "completed": sizes.steps,
        "seconds": round(time.time() - started, 1),
    }


def table(runs: list[dict[str, Any]]) -> str:
    """Final validation loss, its gap to the synchronous run, and micro-batches to reach the synchronous
    run's loss at half the budget."""
    sync = next((r for r in runs if r["name"].startswith("sync")), None)
    target = None
    if sync is not None:
        half = sync["eval_micro"][-1] / 2
        target = next(v for m, v in zip(sync["eval_micro"], sync["eval_losses"]) if m >= half)
    lines = [
        f"| run | val loss | vs sync | micro-batches to sync@half ({target or 0:.3f}) | training wall s "
        "| micro-batches/s | steps per stage | mean delay per stage |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        gap = "" if sync is None or r is sync else f"{r['final_eval'] - sync['final_eval']:+.3f}"
        reach = next((m for m, v in zip(r["eval_micro"], r["eval_losses"]) if target and v <= target), None)
        wall = r["eval_wall_s"][-1]
        lines.append(
            f"| {r['name']} | {r['final_eval']:.3f} | {gap} | {reach if reach is not None else 'never'} | "
            f"{wall:g} | {r['completed'] / wall if wall else 0:.1f} | {r.get('optimizer_steps', '')} | "
            f"{r.get('mean_delays', '')} |"
        )
    return "\n".join(lines)


def curves(runs: list[dict[str, Any]]) -> str:
    lines = []
    for r in runs:
        points = ", ".join(
            f"{m}: {v:.2f} ({w:g} s)" for m, v, w in zip(r["eval_micro"], r["eval_losses"], r["eval_wall_s"])
        )
        lines.append(f"{r['name']}: {points}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=Sizes.steps, help="micro-batches per run")
    parser.add_argument("--stages", type=int, default=Sizes.stages)
    parser.add_argument("--eval-every", type=int, default=Sizes.eval_every)
    parser.add_argument("--only", default="", help=f"comma-separated optimizers of {', '.join(OPTIMIZERS)}")
    parser.add_argument("--compensation", type=float, default=1.0, help="basis_rotation_dc's lambda")
    parser.add_argument("--quick", action="store_true", help="2 tiny stages, 24 micro-batches, one optimizer")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one swarm run may take")
    parser.add_argument("--workdir", type=Path, help="keep the swarms' logs here (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    OPTIMIZERS["basis_rotation_dc"]["delay_compensation"] = args.compensation
    sizes = QUICK if args.quick else Sizes(stages=args.stages, steps=args.steps, eval_every=args.eval_every)
    names = args.only.split(",") if args.only else (["basis_rotation_dc"] if args.quick else list(OPTIMIZERS))
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown:
        parser.error(f"unknown optimizer(s) {', '.join(unknown)}; known: {', '.join(OPTIMIZERS)}")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="swarm-convergence-") as tmp:
        root = args.workdir or Path(tmp)
        runs = [sync_reference(sizes, root / "sync")]
        print(f"{runs[0]['name']:<28} val {runs[0]['final_eval']:.4f}  {runs[0]['seconds']:6.1f}s", flush=True)
        for name in names:
            (root / name).mkdir(parents=True, exist_ok=True)
            record = swarm_run(name, sizes, root / name, args.timeout)
            runs.append(record)
            print(f"{name:<28} val {record['final_eval']:.4f}  {record['seconds']:6.1f}s", flush=True)
    print()
    print(table(runs))
    print()
    print(curves(runs))
    total = time.time() - started
    print(f"total {total:.0f}s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"sizes": vars(sizes), "quick": args.quick, "seconds": round(total, 1), "runs": runs}
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
