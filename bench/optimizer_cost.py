"""Basis rotation's cost at scale (issue 16, item 6): state memory and step time against AdamW, per matrix.

    python bench/optimizer_cost.py [--widths 256,512,1024,2048] [--threads 1] [--out bench/results/optimizer_cost.json]

For a transformer block of width d the rotated matrices are d x d (attention projection) and the MLP's
4d x d (fc; fc_out is its transpose, same cost). For each width and shape this measures, on the CPU with
``--threads`` torch threads (a GPU is not measured here: none was lent when this was written):

* state bytes of AdamW (2mn floats) and of basis rotation (2mn + 2m^2 + 2n^2), and the ratio;
* the median time of an AdamW step and of a basis-rotation step between refreshes (rotate the gradient
  and the first moment in, divide, rotate back), and of a refresh step (one power iteration and QR per
  side, every ``rotation_every`` = 10 steps), amortised into the mean step time; the ratio to AdamW;
* the first step's float64 ``eigh`` (once per matrix, when a replica starts from scratch), for sides up
  to ``--max-eigh`` (beyond, minutes on a CPU core: not measured);
* the matrix's own forward + backward over one micro-batch of 16 x 64 tokens, to put the optimizer's
  time in proportion;
* the same for the bound ``rotation_max_dim = d`` (a side longer than d keeps the identity basis: only
  the d-wide side of the MLP matrices rotates), which caps the state at 2mn + 2d^2;
* the same for ``rotation_factor_dtype = "bfloat16"`` (factors and bases stored in bfloat16, the EMAs
  stochastically rounded; computed in float32), which halves the 2m^2 + 2n^2 part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmpipe.peer.optim.basis_rotation import BasisRotationAdam, _sorted_eigh  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "optimizer_cost.json"
TOKENS = 16 * 64  # one micro-batch of the convergence bench
EVERY = 10  # rotation_every


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` calls (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


def measure(m: int, n: int, max_dim: int, repeats: int, max_eigh: int, factors: str = "float32") -> dict:
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(m, n, generator=gen) * 1e-2
    p_adam = torch.nn.Parameter(torch.randn(m, n, generator=gen) * 0.02)
    adam = torch.optim.AdamW([p_adam], lr=1e-3)
    p_adam.grad = grad.clone()

    def adam_step() -> None:
        adam.step()

    t_adam = timed(adam_step, repeats)
    p = torch.nn.Parameter(p_adam.detach().clone())
    # identity start (no eigh) and no automatic refresh: the step and the refresh are timed apart
    opt = BasisRotationAdam(
        [p], lr=1e-3, rotate=True, init_basis="identity", rotation_every=0, max_dim=max_dim, factor_dtype=factors
    )
    p.grad = grad.clone()
    t_step = timed(opt.step, repeats)
    group = opt.param_groups[0]

    def refresh_step() -> None:
        group["rotation_every"] = 1  # every step refreshes: time one of them
        opt.step()
        group["rotation_every"] = 0

    t_refresh = timed(refresh_step, 1 if max(m, n) >= 4096 else repeats)
    rotated = [k for k in (m, n) if not max_dim or k <= max_dim]
    t_eigh = None
    if rotated and max(rotated) <= max_eigh:
        covariances = [(grad @ grad.T) if k == m else (grad.T @ grad) for k in rotated]
        t_eigh = sum(timed(lambda c=c: _sorted_eigh(c), 1) for c in covariances)
    x = torch.randn(TOKENS, n, generator=gen)
    w = torch.randn(m, n, generator=gen, requires_grad=True)

    def forward_backward() -> None:
        xi = x.clone().requires_grad_(True)
        (xi @ w.T).sum().backward()

    t_fb = timed(forward_backward, repeats)
    amortised = t_step + (t_refresh - t_step) / EVERY
    return {
        "shape": [m, n],
        "max_dim": max_dim,
        "factor_dtype": factors,
        "adamw_state_bytes": state_bytes(adam),
        "rotation_state_bytes": state_bytes(opt),
        "memory_ratio": round(state_bytes(opt) / state_bytes(adam), 2),
        "adamw_step_s": t_adam,
        "rotation_step_s": t_step,
        "refresh_step_s": t_refresh,
        "rotation_amortised_s": amortised,
        "time_ratio": round(amortised / t_adam, 1),
        "first_eigh_s": t_eigh,
        "matrix_forward_backward_s": t_fb,
        "refresh_vs_forward_backward": round(t_refresh / t_fb, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="256,512,1024,2048")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-eigh", type=int, default=4096, help="largest side whose first eigh is timed")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    print(
        "| d | shape | bound | state vs AdamW | MiB (AdamW / rotation) | step ms AdamW | rotation step / refresh ms "
        "| amortised vs AdamW | first eigh s | refresh vs the matrix's fwd+bwd |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    started = time.perf_counter()
    for d in (int(w) for w in args.widths.split(",")):
        for m, n in ((d, d), (4 * d, d)):
            bounds = [(0, "float32"), (0, "bfloat16")] + ([(d, "float32")] if m != n else [])
            for bound, factors in bounds:
                row = {"width": d, **measure(m, n, bound, args.repeats, args.max_eigh, factors)}
                rows.append(row)
                eigh = "-" if row["first_eigh_s"] is None else f"{row['first_eigh_s']:.2f}"
                label = "one-sided" if bound else ("bf16 factors" if factors == "bfloat16" else "none")
                print(
                    f"| {d} | {m}x{n} | {label} | {row['memory_ratio']}x "
                    f"| {row['adamw_state_bytes'] / 2**20:.1f} / {row['rotation_state_bytes'] / 2**20:.1f} "
                    f"| {row['adamw_step_s'] * 1e3:.2f} | {row['rotation_step_s'] * 1e3:.1f} / "
                    f"{row['refresh_step_s'] * 1e3:.0f} | {row['time_ratio']}x | {eigh} "
                    f"| {row['refresh_vs_forward_backward']}x |",
                    flush=True,
                )
    total = time.perf_counter() - started
    print(f"total {total:.0f}s, {args.threads} torch thread(s), CPU only")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"threads": args.threads, "tokens": TOKENS, "rotation_every": EVERY, "seconds": round(total, 1)}
    args.out.write_text(json.dumps({**payload, "device": "cpu", "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
