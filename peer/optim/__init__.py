"""Optimizers for asynchronous pipeline stages, selected by the run spec.

The stage runtime (and the delay simulator) accumulates each accepted gradient with its measured
delay and stashed weights in a :class:`StepAccumulator` and, for every local update::

    inputs = accumulator.finish(params)            # p.grad: the (delay-weighted) mean; delay; drift
    set_learning_rate(optimizer, spec, step, stage, num_stages, delay=inputs.delay)
    clip_grad_norm_(params, spec.clip_norm)
    tell_drift(optimizer, inputs)                  # delay compensation (basis_rotation) only
    optimizer.step(); optimizer.zero_grad()

``set_learning_rate(..., delay=d)`` tells the optimizer the measured delay of the gradient it is
about to apply; with ``spec.delay_source = "measured"`` the no-stash Nesterov schedules use a
running average of those (about DELAY_WINDOW steps, kept in the first param group so it travels
with ``state_dict``) instead of the formula ``P - 1 - k``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from swarmpipe.peer.optim.accumulate import StepAccumulator, StepInputs
from swarmpipe.peer.optim.basis_rotation import BasisRotationAdam, rotation_param_groups
from swarmpipe.peer.optim.nesterov import (
    PipelineNesterov,
    beta1_for_delay,
    correction_horizon,
    stage_beta1,
    stage_delay,
)
from swarmpipe.peer.spec import OptimizerSpec

# Horizon T_c of the no-stash learning-rate correction when the spec has no total_steps.
DEFAULT_CORRECTION_STEPS = 1000
# The measured delay's running average: the exact mean of the first DELAY_WINDOW, then an EMA that long.
DELAY_WINDOW = 100


def scheduled_lr(spec: OptimizerSpec, step: int) -> float:
    """Linear warm-up, then constant (total_steps == 0) or cosine decay to 10 %."""
    lr = spec.lr
    if spec.warmup_steps > 0 and step < spec.warmup_steps:
        return lr * (step + 1) / spec.warmup_steps
    if spec.total_steps > 0:
        progress = min(1.0, (step - spec.warmup_steps) / max(1, spec.total_steps - spec.warmup_steps))
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    return lr


def build_optimizer(
    named_params: Iterable[tuple[str, nn.Parameter]], spec: OptimizerSpec, stage: int, num_stages: int
) -> torch.optim.Optimizer:
    """The stage's optimizer for ``spec.kind``.

    * ``adamw``: torch AdamW (the naive asynchronous baseline).
    * ``nesterov``: :class:`PipelineNesterov` with beta1 = ``spec.nesterov_beta1`` (0.99 by
      default; ``spec.betas[0]`` is ignored, ``spec.betas[1]`` is beta2). With
      ``spec.stash`` False beta1 moves from ``spec.betas[0]`` towards ``nesterov_beta1`` with the
      stage's delay (:func:`stage_beta1`, the reference code's adaptive momentum).
    * ``basis_rotation``: :class:`BasisRotationAdam`; attention/MLP matrices rotated (sides up to
      ``spec.rotation_max_dim``; delay compensation with ``spec.delay_compensation``), everything
      else plain AdamW in a second param group.
    """
    named = [(n, p) for n, p in named_params if p.requires_grad]
    params = [p for _, p in named]
    if spec.kind == "adamw":
        return torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    if spec.kind == "nesterov":
        beta1 = spec.nesterov_beta1
        if not spec.stash:
            beta1 = stage_beta1(spec.betas[0], spec.nesterov_beta1, stage, num_stages)
        return PipelineNesterov(
            params,
            lr=spec.lr,
            betas=(beta1, spec.betas[1]),
            eps=spec.eps,
            weight_decay=spec.weight_decay,
            momentum_decay=spec.momentum_decay,
        )
    if spec.kind == "basis_rotation":
        return BasisRotationAdam(
            rotation_param_groups(named),
            lr=spec.lr,
            betas=spec.betas,
            eps=spec.eps,
            weight_decay=spec.weight_decay,
            rotation_every=spec.rotation_every,
            max_dim=spec.rotation_max_dim,
            compensation=spec.delay_compensation,
            compensation_cap=spec.compensation_cap,
            factor_dtype=spec.rotation_factor_dtype,
        )
    raise ValueError(f"optimizer kind {spec.kind!r} is not available")


def stage_lr_factor(spec: OptimizerSpec, step: int, stage: int, num_stages: int, delay: float | None = None) -> float:
    """No-stash nesterov: ``1 / tau_k ** (1 - min((t + 1) / T_c, 1))``, tau_k = max(1, P - 1 - k); else 1.

    Long-delay stages start with lr / tau_k and reach the full rate at T_c = 14 % of
    ``spec.total_steps`` (DEFAULT_CORRECTION_STEPS when that is 0), as the reference code.
    ``delay``: an average measured delay to use instead of ``P - 1 - k``.
    """
    if spec.kind != "nesterov" or spec.stash:
        return 1.0
    tau = stage_delay(stage, num_stages) if delay is None else max(1.0, delay)
    horizon = correction_horizon(spec.total_steps, DEFAULT_CORRECTION_STEPS)
    return tau ** -(1.0 - min((step + 1) / horizon, 1.0))


def average_delay(optimizer: torch.optim.Optimizer, delay: float | None, initial: float) -> float:
    """Fold one measured delay (None: none this step) into the running average; returns the average."""
    group = optimizer.param_groups[0]
    average = float(group.get("delay_avg", initial))
    if delay is not None:
        seen = int(group.get("delay_seen", 0)) + 1
        average += (float(delay) - average) / min(seen, DELAY_WINDOW)
        group["delay_seen"] = seen
    group["delay_avg"] = average
    return average


def set_learning_rate(
    optimizer: torch.optim.Optimizer,
    spec: OptimizerSpec,
    step: int,
    stage: int,
    num_stages: int,
    delay: float | None = None,
) -> float:
    """Set this step's lr (and, for measured no-stash nesterov, its beta1); ``delay``: the measured delay
    of the gradient about to be applied, in local updates (used with ``spec.delay_source = "measured"``)."""
    average = None
    if spec.delay_source == "measured":
        average = average_delay(optimizer, delay, float(max(0, num_stages - 1 - stage)))
        if spec.kind == "nesterov" and not spec.stash:
            beta1 = beta1_for_delay(spec.betas[0], spec.nesterov_beta1, average, num_stages)
            for group in optimizer.param_groups:
                group["betas"] = (beta1, group["betas"][1])
    lr = scheduled_lr(spec, step) * stage_lr_factor(spec, step, stage, num_stages, average)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def tell_drift(optimizer: torch.optim.Optimizer, inputs: StepInputs) -> None:
    """Hand the step's weight drift to an optimizer that compensates delays (basis rotation); others ignore it."""
    if isinstance(optimizer, BasisRotationAdam):
        optimizer.set_drift(inputs.drift)


__all__ = [
    "BasisRotationAdam",
    "PipelineNesterov",
    "StepAccumulator",
    "StepInputs",
    "build_optimizer",
    "scheduled_lr",
    "set_learning_rate",
    "tell_drift",
]
