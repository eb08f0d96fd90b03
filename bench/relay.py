"""What a relay costs (issue 15): samples/s with the last stage relayed vs dialled directly, and raw tunnel MB/s.

    python bench/relay.py [--steps 60] [--rounds 3] [--cases swarm tunnel] [--quick] [--out bench/results/relay.json]

(a) swarm: two 2-stage swarms (a coordinator and one peer per stage each, real processes) at the run spec's
    default model size, identical but for one thing: in ``relayed`` the stage-1 peer runs with ``--relay always``
    and is served through the stage-0 peer (``--relay-capacity 2``: a relay found in the DHT; its record and
    tunnel checked in the event log); in ``direct`` the stage-1 peer is dialled at its own port (its stage-0 peer
    also has ``--relay-capacity 2``, unused). Trainers run one after another, alternating direct, relayed,
    direct, relayed, ... so that load drift on the shared machine hits both alike. Why two swarms and not one
    swarm with both stage-1 peers: a trainer cannot be pinned to one peer of a stage (it spreads micro-batches
    over every online peer), and killing / restarting a peer per round adds a join, a state download and a
    fresh relay tunnel to every round; an idle swarm costs only its DHT announcements, the same for both.
    Reported per run: samples/s over the window in which the peers were busy (bench/pipeline.py); the ratio
    relayed/direct is paired (each relayed run against the direct run just before it), median and range. Also
    the round-trip time of an ``Info`` call from this process to the stage-1 peer, directly and via the relay.
(b) tunnel: in one process (one event loop: caller, relay, tunnel client and target share one core, as the
    relay and the relayed peer's pump share the relay's and the peer's own cores in a swarm), a gRPC echo
    server dialled directly and through a real relay (:class:`RelayServicer` on a gRPC server, a
    :class:`RelayTunnel` to it) with no rate cap and with the peers' default cap (``--relay-rate-mbit``):
    sequential echo calls of one activation (256 KiB) and of 4 MiB, MB/s of payload moved (request + reply),
    and the median round trip of a 64-byte call.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.pipeline import BenchSwarm, summarize, write_results  # noqa: E402
from swarmpipe.peer.config import PeerConfig  # noqa: E402
from swarmpipe.peer.spec import RunSpec  # noqa: E402
from swarmpipe.peer.swarm.relaying import relay_handlers  # noqa: E402
from swarmpipe.peer.transport.channels import channel_options, server_options  # noqa: E402
from swarmpipe.peer.transport.relay_client import RelayTunnel  # noqa: E402
from swarmpipe.peer.transport.relay_server import RelayServicer  # noqa: E402
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc  # noqa: E402

MODES = ("direct", "relayed")
PEER_ID = "QmBenchTarget111111111111111111111111111111111"


# ------------------------------------------------------------------ (a) the swarm
def start_swarms(workroot: Path, knobs: dict) -> dict[str, BenchSwarm]:
    """Both swarms, started side by side; the relayed stage-1 peer only once its relay serves."""
    swarms = {m: BenchSwarm(workroot / m, 2, run_id=f"relay-{m}", **knobs) for m in MODES}
    for swarm in swarms.values():
        swarm.start_coordinator(swarm.write_spec(2, **swarm.spec_knobs))
    relays = {m: s.start_peer(0, "--relay-capacity", "2", wait=False, name="peer-s0") for m, s in swarms.items()}
    ready0 = {m: swarms[m].wait_ready(p, timeout=180) for m, p in relays.items()}
    lasts = {
        m: s.start_peer(1, *(["--relay", "always"] if m == "relayed" else []), wait=False, name="peer-s1")
        for m, s in swarms.items()
    }
    for m, swarm in swarms.items():
        swarm.peers = [ready0[m], swarm.wait_ready(lasts[m], timeout=180)]
        swarm._stubs = [swarm_pb2_grpc.StageStub(grpc.insecure_channel(p["address"])) for p in swarm.peers]
    relayed = [
        e for e in swarms["relayed"].events_of("relayed") if e.get("address") == swarms["relayed"].peers[1]["address"]
    ]
    if not relayed or swarms["direct"].events_of("relayed"):
        raise RuntimeError("the relayed swarm's stage-1 peer is not relayed (or the direct one is)")
    print(
        f"direct: stage 1 at {swarms['direct'].peers[1]['address']}; relayed: stage 1 at "
        f"{swarms['relayed'].peers[1]['address']} through {relayed[-1]['relay_address']}",
        flush=True,
    )
    return swarms


def info_rtt_ms(swarms: dict[str, BenchSwarm], blocks: int, calls: int) -> dict:
    """Median round trip of Info to each swarm's stage-1 peer, alternating blocks of calls."""
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(blocks):
        for m in MODES:
            stub = swarms[m]._stubs[1]
            for _ in range(calls):
                t = time.perf_counter()
                stub.Info(swarm_pb2.InfoRequest(run_id=swarms[m].run_id), timeout=10)
                times[m].append((time.perf_counter() - t) * 1e3)
    return {m: {"median_ms": statistics.median(v), "p90_ms": sorted(v)[int(0.9 * len(v))]} for m, v in times.items()}


def run_swarm_case(swarms: dict[str, BenchSwarm], args) -> list[dict]:
    trainer_args = ["--route", args.route, "--verify-fraction", "0"]
    for m in MODES:
        swarms[m].train(f"warmup-{m}", 4, "--in-flight", "2", *trainer_args)
    rows = []
    for r in range(args.rounds):
        for m in MODES:
            report, polls = swarms[m].train(f"{m}-{r}", args.steps, *trainer_args)
            row = summarize(m, report, polls, args.microbatch)
            row.update(mode=m, round=r)
            rows.append(row)
            print(
                f"  {m:7s} round {r}: {row['window_samples_per_s']:7.1f} samples/s (window), "
                f"{row['samples_per_s']:7.1f} (trainer), lost {row['lost']}, retried {row['retried']}",
                flush=True,
            )
    return rows


def swarm_ratios(rows: list[dict]) -> dict:
    pairs = [
        (d, r)
        for d, r in zip(rows, rows[1:])
        if d["mode"] == "direct" and r["mode"] == "relayed" and d["round"] == r["round"]
    ]
    ratio = [r["window_samples_per_s"] / d["window_samples_per_s"] for d, r in pairs]
    return {
        "samples_per_s_ratio": statistics.median(ratio),
        "samples_per_s_ratio_range": [min(ratio), max(ratio)],
        "samples_per_s_ratios": ratio,
        "direct_samples_per_s": statistics.median(d["window_samples_per_s"] for d, _ in pairs),
        "relayed_samples_per_s": statistics.median(r["window_samples_per_s"] for _, r in pairs),
    }


# ------------------------------------------------------------------ (b) the tunnel, in process
async def _echo(request: bytes, context) -> bytes:
    return request


async def _server(handlers: dict[str, dict[str, grpc.RpcMethodHandler]]) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(options=server_options(64))
    for name, methods in handlers.items():
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def tunnel_bench(sizes: list[int], mb_per_case: float, rounds: int, rate_mbit: float) -> dict:
    """MB/s of sequential echo calls, direct and through a relay (uncapped, capped); 64-byte round trips."""
    target, target_address = await _server({"bench.Echo": {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}})
    port = int(target_address.rsplit(":", 1)[1])
    servers, tunnels, runs, channels = [target], [], [], {}
    channels["direct"] = grpc.aio.insecure_channel(target_address, options=channel_options(64))
    try:
        for name, rate in (("relayed", 0.0), ("relayed_capped", rate_mbit * 1e6 / 8)):
            relay = RelayServicer(2, "127.0.0.1", "127.0.0.1", rate_bytes_s=rate, own_id=f"QmRelay{name[-1]}")
            server, address = await _server(relay_handlers(relay))
            servers.append(server)
            tunnel = RelayTunnel(address, PEER_ID, "127.0.0.1", port)
            tunnels.append(tunnel)
            channels[name] = grpc.aio.insecure_channel(await tunnel.open(), options=channel_options(64))
            runs.append(asyncio.ensure_future(tunnel.run()))
        calls = {name: channel.unary_unary("/bench.Echo/Echo") for name, channel in channels.items()}
        for call in calls.values():  # connections up (through the relay: a Connect per TCP connection)
            for _ in range(3):
                await call(b"x" * 1024, timeout=30)
        out: dict = {"rtt_ms": {}, "mb_s": {}}
        for name, call in calls.items():
            rtts = []
            for _ in range(200):
                t = time.perf_counter()
                await call(b"x" * 64, timeout=30)
                rtts.append((time.perf_counter() - t) * 1e3)
            out["rtt_ms"][name] = statistics.median(rtts)
        for size in sizes:
            payload = os.urandom(size)
            reps = max(2, int(mb_per_case * 1e6 / size))
            rates: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(rounds):
                for name, call in calls.items():
                    t = time.perf_counter()
                    for _ in range(reps):
                        await call(payload, timeout=120)
                    rates[name].append(2 * size * reps / (time.perf_counter() - t) / 1e6)
            out["mb_s"][str(size)] = {name: statistics.median(v) for name, v in rates.items()}
            out["mb_s"][str(size)]["ratio_relayed_direct"] = [r / d for r, d in zip(rates["relayed"], rates["direct"])]
            print(
                f"  tunnel {size // 1024:5d} KiB x {reps}: "
                + ", ".join(f"{n} {statistics.median(v):.1f} MB/s" for n, v in rates.items()),
                flush=True,
            )
        return out
    finally:
        for task in runs:
            task.cancel()
        for channel in channels.values():
            await channel.close()
        for tunnel in tunnels:
            await tunnel.close()
        for server in servers:
            await server.stop(None)
        gc.collect()


# ------------------------------------------------------------------ main
def main() -> None:
    default = RunSpec()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="micro-batches per trainer run")
    ap.add_argument("--rounds", type=int, default=3, help="direct/relayed pairs")
    ap.add_argument("--d-model", type=int, default=default.model.d_model)
    ap.add_argument("--seq-len", type=int, default=default.model.seq_len)
    ap.add_argument("--microbatch", type=int, default=default.microbatch_size)
    ap.add_argument("--codec", default=default.compression.activations)
    ap.add_argument("--route", default="hub", choices=["hub", "chain"], help="the trainers' --route")
    ap.add_argument("--cases", nargs="+", default=["swarm", "tunnel"], choices=["swarm", "tunnel"])
    ap.add_argument("--tunnel-mb", type=float, default=64.0, help="payload MB per tunnel case, size and round")
    ap.add_argument("--rate-mbit", type=float, default=PeerConfig().relay_rate_mbit, help="the capped tunnel's rate")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 12 micro-batches, 1 round, 8 MB per case")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "relay.json"))
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rounds, args.tunnel_mb = 12, 1, 8.0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run finally on SIGTERM too
    workroot = Path(tempfile.mkdtemp(prefix="bench-relay-"))
    knobs = dict(d_model=args.d_model, seq_len=args.seq_len, mb=args.microbatch, codec=args.codec)
    print(
        f"relay bench: 2 stages, d_model {args.d_model}, seq_len {args.seq_len}, micro-batch {args.microbatch}, "
        f"codec {args.codec}, route {args.route}; {args.rounds} x (direct, relayed) x {args.steps} micro-batches; "
        f"logs in {workroot}",
        flush=True,
    )
    out: dict = {"steps": args.steps, "rounds": args.rounds, "route": args.route, **knobs}
    if "swarm" in args.cases:
        swarms: dict[str, BenchSwarm] = {}
        try:
            swarms = start_swarms(workroot, knobs)
            rtt = info_rtt_ms(swarms, blocks=2 if args.quick else 5, calls=10 if args.quick else 40)
            print("  Info round trip: " + ", ".join(f"{m} {v['median_ms']:.2f} ms" for m, v in rtt.items()))
            rows = run_swarm_case(swarms, args)
        finally:
            for swarm in swarms.values():
                swarm.stop()
        out["swarm"] = {"rows": rows, "info_rtt": rtt, **swarm_ratios(rows)}
    if "tunnel" in args.cases:  # last: no grpc.aio object may live on in this process while it forks peers
        sizes = [16 * 64 * 128 * 2, 4 << 20]
        out["tunnel"] = asyncio.run(tunnel_bench(sizes, args.tunnel_mb, args.rounds, args.rate_mbit))
        out["tunnel"]["rate_mbit"] = args.rate_mbit
    if "swarm" in out:
        s = out["swarm"]
        lo, hi = s["samples_per_s_ratio_range"]
        print("\n| stage 1 served | samples/s (median) | relayed/direct (paired, median, range) | Info RTT ms |")
        print("|---|---|---|---|")
        print(f"| direct | {s['direct_samples_per_s']:.1f} | | {s['info_rtt']['direct']['median_ms']:.2f} |")
        print(
            f"| relayed | {s['relayed_samples_per_s']:.1f} | x{s['samples_per_s_ratio']:.2f} ({lo:.2f}-{hi:.2f}) | "
            f"{s['info_rtt']['relayed']['median_ms']:.2f} |"
        )
    if "tunnel" in out:
        t = out["tunnel"]
        print(
            f"\n| echo calls, in process | direct | relayed | relayed, {args.rate_mbit:g} Mbit/s cap | relayed/direct |"
        )
        print("|---|---|---|---|---|")
        print(
            f"| 64 B round trip, ms | {t['rtt_ms']['direct']:.2f} | {t['rtt_ms']['relayed']:.2f} | "
            f"{t['rtt_ms']['relayed_capped']:.2f} | x{t['rtt_ms']['relayed'] / t['rtt_ms']['direct']:.1f} |"
        )
        for size, v in t["mb_s"].items():
            print(
                f"| {int(size) // 1024} KiB, MB/s | {v['direct']:.1f} | {v['relayed']:.1f} | {v['relayed_capped']:.1f} "
                f"| x{v['relayed'] / v['direct']:.2f} |"
            )
    out["loadavg"] = os.getloadavg()
    write_results(args.out, out)


if __name__ == "__main__":
    main()
