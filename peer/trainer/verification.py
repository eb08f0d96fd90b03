"""Byzantine compute: a trainer checks a random fraction of what replicas compute and bans those that lie.

Two checks, each on a random ``fraction`` of micro-batches per stage:

* **Outputs, against the replica itself and other replicas.** A stage's forward output is recomputed
  forward-only by the same replica: one that answers training calls differently from forward-only ones is
  lying, and is struck at once (``SELF_CONSISTENCY``). The primary's call was an ordinary training call, so a
  replica cannot tell a checked micro-batch from any other; it can only lie on every call alike, which other
  replicas expose: the output is compared with a second replica's (relative L2 difference against a tolerance
  learned from the pairs that agreed), and on a disagreement a third replica votes; the one that two others
  outvote is struck. With two replicas, or three that all differ (honest replicas drift apart between
  averaging rounds), nobody is struck: the spread is learned and reported as ``verification_inconclusive``.
* **Gradients, against the replica's own function.** An input gradient g claims a slope: moving the input by h
  along g/|g| changes the stage's objective (the loss on the last stage, from its logits; <output, output
  gradient> on the others) by h|g|. One forward-only call with both probes x +- h g/|g| stacked as rows measures
  it (central difference); the slope must lie within ``SLOPE_BAND`` of the claim (see there for why a band and
  what it guarantees). The last stage's reported loss is checked against the probes' midpoint too. No second
  replica is needed.

A failed check fails the call (``Disputed``), in the grace period too: the micro-batch is redone on another
replica (forward, last stage) or replayed (backward), so a lie found is never passed on. ``ban_after`` strikes,
while most of its last ``RECENT_CHECKS`` judged checks failed, ban the replica from this trainer's routing for
``ban_s``; bans are published in the trainer's record and the coordinator turns them into events. What the checks
cannot see: lies on unchecked micro-batches (bounded by the ban: the expected number before a ban is about
ban_after / fraction of the liar's calls; a replica that lies on under half of its calls is never banned, though
each lie a check finds is redone), a replica that recognises probes as small perturbations of a recent input and
answers them consistently with its lie, and one that lies on all its forward calls alike in a stage with fewer
than three replicas (reported, not banned).
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.nn.functional as F

from swarmpipe.peer.events import EventLog, short_id
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.trainer.routing import PeerView, Router
from swarmpipe.peer.trainer.stage_calls import StageCalls
from swarmpipe.peer.transport.wire import WireError

PROBE_STEP = 1e-3  # h as a fraction of |x|: the central difference is exact to ~1e-3 from 1e-4 to 1e-2 (fp32)
# The probes see the weights after the update the gradient made (at most MAX_VERSION_GAP more): early in training
# the slope they measured was 0.32..1.05 of the honest claim in a 2x2 test swarm, and 0.11 for an honest last
# stage whose inputs a sign-flipping sibling had just poisoned. So the check is a band, and what it guarantees is
# this: a gradient that passes is a descent direction of the replica's current loss, with at least 1/20 of the
# slope it claims and at most 20x. A sign flip, scaling by 20 or more, or noise over 4x the gradient fails;
# milder lies slow training at worst.
SLOPE_BAND = (0.05, 20.0)
# A replica's training output against its own forward-only answer a moment later: honest ones differed by up to
# 0.33 (relative L2) in a 2x2 test swarm's first steps, where each Adam step moves stage 0 a lot; noise as large
# as the output is 0.83, a sign flip 2, scaling by 10 1.6.
SELF_CONSISTENCY = 0.6
# A check is judged only when the replica's weights moved at most this many updates between its answer and the
# check's; in a test swarm's first seconds (lr 3e-3, warm-up 5, 30 steps/s) stage 0's output moved by 1.37 and
# the last stage's loss by 38 % across more. UNVERIFIABLE_*: when a replica's checks are skipped that often.
MAX_VERSION_GAP = 2
UNVERIFIABLE_AFTER = 30
UNVERIFIABLE_SHARE = 0.9
LOSS_TOLERANCE = 0.5  # a last stage's reported loss vs its function: honest ones moved 38 % in a few steps
MAX_REPORTED_BANS = 32
# A ban needs most of the replica's last RECENT_CHECKS judged checks failed (see ReplicaVerifier.strike).
RECENT_CHECKS = 10
MAX_TRACKED = 10_000  # replicas whose strikes, outcomes and skips are kept: bounded however many peers lie

T = TypeVar("T")


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
    checks: int = 0  # judged
    skipped: int = 0  # the replica's weights moved too far between its answer and the check
    graced: int = 0  # failures logged, not counted: the trainer's first checks of a stage
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
        grace: int = 20,
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
        self.strikes: dict[str, int] = {}
        self.recent: dict[str, deque] = {}  # peer id -> outcomes of its last judged checks (True: passed)
        self.banned: dict[str, str] = {}  # peer id -> why, newest last
        self.stats = VerifierStats()
        self.skips: dict[str, list[int]] = {}  # peer id -> [checks attempted, skipped]
        self.grace = grace
        self.judged = [0] * spec.num_stages  # checks judged per stage (the grace period counts these)
        self._ids = itertools.count()

    def sampled(self) -> bool:
        return self.fraction > 0 and self.rng.random() < self.fraction

    # ------------------------------------------------------------ outputs
    async def check_output(self, view: PeerView, stage: int, x: torch.Tensor, y: torch.Tensor, mb_id: str = "") -> None:
        """Compare ``view``'s output ``y`` with its own forward-only answer and with other replicas'; raises
        ``Disputed`` when ``view`` lied."""
        before = self._version(view, mb_id)
        again = await self._answer(view, stage, x)
        if again is None:  # no answer: the next call will find out; not a lie
            return
        if not self._comparable(view, stage, before):
            return
        difference = relative_difference(y, again)
        if difference > SELF_CONSISTENCY:
            self.stats.disputes += 1
            reason = f"its training output differs from its own forward-only answer by {difference:.3g}"
            self.strike(view, stage, reason)
            raise Disputed(f"stage {stage} output failed verification: {reason}")
        await self._compare_with_others(view, stage, x, y)  # raises Disputed when view is outvoted
        self._record(view.peer_id, True)

    async def _compare_with_others(self, view: PeerView, stage: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """The second half of an output check: ``view`` passed against itself; now against its siblings."""
        others = self.router.available(stage, exclude={view.peer_id})
        self.rng.shuffle(others)
        second = await self._answer(others[0], stage, x) if others else None
        if second is None:
            return
        tolerance = self.outputs[stage]
        difference = relative_difference(y, second)
        if tolerance.agrees(difference):
            return
        self.stats.disputes += 1
        detail = f"outputs differ by {difference:.3g} (tolerance {tolerance.limit():.3g})"
        third = await self._answer(others[1], stage, x) if len(others) > 1 else None
        if third is not None:
            limit = tolerance.limit()
            ours, theirs = relative_difference(y, third), relative_difference(second, third)
            if theirs <= limit < ours:
                self.strike(view, stage, f"{detail}; two other replicas agree with each other")
                raise Disputed(f"stage {stage} output failed verification: outvoted by two replicas")
            if ours <= limit < theirs:
                self.strike(others[0], stage, f"{detail}; it alone disagrees with two replicas")
                return
        # Two replicas, or three that all differ: honest replicas drift apart between averaging rounds, and
        # nothing here says who is right. Learn the spread; say so.
        self.stats.inconclusive += 1
        tolerance.widen(difference)
        self.events.emit(
            "verification_inconclusive",
            level=logging.INFO,
            stage=stage,
            peers=[short_id(view.peer_id), short_id(others[0].peer_id)],
            detail=detail,
        )

    async def _answer(self, view: PeerView, stage: int, x: torch.Tensor) -> torch.Tensor | None:
        try:
            return await self.calls.forward(view, stage, self._id(), x, evaluate=True)
        except Exception:
            return None

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
        mb_id: str = "",
    ) -> None:
        """Probe ``view``'s function around ``x`` and check the slope its ``grad_input`` claims (and, on the last
        stage, its ``loss``); raises ``Disputed`` when they disagree."""
        norm = float(grad_input.norm())
        if not math.isfinite(norm) or norm == 0.0:
            return
        direction = grad_input / norm
        before = self._version(view, mb_id)
        problems: list[str] = []
        for attempt, step in enumerate((PROBE_STEP * float(x.norm()), 0.1 * PROBE_STEP * float(x.norm()))):
            try:
                above, below = await self._probe(view, stage, x, step * direction, grad_output, targets)
            except Exception:  # it did not answer (or the logits would be too large): no verdict
                return
            # the shorter probe is part of the same check: judged (and counted) once
            if not (self._close(view, before) if attempt else self._comparable(view, stage, before)):
                return
            slope = (above - below) / (2 * step)
            problems = []
            if not SLOPE_BAND[0] * norm <= slope <= SLOPE_BAND[1] * norm:
                problems.append(f"gradient claims slope {norm:.4g}, its function shows {slope:.4g}")
            middle = 0.5 * (above + below)
            if loss is not None and abs(loss - middle) > LOSS_TOLERANCE * max(abs(loss), abs(middle)) + 0.05:
                problems.append(f"reported loss {loss:.4g}, its function gives {middle:.4g}")
            if not problems:
                self._record(view.peer_id, True)
                return
            # A second, 10x shorter probe before any verdict: where the function bends sharply (a run whose
            # inputs were just poisoned) the longer central difference misjudged honest gradients.
        self.stats.disputes += 1
        self.strike(view, stage, f"{'; '.join(problems)} (weights v{before} -> v{self._version(view)})")
        raise Disputed(f"stage {stage} gradient failed verification: {problems[0]}")

    async def _probe(
        self,
        view: PeerView,
        stage: int,
        x: torch.Tensor,
        offset: torch.Tensor,
        grad_output: torch.Tensor | None,
        targets: torch.Tensor | None,
    ) -> tuple[float, float]:
        """The stage's objective at x + offset and x - offset, from ONE forward-only call (both rows stacked),
        so both see the same weights: weights that moved between two calls would swamp the difference."""
        rows = x.shape[0]
        y = await self.calls.forward(view, stage, self._id(), torch.cat([x + offset, x - offset]), True, exact=True)
        if grad_output is None:  # the last stage answers with logits: the loss is peer.model.lm_loss, recomputed here
            y = y.double()
            return _lm_loss(y[:rows], targets), _lm_loss(y[rows:], targets)
        g = grad_output.double()
        return float((y[:rows].double() * g).sum()), float((y[rows:].double() * g).sum())

    # ------------------------------------------------------------ versions
    def _version(self, view: PeerView, mb_id: str = "") -> int:
        """The version ``view`` answered ``mb_id``'s training call at (else the newest it answered with)."""
        newest = self.calls.versions.get(view.peer_id, 0)
        return self.calls.answered.pop((view.peer_id, mb_id), newest) if mb_id else newest

    def _close(self, view: PeerView, before: int) -> bool:
        return self._version(view) - before <= MAX_VERSION_GAP

    def _comparable(self, view: PeerView, stage: int, before: int) -> bool:
        """Whether the check's answer came from weights close enough to the training answer's to judge it: at
        most ``MAX_VERSION_GAP`` updates later. A replica whose checks keep landing further (it claims versions
        that race ahead) is struck as unverifiable: skipping must not be a way out."""
        record = _slot(self.skips, view.peer_id, lambda: [0, 0])
        record[0] += 1
        if self._close(view, before):
            self.stats.checks += 1
            self.judged[stage] += 1
            return True
        record[1] += 1
        self.stats.skipped += 1
        attempts, skipped = record
        if attempts >= UNVERIFIABLE_AFTER and skipped > UNVERIFIABLE_SHARE * attempts:
            record[:] = [0, 0]
            reason = f"{skipped} of {attempts} checks found its weights too far moved to judge"
            self.strike(view, stage, reason, graceable=False)  # always skipping must not keep it in grace
        return False

    # ------------------------------------------------------------ verdicts
    def strike(self, view: PeerView, stage: int, reason: str, graceable: bool = True) -> None:
        """Count a failed check against ``view`` (the caller fails the call: a failed answer is never passed on).
        While this trainer is in its grace period for ``stage`` (its first ``grace`` judged checks there: a young
        run's stages move so fast between an answer and its check that honest replicas failed a few) the failure
        is only logged. A ban needs ``ban_after`` strikes *and* most of the replica's recent judged checks failed:
        a liar fails nearly all of its checks, while an honest replica whose inputs a liar upstream had just
        poisoned failed three in a row between many passes (tests/integration/test_byzantine_replica.py)."""
        if graceable and self.judged[stage] <= self.grace:
            self.stats.graced += 1
            self.events.emit(
                "verification_failed",
                level=logging.INFO,
                stage=stage,
                peer=short_id(view.peer_id),
                strikes=self.strikes.get(view.peer_id, 0),
                grace=True,
                reason=reason[:300],
            )
            return
        self.stats.strikes += 1
        self._record(view.peer_id, False)
        count = self.strikes[view.peer_id] = _slot(self.strikes, view.peer_id, int) + 1
        failing, judged = self._recent_failures(view.peer_id)
        self.events.emit(
            "verification_failed",
            level=logging.WARNING,
            stage=stage,
            peer=short_id(view.peer_id),
            strikes=count,
            recent_failed=f"{failing}/{judged}",
            reason=reason[:300],
        )
        if count >= self.ban_after and 2 * failing >= judged and view.peer_id not in self.banned:
            self.banned[view.peer_id] = reason[:200]
            while len(self.banned) > MAX_REPORTED_BANS:
                self.banned.pop(next(iter(self.banned)))
            self.router.distrust(view.peer_id, self.router.clock() + self.ban_s)
            self.events.emit(
                "replica_banned", level=logging.WARNING, stage=stage, peer=short_id(view.peer_id), strikes=count
            )

    def _record(self, peer_id: str, passed: bool) -> None:
        """One judged check's outcome, kept for the last ``RECENT_CHECKS`` per replica (bounded replicas)."""
        _slot(self.recent, peer_id, lambda: deque(maxlen=RECENT_CHECKS)).append(passed)

    def _recent_failures(self, peer_id: str) -> tuple[int, int]:
        outcomes = self.recent.get(peer_id, ())
        return sum(1 for passed in outcomes if not passed), len(outcomes)

    def _id(self) -> str:
        return f"verify-{next(self._ids)}"


def _slot(table: dict, key: str, make: Callable[[], T]) -> T:
    """``table[key]``, made by ``make`` when missing; beyond ``MAX_TRACKED`` keys the oldest goes first."""
    if key not in table:
        while len(table) >= MAX_TRACKED:
            table.pop(next(iter(table)))
        table[key] = make()
    return table[key]


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))
