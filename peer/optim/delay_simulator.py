"""Exact per-stage gradient delays of an asynchronous pipeline, in one process.

The real model is split into P :class:`PipelineStage` s, each with its own optimizer
(built by :func:`build_optimizer`, lr from :func:`set_learning_rate`, gradients
clipped per stage by ``clip_norm`` as the stage runtime does). Micro-batch t is
processed by stage k on the weight version from ``tau_k`` updates before, which is
what an asynchronous 1F1B pipeline (PipeDream) does: stage k has ``P - 1 - k``
micro-batches in flight between a forward and its backward. With a
:class:`~swarmpipe.peer.optim.delay_models.DelayModel` instead of fixed delays, ``tau_k``
is drawn for every micro-batch (random, heavy-tailed, slow replica, replays, or a
histogram recorded from a real swarm; see delay_models.py).

Modes:

* ``stash``: forward and backward at stage k both on version ``u - tau_k`` (weight
  stashing); the gradient is applied to the live weights. All-zero delays give
  plain synchronous training with the same code.
* ``nostash``: forward on the stale version, backward recomputed on the live weights
  from the stored (stale) input activations, as a peer without weight stashing does.
* ``gpipe``: the synchronous GPipe-equivalent baseline: delays 0 and ``accumulate``
  (default 4) micro-batches averaged per update, so the same samples make fewer,
  larger steps. Warm-up and total steps of the lr schedule are divided by
  ``accumulate`` so the schedule spans the same samples (in every mode).

Every stage accumulates its gradients in a :class:`StepAccumulator` with their delays and
(stash mode) stashed weights, and steps as the stage runtime does: the (delay-weighted) mean
gradient, the measured delay told to ``set_learning_rate`` and the drift to the optimizer.

Versions are counted in updates: version u is the stage's weights after u optimizer
steps. During pipeline fill the version is clamped at 0, as in a real pipeline.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.func import functional_call

from swarmpipe.peer.model.bytegpt import PipelineStage, lm_loss
from swarmpipe.peer.optim import StepAccumulator, build_optimizer, set_learning_rate, tell_drift
from swarmpipe.peer.optim.delay_models import DelayModel, FixedDelays, one_f_one_b
from swarmpipe.peer.spec import RunSpec

Batch = tuple[torch.Tensor, torch.Tensor]
Params = dict[str, torch.Tensor]
MODES = ("stash", "nostash", "gpipe")


one_f_one_b_delays = one_f_one_b  # the name bench/convergence.py and the tests use


@dataclass
class StageEvent:
    """What one stage computed for one micro-batch (passed to the observer)."""

    micro: int  # micro-batch index
    update: int  # updates done when the micro-batch was processed (= live version)
    stage: int
    forward_version: int
    backward_version: int
    forward_params: Params  # the tensors actually used (do not modify)
    backward_params: Params


@dataclass
class SimResult:
    train_losses: list[float] = field(default_factory=list)  # per micro-batch
    eval_micro: list[int] = field(default_factory=list)  # micro-batches seen at each evaluation
    eval_losses: list[float] = field(default_factory=list)
    updates: int = 0
    seconds: float = 0.0
    mean_delays: list[float] = field(default_factory=list)  # per stage, over all micro-batches
    capped: int = 0  # delays the model cut down to its max_delay


class DelaySimulator:
    """P live stages, their optimizers and rings of stashed weight versions."""

    def __init__(
        self,
        spec: RunSpec,
        delays: Sequence[int] | DelayModel | None = None,
        mode: str = "stash",
        accumulate: int | None = None,
        observer: Callable[[StageEvent], None] | None = None,
        init: Callable[[PipelineStage, int], None] | None = None,
    ):
        """``delays``: fixed per-stage delays (default 1F1B) or a :class:`DelayModel` drawing them per
        micro-batch. ``init(stage, k)``, if given, re-initialises each fresh stage before anything is stashed."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.num_stages = P = spec.num_stages
        if mode == "gpipe":
            delays = [0] * P
            accumulate = 4 if accumulate is None else accumulate
        if (accumulate or 1) > 1:
            opt = spec.optimizer
            spec = dataclasses.replace(
                spec,
                optimizer=dataclasses.replace(
                    opt, warmup_steps=opt.warmup_steps // accumulate, total_steps=opt.total_steps // accumulate
                ),
            )
        model = delays if hasattr(delays, "max_delay") else FixedDelays(P, delays)  # type: ignore[arg-type]
        if model.num_stages != P:
            raise ValueError(f"the delay model is for {model.num_stages} stages, the spec has {P}")
        self.model: DelayModel = model
        self.delays = model.delays(0)  # this micro-batch's delay at each stage
        self.delay_sums = [0] * P
        self.spec, self.mode, self.observer = spec, mode, observer
        self.accumulate = accumulate or 1
        self.stages = [PipelineStage(spec, k) for k in range(P)]
        for k, stage in enumerate(self.stages):
            if init is not None:
                init(stage, k)
        self.optimizers = [
            build_optimizer(s.named_parameters(), spec.optimizer, k, P) for k, s in enumerate(self.stages)
        ]
        self.accumulators = [StepAccumulator(spec.optimizer) for _ in range(P)]
        self.updates = 0
        self.micro = 0
        # ring[k] holds (version, params) for versions updates - tau_k .. updates.
        self.rings: list[deque[tuple[int, Params]]] = [deque(maxlen=model.max_delay + 1) for _ in range(P)]
        for k in range(P):
            self.rings[k].append((0, self._snapshot(k)))

    def _snapshot(self, k: int) -> Params:
        return {n: p.detach().clone() for n, p in self.stages[k].named_parameters()}

    def version_for(self, stage: int) -> int:
        return max(0, self.updates - self.delays[stage])

    def stashed(self, stage: int, version: int) -> Params:
        for v, params in self.rings[stage]:
            if v == version:
                return params
        raise KeyError(f"stage {stage} holds no version {version}")

    def train_micro(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One micro-batch through all stages; steps every stage after ``accumulate`` of them."""
        if self.micro > 0:
            self.delays = self.model.delays(self.micro)
        self.delay_sums = [a + min(d, self.updates) for a, d in zip(self.delay_sums, self.delays)]
        loss = self._stash_pass(tokens, targets) if self.mode != "nostash" else self._nostash_pass(tokens, targets)
        self.micro += 1
        if self.micro % self.accumulate == 0:
            self._update()
        return loss

    def _stash_pass(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        # Fresh leaves over the stashed tensors: version 0 may serve several micro-batches.
        leaves = [
            {n: t.detach().requires_grad_() for n, t in self.stashed(k, self.version_for(k)).items()}
            for k in range(self.num_stages)
        ]
        x = tokens
        for k, stage in enumerate(self.stages):
            x = functional_call(stage, leaves[k], (x,))
        loss = lm_loss(x, targets)
        loss.backward()
        for k, stage in enumerate(self.stages):
            grads = {n: leaf.grad for n, leaf in leaves[k].items()}
            self.accumulators[k].add(dict(stage.named_parameters()), grads, self._delay(k), 1, stashed=leaves[k])
            self._observe(k, self.version_for(k), leaves[k], self.version_for(k), leaves[k])
        return float(loss.detach())

    def _delay(self, k: int) -> int:
        """Stage k's delay for this micro-batch, in updates (pipeline fill: at most the updates so far)."""
        return min(self.delays[k], self.updates)

    def _nostash_pass(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        inputs, x = [], tokens
        with torch.no_grad():
            for k, stage in enumerate(self.stages):
                inputs.append(x)
                x = functional_call(stage, self.stashed(k, self.version_for(k)), (x,))
            loss = float(lm_loss(x, targets))
        grad_out: torch.Tensor | None = None
        for k in reversed(range(self.num_stages)):
            # Recompute this stage on live weights from its stored stale input.
            stage, x_in = self.stages[k], inputs[k]
            if k > 0:
                x_in = x_in.detach().requires_grad_()
            out = stage(x_in)
            live = dict(stage.named_parameters())
            wrt = ([x_in] if k > 0 else []) + list(live.values())
            last = k == self.num_stages - 1
            grads = torch.autograd.grad(
                lm_loss(out, targets) if last else out, wrt, None if last else grad_out, allow_unused=True
            )
            grad_out = grads[0] if k > 0 else None
            # the gradient is taken at the live weights: no drift to tell
            self.accumulators[k].add(live, dict(zip(live, grads[1 if k > 0 else 0 :])), self._delay(k), 1)
            self._observe(k, self.version_for(k), self.stashed(k, self.version_for(k)), self.updates, live)
        return loss

    def _observe(self, k: int, fv: int, fp: Params, bv: int, bp: Params) -> None:
        if self.observer is not None:
            self.observer(StageEvent(self.micro, self.updates, k, fv, bv, fp, bp))

    def _update(self) -> None:
        opt_spec = self.spec.optimizer
        for k, (stage, opt) in enumerate(zip(self.stages, self.optimizers)):
            # tell the optimizer the delay these gradients really had, and (stash) how far the weights moved since
            inputs = self.accumulators[k].finish(dict(stage.named_parameters()))
            set_learning_rate(opt, opt_spec, self.updates, k, self.num_stages, delay=inputs.delay)
            if opt_spec.clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(stage.parameters(), opt_spec.clip_norm)
            tell_drift(opt, inputs)
            opt.step()
            opt.zero_grad(set_to_none=True)
        self.updates += 1
        for k in range(self.num_stages):
            self.rings[k].append((self.updates, self._snapshot(k)))

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> float:
        """Mean loss of the live weights on the given batches."""
        losses = []
        for tokens, targets in batches:
            x = tokens
            for stage in self.stages:
                x = stage(x)
            losses.append(float(lm_loss(x, targets)))
        return sum(losses) / max(1, len(losses))


def simulate(
    spec: RunSpec,
    steps: int,
    next_batch: Callable[[], Batch],
    delays: Sequence[int] | DelayModel | None = None,
    mode: str = "stash",
    eval_batches: Sequence[Batch] = (),
    eval_every: int = 0,
    accumulate: int | None = None,
    observer: Callable[[StageEvent], None] | None = None,
    init: Callable[[PipelineStage, int], None] | None = None,
) -> SimResult:
    """Train for ``steps`` micro-batches; evaluate every ``eval_every`` micro-batches and at the end."""
    sim = DelaySimulator(spec, delays, mode, accumulate, observer, init)
    result = SimResult()
    start = time.perf_counter()
    for i in range(1, steps + 1):
        result.train_losses.append(sim.train_micro(*next_batch()))
        if eval_batches and ((eval_every and i % eval_every == 0) or i == steps):
            result.eval_micro.append(i)
            result.eval_losses.append(sim.evaluate(eval_batches))
    result.updates = sim.updates
    result.mean_delays = [total / max(1, steps) for total in sim.delay_sums]
    result.capped = sim.model.capped
    result.seconds = time.perf_counter() - start
    return result
