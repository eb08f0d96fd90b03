"""Data-plane throughput and latency: swarmpipe's stage RPC vs raw loopback TCP vs hivemind P2P RPC.

    python bench/dataplane.py [--sizes-kib 64 1024 4096 16384 65536] [--seconds 0.5] [--rounds 5] [--out ...]

Every transport does the same echo: the caller sends N payload bytes, the callee sends N bytes
back. Throughput is N / (round-trip time) (payload one way, GB/s = 1e9 B/s), so all three columns
compare like with like. The callees run in their own processes (``bench/echo_servers.py``), as a
stage peer does in a swarm; the caller is this process; everything on 127.0.0.1, in the same run:
  * swarmpipe: ``Forward`` of an identity stage (codec none) through the real StageServicer:
    validation, finite check, encode/decode, unary below the streaming threshold, chunked
    ``Stream`` above it; with 1 and with 4 calls in flight on one pooled channel;
  * tcp: a socket over loopback, echo into one reused buffer (recv_into / sendall): the limit;
  * hivemind: ``P2P.call_protobuf_handler`` between two hivemind P2P daemons (the RPC Petals uses),
    with 1 and with 4 calls in flight.
Ratios are paired: each is the median over rounds of the ratio measured within one round (the
transports run seconds apart there), so this machine's drift between rounds cancels out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.echo_servers import WIDTH, recv_exact  # noqa: E402
from bench.pipeline import write_results  # noqa: E402
from swarmpipe.peer.transport.channels import ChannelPool, tune_allocator  # noqa: E402
from swarmpipe.peer.transport.streaming import StreamingCaller  # noqa: E402
from swarmpipe.peer.transport.wire import decode, encode, raw_view  # noqa: E402
from swarmpipe.protos import swarm_pb2  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@contextlib.contextmanager
def callee(kind: str):
    """Start ``echo_servers.py kind`` in its own process; yields its address; stops it on exit."""
    with callee_process(kind) as (address, _):
        yield address


@contextlib.contextmanager
def callee_process(kind: str, *args: str):
    """``echo_servers.py kind args...`` in its own process; yields (address, pid); stops it on exit."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "echo_servers.py"), kind, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        if not line.startswith("READY "):
            raise RuntimeError(f"{kind} echo server did not start (exit {proc.poll()})")
        yield line.split()[1], proc.pid
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tensor_for(nbytes: int) -> torch.Tensor:
    n = max(nbytes // 4, WIDTH)
    rows = n // WIDTH
    seq = min(rows, 1024)
    return torch.randn(max(rows // seq, 1), seq, WIDTH)


async def timed(fn, seconds: float, min_reps: int = 3, max_reps: int = 200) -> list[float]:
    await fn()  # warm-up (connection, allocator)
    out, start = [], time.perf_counter()
    while len(out) < min_reps or (time.perf_counter() - start < seconds and len(out) < max_reps):
        t = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t)
    return out


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


# ------------------------------------------------------------------ swarmpipe
def echo_request(x: torch.Tensor) -> swarm_pb2.ForwardRequest:
    """A Forward of ``x`` to the identity stage whose tensor carries shape and dtype only: the bytes
    go as a zero-copy payload (``raw_view(x)``). The reply comes back uncompressed, as with TCP."""
    header = encode(x[:0], "none")
    header.ClearField("shape")
    header.shape.extend(x.shape)
    return swarm_pb2.ForwardRequest(run_id="bench", stage=1, microbatch_id="m", input=header, reply_codec="none")


async def bench_swarmpipe(address: str, sizes: list[int], seconds: float, inflight: int) -> dict[int, dict]:
    pool = ChannelPool(64)
    caller = StreamingCaller()
    stub, channel = pool.stub(address), pool.channel(address)
    results = {}
    try:
        for nbytes in sizes:
            x = tensor_for(nbytes)
            real = x.numel() * 4

            async def one(x=x) -> None:
                response = await caller.call(
                    channel, stub, "Forward", echo_request(x), timeout=120, payloads=[raw_view(x)], expected_bytes=real
                )
                y = decode(response.output, max_elements=1 << 25, what="output")
                assert y.shape == x.shape

            async def many() -> None:
                await asyncio.gather(*(one() for _ in range(inflight)))

            times = await timed(many if inflight > 1 else one, seconds)
            t = median(times)
            results[real] = dict(gbps=real * inflight / t / 1e9, latency_ms=t * 1e3, reps=len(times))
    finally:
        await pool.close()
    return results


async def bench_empty_call(address: str, seconds: float) -> dict:
    pool = ChannelPool(64)
    stub = pool.stub(address)
    try:
        info = await timed(lambda: stub.Info(swarm_pb2.InfoRequest(run_id="bench"), timeout=10), seconds)
        x = torch.randn(1, 1, WIDTH)  # one token's activation: the smallest Forward the stage takes

        async def tiny() -> None:
            r = await stub.Forward(
                swarm_pb2.ForwardRequest(
                    run_id="bench", stage=1, microbatch_id="m", input=encode(x), reply_codec="none"
                ),
                timeout=10,
            )
            decode(r.output)

        fwd = await timed(tiny, seconds)
    finally:
        await pool.close()
    return dict(info_rtt_ms=median(info) * 1e3, small_forward_rtt_ms=median(fwd) * 1e3, small_forward_bytes=WIDTH * 4)


# ------------------------------------------------------------------ raw TCP
def bench_tcp(address: str, sizes: list[int], seconds: float) -> dict[int, dict]:
    host, port = address.rsplit(":", 1)
    client = socket.create_connection((host, int(port)))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    results = {}
    try:
        for nbytes in sizes:
            real = tensor_for(nbytes).numel() * 4
            out, back = bytearray(real), bytearray(real)

            def one() -> float:
                t = time.perf_counter()
                client.sendall(real.to_bytes(8, "little"))
                client.sendall(out)
                if not recv_exact(client, memoryview(back)):
                    raise ConnectionError("tcp echo server closed the connection")
                return time.perf_counter() - t

            one()
            times, start = [], time.perf_counter()
            while len(times) < 3 or (time.perf_counter() - start < seconds and len(times) < 500):
                times.append(one())
            t = median(times)
            results[real] = dict(gbps=real / t / 1e9, latency_ms=t * 1e3, reps=len(times))
    finally:
        client.close()
    return results


# ------------------------------------------------------------------ hivemind
async def bench_hivemind(maddr: str, sizes: list[int], seconds: float, inflight: int = 1) -> dict[int, dict]:
    from hivemind.p2p import P2P, PeerID

    cap = max(sizes) + (16 << 20)
    client = await P2P.create(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"], persistent_conn_max_msg_size=cap, initial_peers=[maddr]
    )
    server_id = PeerID.from_base58(maddr.rsplit("/p2p/", 1)[1])
    results = {}
    try:
        for nbytes in sizes:
            x = tensor_for(nbytes)
            real = x.numel() * 4

            async def one(x=x) -> None:
                r = await client.call_protobuf_handler(server_id, "echo", encode(x), swarm_pb2.Tensor)
                decode(r)

            async def many() -> None:
                await asyncio.gather(*(one() for _ in range(inflight)))

            times = await timed(many if inflight > 1 else one, seconds, min_reps=2)
            t = median(times)
            results[real] = dict(gbps=real * inflight / t / 1e9, latency_ms=t * 1e3, reps=len(times))
    finally:
        await client.shutdown()
    return results


# ------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 1024, 4096, 16384, 65536])
    ap.add_argument("--seconds", type=float, default=0.5, help="time budget per size, transport and round")
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="interleaved sweeps; each figure is their median, each ratio the median of per-round ratios",
    )
    ap.add_argument("--no-hivemind", action="store_true")
    ap.add_argument("--out", default="bench/results/dataplane.json")
    args = ap.parse_args()
    tune_allocator()
    torch.set_num_threads(1)  # as a trainer runs by default (and an idle OpenMP worker spins on a core)
    sizes = [k * 1024 for k in args.sizes_kib]
    # Interleaved: every round measures each size on every transport back to back, so load drift on a
    # shared machine hits all transports alike; each figure is the median over rounds, each ratio the
    # median of the ratios within a round.
    samples: dict[str, dict[int, list[dict]]] = {name: {} for name in ("tcp", "sp1", "sp4", "hm", "hm4")}
    with contextlib.ExitStack() as stack:
        tcp_at = stack.enter_context(callee("tcp"))
        stage_at = stack.enter_context(callee("stage"))
        hm_at = None if args.no_hivemind else stack.enter_context(callee("hivemind"))
        for r in range(args.rounds):
            for size in sizes:
                measured = {
                    "tcp": bench_tcp(tcp_at, [size], args.seconds),
                    "sp1": asyncio.run(bench_swarmpipe(stage_at, [size], args.seconds, 1)),
                    "sp4": asyncio.run(bench_swarmpipe(stage_at, [size], args.seconds, 4)),
                }
                if hm_at is not None:
                    measured["hm"] = asyncio.run(bench_hivemind(hm_at, [size], args.seconds))
                    measured["hm4"] = asyncio.run(bench_hivemind(hm_at, [size], args.seconds, 4))
                for name, result in measured.items():
                    for real, row in result.items():
                        samples[name].setdefault(real, []).append(row)
                print(
                    f"  round {r + 1}/{args.rounds}, {size >> 10} KiB: "
                    + ", ".join(
                        f"{name} {row['gbps']:.3f}" for name, result in measured.items() for row in result.values()
                    ),
                    flush=True,
                )
        empty = asyncio.run(bench_empty_call(stage_at, args.seconds))

    def median_row(rows: list[dict]) -> dict:
        return sorted(rows, key=lambda row: row["gbps"])[len(rows) // 2]

    def paired(name: str, base: str, real: int) -> list[float]:
        """The ratio within each round: both were measured seconds apart, so drift cancels."""
        return sorted(a["gbps"] / b["gbps"] for a, b in zip(samples[name][real], samples[base][real]))

    tcp, sp1, sp4, hm, hm4 = (
        {real: median_row(rows) for real, rows in samples[name].items()} for name in ("tcp", "sp1", "sp4", "hm", "hm4")
    )
    rows = []
    for real in sorted(tcp):
        r = dict(
            bytes=real,
            tcp_gbps=tcp[real]["gbps"],
            swarmpipe_gbps=sp1[real]["gbps"],
            swarmpipe_x4_gbps=sp4[real]["gbps"],
            swarmpipe_latency_ms=sp1[real]["latency_ms"],
            tcp_latency_ms=tcp[real]["latency_ms"],
        )
        if real in hm:
            r.update(
                hivemind_gbps=hm[real]["gbps"],
                hivemind_latency_ms=hm[real]["latency_ms"],
                hivemind_x4_gbps=hm4[real]["gbps"],
            )
        # Ratios are medians of the per-round ratios (paired), not ratios of medians taken at different times.
        for key, name, base in (
            ("vs_tcp", "sp1", "tcp"),
            ("x4_vs_tcp", "sp4", "tcp"),
            ("vs_hivemind", "sp1", "hm"),
            ("x4_vs_hivemind_x4", "sp4", "hm4"),
        ):
            if real in samples[base]:
                ratios = paired(name, base, real)
                r[key], r[key + "_range"] = ratios[len(ratios) // 2], (ratios[0], ratios[-1])
        rows.append(r)
    print(
        f"{'size':>9} {'tcp GB/s':>9} {'swarmpipe':>10} {'sp x4':>7} {'hivemind':>9} {'hm x4':>7} "
        f"{'sp/tcp':>7} {'x4/tcp':>7} {'sp/hm':>7} {'x4/hm x4':>9} {'sp ms':>8} {'tcp ms':>8} {'hm ms':>8}"
    )
    nan = float("nan")
    for r in rows:
        size = f"{r['bytes'] / 1024:.0f}K" if r["bytes"] < 1 << 20 else f"{r['bytes'] / (1 << 20):.0f}M"
        print(
            f"{size:>9} {r['tcp_gbps']:>9.3f} {r['swarmpipe_gbps']:>10.3f} {r['swarmpipe_x4_gbps']:>7.3f} "
            f"{r.get('hivemind_gbps', nan):>9.3f} {r.get('hivemind_x4_gbps', nan):>7.3f} {r['vs_tcp']:>7.2f} "
            f"{r['x4_vs_tcp']:>7.2f} {r.get('vs_hivemind', nan):>7.1f} {r.get('x4_vs_hivemind_x4', nan):>9.1f} "
            f"{r['swarmpipe_latency_ms']:>8.2f} {r['tcp_latency_ms']:>8.2f} {r.get('hivemind_latency_ms', nan):>8.2f}"
        )
    if args.rounds > 1:
        print(
            "ratio ranges over rounds: "
            + "; ".join(
                f"{r['bytes'] >> 10} KiB sp/tcp {r['vs_tcp_range'][0]:.2f}-{r['vs_tcp_range'][1]:.2f}"
                + (
                    f", sp/hm {r['vs_hivemind_range'][0]:.1f}-{r['vs_hivemind_range'][1]:.1f}"
                    f", x4/hm x4 {r['x4_vs_hivemind_x4_range'][0]:.1f}-{r['x4_vs_hivemind_x4_range'][1]:.1f}"
                    if "vs_hivemind" in r
                    else ""
                )
                for r in rows
            )
        )
    print(
        f"empty-ish calls: Info round trip {empty['info_rtt_ms']:.3f} ms, "
        f"Forward of a {empty['small_forward_bytes']}-byte tensor {empty['small_forward_rtt_ms']:.3f} ms"
    )
    write_results(
        args.out,
        dict(
            rows=rows,
            empty_calls=empty,
            seconds_per_point=args.seconds,
            rounds=args.rounds,
            callee="own process",
            loadavg=os.getloadavg(),
        ),
    )


if __name__ == "__main__":
    main()
