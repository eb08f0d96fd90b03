"""Robust aggregates of replica weights, centred on this replica's own (it trusts itself, not its siblings).

A replica averages its stage's trainable parameters (one flat fp32 vector) with those it pulled from up to
``k`` siblings. A plain mean lets one Byzantine sibling put everyone's weights anywhere, so the default is
CenteredClip (Karimireddy, He, Jaggi 2021, "Learning from History for Byzantine Robust Optimization"):

    v <- v + mean_i (x_i - v) * min(1, tau / ||x_i - v||)     (a few iterations, v starting at our weights)

Every contribution moves ``v`` by at most ``tau`` per iteration, however large it is, and one beyond
:data:`OUTLIER_MULTIPLE` x tau (no honest sibling is that far after one round) not at all: a redescending
clip, so a gross attacker (1e6 x the weights) has no pull, and a careful one, just inside, moves a round's
result by about tau / (n - 1) (n contributions, ours included). ``tau`` comes from something a sibling cannot
inflate: how far this replica's own weights moved since its previous round (times :data:`TAU_MULTIPLE`;
honest siblings that trained as long are about that far away), with a floor of :data:`TAU_FLOOR` of the
weights' norm. ``trimmed_mean`` (coordinate-wise, dropping the extremes) and a
plain ``mean`` can be chosen instead in the spec (``averaging_aggregate``).

Pure torch on CPU tensors: no gRPC, no DHT (the averager fetches and applies, :mod:`.averaging`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarmpipe.peer.spec import AVERAGING_AGGREGATES

TAU_MULTIPLE = 2.0  # honest siblings trained about as long as we did: about our own movement away
TAU_FLOOR = 1e-3  # of ||w||: the radius before any movement was measured (first round, an idle replica)
OUTLIER_MULTIPLE = 100.0  # beyond this many tau a contribution is dropped, not clipped (slow vs fast siblings: < 20)
CLIP_ITERATIONS = 3
TRIM_BLOCK = 1 << 20  # coordinates sorted at once by the trimmed mean (bounds its scratch memory)


class AggregateError(ValueError):
    """A contribution that cannot be averaged in (wrong count of tensors, wrong shape, not finite)."""


@dataclass
class Aggregate:
    vector: torch.Tensor  # the aggregate of every contribution, ours included
    tau: float  # the clipping radius used
    clipped: int  # siblings whose pull the aggregate bounded (outliers included: bounded to nothing)
    outliers: int  # siblings beyond OUTLIER_MULTIPLE x tau from our weights: no pull at all
    far: int  # siblings farther than tau from our weights
    farthest: float  # the largest sibling distance from our weights, in units of tau


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat fp32 CPU vector of ``tensors`` (in order)."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def unflatten(vector: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``vector`` shaped as ``like`` (no copy)."""
    out, offset = [], 0
    for t in like:
        out.append(vector[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def check_contribution(own: Sequence[torch.Tensor], other: Sequence[torch.Tensor], who: str = "sibling") -> None:
    """``other`` has our tensors' count and shapes and only finite values; raises :class:`AggregateError`."""
    if len(other) != len(own):
        raise AggregateError(f"{who} sent {len(other)} tensors, this stage has {len(own)}")
    for i, (mine, theirs) in enumerate(zip(own, other)):
        if theirs.shape != mine.shape:
            raise AggregateError(f"{who}: tensor {i} has shape {list(theirs.shape)}, ours {list(mine.shape)}")
        if theirs.is_floating_point() and not bool(torch.isfinite(theirs).all()):
            raise AggregateError(f"{who}: tensor {i} has NaN or Inf values")
        if not theirs.is_floating_point():
            raise AggregateError(f"{who}: tensor {i} is {theirs.dtype}, not floating point")


def trust_radius(own: torch.Tensor, reference: torch.Tensor | None) -> float:
    """tau: :data:`TAU_MULTIPLE` x how far our weights moved since ``reference`` (where the previous round
    left them), at least :data:`TAU_FLOOR` x ||own||. Nothing a sibling sends enters it."""
    floor = TAU_FLOOR * float(own.norm())
    moved = 0.0 if reference is None or reference.shape != own.shape else float((own - reference).norm())
    return max(TAU_MULTIPLE * moved, floor, 1e-12)


def clip_scale(distance: float, radius: float) -> float:
    """The factor that brings a displacement of ``distance`` within ``radius`` (1 when it already is); 0 for
    one beyond :data:`OUTLIER_MULTIPLE` x ``radius`` (or not finite): an outlier gets no pull at all."""
    if not math.isfinite(distance) or distance > OUTLIER_MULTIPLE * radius:
        return 0.0
    return 1.0 if distance <= radius else radius / distance


def centered_clip(
    own: torch.Tensor, others: Sequence[torch.Tensor], tau: float, iterations: int = CLIP_ITERATIONS
) -> Aggregate:
    """CenteredClip over ``own`` and ``others``, starting at ``own``; outliers (:func:`clip_scale`) are left
    out first, then each iteration moves at most tau."""
    distances = [float((x - own).norm()) for x in others]
    kept = [x for x, d in zip(others, distances) if clip_scale(d, tau) > 0.0]
    n = len(kept) + 1
    v = own.clone()
    clipped: set[int] = set()
    for _ in range(iterations):
        step = (own - v) * min(1.0, tau / max(float((own - v).norm()), 1e-30))  # our own pull (0 at first)
        for i, x in enumerate(kept):
            diff = x - v
            distance = float(diff.norm())
            if distance > tau:
                clipped.add(i)
            step.add_(diff, alpha=min(1.0, tau / distance) if distance > 0 else 1.0)
            del diff
        v.add_(step, alpha=1.0 / n)
        if float(step.norm()) <= 1e-7 * (float(v.norm()) + 1e-12):  # settled
            break
    outliers = len(others) - len(kept)
    return _result(v, tau, len(clipped) + outliers, distances, outliers)


def trim_count(n: int) -> int:
    """How many values the trimmed mean drops at each end: a quarter, at least one, while one stays."""
    return min((n - 1) // 2, max(1, n // 4))


def trimmed_mean(own: torch.Tensor, others: Sequence[torch.Tensor], tau: float) -> Aggregate:
    """Coordinate-wise: drop the :func:`trim_count` lowest and highest values, average the rest. Outliers (as
    in :func:`clip_scale`) are left out first. With two contributions nothing can be dropped (a plain mean):
    it needs three to stop a careful bad sibling."""
    distances = [float((x - own).norm()) for x in others]
    points = [own, *(x for x, d in zip(others, distances) if clip_scale(d, tau) > 0.0)]
    b = trim_count(len(points))
    out = torch.empty_like(own)
    for start in range(0, own.numel(), TRIM_BLOCK):
        block = torch.stack([p[start : start + TRIM_BLOCK] for p in points])
        kept = block.sort(dim=0).values[b : len(points) - b]
        out[start : start + TRIM_BLOCK] = kept.mean(dim=0)
        del block, kept
    outliers = len(others) + 1 - len(points)
    bounded = sum(d > tau for d in distances) if b else outliers  # trimmed coordinate-wise, or dropped
    return _result(out, tau, bounded, distances, outliers)


def plain_mean(own: torch.Tensor, others: Sequence[torch.Tensor], tau: float) -> Aggregate:
    """The unprotected mean (what the all-reduce computed): for trusted swarms and comparisons."""
    total = own.clone()
    for x in others:
        total.add_(x)
    return _result(total / (len(others) + 1), tau, 0, [float((x - own).norm()) for x in others], outliers=0)


def aggregate(kind: str, own: torch.Tensor, others: Sequence[torch.Tensor], tau: float) -> Aggregate:
    """The spec's ``averaging_aggregate`` of ``own`` and ``others`` (flat vectors of one length)."""
    if kind not in AVERAGING_AGGREGATES:
        raise ValueError(f"unknown aggregate {kind!r}; known: {', '.join(AVERAGING_AGGREGATES)}")
    for i, x in enumerate(others):
        if x.shape != own.shape:
            raise AggregateError(f"contribution {i} has {x.numel()} values, ours {own.numel()}")
        if not bool(torch.isfinite(x).all()):
            raise AggregateError(f"contribution {i} has NaN or Inf values")
    if kind == "centered_clip":
        return centered_clip(own, others, tau)
    if kind == "trimmed_mean":
        return trimmed_mean(own, others, tau)
    return plain_mean(own, others, tau)


def _result(
    vector: torch.Tensor, tau: float, clipped: int, distances: list[float], outliers: int | None = None
) -> Aggregate:
    far = sum(d > tau for d in distances)
    if outliers is None:
        outliers = sum(clip_scale(d, tau) == 0.0 for d in distances)
    return Aggregate(vector, tau, clipped, outliers, far, max(distances, default=0.0) / tau)
