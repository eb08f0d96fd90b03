"""Samples/s under a bandwidth limit with each codec: what activation / gradient compression buys.

    sudo python bench/bandwidth.py [--rate 25mbit] [--delay 20ms] [--steps 40] [--out bench/results/bandwidth.json]

Builds a network namespace with a veth pair (addresses in 10.213.N.0/30, which exist only on this
pair) and shapes both ends with ``tc netem delay D rate R`` (each direction; where the kernel has no
sch_netem, ``tc tbf rate R`` and no added delay, which the output says). Stage 0's peer, the
coordinator and the trainer run in the root namespace bound to the root-side veth address; the last
stage's peer runs inside the namespace (``ip netns exec``) on the far address. The trainer relays
every hop, so each micro-batch's activations to the last stage and the gradients back cross the
shaped link once each way; the DHT runs over the same link.

For each codec (``compression.activations`` = ``compression.gradients`` = codec in the spec) a
fresh swarm is started, warmed up, and one trainer runs ``--steps`` micro-batches. Reported:
the trainer's ``samples_per_s``, samples/s over the window in which the peers were busy (see
bench/pipeline.py), the bytes one activation takes on the wire, and the last stage's busy fraction.
Needs root (network namespaces); without them it prints why and exits 0. The namespace, and the
veth with it, are deleted at exit.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from bench.pipeline import BenchSwarm, summarize, write_results  # noqa: E402
from swarmpipe.peer.transport.codecs import allowed_in_spec  # noqa: E402
from swarmpipe.peer.transport.wire import encoded_size  # noqa: E402


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


class ShapedLink:
    """A namespace ``ns`` joined to the root namespace by a veth pair shaped with netem on both ends."""

    def __init__(self, rate: str, delay: str):
        n = os.getpid() % 250 + 1
        self.ns = f"spbw{os.getpid()}"
        self.root_if, self.ns_if = f"spbw{n}r", f"spbw{n}n"
        self.root_ip, self.ns_ip = f"10.213.{n}.1", f"10.213.{n}.2"
        self.rate, self.delay = rate, delay
        self.up = False
        self.shaping = ""

    def create(self) -> None:
        self.up = True  # from here on, delete() has something to clean
        sh("ip", "netns", "add", self.ns)
        sh("ip", "link", "add", self.root_if, "type", "veth", "peer", "name", self.ns_if)
        sh("ip", "link", "set", self.ns_if, "netns", self.ns)
        sh("ip", "addr", "add", f"{self.root_ip}/30", "dev", self.root_if)
        sh("ip", "link", "set", self.root_if, "up")
        sh("ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
        sh("ip", "netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "up")
        sh("ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
        netem = ["root", "netem", "delay", self.delay, "rate", self.rate, "limit", "10000"]
        if sh("tc", "qdisc", "add", "dev", self.root_if, *netem, check=False).returncode == 0:
            sh("ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.ns_if, *netem)
            self.shaping = f"netem delay {self.delay} rate {self.rate} on each end"
        else:  # a kernel without sch_netem: rate only, with a token bucket; no added delay
            tbf = ["root", "tbf", "rate", self.rate, "burst", "32kb", "latency", "400ms"]
            sh("tc", "qdisc", "add", "dev", self.root_if, *tbf)
            sh("ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.ns_if, *tbf)
            self.shaping = f"tbf rate {self.rate} on each end (no netem in this kernel: no added delay)"
            self.delay = "0ms"
        self._check_reachable()

    def _check_reachable(self) -> None:
        """A TCP connect from inside the namespace to a listener on the root-side address."""
        import socket

        with socket.socket() as srv:
            srv.bind((self.root_ip, 0))
            srv.listen()
            code = f"import socket; socket.create_connection(({self.root_ip!r}, {srv.getsockname()[1]}), timeout=5)"
            sh("ip", "netns", "exec", self.ns, sys.executable, "-c", code)

    def delete(self) -> None:
        if not self.up:
            return
        self.up = False
        sh("ip", "link", "del", self.root_if, check=False)  # also removes the namespace's end
        sh("ip", "netns", "del", self.ns, check=False)

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]


def probe_reason() -> str | None:
    """Why namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "needs root for network namespaces (ip netns); skipping"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            return f"'{tool}' (iproute2) is not installed; skipping"
    name = f"spbwprobe{os.getpid()}"
    r = sh("ip", "netns", "add", name, check=False)
    if r.returncode:
        return f"cannot create a network namespace ({r.stderr.strip()}); skipping"
    sh("ip", "netns", "del", name, check=False)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--rate", default="25mbit", help="25mbit: on the loaded 2-core VM, 100mbit left the 8-bit codecs compute-bound"
    )
    ap.add_argument("--delay", default="20ms", help="one way, on each end (round trip = 2x)")
    ap.add_argument(
        "--codecs",
        nargs="+",
        default=[c for c in ("none", "fp16", "uint8", "blockwise8", "auto") if c in allowed_in_spec("activations")],
    )
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--microbatch", type=int, default=64)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bandwidth.json")
    )
    args = ap.parse_args()
    reason = probe_reason()
    if reason:
        print(f"bench/bandwidth.py: {reason}")
        return
    link = ShapedLink(args.rate, args.delay)
    atexit.register(link.delete)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run finally / atexit on SIGTERM too
    workroot = Path(tempfile.mkdtemp(prefix="bench-bandwidth-"))
    numel = args.microbatch * args.seq_len * args.d_model
    print(
        f"bandwidth bench: {args.stages} stages, last one behind a link shaped to {args.rate}; "
        f"activation {args.microbatch}x{args.seq_len}x{args.d_model} = {numel * 4 / 2**20:.1f} MiB float32; "
        f"{args.steps} micro-batches per codec; logs in {workroot}",
        flush=True,
    )
    rows = []
    try:
        link.create()
        print(f"link {link.root_ip} <-> {link.ns_ip} ({link.ns}): {link.shaping}", flush=True)
        for codec in args.codecs:
            swarm = BenchSwarm(
                workroot / codec,
                args.stages,
                d_model=args.d_model,
                seq_len=args.seq_len,
                mb=args.microbatch,
                codec=codec,
                host=link.root_ip,
            )
            try:
                swarm.start(peer_hosts={args.stages - 1: (link.ns_ip, link.prefix())})
                swarm.train("warmup", 4, "--in-flight", "2")
                report, polls = swarm.train("run", args.steps)
            finally:
                swarm.stop()
            row = summarize(codec, report, polls, args.microbatch)
            wire = encoded_size(codec, torch.float32, numel) if codec != "auto" else None
            rows.append(
                {
                    "codec": codec,
                    "samples_per_s": row["samples_per_s"],
                    "window_samples_per_s": row["window_samples_per_s"],
                    "activation_bytes": wire,
                    "last_stage_busy": row["busy_fraction"][-1],
                    "busy_fraction": row["busy_fraction"],
                    "microbatches": row["microbatches"],
                    "retried": row["retried"],
                    "lost": row["lost"],
                    "loss_last": report["loss_last"],
                }
            )
            print(
                f"  {codec:10s} {row['samples_per_s']:6.1f} samples/s (window {row['window_samples_per_s']:6.1f}), "
                f"busy {' '.join(f'{b:.2f}' for b in row['busy_fraction'])}",
                flush=True,
            )
    finally:
        link.delete()

    base = next((r for r in rows if r["codec"] == "none"), rows[0])
    print(f"\nlink: {link.shaping}")
    print("| codec | bytes per activation | samples/s (report) | samples/s (window) | vs none | last stage busy |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        r["vs_none"] = r["window_samples_per_s"] / base["window_samples_per_s"]
        size = f"{r['activation_bytes'] / 2**20:.2f} MiB" if r["activation_bytes"] else "per hop"
        print(
            f"| {r['codec']} | {size} | {r['samples_per_s']:.1f} | {r['window_samples_per_s']:.1f} | "
            f"x{r['vs_none']:.2f} | {r['last_stage_busy']:.2f} |"
        )
    out = {
        "rate": args.rate,
        "delay_each_way": link.delay,
        "shaping": link.shaping,
        "stages": args.stages,
        "steps": args.steps,
        "microbatch": args.microbatch,
        "seq_len": args.seq_len,
        "d_model": args.d_model,
        "rows": rows,
        "loadavg": os.getloadavg(),
    }
    write_results(args.out, out)


if __name__ == "__main__":
    main()
