"""Nesterov momentum for asynchronous pipeline stages (Ajanthan et al., ICML 2025, arXiv 2505.01099).

The paper's look-ahead NAG, in its practical form for language models (its reference code,
PluralisResearch/AsyncPP, runs ``torch.optim.NAdam`` with ``betas=(0.99, 0.999)``,
``momentum_decay=0.004`` and decoupled weight decay): NAdam-style Nesterov momentum with a
*high* beta1 and the NAdam momentum schedule ``mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * psi))``
(psi = ``momentum_decay``). The look-ahead term ``mu_{t+1} m_t`` extrapolates the weights
along the momentum direction, which compensates for gradients a few steps old. It does not
dominate early: mu_t is 0.50 at t = 1, 0.57 at t = 1000, 0.89 at 10 000 and 0.98 only after
about 24 000 steps (the paper trains 50 000), so in a run of a few thousand steps the
step is about half the current (stale) gradient and half the momentum.

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
the gradient then mixes stale activations with live weights, and earlier stages see longer
delays. The reference code's two per-stage corrections (``--adaptive_momentum`` and
``--lr_correction``), with ``d_k = P - 1 - k`` the stage's 1F1B delay:

* momentum: ``beta1_k = b + d_k * (target - b) / P`` -- from the base b (``betas[0]``,
  the code's ``--momentum``, 0.9) towards ``target`` (``nesterov_beta1``, the code's
  constant 0.99) with the delay, never reaching it (last stage: b; stage 0 of P = 8:
  b + 7/8 (target - b) = 0.97875);
* learning rate: ``lr_k(t) = lr(t) / tau_k ** (1 - min((t + 1) / T_c, 1))``, tau_k =
  max(1, d_k), over the first T_c = 14 % of the run (the code's 7 of 50 epochs; see
  :func:`swarmpipe.peer.optim.set_learning_rate`): small steps for long-delay stages
  early, the full rate afterwards.

With ``OptimizerSpec.delay_source = "measured"`` both corrections take d_k and tau_k from a
running average of the delays the optimizer is told (``set_learning_rate(..., delay=)``)
instead of ``P - 1 - k``; in 1F1B the two agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

# The reference code's lr correction spans --lr_correction_epoch 7 of its 50 epochs.
LR_CORRECTION_FRACTION = 7 / 50


def stage_delay(stage: int, num_stages: int) -> int:
    """1F1B delay (in local steps) of a stage's gradients, at least 1 (the lr correction's tau_k)."""
    return max(1, num_stages - 1 - stage)


def beta1_for_delay(base: float, target: float, delay: float, num_stages: int) -> float:
    """No-stash momentum for a delay d: ``base + min(d, P - 1) (target - base) / P`` (below target)."""
    return base + min(max(delay, 0.0), num_stages - 1) * (target - base) / num_stages


def stage_beta1(base: float, target: float, stage: int, num_stages: int) -> float:
    """No-stash momentum of the formula: d_k = P - 1 - k (0 for the last stage)."""
    return beta1_for_delay(base, target, max(0, num_stages - 1 - stage), num_stages)


def correction_horizon(total_steps: int, fallback: int) -> int:
    """Steps over which the no-stash lr correction fades out: 14 % of the run, else ``fallback``."""
    return max(1, round(LR_CORRECTION_FRACTION * total_steps)) if total_steps > 0 else fallback


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
