"""Pipeline schedule: asynchronous (no flush) vs synchronous flush-every-K, on the SAME local swarm.

    python bench/pipeline.py [--stages 4] [--steps 120] [--rounds 2] [--out bench/results/pipeline.json]

Starts a coordinator and one peer per stage (real processes, ``python -m swarmpipe.cli.main``), then runs
trainers one after another against that swarm, interleaving the schedules (async, flush, async,
flush, ...) so that load drift on a shared machine hits both alike:
  * ``async``: the default trainer (``--in-flight`` = 2 per stage, no flush);
  * ``flush``: ``--flush-every K`` (K = number of stages): after each K micro-batches started, the
    trainer waits for every one in flight (a GPipe-like fill / drain schedule);
  * ``serial``: ``--in-flight 1``, one micro-batch at a time: the unloaded latency that the
    per-micro-batch time breakdown starts from.

Busy fraction of a peer = delta ``busy_seconds`` / delta wall time, from the gRPC ``Info`` RPC of
every peer, polled every 0.25 s by this script. The window is the trainer's active period: from the
last poll before any peer's busy time moved to the first poll after the last move, so trainer
start-up (DHT join, corpus loading) does not dilute it. ``samples_per_s`` is the trainer's own
report (its clock starts before the DHT join); ``window_samples_per_s`` is completed samples over
the busy window. ``busy_seconds`` is wall time inside compute, so on an oversubscribed machine it
also counts time a peer's compute thread waited for a core; the CPU fraction (delta user + system
CPU seconds of each peer process, from /proc, over the same window) is printed next to it.

Time breakdown of one micro-batch (round trip through all stages, forward and backward):
  * compute: sum over stages of delta busy_seconds / micro-batches (peers time their own compute);
  * encode / decode: ``swarmpipe.peer.transport.wire.encode`` / ``decode`` of an activation-sized tensor with the
    spec's codecs, timed in this process, times the number of activation-sized tensors one
    micro-batch moves: 4 (P - 1) (the trainer relays every hop, so each of the P - 1 activations
    and P - 1 gradients is sent twice);
  * transfer: in the serial run (one micro-batch at a time, nothing queues) latency minus compute
    minus encode/decode: gRPC, loopback and asyncio overhead;
  * queue: in the async run, latency (Little's law: in-flight / micro-batches per second) minus
    compute minus encode/decode minus the serial run's transfer time: waiting for a busy peer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from swarmpipe.cli.launcher import wait_for  # noqa: E402
from swarmpipe.cli.local_swarm import LocalSwarm  # noqa: E402
from swarmpipe.peer.transport.wire import decode, encode  # noqa: E402
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc  # noqa: E402


class BenchSwarm(LocalSwarm):
    """A coordinator and one peer per stage (the shared :class:`LocalSwarm`), plus the bench's own
    measurements: every peer's ``Info`` polled while a trainer runs."""

    def __init__(
        self,
        workdir: Path,
        stages: int,
        d_model: int = 128,
        seq_len: int = 64,
        mb: int = 16,
        codec: str = "fp16",
        host: str = "127.0.0.1",
        run_id: str = "bench",
        spec_settings: dict[str, Any] | None = None,
    ):
        # No checkpoints and the trainer's default announce period: nothing but the pipeline competes for cores.
        super().__init__(
            Path(workdir),
            run_id=run_id,
            log_level="WARNING",
            host=host,
            peer_announce_period=1.0,
            trainer_announce_period=None,
            checkpoints=False,
        )
        self.stages = stages
        # The one spec template at the bench's sizes, no averaging or checkpoints; spec_settings (top-level
        # keys or whole tables, e.g. {"batching": {...}}) replace the bench's own.
        settings = {
            "averaging_interval_s": 0,
            "checkpoint_every": 1000000,
            "update": {"max_staleness": 64},
            "compression": {"activations": codec, "gradients": codec},
            **(spec_settings or {}),
        }
        self.spec_knobs: dict[str, Any] = dict(
            d_model=d_model, seq_len=seq_len, microbatch_size=mb, lr=1e-3, max_message_mb=64, settings=settings
        )
        self.peers: list[dict] = []  # ready-file contents, by stage
        self._stubs: list = []

    def start(self, peer_hosts: dict[int, tuple[str, list[str]]] | None = None) -> None:
        """``peer_hosts``: stage -> (host, command prefix) for peers that live elsewhere (``ip netns exec NS``)."""
        self.start_coordinator(self.write_spec(self.stages, **self.spec_knobs))
        launched = []
        for s in range(self.stages):
            host, prefix = (peer_hosts or {}).get(s, (self.host, None))
            launched.append(self.start_peer(s, wait=False, name=f"peer-s{s}", host=host, prefix=prefix))
        self.peers = [self.wait_ready(p, timeout=180) for p in launched]
        self._stubs = [swarm_pb2_grpc.StageStub(grpc.insecure_channel(p["address"])) for p in self.peers]

    def info(self) -> list[swarm_pb2.InfoResponse]:
        return [stub.Info(swarm_pb2.InfoRequest(run_id=self.run_id), timeout=10) for stub in self._stubs]

    def train(self, name: str, steps: int, *args: str, timeout: float = 900) -> tuple[dict, list[tuple]]:
        """Run one trainer to the end while polling every peer's Info; returns (report, polls)."""
        polls: list[tuple] = []
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                try:
                    infos = self.info()
                    polls.append(
                        (
                            time.monotonic(),
                            [i.busy_seconds for i in infos],
                            [i.queue for i in infos],
                            [cpu_seconds(p["pid"]) for p in self.peers],
                        )
                    )
                except grpc.RpcError:
                    pass
                stop.wait(0.25)

        poll_thread = threading.Thread(target=poll, daemon=True)
        poll_thread.start()
        trainer, report = self.start_trainer(steps, "--call-timeout", "120", *args, name=name)
        try:
            wait_for(lambda: not trainer.alive(), timeout, f"trainer {name} to finish", poll=0.5)
        finally:
            time.sleep(0.6)  # one more poll after the last backward
            stop.set()
            poll_thread.join()
        return self.wait_report(trainer, report, timeout=10), polls


def write_results(path: str, data: dict) -> None:
    """The benchmark's JSON, next to the table it printed."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"\nwrote {path}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (its threads, not its children), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def busy_window(polls: list[tuple]) -> dict:
    """Busy fractions over the active window (see the module docstring)."""
    moved = [i for i in range(1, len(polls)) if polls[i][1] != polls[i - 1][1]]
    if not moved:
        raise RuntimeError("no peer's busy time moved during the run")
    a, b = polls[moved[0] - 1], polls[moved[-1]]
    wall = b[0] - a[0]
    busy = [(y - x) for x, y in zip(a[1], b[1])]
    inside = polls[moved[0] - 1 : moved[-1] + 1]
    queue = [sum(p[2][s] for p in inside) / len(inside) for s in range(len(a[1]))]
    cpu = [(y - x) for x, y in zip(a[3], b[3])]
    return {
        "wall_s": wall,
        "busy_s": busy,
        "busy_fraction": [x / wall for x in busy],
        "mean_queue": queue,
        "cpu_s": cpu,
        "cpu_fraction": [x / wall for x in cpu],
    }


def codec_seconds(shape: tuple[int, ...], codec: str, reps: int = 50) -> tuple[float, float]:
    """Median seconds to encode and to decode one float32 tensor of ``shape`` with ``codec``."""
    x = torch.randn(*shape)
    enc, dec = [], []
    for _ in range(reps):
        t = time.perf_counter()
        msg = encode(x, codec)
        enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        decode(msg).float()
        dec.append(time.perf_counter() - t)
    return sorted(enc)[reps // 2], sorted(dec)[reps // 2]


def summarize(name: str, report: dict, polls: list[tuple], mb: int) -> dict:
    w = busy_window(polls)
    done = report["microbatches_completed"] + report["microbatches_dropped_stale"]
    return {
        "schedule": name,
        "samples_per_s": report["samples_per_s"],
        "window_samples_per_s": done * mb / w["wall_s"],
        "microbatches": done,
        "dropped_stale": report["microbatches_dropped_stale"],
        "retried": report["microbatches_retried"],
        "lost": report["microbatches_lost"],
        **w,
        "mean_busy_fraction": sum(w["busy_fraction"]) / len(w["busy_fraction"]),
        "mean_cpu_fraction": sum(w["cpu_fraction"]) / len(w["cpu_fraction"]),
        "compute_s_per_mb": sum(w["busy_s"]) / max(1, done),
        "peer_cpu_s_per_mb": sum(w["cpu_s"]) / max(1, done),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--steps", type=int, default=120, help="micro-batches per trainer run")
    ap.add_argument("--rounds", type=int, default=2, help="async/flush pairs, interleaved")
    ap.add_argument("--flush-every", type=int, default=0, help="K (default: the number of stages)")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--microbatch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--workdir", default="")
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pipeline.json")
    )
    args = ap.parse_args()
    P, K, mb = args.stages, args.flush_every or args.stages, args.microbatch
    in_flight = 2 * P
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-pipeline-"))
    print(
        f"pipeline bench: {P} stages x 1 block, d_model {args.d_model}, micro-batch {mb}x{args.seq_len}, "
        f"{args.steps} micro-batches per run; logs in {workdir}",
        flush=True,
    )

    swarm = BenchSwarm(workdir, P, d_model=args.d_model, seq_len=args.seq_len, mb=mb)
    runs: list[dict] = []
    try:
        t = time.monotonic()
        swarm.start()
        print(f"swarm up in {time.monotonic() - t:.0f}s: " + ", ".join(p["address"] for p in swarm.peers), flush=True)
        plan = [("warmup", ["--in-flight", "2"], max(10, args.steps // 6))]
        plan.append(("serial", ["--in-flight", "1"], max(20, args.steps // 3)))
        for _ in range(args.rounds):
            plan.append(("async", ["--in-flight", str(in_flight)], args.steps))
            plan.append(("flush", ["--in-flight", str(in_flight), "--flush-every", str(K)], args.steps))
        for i, (name, extra, steps) in enumerate(plan):
            report, polls = swarm.train(f"{i:02d}-{name}", steps, *extra)
            if name == "warmup":
                continue
            row = summarize(name, report, polls, mb)
            row["round"] = i
            runs.append(row)
            print(
                f"  {name:6s} {row['samples_per_s']:6.1f} samples/s (window {row['window_samples_per_s']:6.1f}), "
                f"busy {' '.join(f'{b:.2f}' for b in row['busy_fraction'])}, queue "
                f"{' '.join(f'{q:.1f}' for q in row['mean_queue'])}, cpu "
                f"{' '.join(f'{c:.2f}' for c in row['cpu_fraction'])}",
                flush=True,
            )
    finally:
        swarm.stop()

    # Encode/decode cost of the activation-sized tensors one micro-batch moves, with the spec's codec.
    torch.set_num_threads(1)
    enc, dec = codec_seconds((mb, args.seq_len, args.d_model), "fp16")
    tensors_per_mb = 4 * (P - 1)

    def mean(name: str, key: str) -> float:
        xs = [r[key] for r in runs if r["schedule"] == name]
        return sum(xs) / len(xs)

    def per_stage(name: str, key: str) -> list[float]:
        rows = [r[key] for r in runs if r["schedule"] == name]
        return [sum(col) / len(col) for col in zip(*rows)]

    agg = {
        name: {
            "samples_per_s": mean(name, "samples_per_s"),
            "window_samples_per_s": mean(name, "window_samples_per_s"),
            "busy_fraction": per_stage(name, "busy_fraction"),
            "mean_busy_fraction": mean(name, "mean_busy_fraction"),
            "mean_queue": per_stage(name, "mean_queue"),
            "compute_s_per_mb": mean(name, "compute_s_per_mb"),
            "cpu_fraction": per_stage(name, "cpu_fraction"),
            "mean_cpu_fraction": mean(name, "mean_cpu_fraction"),
            "peer_cpu_s_per_mb": mean(name, "peer_cpu_s_per_mb"),
        }
        for name in ("serial", "flush", "async")
    }
    codec_s = tensors_per_mb * (enc + dec)
    serial_latency = 1 / (agg["serial"]["window_samples_per_s"] / mb)  # one in flight: latency = time per micro-batch
    transfer = serial_latency - agg["serial"]["compute_s_per_mb"] - codec_s
    async_latency = in_flight / (agg["async"]["window_samples_per_s"] / mb)  # Little's law
    queue = async_latency - agg["async"]["compute_s_per_mb"] - codec_s - transfer
    breakdown = {
        "serial": {
            "latency_ms": 1e3 * serial_latency,
            "compute_ms": 1e3 * agg["serial"]["compute_s_per_mb"],
            "encode_ms": 1e3 * tensors_per_mb * enc,
            "decode_ms": 1e3 * tensors_per_mb * dec,
            "transfer_ms": 1e3 * transfer,
            "queue_ms": 0.0,
        },
        "async": {
            "latency_ms": 1e3 * async_latency,
            "compute_ms": 1e3 * agg["async"]["compute_s_per_mb"],
            "encode_ms": 1e3 * tensors_per_mb * enc,
            "decode_ms": 1e3 * tensors_per_mb * dec,
            "transfer_ms": 1e3 * transfer,
            "queue_ms": 1e3 * queue,
        },
    }
    ratio = agg["async"]["mean_busy_fraction"] / agg["flush"]["mean_busy_fraction"]
    min_ratio = min(a / f for a, f in zip(agg["async"]["busy_fraction"], agg["flush"]["busy_fraction"]))

    print(
        "\n| schedule | samples/s (report) | samples/s (window) | busy fraction per stage | mean busy | "
        "CPU fraction per stage | mean queue per stage |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in ("serial", "flush", "async"):
        a = agg[name]
        label = {"serial": "in-flight 1", "flush": f"flush every {K}", "async": f"async, {in_flight} in flight"}[name]
        print(
            f"| {label} | {a['samples_per_s']:.1f} | {a['window_samples_per_s']:.1f} | "
            f"{' / '.join(f'{b:.2f}' for b in a['busy_fraction'])} | {a['mean_busy_fraction']:.2f} | "
            f"{' / '.join(f'{c:.2f}' for c in a['cpu_fraction'])} | "
            f"{' / '.join(f'{q:.1f}' for q in a['mean_queue'])} |"
        )
    print(
        f"\nasync / flush: busy fraction x{ratio:.2f} (mean; lowest per stage x{min_ratio:.2f}), "
        f"CPU fraction x{agg['async']['mean_cpu_fraction'] / agg['flush']['mean_cpu_fraction']:.2f}, "
        f"samples/s x{agg['async']['window_samples_per_s'] / agg['flush']['window_samples_per_s']:.2f}; "
        f"bar x1.5: {'met' if ratio >= 1.5 else 'NOT met'}"
    )
    print(
        f"\nper micro-batch, ms ({tensors_per_mb} activation-sized tensors of {mb}x{args.seq_len}x{args.d_model} fp16 "
        f"per micro-batch; encode {1e3 * enc:.3f} ms, decode {1e3 * dec:.3f} ms each)"
    )
    print("| run | latency | compute (peers' busy) | encode | decode | transfer | queue | peers' CPU |")
    print("|---|---|---|---|---|---|---|---|")
    for name, b in breakdown.items():
        print(
            f"| {name} | {b['latency_ms']:.0f} | {b['compute_ms']:.0f} | {b['encode_ms']:.1f} | {b['decode_ms']:.1f} | "
            f"{b['transfer_ms']:.0f} | {b['queue_ms']:.0f} | {1e3 * agg[name]['peer_cpu_s_per_mb']:.0f} |"
        )

    out = {
        "stages": P,
        "flush_every": K,
        "in_flight": in_flight,
        "steps": args.steps,
        "d_model": args.d_model,
        "microbatch": mb,
        "seq_len": args.seq_len,
        "runs": runs,
        "aggregate": agg,
        "busy_ratio_async_vs_flush": ratio,
        "busy_ratio_min_stage": min_ratio,
        "bar_met": ratio >= 1.5,
        "codec": {"name": "fp16", "encode_s": enc, "decode_s": dec, "tensors_per_microbatch": tensors_per_mb},
        "breakdown_ms": breakdown,
        "loadavg": os.getloadavg(),
    }
    write_results(args.out, out)


if __name__ == "__main__":
    main()
