"""How a stage computes: the autocast dtype, the dtype its weights live in, and fp16's loss scaling.

``[precision] compute = "auto"`` is bf16 autocast on CUDA (fp32 master weights and optimizer state,
TF32 matmuls on) and fp32 elsewhere. The wire is independent of all this: activations and gradients
leave in the codec the spec names, whatever dtype computed them.

fp16 needs its gradients scaled so small values survive. In a pipeline there is no single loss to
scale, so each stage scales the gradient it receives: ``grad_output * S`` goes through the backward,
the parameter and input gradients are divided by ``S`` before they are used or sent, and a backward
whose scaled gradients overflow is dropped (counted as non-finite) and halves ``S``; ``S`` doubles
after a run of clean steps. Each stage's scale is its own, so nothing travels between stages.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from swarmpipe.peer.spec import PrecisionSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class PrecisionError(ValueError):
    """A precision this device cannot compute in."""


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype  # what matmuls run in (float32: no autocast)
    weights: torch.dtype  # what the parameters and optimizer state are stored in
    device_type: str

    @property
    def autocast(self) -> bool:
        return self.compute != torch.float32

    @property
    def scaled(self) -> bool:
        return self.compute == torch.float16

    def context(self) -> contextlib.AbstractContextManager:
        """The autocast region for a forward (and the recompute of a backward)."""
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute)

    def describe(self) -> str:
        names = {v: k for k, v in DTYPES.items()}
        return f"compute {names[self.compute]}, weights {names[self.weights]}"


def resolve_precision(spec: PrecisionSpec, device: torch.device) -> Precision:
    compute = spec.compute
    if compute == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        compute = "bf16" if bf16 else "fp32"
    if compute == "fp16" and device.type != "cuda":
        raise PrecisionError(f"compute = 'fp16' needs a CUDA device (this peer computes on {device.type})")
    if compute == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise PrecisionError(f"compute = 'bf16': {torch.cuda.get_device_name(device)} has no bf16; use fp16")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls (master-weight math) on tensor cores
        torch.backends.cudnn.allow_tf32 = True
    return Precision(DTYPES[compute], DTYPES[spec.weights], device.type)


class LossScale:
    """One stage's dynamic gradient scale for fp16 (see the module docstring); 1 and inert otherwise."""

    def __init__(self, enabled: bool, initial: float = 2.0**14, growth_interval: int = 200):
        self.enabled = enabled
        self.scale = initial if enabled else 1.0
        self.growth_interval = growth_interval
        self._clean = 0
        self.overflows = 0

    def scale_grad(self, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        return grad_output if not self.enabled or grad_output is None else grad_output * self.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale(self, grads: list[torch.Tensor | None]) -> bool:
        """Divide ``grads`` by the scale in place; False (and a smaller scale) when any overflowed."""
        if not self.enabled:
            return True
        finite = all(g is None or bool(torch.isfinite(g).all()) for g in grads)
        if not finite:
            self.overflows += 1
            self.scale = max(1.0, self.scale / 2)
            self._clean = 0
            return False
        for g in grads:
            if g is not None:
                g.div_(self.scale)
        self._clean += 1
        if self._clean >= self.growth_interval:
            self.scale = min(2.0**24, self.scale * 2)
            self._clean = 0
        return True
