"""Bytes per hop and link-bound tokens/s of a pipeline stage boundary, per codec, computed (not measured).

    python bench/link_budget.py                                  # the 8B-shaped Llama of issue 31
    python bench/link_budget.py --d-model 2048 --layers 24 --stages 8 --tokens 4096 --out /tmp/budget.json

For each codec in the registry (peer/transport/codecs.py: its exact encoded size), one boundary crossing of a
micro-batch of ``--tokens`` tokens carries ``tokens x d_model`` values forward (activations) and as many back
(their gradients). A link of R Mbit/s each way then passes at most ``R / 8 / bytes_per_token`` tokens/s per
direction; a stage whose home uplink carries both its activations forward and its gradients back gets half of
that. The compute side is the stage's forward + backward at ``--tflops`` effective (6 x matmul parameters x
tokens, Llama-shaped layers with grouped-query attention and a SwiGLU MLP), so ``link / compute`` says how many
times the link, not the GPU, bounds the swarm (above 1: link-bound).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from swarmpipe.peer.transport.codecs import REGISTRY  # noqa: E402

# the wire formats a boundary could use, bf16 first: the baseline every ratio is taken against
CODECS = ("bf16", "fp16", "blockwise8", "blockwise4", "blockwise2")


def layer_matmul_params(d_model: int, heads: int, kv_heads: int, intermediate: int) -> int:
    head_dim = d_model // heads
    attention = d_model * d_model * 2 + 2 * d_model * kv_heads * head_dim  # q and o, k and v (grouped)
    return attention + 3 * d_model * intermediate  # gate, up, down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--stages", type=int, default=32, help="pipeline stages (layers split evenly)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (batch x sequence)")
    ap.add_argument("--tflops", type=float, default=66.0, help="effective TFLOP/s of one stage's GPU")
    ap.add_argument("--mbits", type=float, nargs="+", default=[25.0, 100.0, 1000.0], help="link rates, Mbit/s")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    layers_per_stage = args.layers / args.stages
    flops = 6 * layer_matmul_params(args.d_model, args.heads, args.kv_heads, args.intermediate) * layers_per_stage
    compute_s = flops * args.tokens / (args.tflops * 1e12)
    compute_tokens_s = args.tokens / compute_s
    values = args.tokens * args.d_model
    baseline = REGISTRY["bf16"].size(torch.bfloat16, values)
    print(
        f"d_model {args.d_model}, {args.layers} layers in {args.stages} stages ({layers_per_stage:g} a stage), "
        f"{args.tokens} tokens a micro-batch: the stage's forward + backward takes {compute_s * 1e3:.0f} ms at "
        f"{args.tflops:g} TFLOP/s ({compute_tokens_s:,.0f} tokens/s)"
    )
    print(
        "| codec | MiB a hop, each way | vs bf16 | "
        + " | ".join(f"tokens/s at {m:g} Mbit/s (link / compute)" for m in args.mbits)
        + " |"
    )
    print("|---|---|---|" + "---|" * len(args.mbits))
    rows = []
    for name in CODECS:
        nbytes = REGISTRY[name].size(torch.float32, values)
        per_rate = []
        for mbits in args.mbits:
            tokens_s = mbits * 1e6 / 8 / (nbytes / args.tokens)
            per_rate.append(
                {"mbits": mbits, "tokens_per_s": tokens_s, "link_over_compute": compute_tokens_s / tokens_s}
            )
        rows.append({"codec": name, "bytes_per_hop": nbytes, "vs_bf16": baseline / nbytes, "links": per_rate})
        cells = " | ".join(f"{r['tokens_per_s']:,.0f} ({r['link_over_compute']:.1f}x)" for r in per_rate)
        print(f"| {name} | {nbytes / (1 << 20):.2f} | {baseline / nbytes:.1f}x | {cells} |")
    print(
        "each direction on a link of its own; a home uplink that carries a stage's activations forward and its "
        "gradients back gets half these tokens/s"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"args": vars(args), "compute_s": compute_s, "compute_tokens_per_s": compute_tokens_s, "rows": rows},
                f,
                indent=1,
            )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
