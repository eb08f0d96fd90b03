"""Chained vs hub micro-batches on the same swarm and data: samples/s and the trainer's bytes per micro-batch.

    python bench/chain.py [--stages 2] [--steps 40] [--rounds 2] [--rate 25mbit] [--out bench/results/chain.json]

One swarm (a coordinator and one peer per stage, real processes) at the run spec's default model size, and
trainers run one after another against it, alternating ``--route hub`` and ``--route chain`` (hub, chain, hub,
chain, ...) so that load drift on a shared machine hits both alike:

  (a) loopback: every role on 127.0.0.1;
  (b) the trainer's link limited: the trainer runs in a network namespace behind a veth pair shaped to
      ``--rate`` (``tc netem delay D rate R`` on each end; bench/bandwidth.py's method), the coordinator and
      the peers in the root namespace on the root-side address, so peer-to-peer hops are loopback-fast and only
      what the trainer sends or receives crosses the shaped link. Needs root; without it (b) is skipped and says so.

Reported per run: samples/s over the window in which the peers were busy (bench/pipeline.py), the trainer's
own ``samples_per_s``, and ``trainer_bytes_per_microbatch`` from its report (bytes it sent and received, per
micro-batch). Ratios chain/hub are paired: each chain run against the hub run just before it; the median of
the pairs is the figure. Goals (issue 17): (a) not slower, (b) at least 3x the samples/s and at least 20x
fewer trainer bytes per micro-batch.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bandwidth import ShapedLink, probe_reason  # noqa: E402
from bench.pipeline import BenchSwarm, summarize, write_results  # noqa: E402
from swarmpipe.peer.spec import RunSpec  # noqa: E402

ROUTES = ("hub", "chain")


def run_case(name: str, swarm: BenchSwarm, args, trainer_args: list[str], prefix: list[str] | None) -> list[dict]:
    """Alternating hub / chain trainers on one started swarm; one row per run."""
    rows = []
    saved = swarm.prefix
    swarm.prefix = prefix or []  # only the trainer runs under it (the peers are already up)
    try:
        swarm.train(f"{name}-warmup", 4, "--in-flight", "2", "--route", "chain", *trainer_args)
        for r in range(args.rounds):
            for route in ROUTES:
                report, polls = swarm.train(f"{name}-{route}-{r}", args.steps, "--route", route, *trainer_args)
                row = summarize(route, report, polls, args.microbatch)
                row.update(
                    case=name,
                    route=route,
                    round=r,
                    trainer_bytes_per_microbatch=report["trainer_bytes_per_microbatch"],
                    chain_breaks=report.get("chain_breaks", 0),
                )
                rows.append(row)
                print(
                    f"  {name:8s} {route:5s} round {r}: {row['window_samples_per_s']:7.1f} samples/s (window), "
                    f"{report['trainer_bytes_per_microbatch'] / 1e3:9.1f} kB per micro-batch at the trainer, "
                    f"lost {row['lost']}",
                    flush=True,
                )
    finally:
        swarm.prefix = saved
    return rows


def ratios(rows: list[dict]) -> dict:
    """Paired chain/hub ratios of one case: median and range over the rounds."""
    pairs = [
        (h, c)
        for h, c in zip(rows, rows[1:])
        if h["route"] == "hub" and c["route"] == "chain" and h["round"] == c["round"]
    ]
    speed = [c["window_samples_per_s"] / h["window_samples_per_s"] for h, c in pairs]
    fewer = [h["trainer_bytes_per_microbatch"] / c["trainer_bytes_per_microbatch"] for h, c in pairs]
    return {
        "samples_per_s_ratio": statistics.median(speed),
        "samples_per_s_ratio_range": [min(speed), max(speed)],
        "trainer_bytes_fewer": statistics.median(fewer),
        "trainer_bytes_fewer_range": [min(fewer), max(fewer)],
        "hub_bytes_per_microbatch": statistics.median(h["trainer_bytes_per_microbatch"] for h, _ in pairs),
        "chain_bytes_per_microbatch": statistics.median(c["trainer_bytes_per_microbatch"] for _, c in pairs),
        "hub_samples_per_s": statistics.median(h["window_samples_per_s"] for h, _ in pairs),
        "chain_samples_per_s": statistics.median(c["window_samples_per_s"] for _, c in pairs),
    }


def main() -> None:
    default = RunSpec()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40, help="micro-batches per trainer run")
    ap.add_argument("--rounds", type=int, default=2, help="hub/chain pairs per case")
    ap.add_argument("--d-model", type=int, default=default.model.d_model)
    ap.add_argument("--seq-len", type=int, default=default.model.seq_len)
    ap.add_argument("--microbatch", type=int, default=default.microbatch_size)
    ap.add_argument("--codec", default=default.compression.activations)
    ap.add_argument("--rate", default="25mbit", help="the trainer's link in case (b)")
    ap.add_argument("--delay", default="20ms", help="one way, on each end of the trainer's link")
    ap.add_argument(
        "--verify-fraction",
        default="0",
        help="the trainers' --verify-fraction: 0 measures the transport alone (a verified micro-batch goes the hub "
        "way in both modes; its cost is bench/verification.py's subject)",
    )
    ap.add_argument("--cases", nargs="+", default=["loopback", "limited"], choices=["loopback", "limited"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "chain.json"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run finally / atexit on SIGTERM too
    workroot = Path(tempfile.mkdtemp(prefix="bench-chain-"))
    knobs = dict(d_model=args.d_model, seq_len=args.seq_len, mb=args.microbatch, codec=args.codec)
    print(
        f"chain bench: {args.stages} stages, d_model {args.d_model}, seq_len {args.seq_len}, micro-batch "
        f"{args.microbatch}, codec {args.codec}; {args.rounds} x (hub, chain) x {args.steps} micro-batches per case; "
        f"logs in {workroot}",
        flush=True,
    )
    out: dict = {"stages": args.stages, "steps": args.steps, "rounds": args.rounds, **knobs, "cases": {}}
    out["verify_fraction"] = float(args.verify_fraction)
    if "loopback" in args.cases:
        swarm = BenchSwarm(workroot / "loopback", args.stages, **knobs)
        try:
            swarm.start()
            rows = run_case("loopback", swarm, args, ["--verify-fraction", args.verify_fraction], None)
        finally:
            swarm.stop()
        out["cases"]["loopback"] = {"rows": rows, **ratios(rows)}
    if "limited" in args.cases:
        reason = probe_reason()
        if reason:
            print(f"case limited: {reason}")
            out["cases"]["limited"] = {"skipped": reason}
        else:
            link = ShapedLink(args.rate, args.delay)
            atexit.register(link.delete)
            try:
                link.create()
                print(f"trainer link {link.ns_ip} -> {link.root_ip}: {link.shaping}", flush=True)
                swarm = BenchSwarm(workroot / "limited", args.stages, host=link.root_ip, **knobs)
                try:
                    swarm.start()
                    trainer_args = ["--host", link.ns_ip, "--verify-fraction", args.verify_fraction]
                    rows = run_case("limited", swarm, args, trainer_args, link.prefix())
                finally:
                    swarm.stop()
            finally:
                link.delete()
            out["cases"]["limited"] = {"rate": args.rate, "shaping": link.shaping, "rows": rows, **ratios(rows)}
    print("\n| case | hub samples/s | chain samples/s | chain/hub | trainer kB/mb hub | chain | fewer |")
    print("|---|---|---|---|---|---|---|")
    for name, case in out["cases"].items():
        if "skipped" in case:
            print(f"| {name} | skipped: {case['skipped']} |||||")
            continue
        lo, hi = case["samples_per_s_ratio_range"]
        print(
            f"| {name} | {case['hub_samples_per_s']:.1f} | {case['chain_samples_per_s']:.1f} | "
            f"x{case['samples_per_s_ratio']:.2f} ({lo:.2f}-{hi:.2f}) | {case['hub_bytes_per_microbatch'] / 1e3:.1f} | "
            f"{case['chain_bytes_per_microbatch'] / 1e3:.1f} | x{case['trainer_bytes_fewer']:.0f} |"
        )
    out["loadavg"] = os.getloadavg()
    write_results(args.out, out)


if __name__ == "__main__":
    main()
