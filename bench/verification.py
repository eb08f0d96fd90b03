"""The cost of Byzantine verification: samples/s at each verified fraction, against no verification, side by side.

    python bench/verification.py [--stages 2] [--replicas 2] [--steps 300] [--rounds 2] [--fractions 0,0.05,0.2,0.5]

One local swarm (coordinator and ``--replicas`` honest peers per stage, real processes) and trainers run against
it one after another with ``--verify-fraction`` cycling through ``--fractions`` (0 first in every round), so load
drift on a shared machine hits every fraction alike. A check costs forward-only calls: two for an output (the
replica itself and a second one; a third on a disagreement) and one stacked probe for a gradient. Printed: each
fraction's samples/s and its ratio to fraction 0 in the same round, the checks judged and skipped, the
inconclusive disagreements and the strikes (honest peers: none expected).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.pipeline import BenchSwarm, write_results  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=2, help="peers per stage (a second opinion needs two)")
    ap.add_argument("--steps", type=int, default=300, help="micro-batches per trainer run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fractions", default="0,0.05,0.2,0.5")
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--microbatch", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "verification.json")
    )
    args = ap.parse_args()
    fractions = [float(f) for f in args.fractions.split(",")]
    if fractions[0] != 0.0:
        fractions.insert(0, 0.0)
    workdir = Path(tempfile.mkdtemp(prefix="bench-verification-"))
    print(
        f"verification bench: {args.stages} stages x {args.replicas} replicas, micro-batch {args.microbatch}x"
        f"{args.seq_len}, d_model {args.d_model}, {args.in_flight} in flight; logs in {workdir}",
        flush=True,
    )
    swarm = BenchSwarm(workdir, args.stages, d_model=args.d_model, seq_len=args.seq_len, mb=args.microbatch)
    rows: list[dict] = []
    try:
        swarm.start()
        extra = [swarm.start_peer(s, wait=False) for s in range(args.stages) for _ in range(args.replicas - 1)]
        for p in extra:
            swarm.wait_ready(p, timeout=180)
        swarm.train("warmup", 30, "--in-flight", "2", "--verify-fraction", "0")
        for r in range(args.rounds):
            for fraction in fractions:
                report, _ = swarm.train(
                    f"{r:02d}-f{fraction}",
                    args.steps,
                    "--in-flight",
                    str(args.in_flight),
                    "--verify-fraction",
                    str(fraction),
                )
                v = report["verification"]
                row = {
                    "round": r,
                    "fraction": fraction,
                    "samples_per_s": report["samples_per_s"],
                    "lost": report["microbatches_lost"],
                    **{k: v[k] for k in ("checks", "skipped", "disputes", "strikes", "inconclusive")},
                    "banned": len(v["banned"]),
                }
                rows.append(row)
                print(
                    f"  round {r} fraction {fraction:<5} {row['samples_per_s']:7.1f} samples/s, checks {row['checks']}"
                    f" (+{row['skipped']} skipped), inconclusive {row['inconclusive']}, strikes {row['strikes']}",
                    flush=True,
                )
    finally:
        swarm.stop()

    baseline = {r["round"]: r["samples_per_s"] for r in rows if r["fraction"] == 0.0}
    for row in rows:
        row["ratio_vs_unverified"] = row["samples_per_s"] / baseline[row["round"]]
    agg = {}
    for fraction in fractions:
        mine = [r for r in rows if r["fraction"] == fraction]
        agg[str(fraction)] = {
            "samples_per_s": sum(r["samples_per_s"] for r in mine) / len(mine),
            "ratio_vs_unverified": sum(r["ratio_vs_unverified"] for r in mine) / len(mine),
            "checks": sum(r["checks"] for r in mine),
            "strikes": sum(r["strikes"] for r in mine),
        }
    print("\n| verified fraction | samples/s | ratio to unverified (same round) | checks judged | strikes |")
    print("|---|---|---|---|---|")
    for fraction in fractions:
        a = agg[str(fraction)]
        print(
            f"| {fraction} | {a['samples_per_s']:.1f} | {a['ratio_vs_unverified']:.2f} | {a['checks']} | "
            f"{a['strikes']} |"
        )
    write_results(
        args.out, {"args": vars(args), "runs": rows, "aggregate": agg, "loadavg": os.getloadavg(), "time": time.time()}
    )


if __name__ == "__main__":
    main()
