"""Where one stage call's time goes: the real stage server against two stripped-down ones.

    python bench/call_breakdown.py [--kib 1024] [--seconds 12] [--out bench/results/call_breakdown.json]

A round trip is serial (caller, callee, caller again), so on a small machine its latency is about
the CPU both sides spend on it. One caller goes round-robin over three callees, each in its own
process, 25 calls at a time, so all three see the same machine load:
  * stage:  the real StageServicer over an identity stage (as in bench/dataplane.py);
  * inline: the same, with the forward run on the event loop (no coalescer, no compute thread);
  * canned: a Stream handler that reads the request and yields a reply prepared up front.
stage - inline is the compute-thread hop; inline - canned is the stage's own per-call work
(validation, finite check, encoding, framing the reply); canned is grpc.aio plus the caller.
Callee CPU per call comes from /proc/<pid>/stat (every thread of the callee process).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.dataplane import callee_process, echo_request, median, tensor_for  # noqa: E402
from bench.echo_servers import WIDTH  # noqa: E402
from bench.pipeline import cpu_seconds, write_results  # noqa: E402
from swarmpipe.peer.transport.channels import ChannelPool, tune_allocator  # noqa: E402
from swarmpipe.peer.transport.streaming import StreamingCaller  # noqa: E402
from swarmpipe.peer.transport.wire import decode, raw_view  # noqa: E402

VARIANTS = ("stage", "inline", "canned")
BURST = 25


async def measure(callees: dict[str, tuple[str, int]], nbytes: int, seconds: float) -> dict[str, dict]:
    pool, caller = ChannelPool(64), StreamingCaller()
    x = tensor_for(nbytes)
    real = x.numel() * 4
    request = echo_request(x)

    async def one(address: str) -> None:
        response = await caller.call(
            pool.channel(address),
            pool.stub(address),
            "Forward",
            request,
            timeout=60,
            payloads=[raw_view(x)],
            expected_bytes=real,
        )
        decode(response.output, max_elements=1 << 25, what="output")

    times: dict[str, list[float]] = {name: [] for name in callees}
    cpu: dict[str, float] = dict.fromkeys(callees, 0.0)
    caller_cpu: dict[str, float] = dict.fromkeys(callees, 0.0)
    try:
        for address, _ in callees.values():
            await one(address)  # connect, warm up
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            for name, (address, pid) in callees.items():
                before, own = cpu_seconds(pid), time.process_time()
                for _ in range(BURST):
                    t = time.perf_counter()
                    await one(address)
                    times[name].append(time.perf_counter() - t)
                caller_cpu[name] += time.process_time() - own
                cpu[name] += cpu_seconds(pid) - before
    finally:
        await pool.close()
    return {
        name: dict(
            latency_ms=median(ts) * 1e3,
            callee_cpu_ms=cpu[name] / len(ts) * 1e3,
            caller_cpu_ms=caller_cpu[name] / len(ts) * 1e3,
            calls=len(ts),
        )
        for name, ts in times.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kib", type=int, default=1024, help="tensor size each way")
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--out", default="bench/results/call_breakdown.json")
    args = ap.parse_args()
    tune_allocator()
    torch.set_num_threads(1)
    real = tensor_for(args.kib * 1024).numel() * 4
    with contextlib.ExitStack() as stack:
        callees = {}
        for name in VARIANTS:
            kind = "stage" if name == "stage" else f"stage-{name}"
            callees[name] = stack.enter_context(callee_process(kind, str(WIDTH), str(real)))
        rows = asyncio.run(measure(callees, args.kib * 1024, args.seconds))
    print(f"{'callee':>8} {'round trip ms':>14} {'callee CPU ms':>14} {'caller CPU ms':>14} {'calls':>6}")
    for name, r in rows.items():
        print(
            f"{name:>8} {r['latency_ms']:>14.3f} {r['callee_cpu_ms']:>14.3f} {r['caller_cpu_ms']:>14.3f} {r['calls']:>6}"
        )
    hop = rows["stage"]["latency_ms"] - rows["inline"]["latency_ms"]
    work = rows["inline"]["latency_ms"] - rows["canned"]["latency_ms"]
    print(
        f"compute-thread hop {hop:.2f} ms, the stage's own work {work:.2f} ms, "
        f"grpc.aio + caller {rows['canned']['latency_ms']:.2f} ms per {real >> 10} KiB call"
    )
    write_results(args.out, dict(bytes=real, rows=rows, hop_ms=hop, stage_work_ms=work, loadavg=os.getloadavg()))


if __name__ == "__main__":
    main()
