"""Codec speed and error: encode+decode GB/s on one core and relative error, against a plain memory copy.

    python bench/codecs.py [--sizes-mib 1 4 16] [--repeats 20] [--out bench/results/codecs.json]

GB/s counts the float32 input bytes per (encode + decode) round trip; the baseline is a copy of
the same bytes (``torch.Tensor.clone``), measured in the same run on the same core.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from swarmpipe.peer.transport.channels import tune_allocator  # noqa: E402
from swarmpipe.peer.transport.codecs import REGISTRY  # noqa: E402
from swarmpipe.peer.transport.wire import decode, encode  # noqa: E402

CODECS = tuple(REGISTRY)  # every codec the swarm speaks


def best_time(fn, repeats: int) -> float:
    """Median of ``repeats`` timings after one warm-up (the machine is shared: the median resists noise)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="bench/results/codecs.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tune_allocator()  # as peers and trainers do (swarmpipe.peer.transport.channels)
    rows = []
    for mib in args.sizes_mib:
        n = int(mib * (1 << 20)) // 4
        x = torch.randn(n, generator=torch.Generator().manual_seed(0)).view(-1, 256)  # activation-like
        nbytes = x.numel() * 4
        t_copy = best_time(lambda: x.clone(), args.repeats)
        rows.append(
            dict(
                size_mib=mib,
                codec="memcpy",
                gbps=nbytes / t_copy / 1e9,
                encode_ms=t_copy * 1e3,
                decode_ms=0.0,
                ratio=1.0,
                rel_err=0.0,
                vs_copy=1.0,
            )
        )
        for codec in CODECS:
            msg = encode(x, codec)
            t_enc = best_time(lambda: encode(x, codec), args.repeats)
            t_dec = best_time(lambda: decode(msg), args.repeats)
            y = decode(msg)
            rel = float((y.float() - x).norm() / x.norm())
            gbps = nbytes / (t_enc + t_dec) / 1e9
            rows.append(
                dict(
                    size_mib=mib,
                    codec=codec,
                    gbps=gbps,
                    encode_ms=t_enc * 1e3,
                    decode_ms=t_dec * 1e3,
                    ratio=nbytes / len(msg.data),
                    rel_err=rel,
                    vs_copy=gbps / (nbytes / t_copy / 1e9),
                )
            )
    print(
        f"{'MiB':>5} {'codec':>10} {'enc+dec GB/s':>13} {'enc ms':>8} {'dec ms':>8} {'size ratio':>10} "
        f"{'rel err':>9} {'vs memcpy':>9}"
    )
    for r in rows:
        print(
            f"{r['size_mib']:>5g} {r['codec']:>10} {r['gbps']:>13.2f} {r['encode_ms']:>8.2f} {r['decode_ms']:>8.2f} "
            f"{r['ratio']:>10.2f} {r['rel_err']:>9.2e} {r['vs_copy']:>9.2f}"
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(threads=1, rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
