"""GPU stages: real peers on one CUDA device against the same model trained in a bare torch loop.

    python bench/gpu.py [--layers 4] [--hidden 2048] [--swarm-stages 2 4] [--out bench/results/gpu.json]
    python bench/gpu.py --allow-cpu --tiny --out /tmp/gpu.json   # CI: the same code paths on the CPU, tiny

One Llama-family model (``[model] family = "llama"``, inline fields, no checkpoint; default 4 decoder
layers, hidden 2048, 16 heads, 8 kv heads, intermediate 5632, vocab 32000, seq 1024, micro-batch 4):
  * ``bare`` (the baseline): this process trains the whole model (``build_stage`` of a 1-stage spec) under
    ``torch.autocast("cuda", torch.bfloat16)`` with torch's AdamW, one micro-batch at a time; run before
    and after the swarms, the baseline is their mean;
  * (a) ``1 peer``: a ``LocalSwarm`` (coordinator, one real peer process per stage, a trainer with
    ``--report``) with the same spec, ``num_stages = 1``: the peer serves the whole model;
  * (b) ``N peers``: the model split into N = ``--swarm-stages`` stages, every peer on the same device.
Peers get ``--device`` when ``swarmpipe peer --help`` has it; their precision is the spec's default
(``[precision] compute = "auto"``: bf16 autocast on CUDA, fp32 on the CPU, as the bare loop there).
tokens/s: the bare loop's over its synchronized wall time; a swarm's over the peers' busy window (``Info``
polled every 0.25 s, as bench/pipeline.py). MFU = 6 x params (all but the token embedding) x tokens/s /
peak bf16 FLOP/s (``PEAK_BF16`` by device name, or ``--peak-tflops``; "n/a" when unknown).
(c) memory: the bare loop's ``torch.cuda.max_memory_allocated``, the peers' ``Info.device_memory_used``
(highest poll during the run) and, where ``swarmpipe.peer.plan.memory`` exists, its estimate for each.
Goals: the 1-peer stage >= 0.8 of the bare loop's tokens/s; a swarm on one GPU >= 0.6 of it. Without
CUDA it says so and exits 0; ``--allow-cpu --tiny`` runs every path on the CPU at a tiny size (a check
for CI, not a figure). Method and goals in detail: bench/PERFORMANCE.md, "GPU stages".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile
import threading
import time
from inspect import signature
from pathlib import Path

import grpc
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.pipeline import BenchSwarm, summarize, write_results  # noqa: E402
from swarmpipe.cli.local_swarm import spec_toml  # noqa: E402
from swarmpipe.peer.config import PeerConfig  # noqa: E402
from swarmpipe.peer.model import build_stage, lm_loss  # noqa: E402
from swarmpipe.peer.spec import RunSpec, load_spec  # noqa: E402
from swarmpipe.protos import swarm_pb2_grpc  # noqa: E402

NO_CUDA = "no CUDA device: bench/gpu.py measures GPU stages; nothing to do"
# Dense bf16 tensor-core peak by device name (first match wins); --peak-tflops for anything else.
PEAK_BF16 = [
    (r"\bH100\b", 989e12),
    (r"\bH200\b", 989e12),
    (r"\bA100\b", 312e12),
    (r"\bL4\b", 121e12),  # not L40 / L40S (word boundary)
    (r"RTX 4090", 165e12),
]
GOAL_PEER, GOAL_SWARM = 0.8, 0.6


def peak_flops(device_name: str, override_tflops: float) -> float | None:
    if override_tflops > 0:
        return override_tflops * 1e12
    return next((flops for pattern, flops in PEAK_BF16 if re.search(pattern, device_name)), None)


def peer_flags(device: torch.device) -> tuple[list[str], list[str]]:
    """(flags for the peers, notes): ``--device`` when ``swarmpipe peer --help`` lists it. The peer's flags
    are PeerConfig's fields (swarmpipe/cli/args.py), so they are read here without starting a process.
    Precision is the spec's: ``[precision] compute = "auto"`` is bf16 autocast on CUDA, fp32 on the CPU."""
    if "device" in {f.name for f in dataclasses.fields(PeerConfig)}:
        return ["--device", device.type], []
    return [], ["swarmpipe peer has no --device flag yet: peers compute on their default device (the CPU)"]


def spec_settings(args: argparse.Namespace) -> dict:
    """The run spec's tables (over the LocalSwarm template): the model inline, AdamW, no averaging."""
    model = {
        "family": "llama",
        "n_layers": args.layers,
        "d_model": args.hidden,
        "n_heads": args.heads,
        "n_kv_heads": args.kv_heads,
        "intermediate_size": args.intermediate,
        "vocab_size": args.vocab,
        "seq_len": args.seq_len,
    }
    return {
        "model": model,
        "optimizer": {"kind": "adamw", "lr": 1e-4, "warmup_steps": 0},
        "averaging_interval_s": 0,
        "update": {"max_staleness": 64},
        "compression": {"activations": "bf16", "gradients": "bf16"},
        "limits": {"max_message_mb": 256},
    }


def run_spec(args: argparse.Namespace, num_stages: int) -> RunSpec:
    """The spec the swarm of ``num_stages`` runs (the same TOML its coordinator reads)."""
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(spec_toml("bench-gpu", num_stages, microbatch_size=args.microbatch, settings=spec_settings(args)))
    try:
        return load_spec(f.name)
    finally:
        os.unlink(f.name)


def matmul_params(spec: RunSpec) -> tuple[int, int]:
    """(all parameters, all but the token embedding) of the whole model, counted on the meta device."""
    total = embedding = 0
    for s in range(spec.num_stages):
        for name, p in build_stage(spec, s, empty=True).named_parameters():
            total += p.numel()
            embedding += p.numel() if name.startswith("embed_tokens") else 0
    return total, total - embedding


def memory_estimate(spec: RunSpec, stage: int, in_flight: int, autocast: bool) -> int | None:
    """``estimate_stage_memory(spec, stage, in_flight).total_bytes`` where that module exists yet (with
    2-byte activations under bf16 autocast, when it takes ``activation_bytes``)."""
    try:
        from swarmpipe.peer.plan.memory import estimate_stage_memory
    except ImportError:
        return None
    extra = (
        {"activation_bytes": 2}
        if autocast and "activation_bytes" in signature(estimate_stage_memory).parameters
        else {}
    )
    try:
        return int(estimate_stage_memory(spec, stage, in_flight, **extra).total_bytes)
    except Exception as e:  # a prediction that fails is reported, never fatal to the measurement
        print(f"  memory estimate for stage {stage} failed: {e!r}", flush=True)
        return None


def bare_loop(spec: RunSpec, device: torch.device, steps: int, warmup: int) -> dict:
    """The whole model forward + backward + AdamW step in this process, one micro-batch at a time."""
    torch.manual_seed(0)
    module = build_stage(spec, 0).to(device)
    o = spec.optimizer
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    mb, seq = spec.microbatch_size, spec.model.seq_len
    batches = [torch.randint(0, min(256, spec.model.vocab_size), (mb, seq + 1), device=device) for _ in range(4)]
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # as a peer's bf16 precision does
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    loss = torch.zeros(())
    for i in range(warmup + steps):
        if i == warmup:
            if cuda:
                torch.cuda.synchronize(device)
            started = time.perf_counter()
        tokens = batches[i % len(batches)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = lm_loss(module(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        if o.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, o.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    final_loss = float(loss.detach())
    del module, opt, params, batches, loss
    if cuda:
        torch.cuda.empty_cache()  # the peers get the device to themselves
    return {
        "tokens_per_s": steps * mb * seq / seconds,
        "seconds": seconds,
        "peak_memory_bytes": peak,
        "loss": final_loss,
    }


class GpuSwarm(BenchSwarm):
    """BenchSwarm whose peers get extra flags (``--device``)."""

    def start_with(self, peer_args: list[str]) -> None:
        self.start_coordinator(self.write_spec(self.stages, **self.spec_knobs))
        launched = [self.start_peer(s, *peer_args, wait=False, name=f"peer-s{s}") for s in range(self.stages)]
        self.peers = [self.wait_ready(p, timeout=300) for p in launched]
        self._stubs = [swarm_pb2_grpc.StageStub(grpc.insecure_channel(p["address"])) for p in self.peers]

    def device_report(self) -> tuple[list[str], list[int | None]]:
        """Per peer: the device it computes on and the bytes it holds there (``Info.device`` and
        ``Info.device_memory_used``; "" and None from a peer that does not report them)."""
        devices, memory = [], []
        for info in self.info():
            fields = info.DESCRIPTOR.fields_by_name
            devices.append(info.device if "device" in fields else "")
            memory.append(int(info.device_memory_used) if "device_memory_used" in fields else None)
        return devices, memory

    def train_watching_memory(self, name: str, steps: int, *args: str) -> tuple[dict, list[tuple], list]:
        """:meth:`train`, with each peer's reported memory polled every 0.25 s: (report, polls, max per peer)."""
        peaks: list[int | None] = [None] * self.stages
        stop = threading.Event()

        def poll() -> None:
            while not stop.wait(0.25):
                try:
                    _, memory = self.device_report()
                except grpc.RpcError:
                    continue
                for i, m in enumerate(memory):
                    peaks[i] = m if peaks[i] is None or (m is not None and m > peaks[i]) else peaks[i]

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        try:
            report, polls = self.train(name, steps, *args)
        finally:
            stop.set()
            thread.join()
        return report, polls, peaks


def swarm_run(args: argparse.Namespace, workdir: Path, stages: int, peer_args: list[str], autocast: bool) -> dict:
    """One swarm of ``stages`` peers: start, warm up, one measured trainer run, memory, stop."""
    spec = run_spec(args, stages)
    mb, seq = spec.microbatch_size, spec.model.seq_len
    (workdir / f"swarm{stages}").mkdir(parents=True, exist_ok=True)  # the model table sets d_model and seq_len
    swarm = GpuSwarm(
        workdir / f"swarm{stages}", stages, mb=mb, run_id=f"bench-gpu-{stages}", spec_settings=spec_settings(args)
    )
    in_flight = args.in_flight or 2 * stages
    try:
        t = time.monotonic()
        swarm.start_with(peer_args)
        print(f"  {stages} peer(s) up in {time.monotonic() - t:.0f}s", flush=True)
        if args.warmup_steps:
            swarm.train("warmup", args.warmup_steps, "--in-flight", str(in_flight), "--call-timeout", "300")
        report, polls, memory = swarm.train_watching_memory(
            "measured", args.steps, "--in-flight", str(in_flight), "--call-timeout", "300"
        )
        row = summarize(f"{stages} peers", report, polls, mb)
        devices, _ = swarm.device_report()
    finally:
        swarm.stop()
    row.update(
        stages=stages,
        in_flight=in_flight,
        tokens_per_s=row["window_samples_per_s"] * seq,
        report_tokens_per_s=report["samples_per_s"] * seq,
        peer_devices=devices,
        peer_memory_bytes=memory,
        memory_estimate_bytes=[memory_estimate(spec, s, in_flight, autocast) for s in range(stages)],
        loss_first=report.get("loss_first"),
        loss_last=report.get("loss_last"),
    )
    return row


def gib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**30:.3g}"


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--microbatch", type=int, default=4)
    ap.add_argument("--swarm-stages", type=int, nargs="*", default=[2, 4], help="(b): swarms of N peers, N >= 2")
    ap.add_argument("--steps", type=int, default=120, help="micro-batches per measured trainer run")
    ap.add_argument("--warmup-steps", type=int, default=20, help="micro-batches of a warm-up trainer run first")
    ap.add_argument("--bare-steps", type=int, default=60, help="timed micro-batches of the bare loop")
    ap.add_argument("--in-flight", type=int, default=0, help="trainer's micro-batches in flight (0: two per stage)")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="peak bf16 TFLOP/s (default: from the name)")
    ap.add_argument("--allow-cpu", action="store_true", help="with --tiny: run on the CPU when there is no CUDA")
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, seq 32, a few steps: a check")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available() and not (args.allow_cpu and args.tiny):
        print(NO_CUDA + " (--allow-cpu --tiny runs its code paths on the CPU at a tiny size)")
        return
    if args.tiny:
        args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate = 2, 64, 4, 2, 128
        args.vocab, args.seq_len, args.microbatch, args.swarm_stages = 256, 32, 4, [2]
        args.steps, args.warmup_steps, args.bare_steps = 6, 0, 3
    args.swarm_stages = [n for n in args.swarm_stages if 2 <= n <= args.layers]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_flops(device_name, args.peak_tflops) if device.type == "cuda" else None
    figure = device.type == "cuda" and not args.tiny
    notes: list[str] = [] if figure else ["not a figure: a tiny model or the CPU (a check of the code paths)"]
    peer_args, peer_notes = peer_flags(device)
    notes += peer_notes
    swarm_sizes = [1, *args.swarm_stages]
    if device.type == "cuda" and "--device" not in peer_args and not args.tiny:
        swarm_sizes = []  # CPU peers at this size would take hours and measure nothing about GPUs
        notes.append("swarms skipped: the peers cannot be put on the GPU (only the bare loop is measured)")
    whole = run_spec(args, 1)
    total, params = matmul_params(whole)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-gpu-"))
    print(
        f"gpu bench on {device_name}: llama {args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} "
        f"heads, intermediate {args.intermediate}, vocab {args.vocab}, micro-batch {args.microbatch}x{args.seq_len}, "
        f"{total / 1e6:.1f}M params ({params / 1e6:.1f}M without the embedding); peak "
        f"{fmt(peak and peak / 1e12, '.0f')} TFLOP/s; peers {' '.join(peer_args) or 'without --device'}; "
        f"logs in {workdir}",
        flush=True,
    )
    for note in notes:
        print("  note: " + note, flush=True)

    bare = [bare_loop(whole, device, args.bare_steps, 2 if args.tiny else 10)]
    print(f"  bare loop {bare[0]['tokens_per_s']:.0f} tokens/s", flush=True)
    swarms = []
    for stages in swarm_sizes:
        swarms.append(swarm_run(args, workdir, stages, peer_args, device.type == "cuda"))
        print(f"  {stages} peer(s) {swarms[-1]['tokens_per_s']:.0f} tokens/s (window)", flush=True)
    bare.append(bare_loop(whole, device, args.bare_steps, 2 if args.tiny else 10))
    print(f"  bare loop again {bare[1]['tokens_per_s']:.0f} tokens/s", flush=True)

    base = sum(b["tokens_per_s"] for b in bare) / len(bare)
    bare_peak = max((b["peak_memory_bytes"] for b in bare if b["peak_memory_bytes"] is not None), default=None)
    bare_estimate = memory_estimate(whole, 0, 1, device.type == "cuda")

    def mfu(tokens_per_s: float) -> float | None:
        return 6 * params * tokens_per_s / peak if peak else None

    bare_row = dict(run="bare loop (one process)", stages=1, tokens_per_s=base, ratio=1.0, mfu=mfu(base))
    bare_row.update(peer_memory_bytes=[bare_peak], memory_estimate_bytes=[bare_estimate])
    for s in swarms:
        s.update(ratio=s["tokens_per_s"] / base, mfu=mfu(s["tokens_per_s"]))
        s.update(run=f"swarm, {s['stages']} peer(s) on the device", goal=GOAL_PEER if s["stages"] == 1 else GOAL_SWARM)
        s["goal_met"] = s["ratio"] >= s["goal"] if figure else None

    print(f"\n{device_name}{'' if figure else ' (not a figure)'}")
    print(
        "| run | stages | tokens/s | vs bare loop | MFU | memory GiB (bare: peak; peers: max in use) | predicted GiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in [bare_row, *swarms]:
        print(
            f"| {r['run']} | {r['stages']} | {r['tokens_per_s']:.0f} | x{r['ratio']:.2f} | "
            f"{fmt(r['mfu'] and 100 * r['mfu'], '.1f')}{'%' if r['mfu'] else ''} | "
            f"{' / '.join(map(gib, r['peer_memory_bytes']))} | {' / '.join(map(gib, r['memory_estimate_bytes']))} |"
        )
    for s in swarms:
        verdict = "n/a (not a figure)" if s["goal_met"] is None else ("met" if s["goal_met"] else "NOT met")
        print(f"{s['stages']} peer(s) / bare loop: tokens/s x{s['ratio']:.2f}; goal x{s['goal']}: {verdict}")
    out = {
        "device": device_name,
        "figure": figure,
        "notes": notes,
        "peak_flops": peak,
        "model": spec_settings(args)["model"],
        "microbatch": args.microbatch,
        "params": total,
        "params_without_embedding": params,
        "peer_args": peer_args,
        "bare": bare,
        "bare_tokens_per_s": base,
        "bare_mfu": mfu(base),
        "bare_peak_memory_bytes": bare_peak,
        "bare_memory_estimate_bytes": bare_estimate,
        "swarms": swarms,
        "args": vars(args),
        "loadavg": os.getloadavg(),
        "time": time.time(),
    }
    write_results(args.out, out)


if __name__ == "__main__":
    main()
