"""Server-side batching: the same local swarm shape with batching off (1) and on (N), side by side.

    python bench/batching.py [--stages 2] [--steps 300] [--rounds 2] [--in-flight 8] [--max-batch 4]

Starts two swarms (coordinator + one peer per stage, real processes) that differ only in
``[batching] max_microbatches``, then runs trainers against them alternately (off, on, off, on, ...)
so load drift on a shared machine hits both alike. Each trainer keeps ``--in-flight`` micro-batches
in flight, so requests queue at the peers and batches can form. Printed per configuration: samples/s
(the trainer's report and over the peers' busy window), the peers' busy time per micro-batch, and
the final loss (batching takes fewer, larger optimizer steps, so the loss per sample may differ).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.pipeline import BenchSwarm, summarize, write_results  # noqa: E402


def batching_table(max_batch: int) -> dict[str, dict]:
    return {"batching": {"max_microbatches": max_batch, "wait_ms": 0, "backward_wait_ms": 10}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300, help="micro-batches per trainer run")
    ap.add_argument("--rounds", type=int, default=2, help="off/on pairs, interleaved")
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--microbatch", type=int, default=4, help="small micro-batches: where batching pays")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "batching.json")
    )
    args = ap.parse_args()
    mb = args.microbatch
    workdir = Path(tempfile.mkdtemp(prefix="bench-batching-"))
    print(
        f"batching bench: {args.stages} stages, micro-batch {mb}x{args.seq_len}, d_model {args.d_model}, "
        f"{args.in_flight} in flight, batches of up to {args.max_batch}; logs in {workdir}",
        flush=True,
    )
    configs = {"off": 1, "on": args.max_batch}
    swarms = {}
    rows: list[dict] = []
    try:
        for name, max_batch in configs.items():
            (workdir / name).mkdir()
            swarms[name] = BenchSwarm(
                workdir / name,
                args.stages,
                d_model=args.d_model,
                seq_len=args.seq_len,
                mb=mb,
                run_id=f"bench-{name}",
                spec_settings=batching_table(max_batch),
            )
            swarms[name].start()
            swarms[name].train("warmup", 20, "--in-flight", "2")
        for r in range(args.rounds):
            for name in configs:
                before = swarms[name].info()
                report, polls = swarms[name].train(f"{r:02d}-{name}", args.steps, "--in-flight", str(args.in_flight))
                after = swarms[name].info()
                row = summarize(name, report, polls, mb)
                mean_batch = [
                    (b.batched_microbatches - a.batched_microbatches) / max(1, b.batches - a.batches)
                    for a, b in zip(before, after)
                ]
                row.update(
                    round=r, loss_last=report["loss_last"], loss_first=report["loss_first"], mean_batch=mean_batch
                )
                rows.append(row)
                print(
                    f"  {name:3s} {row['samples_per_s']:6.1f} samples/s (window {row['window_samples_per_s']:6.1f}), "
                    f"busy {1e3 * row['compute_s_per_mb']:.1f} ms per micro-batch, mean batch per stage "
                    f"{' / '.join(f'{m:.2f}' for m in mean_batch)}, loss {report['loss_last']:.3f}",
                    flush=True,
                )
    finally:
        for swarm in swarms.values():
            swarm.stop()

    def mean(name: str, key: str) -> float:
        xs = [r[key] for r in rows if r["schedule"] == name]
        return sum(xs) / len(xs)

    agg = {
        name: {
            key: mean(name, key)
            for key in ("samples_per_s", "window_samples_per_s", "compute_s_per_mb", "peer_cpu_s_per_mb", "loss_last")
        }
        for name in configs
    }
    print(
        "\n| batching | samples/s (report) | samples/s (window) | peers' busy ms per micro-batch | "
        "peers' CPU ms per micro-batch | last loss |"
    )
    print("|---|---|---|---|---|---|")
    for name, max_batch in configs.items():
        a = agg[name]
        print(
            f"| {name} (max {max_batch}) | {a['samples_per_s']:.1f} | {a['window_samples_per_s']:.1f} | "
            f"{1e3 * a['compute_s_per_mb']:.1f} | {1e3 * a['peer_cpu_s_per_mb']:.1f} | {a['loss_last']:.3f} |"
        )
    ratio = agg["on"]["window_samples_per_s"] / agg["off"]["window_samples_per_s"]
    print(
        f"\nbatching on / off: samples/s x{ratio:.2f}, busy time per micro-batch "
        f"x{agg['on']['compute_s_per_mb'] / agg['off']['compute_s_per_mb']:.2f}"
    )
    out = {
        "args": vars(args),
        "runs": rows,
        "aggregate": agg,
        "samples_ratio_on_vs_off": ratio,
        "loadavg": os.getloadavg(),
        "time": time.time(),
    }
    write_results(args.out, out)


if __name__ == "__main__":
    main()
