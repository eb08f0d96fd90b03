"""What a stage's optimizer is told about the gradients of one step: their delay and their weights' drift.

The stage runtime (and the delay simulator, so the bench measures the same code) hands every gradient it
accepts to a :class:`StepAccumulator` with the delay it measured (its own local steps between the forward
and the backward) and, with weight stashing, the snapshot the forward ran on. At the step the accumulator

* writes the combined gradient into ``p.grad``: the mean of the accumulated micro-batches, or with
  ``spec.delay_weight_power = a > 0`` (issue 16, 3b) the delay-weighted mean::

      w(d) = (1 + d) ** -a,      g = sum_i w(d_i) G_i / sum_i n_i w(d_i)

  where call i brought the summed gradient G_i of n_i micro-batches with delay d_i (one server batch shares
  one delay). Equal delays give the plain mean exactly; fresher gradients count more when they differ.
* returns the step's delay (the same weighted mean of the d_i): what ``set_learning_rate(..., delay=)``
  folds into its running average for ``delay_source = "measured"`` (3a);
* and, when the optimizer compensates delays (``spec.delay_compensation > 0``, 3c), the drift
  ``D = live - stashed`` of every weight, weighted the same way: how far the weights moved between the
  forward that produced the gradient and now. Stashing makes it free (the snapshot is there anyway);
  without it (or for a gradient taken on the live weights: the last stage, replays) the drift is zero.
  An averaging round's correction in between is part of the drift as well (it did move the weights);
  the optimizer caps what it does with it relative to the gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from swarmpipe.peer.spec import OptimizerSpec


def delay_weight(delay: float, power: float) -> float:
    """``(1 + delay) ** -power``: 1 at delay 0 and for power 0; a negative delay counts as 0."""
    return 1.0 if power == 0 else (1.0 + max(0.0, float(delay))) ** -power


@dataclass
class StepInputs:
    """What one optimizer step gets besides the gradients in ``p.grad``."""

    delay: float | None  # weighted mean delay of the step's gradients (None: none accumulated)
    drift: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)  # parameter -> live - stashed


class StepAccumulator:
    """Sums gradients into ``p.grad`` between steps, weighted by delay; keeps the delay and (if wanted) drift."""

    def __init__(self, spec: OptimizerSpec) -> None:
        self.power = float(spec.delay_weight_power)
        self.want_drift = spec.delay_compensation > 0
        self.reset()

    def reset(self) -> None:
        self.count = 0  # micro-batches accumulated
        self._weight = 0.0  # sum of n_i w(d_i)
        self._delay = 0.0  # sum of n_i w(d_i) d_i
        self._drift: dict[str, torch.Tensor] = {}  # name -> sum of n_i w(d_i) D_i

    def add(
        self,
        params: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor | None],
        delay: float,
        count: int = 1,
        stashed: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Add ``grads`` (summed over ``count`` micro-batches of one ``delay``) to the parameters' ``grad``;
        ``stashed``: the weights the gradient was taken at (None: the live ones, no drift)."""
        w = delay_weight(delay, self.power)
        with torch.no_grad():
            for name, p in params.items():
                g = grads.get(name)
                if g is None:
                    continue
                g = g.detach()
                if p.grad is None:
                    p.grad = g.clone() if w == 1.0 else g * w
                else:
                    p.grad.add_(g, alpha=w)
                if self.want_drift and stashed is not None and name in stashed:
                    moved = (p.detach() - stashed[name].detach().to(p.dtype)).mul_(w * count)
                    held = self._drift.get(name)
                    self._drift[name] = moved if held is None else held.add_(moved)
        self.count += count
        self._weight += w * count
        self._delay += w * count * max(0.0, float(delay))

    def finish(self, params: Mapping[str, torch.Tensor]) -> StepInputs:
        """Normalise ``p.grad`` to the (weighted) mean and return the step's delay and drift; then reset."""
        if self.count == 0:
            self.reset()
            return StepInputs(None)
        norm = self._weight
        with torch.no_grad():
            if norm != 1.0:
                for p in params.values():
                    if p.grad is not None:
                        p.grad.div_(norm)
            drift = {params[n]: d.div_(norm) for n, d in self._drift.items() if n in params}
        inputs = StepInputs(self._delay / norm, drift)
        self.reset()
        return inputs
