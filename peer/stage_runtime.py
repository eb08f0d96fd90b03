"""The compute side of one pipeline stage: forward, backward, asynchronous updates.

Weight stashing: a forward runs on an immutable snapshot of the weights of the
current version and keeps its autograd graph; the matching backward
differentiates that graph, so the gradient is exact for the weights that
produced the activations, even though the live weights moved on meanwhile.
The gradient is then applied to the live weights (no pipeline flush). The delay
(updates between forward and backward) is measured per micro-batch; gradients
staler than the spec's bound are dropped and counted, never applied silently.

Not thread-safe by design: the server runs every call on one compute thread.
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch
from torch.func import functional_call

from peer.model import build_stage, lm_loss
from peer.optim import build_optimizer, set_learning_rate
from peer.spec import RunSpec


class UnknownMicrobatch(KeyError):
    """A backward for a micro-batch whose forward this peer never ran (or expired)."""


@dataclass
class ForwardRecord:
    version: int
    inputs: torch.Tensor
    output: torch.Tensor  # carries the autograd graph to the snapshot
    params: dict[str, torch.Tensor]
    created_at: float


@dataclass
class BackwardResult:
    grad_input: torch.Tensor | None
    delay: int
    applied: bool
    dropped_reason: str = ""
    loss: float | None = None


@dataclass
class RuntimeStats:
    forwards: int = 0
    backwards: int = 0
    replays: int = 0
    steps: int = 0
    dropped_stale: int = 0
    dropped_nonfinite: int = 0
    expired: int = 0
    samples: int = 0
    busy_seconds: float = 0.0  # time spent computing: busy fraction = its rate of change
    delays: Counter = field(default_factory=Counter)


class StageRuntime:
    def __init__(self, spec: RunSpec, stage: int, max_pending: int = 256):
        self.spec = spec
        self.stage = stage
        self.module = build_stage(spec, stage)
        self.module.train()
        self.is_first = self.module.is_first
        self.is_last = self.module.is_last
        self.optimizer = build_optimizer(self.module.named_parameters(), spec.optimizer, stage, spec.num_stages)
        self.version = 0  # optimizer steps applied to the live weights
        self.pending: OrderedDict[str, ForwardRecord] = OrderedDict()
        self.max_pending = max_pending
        self.stats = RuntimeStats()
        self._accumulated = 0
        self._snapshot: tuple[int, dict[str, torch.Tensor]] | None = None
        self._seconds_per_sample: float | None = None  # EMA of compute time per sample

    # ---------------------------------------------------------------- compute
    def _params_snapshot(self) -> dict[str, torch.Tensor]:
        """Detached copies of the live weights at the current version, shared by its forwards."""
        if self._snapshot is None or self._snapshot[0] != self.version:
            params = {n: p.detach().clone().requires_grad_(True) for n, p in self.module.named_parameters()}
            self._snapshot = (self.version, params)
        return self._snapshot[1]

    def forward(self, microbatch_id: str, inputs: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        self.expire()
        if microbatch_id in self.pending:
            del self.pending[microbatch_id]  # a retried forward replaces the old record
        params = self._params_snapshot()
        x = inputs if self.is_first else inputs.detach().float().requires_grad_(True)
        output = functional_call(self.module, params, (x,))
        self.pending[microbatch_id] = ForwardRecord(self.version, x, output, params, time.monotonic())
        while len(self.pending) > self.max_pending:
            self.pending.popitem(last=False)
            self.stats.expired += 1
        self.stats.forwards += 1
        self._observe(time.perf_counter() - started, inputs.shape[0], weight=1 / 3)
        return output.detach()

    def backward(self, microbatch_id: str, grad_output: torch.Tensor) -> BackwardResult:
        record = self.pending.pop(microbatch_id, None)
        if record is None:
            raise UnknownMicrobatch(f"stage {self.stage} holds no forward for micro-batch {microbatch_id!r}")
        if grad_output.shape != record.output.shape:
            self.pending[microbatch_id] = record  # caller error: keep the record for a correct retry
            raise ValueError(f"grad_output shape {list(grad_output.shape)} does not match output {list(record.output.shape)}")
        started = time.perf_counter()
        names = list(record.params)
        wrt = ([] if self.is_first else [record.inputs]) + [record.params[n] for n in names]
        grads = torch.autograd.grad(record.output, wrt, grad_output.to(record.output.dtype), allow_unused=True)
        grad_input = None if self.is_first else grads[0]
        param_grads = grads[0 if self.is_first else 1:]
        result = self._apply(dict(zip(names, param_grads)), self.version - record.version)
        result.grad_input = grad_input
        self._observe(time.perf_counter() - started, record.inputs.shape[0], weight=2 / 3)
        return result

    def replay_backward(self, inputs: torch.Tensor, grad_output: torch.Tensor) -> BackwardResult:
        """Backward for a forward that ran on another (vanished) replica: recompute here on live weights."""
        started = time.perf_counter()
        x = inputs if self.is_first else inputs.detach().float().requires_grad_(True)
        output = self.module(x)
        if grad_output.shape != output.shape:
            raise ValueError(f"grad_output shape {list(grad_output.shape)} does not match output {list(output.shape)}")
        params = dict(self.module.named_parameters())
        wrt = ([] if self.is_first else [x]) + list(params.values())
        grads = torch.autograd.grad(output, wrt, grad_output.to(output.dtype), allow_unused=True)
        self.stats.replays += 1
        result = self._apply(dict(zip(params, grads[0 if self.is_first else 1:])), 0)
        result.grad_input = None if self.is_first else grads[0]
        self._observe(time.perf_counter() - started, inputs.shape[0], weight=1.0)
        return result

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> BackwardResult:
        """Last stage: loss and input gradient in one call, on the live weights (delay 0)."""
        if not self.is_last:
            raise ValueError(f"stage {self.stage} is not the last stage; ForwardBackward is for stage {self.spec.num_stages - 1}")
        started = time.perf_counter()
        x = inputs if self.is_first else inputs.detach().float().requires_grad_(True)
        logits = self.module(x)
        if targets.shape != logits.shape[:-1]:
            raise ValueError(f"targets shape {list(targets.shape)} does not match logits {list(logits.shape[:-1])}")
        if targets.numel() and (targets.min() < 0 or targets.max() >= logits.shape[-1]):
            raise ValueError(f"targets must lie in [0, {logits.shape[-1]})")
        loss = lm_loss(logits, targets)
        params = dict(self.module.named_parameters())
        wrt = ([] if self.is_first else [x]) + list(params.values())
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        self.stats.forwards += 1
        result = self._apply(dict(zip(params, grads[0 if self.is_first else 1:])), 0)
        result.grad_input = None if self.is_first else grads[0]
        result.loss = float(loss.detach())
        self._observe(time.perf_counter() - started, inputs.shape[0], weight=1.0)
        return result

    # ---------------------------------------------------------------- updates
    def _apply(self, grads: dict[str, torch.Tensor | None], delay: int) -> BackwardResult:
        self.stats.backwards += 1
        self.stats.delays[delay] += 1
        if delay > self.spec.update.max_staleness:
            self.stats.dropped_stale += 1
            return BackwardResult(None, delay, False, f"stale: delay {delay} > bound {self.spec.update.max_staleness}")
        if not all(g is None or bool(torch.isfinite(g).all()) for g in grads.values()):
            self.stats.dropped_nonfinite += 1
            return BackwardResult(None, delay, False, "non-finite gradient")
        for name, p in self.module.named_parameters():
            g = grads.get(name)
            if g is None:
                continue
            p.grad = g.detach().clone() if p.grad is None else p.grad.add_(g)
        self._accumulated += 1
        if self._accumulated >= self.spec.update.step_every:
            self._step()
        return BackwardResult(None, delay, True)

    def _step(self) -> None:
        opt = self.spec.optimizer
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self._accumulated > 1:
            for p in params:
                p.grad.div_(self._accumulated)
        set_learning_rate(self.optimizer, opt, self.version, self.stage, self.spec.num_stages)
        if opt.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, opt.clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._accumulated = 0
        self.version += 1
        self.stats.steps += 1

    # ---------------------------------------------------------------- housekeeping
    def expire(self, now: float | None = None) -> int:
        """Drop forward records whose backward never came (trainer died) or can no longer apply."""
        now = time.monotonic() if now is None else now
        ttl = self.spec.update.pending_ttl_s
        bound = self.spec.update.max_staleness
        dead = [k for k, r in self.pending.items() if now - r.created_at > ttl or self.version - r.version > bound]
        for key in dead:
            del self.pending[key]
        self.stats.expired += len(dead)
        return len(dead)

    def _observe(self, seconds: float, samples: int, weight: float) -> None:
        """EMA of compute seconds per sample; ``weight`` is the share of a full fwd+bwd this call did."""
        self.stats.busy_seconds += seconds
        self.stats.samples += samples if weight >= 2 / 3 else 0
        per_sample = seconds / max(1, samples) / weight
        ema = self._seconds_per_sample
        self._seconds_per_sample = per_sample if ema is None else 0.9 * ema + 0.1 * per_sample

    def assume_throughput(self, microbatches_per_s: float) -> None:
        """Seed the estimate (e.g. after moving here) until real measurements take over."""
        if microbatches_per_s > 0 and self._seconds_per_sample is None:
            self._seconds_per_sample = 1.0 / (microbatches_per_s * self.spec.microbatch_size)

    def throughput(self) -> float:
        """Micro-batches per second this stage can compute (forward + backward)."""
        if not self._seconds_per_sample:
            return 0.0
        return 1.0 / (self._seconds_per_sample * self.spec.microbatch_size)
