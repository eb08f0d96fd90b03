"""Nesterov momentum for asynchronous pipeline stages (Ajanthan et al., ICML 2025, arXiv 2505.01099).

The paper's look-ahead NAG, in its practical form for language models: NAdam-style
Nesterov momentum with a *high* beta1 (0.99) and the NAdam momentum schedule
``mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * psi))`` (psi = ``momentum_decay``), plus
decoupled (AdamW-style) weight decay. With beta1 close to 1 the look-ahead term
``mu_{t+1} m_t`` dominates the step, which extrapolates the weights along the
momentum direction and so compensates for gradients that are a few steps old.

Update for step t (g already clipped by the runtime)::

    p      <- p * (1 - lr * wd)
    m      <- beta1 m + (1 - beta1) g
    v      <- beta2 v + (1 - beta2) g^2
    denom   = sqrt(v / (1 - beta2^t)) + eps
    p      <- p - lr (1 - mu_t) / (1 - prod_{i<=t} mu_i) * g / denom
             - lr mu_{t+1} / (1 - prod_{i<=t+1} mu_i) * m / denom

This matches ``torch.optim.NAdam(decoupled_weight_decay=True)`` step for step; it is
written out here so the pipeline runtime controls its state layout (tensors and
plain floats only, so ``state_dict()`` can travel to a new replica).

No-stash variant (peers that cannot keep old weight versions, ``OptimizerSpec.stash=False``):
the gradient then mixes stale activations with live weights, and earlier stages see
longer delays ``tau_k = max(1, P - 1 - k)``. Two corrections, both per stage:

* momentum: ``beta1_k = min(0.999, 1 - (1 - beta1) / tau_k)`` -- the momentum window
  ``1 / (1 - beta1)`` grows in proportion to the stage's delay (last stage: beta1;
  stage 0 of P = 8 with beta1 = 0.99: 0.99857);
* learning rate: ``lr_k(t) = lr(t) / tau_k ** (1 - min(t / T, 1))`` (see
  :func:`swarmpipe.peer.optim.set_learning_rate`): small steps for long-delay stages early,
  the full rate once t reaches T = ``total_steps``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

# Cap for the stage-dependent beta1 of the no-stash variant: keeps the momentum
# window (1 / (1 - beta1) = 1000 steps) shorter than typical runs.
NOSTASH_BETA1_MAX = 0.999


def stage_delay(stage: int, num_stages: int) -> int:
    """1F1B delay (in local steps) of a stage's gradients, at least 1 (used by the corrections)."""
    return max(1, num_stages - 1 - stage)


def stage_beta1(beta1: float, stage: int, num_stages: int) -> float:
    """No-stash momentum: scale the momentum window with the stage delay, capped."""
    scaled = 1.0 - (1.0 - beta1) / stage_delay(stage, num_stages)
    return max(beta1, min(NOSTASH_BETA1_MAX, scaled))  # never below the last stage's beta1


class PipelineNesterov(torch.optim.Optimizer):
    """NAdam-style Nesterov momentum with decoupled weight decay (see module docstring)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 2e-3,
        betas: tuple[float, float] = (0.99, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        momentum_decay: float = 0.004,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or momentum_decay < 0:
            raise ValueError("lr, eps, weight_decay and momentum_decay must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, momentum_decay=momentum_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd, psi = group["lr"], group["eps"], group["weight_decay"], group["momentum_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    # step and mu_product are plain floats: portable across devices and dtypes.
                    state["step"] = 0.0
                    state["mu_product"] = 1.0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                step = float(state["step"]) + 1.0
                state["step"] = step
                mu = beta1 * (1.0 - 0.5 * 0.96 ** (step * psi))
                mu_next = beta1 * (1.0 - 0.5 * 0.96 ** ((step + 1.0) * psi))
                mu_product = float(state["mu_product"]) * mu
                state["mu_product"] = mu_product
                if wd != 0:
                    p.mul_(1.0 - lr * wd)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(grad, 1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = (exp_avg_sq / (1.0 - beta2**step)).sqrt_().add_(eps)
                p.addcdiv_(grad, denom, value=-lr * (1.0 - mu) / (1.0 - mu_product))
                p.addcdiv_(exp_avg, denom, value=-lr * mu_next / (1.0 - mu_product * mu_next))
        return loss
