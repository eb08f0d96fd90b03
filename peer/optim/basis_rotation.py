"""Adam in a rotated basis (Jung, Shin, Lee, ICML 2026, arXiv 2602.03515).

Delayed gradients hurt Adam most when the Hessian's eigenbasis is misaligned with
the coordinate axes: coordinate-wise adaptivity then oscillates and a stale update
points the wrong way. Basis rotation runs Adam's second moment in an approximate
eigenbasis of each weight matrix (bilateral: left and right factors), so the
delayed updates stay useful.

For every matrix parameter W (m x n) of a ``rotate`` group, with gradient G
(the paper's Algorithm 1 as its reference code, LOG-postech/basis-rotation, does it):

* ``L <- beta2 L + (1 - beta2) G G^T`` and ``R <- beta2 R + (1 - beta2) G^T G``;
* eigenbases ``Q_L``, ``Q_R``: full ``eigh`` at the first step, then every
  ``rotation_every`` steps one power-iteration step: the old basis is sorted by its
  estimated eigenvalues ``diag(Q^T M Q)`` (descending, the second moment permuted to
  match), then ``Q <- QR(M Q)``;
* first moment m in the original space; ``G' = Q_L^T G Q_R``, ``M' = Q_L^T m Q_R``;
  second moment ``v <- beta2 v + (1 - beta2) G'^2`` kept in the rotated space;
* step ``W <- W (1 - lr wd) - lr sqrt(bc2) / bc1 * Q_L [M' / (sqrt(v) + eps)] Q_R^T``
  with ``bc_i = 1 - beta_i^t``: eps sits on the raw ``sqrt(v)``, before bias correction,
  as in the reference code and SOAP. Relative to ``v / bc2`` it is ``eps / sqrt(bc2)``
  (31.6 eps at step 1 with beta2 = 0.999). That matters right after the first ``eigh``:
  G' is then diagonal up to float32 residue, and Adam's first step divides every entry by
  its own magnitude; with eps on ``v / bc2`` (this module before issue 16) a full-rank
  gradient-sized G got off-diagonal updates of 0.3 lr (RMS), now 0.02 lr. The first
  ``eigh`` runs in float64 for the same reason (float32 eigenvectors of G G^T mix close
  eigenvalues); the reference runs it in float32.

Other parameters (``rotate`` False: embeddings, norms, biases, head) get plain AdamW
math (torch's: eps after bias correction, as the reference's AdamW for them) in the same
optimizer, so one ``state_dict`` covers the whole stage. With the identity basis
(``init_basis="identity"``, ``rotation_every=0``) a rotate group is AdamW up to where
eps sits.

State per m x n matrix: m, v (2mn), L, R and both bases (2m^2 + 2n^2) floats. For the
bench's block (width 64: qkv 192x64, proj 64x64, fc 256x64, fc_out 64x256) that is
4.8x AdamW's 2mn; at m = n it is 3x, and it grows with the ratio of the sides.
``max_dim`` bounds it (``OptimizerSpec.rotation_max_dim``): a side longer than that keeps the
identity basis and no factor (one-sided rotation), so a 4d x d MLP matrix costs
``2mn + 2d^2`` instead of ``2mn + 34 d^2`` (bench/optimizer_cost.py).

Lower-precision factors (``factor_dtype="bfloat16"``, ``OptimizerSpec.rotation_factor_dtype``): L, R and
both bases are stored in bfloat16 and computed on in the parameter's dtype, which halves the 2m^2 + 2n^2
part of the state (what travels on joins, drains and checkpoints). L and R are EMAs with beta2 = 0.999: a
bfloat16 value (8 significant bits) rounded to nearest would never move by a relative 1e-3 per step, so after
a few hundred steps the factors would freeze. They are written back with stochastic rounding (unbiased: the
expected stored value is the float32 one), from a generator of the optimizer's own so the global RNG stream
is untouched. The bases are recomputed from the factors at each refresh, not accumulated, so they round to
nearest; their orthogonality error is about 2^-9 / sqrt(m) per entry of Q^T Q.

Delay compensation (issue 16, 3c; ``compensation`` = lambda > 0, with weight stashing): the
runtime tells the optimizer each matrix's drift ``D = W_live - W_stashed`` (weighted over the
step's gradients, :mod:`swarmpipe.peer.optim.accumulate`) before the step. A delayed gradient
was taken at ``W_stashed``; to first order the gradient at the live weights is ``G + H D``. In
the eigenbasis the Hessian is taken as diagonal, and as the curvature the preconditioner
implies: the step ``-lr m_hat / d`` with ``d = (sqrt(v) + eps) / sqrt(bc2)`` is a Newton step
for ``H = d / lr``. So, from the second step on, with ``v`` and ``bc2`` of the previous step
(before this gradient enters them) and this step's ``lr``::

    C' = lambda * d_prev / lr * (Q_L^T D Q_R)
    C' <- C' * min(1, cap * ||G'|| / ||C'||)         (cap = ``compensation_cap``)
    G_c = G + Q_L C' Q_R^T

``G_c`` feeds the first moment; L, R and v keep the raw gradient (the curvature estimate is
not fed its own correction). Only rotated matrices are compensated; the AdamW group
(embeddings, norms, head) is not.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def is_rotated_param(name: str, param: torch.Tensor) -> bool:
    """The 2-D weights inside the stage's blocks: attention and MLP matrices (bytegpt ``blocks.*``, the
    llama family's ``layers.*``, and LoRA adapters there); never embeddings or the head."""
    return param.dim() == 2 and name.startswith(("blocks.", "layers."))


def _wide(m: torch.Tensor) -> torch.Tensor:
    return m if m.dtype in (torch.float32, torch.float64) else m.float()


def _sorted_eigh(m: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of a symmetric matrix as columns, by descending eigenvalue, from a float64 ``eigh``.

    M = G G^T squares G's condition number: in float32 the eigenvectors of close or small
    eigenvalues are off by angles up to 1e-5..1e-1, and the first step (which divides the
    rotated gradient by its own magnitude) turns that mixing into full-size updates. Done
    once per matrix, so the float64 cost does not recur; the refreshes stay in float32."""
    host = "cpu" if m.device.type == "mps" else m.device  # mps has no float64
    _, vecs = torch.linalg.eigh(m.to(device=host, dtype=torch.float64))
    return vecs.flip(-1).to(device=m.device, dtype=m.dtype).contiguous()


FACTOR_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """float32 -> bfloat16, rounding up or down at random in proportion to the distance (unbiased).

    bfloat16 is float32's upper 16 bits: adding uniform noise in [0, 2^16) to the lower 16 bits of the
    magnitude and dropping them rounds the magnitude up with probability (dropped bits) / 2^16, for both
    signs (float bits are sign and magnitude)."""
    bits = x.detach().to(torch.float32).contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=generator, device=bits.device, dtype=torch.int32)
    rounded = (bits + noise).bitwise_and_(-65536)  # -65536 == ~0xFFFF: clear the lower 16 bits
    finite = torch.isfinite(x)  # inf / nan keep their bits (noise could turn inf into nan)
    return torch.where(finite, rounded.view(torch.float32), x.to(torch.float32)).to(torch.bfloat16)


def _power_step(m: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power-iteration step (the reference's order): sort the old basis by its estimated
    eigenvalues, then re-orthogonalise ``M Q``; returns (new basis, permutation)."""
    mq = m @ q
    estimates = (q * mq).sum(dim=0)  # diag(Q^T M Q) without the full product
    order = torch.argsort(estimates, descending=True)
    q_new, _ = torch.linalg.qr(_wide(mq[:, order]))
    return q_new.to(m.dtype).contiguous(), order


class BasisRotationAdam(torch.optim.Optimizer):
    """AdamW with bilateral basis rotation for ``rotate`` param groups (see module docstring)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        rotation_every: int = 10,
        rotate: bool = False,
        init_basis: str = "eigh",
        max_dim: int = 0,
        compensation: float = 0.0,
        compensation_cap: float = 3.0,
        factor_dtype: str = "float32",
    ) -> None:
        if factor_dtype not in FACTOR_DTYPES:
            raise ValueError(f"factor_dtype must be one of {', '.join(FACTOR_DTYPES)}, got {factor_dtype!r}")
        if init_basis not in ("eigh", "identity"):
            raise ValueError(f"init_basis must be 'eigh' or 'identity', got {init_basis!r}")
        if rotation_every < 0:
            raise ValueError("rotation_every must be >= 0 (0: never refresh the basis)")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            rotation_every=rotation_every,
            rotate=rotate,
            init_basis=init_basis,
            max_dim=max_dim,
            compensation=compensation,
            compensation_cap=compensation_cap,
            factor_dtype=factor_dtype,
        )
        super().__init__(params, defaults)
        self._rounding: torch.Generator | None = None  # stochastic rounding of bfloat16 factors, made on first use
        self._drift: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> live - stashed, for the next step only
        for group in self.param_groups:
            if group["rotate"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("rotate groups may only hold matrices")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["rotate"]:
                    self._rotated_step(p, group)
                else:
                    self._adamw_step(p, group)
        self._drift = {}
        return loss

    def set_drift(self, drift: dict[torch.Tensor, torch.Tensor]) -> None:
        """The drift ``W_live - W_stashed`` of the next step's gradients, per parameter (see module docstring)."""
        self._drift = dict(drift)

    def _adamw_step(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        state = self.state[p]
        if not state:
            state["step"] = 0.0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] = step = float(state["step"]) + 1.0
        grad = p.grad
        p.mul_(1.0 - lr * wd)
        state["exp_avg"].lerp_(grad, 1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / (1.0 - beta2**step) ** 0.5).add_(eps)
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1.0 - beta1**step))

    def _rotated_step(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        beta2, every = group["betas"][1], group["rotation_every"]
        grad = p.grad
        state = self.state[p]
        first = not state
        if first:
            m, n = p.shape
            limit = group.get("max_dim", 0)
            state["step"] = 0.0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)  # lives in the rotated space
            for side, size in (("left", m), ("right", n)):
                if not limit or size <= limit:  # a longer side keeps the identity: no factor, no basis
                    state[f"gg_{side}"] = torch.zeros(size, size, dtype=p.dtype, device=p.device)
                    state[f"q_{side}"] = torch.eye(size, dtype=p.dtype, device=p.device)
        state["step"] = step = float(state["step"]) + 1.0
        v = state["exp_avg_sq"]
        left, right = "q_left" in state, "q_right" in state
        # "float32" keeps the factors in the parameter's dtype; with bfloat16 weights they follow the weights
        stored = FACTOR_DTYPES[group.get("factor_dtype", "float32")]
        narrow = stored == torch.bfloat16 and p.dtype in (torch.float32, torch.float64)
        kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # basis -> (stored, its wide copy)
        if narrow:  # compute on wide copies (a loaded state_dict arrives in the parameter's dtype)
            for key in ("gg_left", "gg_right", "q_left", "q_right"):
                if key in state:
                    narrow_value, state[key] = state[key], state[key].to(p.dtype)
                    if key.startswith("q_") and narrow_value.dtype == stored:
                        kept[key] = (narrow_value, state[key])
        if left:
            state["gg_left"].mul_(beta2).addmm_(grad, grad.T, alpha=1.0 - beta2)
        if right:
            state["gg_right"].mul_(beta2).addmm_(grad.T, grad, alpha=1.0 - beta2)
        if first and group["init_basis"] == "eigh":
            # Full decomposition once; afterwards the basis drifts slowly, so one cheap
            # power-iteration step every f steps tracks it.
            for side in ("left", "right"):
                if f"q_{side}" in state:
                    state[f"q_{side}"] = _sorted_eigh(state[f"gg_{side}"])
        elif not first and every > 0 and int(step) % every == 0:
            if left:
                state["q_left"], order = _power_step(state["gg_left"], state["q_left"])
                v.copy_(v[order, :])
            if right:
                state["q_right"], order = _power_step(state["gg_right"], state["q_right"])
                v.copy_(v[:, order])
        self._rotated_update(p, state, group, grad, step)
        if narrow:
            self._store_factors(p, state, stored, kept)

    def _store_factors(
        self,
        p: torch.Tensor,
        state: dict[str, Any],
        stored: torch.dtype,
        kept: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Factors back to their storage dtype: stochastic rounding for the EMAs, nearest for the bases (a basis
        this step did not refresh gets its stored tensor back: rounding its wide copy would give the same bits)."""
        if self._rounding is None or self._rounding.device != p.device:
            self._rounding = torch.Generator(device=p.device)
            self._rounding.manual_seed(0x5EED)
        for key in ("gg_left", "gg_right"):
            if key in state:
                state[key] = stochastic_round_bf16(state[key], self._rounding).to(stored)
        for key in ("q_left", "q_right"):
            if key in kept and state[key] is kept[key][1]:
                state[key] = kept[key][0]
            elif key in state:
                state[key] = state[key].to(stored)

    def _rotated_update(
        self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], grad: torch.Tensor, step: float
    ) -> None:
        """Moments and weight step in the current basis (factors already up to date, in compute dtype)."""
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        v = state["exp_avg_sq"]
        grad_rot = self._rotate(state, grad)
        drift = self._drift.get(p)
        if drift is not None and group.get("compensation", 0.0) > 0 and step > 1 and lr > 0:
            grad = grad + self._unrotate(state, self._correction(state, group, grad_rot, drift, step))
        p.mul_(1.0 - lr * wd)
        exp_avg = state["exp_avg"].lerp_(grad, 1.0 - beta1)
        v.mul_(beta2).addcmul_(grad_rot, grad_rot, value=1.0 - beta2)
        denom = v.sqrt().add_(eps)  # eps before bias correction, as the reference code
        direction = self._rotate(state, exp_avg).div_(denom)
        step_size = lr * (1.0 - beta2**step) ** 0.5 / (1.0 - beta1**step)
        p.add_(self._unrotate(state, direction), alpha=-step_size)

    @staticmethod
    def _correction(
        state: dict[str, Any], group: dict[str, Any], grad_rot: torch.Tensor, drift: torch.Tensor, step: float
    ) -> torch.Tensor:
        """Delay compensation in the eigenbasis (module docstring): lambda d_prev / lr * rotated drift, capped."""
        beta2 = group["betas"][1]
        d_prev = (state["exp_avg_sq"].sqrt() + group["eps"]) / (1.0 - beta2 ** (step - 1.0)) ** 0.5
        corr = BasisRotationAdam._rotate(state, drift.to(grad_rot.dtype)).mul_(d_prev)
        corr.mul_(group["compensation"] / group["lr"])
        size, bound = corr.norm(), group["compensation_cap"] * grad_rot.norm()
        if size > bound:
            corr.mul_(bound / size)
        return corr

    @staticmethod
    def _rotate(state: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
        """``Q_L^T x Q_R`` (an identity side left out)."""
        if "q_left" in state:
            x = state["q_left"].T @ x
        return x @ state["q_right"] if "q_right" in state else x.clone()

    @staticmethod
    def _unrotate(state: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
        """``Q_L x Q_R^T`` (an identity side left out)."""
        if "q_left" in state:
            x = state["q_left"] @ x
        return x @ state["q_right"].T if "q_right" in state else x


def rotation_param_groups(named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> list[dict[str, Any]]:
    """Split a stage's parameters into a rotated group (matrices) and a plain AdamW group."""
    rotated, plain = [], []
    for name, p in named_params:
        if p.requires_grad:
            (rotated if is_rotated_param(name, p) else plain).append(p)
    groups = [{"params": rotated, "rotate": True}] if rotated else []
    return groups + ([{"params": plain, "rotate": False}] if plain else [])
