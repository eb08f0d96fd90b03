"""Byzantine compute: a trainer checks a random fraction of what replicas compute and bans those that lie.

Two checks, each on a random ``fraction`` of micro-batches per stage:

* **Outputs, against a second replica.** A stage's forward output is recomputed by another replica of the stage
  (forward-only, on its live weights) and the two compared: relative L2 difference against a tolerance learned
  from the pairs that agreed (replicas differ slightly between averaging rounds). The primary's call was an
  ordinary training call, so a replica cannot tell a checked micro-batch from any other. On a disagreement the
  rest of the pipeline arbitrates: both outputs are carried to the loss (forward-only, uncompressed, through
  the same downstream replicas) and the one that ends with a clearly higher loss is struck; when neither is
  clearly worse (honest replicas that drifted apart) nobody is, and the difference widens the tolerance.
* **Gradients, against the replica's own function.** An input gradient g claims a slope: moving the input by h
  along g/|g| changes the stage's objective (the loss on the last stage; <output, output gradient> on the
  others) by h|g|. Two forward-only probes at x +- h g/|g| measure it (central difference; honest fp32 error is
  ~1e-3 at h = 1 % of |x|); a sign flip is off by 2, scaling by c by |1 - 1/c|, noise by about 1. The last
  stage's reported loss is checked against the probes' midpoint too. No second replica is needed.

A struck call counts as a failed call (``Disputed``): the micro-batch is redone on another replica (forward,
last stage) or replayed (backward), so a lie found is never passed on. ``ban_after`` strikes ban the replica
from this trainer's routing for ``ban_s``; bans are published in the trainer's record and the coordinator
turns them into events. What the checks cannot see: lies on unchecked micro-batches (bounded by the ban: the
expected number before a ban is about ban_after / fraction of the liar's calls), and a replica that recognises
probes as small perturbations of a recent input and answers them consistently with its lie (the output check
still sees its forward).
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections import deque
from dataclasses import dataclass, field

import torch

from swarmpipe.peer.events import EventLog, short_id
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.trainer.routing import PeerView, Router
from swarmpipe.peer.trainer.stage_calls import StageCalls
from swarmpipe.peer.transport.wire import WireError

PROBE_STEP = 1e-2  # h as a fraction of |x|: measured honest slope error ~1e-3 (bytegpt, fp32)
LOSS_MARGIN = 0.02  # arbitration: the loser's loss must exceed the winner's by 2 % (and 0.01 nats)
MAX_REPORTED_BANS = 32


class Disputed(WireError):
    """A check found this replica's answer wrong: the call counts as failed and is redone elsewhere."""


@dataclass
class Tolerance:
    """How far honest answers may differ: ``margin`` x the 90th percentile of recent agreeing differences,
    within [floor, ceiling]; the ceiling until ``min_samples`` agreed."""

    floor: float
    ceiling: float
    margin: float = 4.0
    min_samples: int = 8
    seen: deque = field(default_factory=lambda: deque(maxlen=200))

    def limit(self) -> float:
        if len(self.seen) < self.min_samples:
            return self.ceiling
        ranked = sorted(self.seen)
        p90 = ranked[min(len(ranked) - 1, int(0.9 * len(ranked)))]
        return min(self.ceiling, max(self.floor, self.margin * p90))

    def agrees(self, difference: float) -> bool:
        ok = difference <= self.limit()
        if ok:
            self.seen.append(difference)
        return ok

    def widen(self, difference: float) -> None:
        """An honest disagreement (arbitration found neither side worse): learn it."""
        self.seen.append(min(difference, self.ceiling))


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / (0.5 * (a.norm() + b.norm()) + 1e-12))


@dataclass
class VerifierStats:
    checks: int = 0
    disputes: int = 0
    strikes: int = 0
    inconclusive: int = 0


class ReplicaVerifier:
    def __init__(
        self,
        spec: RunSpec,
        calls: StageCalls,
        router: Router,
        events: EventLog,
        fraction: float,
        ban_after: int = 2,
        ban_s: float = 3600.0,
        rng: random.Random | None = None,
    ):
        self.spec = spec
        self.calls = calls
        self.router = router
        self.events = events
        self.fraction = fraction
        self.ban_after = ban_after
        self.ban_s = ban_s
        self.rng = rng or random.Random()
        self.outputs = [Tolerance(floor=0.01, ceiling=0.5) for _ in range(spec.num_stages)]
        self.slopes = [Tolerance(floor=0.05, ceiling=0.3) for _ in range(spec.num_stages)]
        self.strikes: dict[str, int] = {}
        self.banned: dict[str, str] = {}  # peer id -> why, newest last
        self.stats = VerifierStats()
        self._ids = itertools.count()

    def sampled(self) -> bool:
        return self.fraction > 0 and self.rng.random() < self.fraction

    # ------------------------------------------------------------ outputs
    async def check_output(
        self, view: PeerView, stage: int, x: torch.Tensor, y: torch.Tensor, targets: torch.Tensor
    ) -> None:
        """Compare ``view``'s output ``y`` with another replica's; raises ``Disputed`` when ``view`` lied."""
        other = self.router.choose(stage, exclude={view.peer_id})
        if other is None:
            return
        self.stats.checks += 1
        try:
            y2 = await self.calls.forward(other, stage, self._id(), x, evaluate=True)
        except Exception:  # the checker's failure says nothing about the primary
            return
        difference = relative_difference(y, y2)
        tolerance = self.outputs[stage]
        if tolerance.agrees(difference):
            return
        self.stats.disputes += 1
        ours, theirs = await self._downstream_loss(stage, y, targets), await self._downstream_loss(stage, y2, targets)
        detail = f"output differs by {difference:.3g} (tolerance {tolerance.limit():.3g})"
        if ours is None or theirs is None or not _clearly_worse(ours, theirs) and not _clearly_worse(theirs, ours):
            self.stats.inconclusive += 1
            tolerance.widen(difference)
            self.events.emit(
                "verification_inconclusive",
                level=logging.INFO,
                stage=stage,
                peers=[short_id(view.peer_id), short_id(other.peer_id)],
                detail=detail,
                losses=[ours, theirs],
            )
            return
        liar = view if _clearly_worse(ours, theirs) else other
        self.strike(liar, stage, f"{detail}; loss {max(ours, theirs):.4g} vs {min(ours, theirs):.4g}")
        if liar is view:
            raise Disputed(f"stage {stage} output failed verification against {short_id(other.peer_id)}")

    async def _downstream_loss(self, stage: int, y: torch.Tensor, targets: torch.Tensor) -> float | None:
        """The loss that the rest of the pipeline gives ``y`` (forward-only, uncompressed); None if it failed.
        Routes are chosen the same way for both candidates, so the arbitration compares like with like."""
        last = self.spec.num_stages - 1
        try:
            x = y
            for s in range(stage + 1, last):
                hop = self._arbiter(s)
                x = await self.calls.forward(hop, s, self._id(), x, evaluate=True, exact=True)
            loss, _, _ = await self.calls.forward_backward(
                self._arbiter(last), last, self._id(), x, targets, evaluate=True, exact=True
            )
        except Exception:
            return None
        return float(loss)

    def _arbiter(self, stage: int) -> PeerView:
        candidates = sorted(self.router.available(stage), key=lambda v: v.peer_id)
        if not candidates:
            raise LookupError(f"no replica of stage {stage} to arbitrate with")
        return candidates[0]  # deterministic: both candidates meet the same downstream replicas

    # ------------------------------------------------------------ gradients
    async def check_gradient(
        self,
        view: PeerView,
        stage: int,
        x: torch.Tensor,
        grad_input: torch.Tensor,
        grad_output: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        loss: float | None = None,
    ) -> None:
        """Probe ``view``'s function around ``x`` and check the slope its ``grad_input`` claims (and, on the last
        stage, its ``loss``); raises ``Disputed`` when they disagree."""
        norm = float(grad_input.norm())
        if not math.isfinite(norm) or norm == 0.0:
            return
        self.stats.checks += 1
        step = PROBE_STEP * float(x.norm())
        direction = grad_input / norm
        try:
            above = await self._objective(view, stage, x + step * direction, grad_output, targets)
            below = await self._objective(view, stage, x - step * direction, grad_output, targets)
        except Exception:  # it did not answer: that is a failure the next call will see, not a lie
            return
        slope = (above - below) / (2 * step)
        difference = abs(slope - norm) / max(abs(slope), norm)
        problems = []
        tolerance = self.slopes[stage]
        if not tolerance.agrees(difference):
            problems.append(f"gradient claims slope {norm:.4g}, its function shows {slope:.4g}")
        if loss is not None and abs(loss - 0.5 * (above + below)) > 0.25 * max(abs(loss), 1e-3) + 1e-3:
            problems.append(f"reported loss {loss:.4g}, its function gives {0.5 * (above + below):.4g}")
        if problems:
            self.stats.disputes += 1
            self.strike(view, stage, "; ".join(problems))
            raise Disputed(f"stage {stage} gradient failed verification: {problems[0]}")

    async def _objective(
        self,
        view: PeerView,
        stage: int,
        x: torch.Tensor,
        grad_output: torch.Tensor | None,
        targets: torch.Tensor | None,
    ) -> float:
        if grad_output is None:  # the last stage: its loss
            loss, _, _ = await self.calls.forward_backward(view, stage, self._id(), x, targets, True, exact=True)
            return float(loss)
        y = await self.calls.forward(view, stage, self._id(), x, evaluate=True, exact=True)
        return float((y.double() * grad_output.double()).sum())

    # ------------------------------------------------------------ verdicts
    def strike(self, view: PeerView, stage: int, reason: str) -> None:
        self.stats.strikes += 1
        count = self.strikes[view.peer_id] = self.strikes.get(view.peer_id, 0) + 1
        self.events.emit(
            "verification_failed",
            level=logging.WARNING,
            stage=stage,
            peer=short_id(view.peer_id),
            strikes=count,
            reason=reason[:300],
        )
        if count >= self.ban_after and view.peer_id not in self.banned:
            self.banned[view.peer_id] = reason[:200]
            while len(self.banned) > MAX_REPORTED_BANS:
                self.banned.pop(next(iter(self.banned)))
            self.router.distrust(view.peer_id, self.router.clock() + self.ban_s)
            self.events.emit(
                "replica_banned", level=logging.WARNING, stage=stage, peer=short_id(view.peer_id), strikes=count
            )

    def _id(self) -> str:
        return f"verify-{next(self._ids)}"


def _clearly_worse(loss: float, other: float) -> bool:
    return loss > other * (1 + LOSS_MARGIN) + 0.01
