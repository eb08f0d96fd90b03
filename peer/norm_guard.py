"""Values far outside what has been seen are refused before they are used: NaN/Inf, and finite outliers.

A poisoned contribution (a gradient or an activation scaled by 1e4, or a trainer's broken batch) is finite, so
the NaN/Inf check lets it through, and clipping only shrinks a gradient to the clip norm: one such gradient per
step still steers the weights as far as clipping allows, in the attacker's direction. The guard keeps running
statistics of the log-norm of accepted values and refuses one whose norm exceeds the typical norm by more than
``factor`` *and* by more than ``sigmas`` standard deviations of the log-norm: honest training's slow drift and
its spikes pass, a 1000x outlier does not. Nothing is learned from a refused value, so an attacker cannot drag
the statistics up with its own outliers.

Used by stages on the gradients they apply (``StageRuntime``: refused ones are counted and reported to the
caller as not applied) and on every stage's answer, by trainers and by peers calling the next stage of a chain
alike (``AnswerChecks``, peer/client/answers.py: the activations and gradients passed on between stages).

What it does not catch: a value of ordinary size that is wrong (a sign flip, noise); that needs comparing
replicas' outputs (the trainer's ``ReplicaVerifier``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class NormGuard:
    what: str = "gradient"  # names the value in refusals
    warmup: int = 20  # accepted gradients before the guard judges (early training norms move fast)
    # An asynchronous swarm's honest gradients spike: stage 0 saw 665x its typical norm right after a peer
    # moved to stage 1 (tests/fault, measured). Clipping already bounds each step, so the guard refuses only
    # what no honest pipeline produced in our runs: a gradient scaled by 1e3 or more.
    factor: float = 1000.0  # at least this many times the typical norm to be refused
    sigmas: float = 6.0  # and at least this many standard deviations of the log-norm above it
    decay: float = 0.98  # EMA decay of the statistics (about the last 50 gradients)
    seen: int = 0
    mean: float = 0.0  # EMA of log(norm)
    var: float = 0.0  # EMA of its squared deviation

    def check(self, norm: float) -> str:
        """'' to accept ``norm`` (and learn from it), else why it is refused."""
        if not math.isfinite(norm) or norm < 0:
            return f"non-finite {self.what}"
        log_norm = math.log(max(norm, 1e-30))
        if self.seen >= self.warmup:
            margin = max(math.log(self.factor), self.sigmas * math.sqrt(self.var))
            if log_norm > self.mean + margin:
                typical = math.exp(self.mean)
                return f"outlier {self.what}: norm {norm:.3g} is {norm / typical:.0f}x the typical {typical:.3g}"
        self._learn(log_norm)
        return ""

    def check_grads(self, grads: Iterable[torch.Tensor | None], count: int = 1) -> str:
        """:meth:`check` on the norm of gradients summed over ``count`` micro-batches (per micro-batch)."""
        norm = math.sqrt(sum(float(g.float().pow(2).sum()) for g in grads if g is not None))
        return self.check(norm / max(count, 1))

    def _learn(self, log_norm: float) -> None:
        if self.seen == 0:
            self.mean, self.var = log_norm, 0.0
        else:
            # the EMA weight starts as a plain average so the first gradients do not pin the mean
            a = max(1.0 - self.decay, 1.0 / (self.seen + 1))
            delta = log_norm - self.mean
            self.mean += a * delta
            self.var = (1 - a) * (self.var + a * delta * delta)
        self.seen += 1

    @property
    def typical_norm(self) -> float:
        return math.exp(self.mean) if self.seen else 0.0
