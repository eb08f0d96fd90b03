"""Optimizers for asynchronous pipeline stages, selected by the run spec.

The stage runtime calls, for every local update::

    set_learning_rate(optimizer, spec, step, stage, num_stages)
    clip_grad_norm_(params, spec.clip_norm)
    optimizer.step(); optimizer.zero_grad()
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from peer.spec import OptimizerSpec


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
    params = [p for _, p in named_params if p.requires_grad]
    if spec.kind == "adamw":
        return torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    raise ValueError(f"optimizer kind {spec.kind!r} is not available")


def set_learning_rate(optimizer: torch.optim.Optimizer, spec: OptimizerSpec, step: int, stage: int, num_stages: int) -> float:
    lr = scheduled_lr(spec, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
