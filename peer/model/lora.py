"""LoRA: low-rank adapters on a stage's linear layers, the base weights frozen.

Our own small module rather than peft's wrapper, because the stage runtime differentiates through
``torch.func.functional_call`` on a dict of its trainable tensors (weight stashing): an adapted layer
must keep its base weight under the original name (``q_proj.weight``, so base checkpoints load and
export unchanged) and expose exactly two trainable tensors (``q_proj.lora_A`` [rank, in] and
``q_proj.lora_B`` [out, rank]). The math is peft's: ``y = x W^T + b + (alpha / rank) * B A dropout(x)``,
A from a Kaiming-uniform init, B zero, so an adapted model starts exactly as its base.

Only the adapters require grad: the optimizer, weight stashing, state transfer, replica averaging and
checkpoints all see them alone (peer/state/format.py works on trainable parameters).

Dropout draws a fresh mask when the runtime recomputes a forward (a late sibling of a batched group, a
replayed backward): the gradient is then that of another, equally likely mask. Keep
``lora_dropout = 0`` (the default) where exact recomputation matters.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from swarmpipe.peer.spec import FinetuneSpec, SpecError

ADAPTER_NAMES = ("lora_A", "lora_B")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update; parameter names as in nn.Linear."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, seed: int):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        gen = torch.Generator().manual_seed(seed)
        bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and peft
        self.lora_A = nn.Parameter(torch.rand(rank, self.in_features, generator=gen) * 2 * bound - bound)
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank))
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + self.scaling * update

    def merged_weight(self) -> torch.Tensor:
        return self.weight + self.scaling * (self.lora_B @ self.lora_A)


def apply_lora(module: nn.Module, spec: FinetuneSpec, seed: int, stage: int) -> list[str]:
    """Replace every linear layer whose name ends in one of ``spec.lora_targets`` by a :class:`LoRALinear`
    and freeze all other parameters; returns the adapted module names. Each adapter's init is seeded by
    (run seed, its name): every replica of a stage starts with the same adapters."""
    targets = set(spec.lora_targets)
    adapted: list[str] = []
    for name, sub in list(module.named_modules()):
        if not isinstance(sub, nn.Linear) or name.rsplit(".", 1)[-1] not in targets:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        adapter_seed = seed * 100_003 + zlib.crc32(name.encode())
        setattr(parent, child, LoRALinear(sub, spec.lora_rank, spec.lora_alpha, spec.lora_dropout, adapter_seed))
        adapted.append(name)
    if not adapted:
        raise SpecError(f"lora_targets {sorted(targets)} match no linear layer of stage {stage}")
    for name, p in module.named_parameters():
        p.requires_grad_(name.rsplit(".", 1)[-1] in ADAPTER_NAMES)
    return adapted


def is_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES
