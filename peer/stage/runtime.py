"""The compute side of one pipeline stage: forward, backward, asynchronous updates.

Weight stashing: a forward runs on an immutable snapshot of the weights of the
current version and keeps its autograd graph; the matching backward
differentiates that graph, so the gradient is exact for the weights that
produced the activations, even though the live weights moved on meanwhile.
The gradient is then applied to the live weights (no pipeline flush). The delay
(updates between forward and backward) is measured per micro-batch; gradients
staler than the spec's bound are dropped and counted, never applied silently.

The runtime owns its compute thread: every call that reads or writes its weights (compute, state
export/import, blending, averaging corrections) runs there, through :meth:`StageRuntime.run` or
:meth:`StageRuntime.submit`, so no other module touches its fields or borrows its executor. It is built
from two parts it owns: the weights (``runtime.weights``, :class:`~swarmpipe.peer.stage.weights.StageWeights`)
and the stash of forwards awaiting their backward (``runtime.pending``,
:class:`~swarmpipe.peer.stage.stash.PendingForwards`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from torch.func import functional_call

from swarmpipe.peer.model import lm_loss
from swarmpipe.peer.norm_guard import NormGuard
from swarmpipe.peer.optim import StepAccumulator
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.stage.device import to_device, to_host
from swarmpipe.peer.stage.precision import LossScale, resolve_precision
from swarmpipe.peer.stage.stash import (  # noqa: F401 (BackwardResult, UnknownMicrobatch: part of this API)
    BackwardResult,
    ForwardGroup,
    PendingForwards,
    RuntimeStats,
    UnknownMicrobatch,
    concat_rows,
)
from swarmpipe.peer.stage.throughput import ThroughputEstimate
from swarmpipe.peer.stage.weights import StageWeights

T = TypeVar("T")


class StageRuntime:
    def __init__(
        self,
        spec: RunSpec,
        stage: int,
        max_pending: int = 256,
        base_dir: str = "",
        device: torch.device | str | None = None,
        stash_bound_bytes: int = 0,
    ):
        self.spec = spec
        self.stage = stage
        self.base_dir = base_dir  # a local copy of the base checkpoint (peer --checkpoint), if any
        self.device = torch.device(device or "cpu")
        self.precision = resolve_precision(spec.precision, self.device)
        self.loss_scale = LossScale(self.precision.scaled)
        self.stats = RuntimeStats()
        # stash_bound_bytes 0: no bound beyond max_staleness
        self.pending = PendingForwards(self.stats, max_pending, stash_bound_bytes)
        self.weights = StageWeights(spec, stage, self.device, self.precision, self.pending)
        self.is_first = self.weights.module.is_first
        self.is_last = self.weights.module.is_last
        # Weight stashing (the default): a forward keeps its weight snapshot and graph, so its backward is
        # exact. Without (optimizer.stash = false) nothing but the input is kept, and the backward
        # differentiates on the weights live when it arrives: less memory, a stale-weights gradient.
        self.stashing = spec.optimizer.stash
        self.gradient_guard = NormGuard()
        self.accumulator = StepAccumulator(spec.optimizer)  # gradients since the last step, their delays and drift
        self.speed = ThroughputEstimate(spec.microbatch_size)
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"compute-s{stage}")

    @property
    def version(self) -> int:
        """The live weights' version (:attr:`StageWeights.version`)."""
        return self.weights.version

    # ---------------------------------------------------------------- the compute thread
    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue ``fn`` on this runtime's compute thread (every access to the weights goes there)."""
        return self._compute.submit(fn)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Await ``fn(*args)`` on the compute thread."""
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    def close(self) -> None:
        """Stop the compute thread; queued work is cancelled (the peer is leaving)."""
        self._compute.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- compute
    def forward(self, microbatch_id: str, inputs: torch.Tensor) -> torch.Tensor:
        return self.forward_many([(microbatch_id, inputs)])[0]

    def forward_many(self, items: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """One forward over several micro-batches (same trailing shape); their backwards may come together or apart."""
        started = time.perf_counter()
        self.expire()
        ids = [mb for mb, _ in items]
        if len(set(ids)) != len(ids):
            raise ValueError("a batch holds the same micro-batch id twice")
        if len({tuple(x.shape[1:]) for _, x in items}) != 1:
            raise ValueError("micro-batches in one batch must share their trailing shape")
        for mb in ids:
            self.pending.forget(mb)  # a retried forward replaces the old record
        joined, slices = concat_rows([x for _, x in items])
        joined = to_device(joined, self.device)
        module = self.weights.module
        if self.stashing:
            params = self.weights.snapshot()
            x = joined if self.is_first else joined.detach().float().requires_grad_(True)
            with self.precision.context():
                output = functional_call(module, params, (x,))
        else:  # no stash: keep only the input; the backward recomputes on the weights live then
            params = None
            x = joined if self.is_first else joined.detach().float()
            with torch.no_grad(), self.precision.context():
                output = module(x)
        rows = dict(zip(ids, slices))
        group = ForwardGroup(self.version, self.stats.steps, x, output, params, time.monotonic(), rows, set(ids))
        self.pending.add(group)
        self.stats.forwards += len(items)
        self._observe(time.perf_counter() - started, x.shape[0], weight=1 / 3, microbatches=len(items))
        detached = to_host(output.detach().float())  # the reply leaves from the host
        return [detached[rows[mb]] for mb in ids]

    def backward(self, microbatch_id: str, grad_output: torch.Tensor) -> BackwardResult:
        result = self.backward_many([(microbatch_id, grad_output)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def backward_many(self, items: list[tuple[str, torch.Tensor]]) -> list[BackwardResult | Exception]:
        """Backwards of several micro-batches; one result or exception (bad id, bad shape) per item.

        Members of one forward group that all arrived together share one backward
        through the group's graph; members that come apart are recomputed on the
        group's stashed snapshot (exact, one extra forward for their rows), so a
        late sibling never makes the others differentiate the whole group twice.
        """
        results: list[BackwardResult | Exception | None] = [None] * len(items)
        by_group: dict[int, tuple[ForwardGroup, list[tuple[int, str, torch.Tensor]]]] = {}
        seen: set[str] = set()
        for i, (mb, grad) in enumerate(items):
            group = self.pending.get(mb)
            if group is None or mb in seen:
                results[i] = UnknownMicrobatch(f"stage {self.stage} holds no forward for micro-batch {mb!r}")
                continue
            want = (group.rows[mb].stop - group.rows[mb].start, *group.output.shape[1:])
            if tuple(grad.shape) != want:  # caller error: the record stays for a correct retry
                results[i] = ValueError(f"grad_output shape {list(grad.shape)} does not match output {list(want)}")
                continue
            seen.add(mb)
            by_group.setdefault(id(group), (group, []))[1].append((i, mb, grad))
        for group, members in by_group.values():
            for i, result in self._backward_group(group, members):
                results[i] = result
        return results  # type: ignore[return-value]

    def _backward_group(self, group: ForwardGroup, members: list[tuple[int, str, torch.Tensor]]):
        started = time.perf_counter()
        ids = [mb for _, mb, _ in members]
        for mb in ids:
            self.pending.forget(mb)
        if (
            group.params is not None and not group.outstanding
        ):  # all owed members are here: one backward, the group's graph
            grad_full = torch.zeros_like(group.output)
            for _, mb, grad in members:
                grad_full[group.rows[mb]] = to_device(grad, self.device).to(grad_full.dtype)
            x, output, grad_output, params = group.inputs, group.output, grad_full, group.params
            rows = {mb: group.rows[mb] for mb in ids}
        else:  # siblings are still out (or no stash): recompute just these rows
            params = group.params if group.params is not None else self.weights.trainable()
            joined, slices = concat_rows([group.inputs[group.rows[mb]].detach() for mb in ids])
            x = joined if self.is_first else joined.requires_grad_(True)
            with self.precision.context():
                output = functional_call(self.weights.module, params, (x,))
            grad_output = torch.cat([to_device(g, self.device).to(output.dtype) for _, _, g in members])
            rows = dict(zip(ids, slices))
            self.stats.recomputed += len(ids) if group.params is not None else 0
        grad_input, param_grads = self._differentiate(output, grad_output, x, params)
        grad_input = None if grad_input is None else to_host(grad_input.float())
        shared = self._apply(param_grads, self.stats.steps - group.step, count=len(ids), stashed=group.params)
        self._observe(
            time.perf_counter() - started,
            sum(r.stop - r.start for r in rows.values()),
            weight=2 / 3,
            microbatches=len(ids),
        )
        for i, mb, _ in members:
            yield (
                i,
                BackwardResult(
                    None if grad_input is None else grad_input[rows[mb]],
                    shared.delay,
                    shared.applied,
                    shared.dropped_reason,
                ),
            )

    def _differentiate(
        self, output: torch.Tensor, grad_output: torch.Tensor | None, x: torch.Tensor, params: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor | None]]:
        """Gradients of ``output`` (a scalar loss when ``grad_output`` is None) for the input and the weights."""
        names = list(params)
        wrt = ([] if self.is_first else [x]) + [params[n] for n in names]
        if grad_output is None:
            output = self.loss_scale.scale_loss(output)
        else:
            grad_output = self.loss_scale.scale_grad(grad_output)
        grads = list(torch.autograd.grad(output, wrt, grad_output, allow_unused=True))
        if not self.loss_scale.unscale(grads):  # fp16 overflow: the step is skipped (non-finite), none sent on
            grads = [None if g is None else torch.full_like(g, float("nan")) for g in grads]
            if not self.is_first:
                grads[0] = torch.zeros_like(x)
        grad_input = None if self.is_first else grads[0]
        return grad_input, dict(zip(names, grads[0 if self.is_first else 1 :]))

    def replay_backward(self, inputs: torch.Tensor, grad_output: torch.Tensor) -> BackwardResult:
        """Backward for a forward that ran on another (vanished) replica: recompute here on live weights."""
        started = time.perf_counter()
        inputs, grad_output = to_device(inputs, self.device), to_device(grad_output, self.device)
        x = inputs if self.is_first else inputs.detach().float().requires_grad_(True)
        with self.precision.context():
            output = self.weights.module(x)
        if grad_output.shape != output.shape:
            raise ValueError(f"grad_output shape {list(grad_output.shape)} does not match output {list(output.shape)}")
        trainable = self.weights.trainable()
        grad_input, param_grads = self._differentiate(output, grad_output.to(output.dtype), x, trainable)
        self.stats.replays += 1
        result = self._apply(param_grads, 0)
        result.grad_input = None if grad_input is None else to_host(grad_input.float())
        self._observe(time.perf_counter() - started, inputs.shape[0], weight=1.0)
        return result

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> BackwardResult:
        result = self.forward_backward_many([(inputs, targets)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def forward_backward_many(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> list[BackwardResult | Exception]:
        """Last stage: each micro-batch's loss and input gradient, in one pass on the live weights (delay 0).

        The micro-batches' losses are summed: rows never interact, so each input
        gradient is exactly its own loss's, and the weights take one step with
        the mean of their gradients (as if they had been accumulated)."""
        if not self.is_last:
            raise ValueError(
                f"stage {self.stage} is not the last stage; ForwardBackward is for stage {self.spec.num_stages - 1}"
            )
        results: list[BackwardResult | Exception | None] = [None] * len(items)
        good = []
        for i, (inputs, targets) in enumerate(items):
            problem = self._targets_problem(inputs, targets)
            if problem is not None:
                results[i] = problem
            elif good and tuple(inputs.shape[1:]) != tuple(items[good[0]][0].shape[1:]):
                results[i] = ValueError("micro-batches in one batch must share their trailing shape")
            else:
                good.append(i)
        if not good:
            return results  # type: ignore[return-value]
        started = time.perf_counter()
        joined, rows = concat_rows([items[i][0] for i in good])
        joined = to_device(joined, self.device)
        x = joined if self.is_first else joined.detach().float().requires_grad_(True)
        with self.precision.context():
            logits = self.weights.module(x)
            losses = [lm_loss(logits[r], to_device(items[i][1], self.device)) for r, i in zip(rows, good)]
        grad_input, param_grads = self._differentiate(torch.stack(losses).sum(), None, x, self.weights.trainable())
        grad_input = None if grad_input is None else to_host(grad_input.float())
        loss_values = torch.stack(losses).detach().float().cpu().tolist()
        self.stats.forwards += len(good)
        shared = self._apply(param_grads, 0, count=len(good))
        for k, (r, i) in enumerate(zip(rows, good)):
            results[i] = BackwardResult(
                None if grad_input is None else grad_input[r],
                0,
                shared.applied,
                shared.dropped_reason,
                loss=loss_values[k],
            )
        self._observe(time.perf_counter() - started, x.shape[0], weight=1.0, microbatches=len(good))
        return results  # type: ignore[return-value]

    def _targets_problem(self, inputs: torch.Tensor, targets: torch.Tensor) -> ValueError | None:
        """What is wrong with a micro-batch's targets for these inputs, or None."""
        if tuple(targets.shape) != tuple(inputs.shape[:2]):
            return ValueError(f"targets shape {list(targets.shape)} does not match inputs {list(inputs.shape[:2])}")
        if targets.numel() and (targets.min() < 0 or targets.max() >= self.spec.model.vocab_size):
            return ValueError(f"targets must lie in [0, {self.spec.model.vocab_size})")
        return None

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Forward-only on the live weights (validation): no record kept, no stash, no update.

        Returns the output, or on the last stage with ``targets`` the mean loss as a 0-d tensor."""
        problem = None if targets is None else self._targets_problem(inputs, targets)
        if problem is not None:
            raise problem
        inputs = to_device(inputs, self.device)
        with torch.no_grad(), self.precision.context():
            output = self.weights.module(inputs if self.is_first else inputs.detach().float())
            self.stats.evaluations += 1
            if targets is not None and self.is_last:
                return to_host(lm_loss(output, to_device(targets, self.device)).float())
            return to_host(output.float())

    # ---------------------------------------------------------------- updates
    def _apply(
        self, grads: dict[str, torch.Tensor | None], delay: int, count: int = 1, stashed: dict | None = None
    ) -> BackwardResult:
        """Add the summed gradients of ``count`` micro-batches (taken at the ``stashed`` weights, None: the live
        ones) with their delay; step once ``step_every`` have accumulated."""
        self.stats.backwards += count
        self.stats.delays[delay] += count
        if delay > self.spec.update.max_staleness:
            self.stats.dropped_stale += count
            return BackwardResult(None, delay, False, f"stale: delay {delay} > bound {self.spec.update.max_staleness}")
        if not all(g is None or bool(torch.isfinite(g).all()) for g in grads.values()):
            self.stats.dropped_nonfinite += count
            return BackwardResult(None, delay, False, "non-finite gradient")
        outlier = self.gradient_guard.check_grads(grads.values(), count)
        if outlier:
            self.stats.dropped_outlier += count
            return BackwardResult(None, delay, False, outlier)
        trainable = self.weights.trainable()
        self.accumulator.add(trainable, grads, delay, count, stashed)
        if self.accumulator.count >= self.spec.update.step_every:
            self.weights.step(self.accumulator.finish(trainable))  # p.grad: the (delay-weighted) mean
            self.stats.steps += 1
        return BackwardResult(None, delay, True)

    # ---------------------------------------------------------------- housekeeping
    def expire(self, now: float | None = None) -> int:
        """Drop forward records whose backward never came (trainer died) or can no longer apply."""
        now = time.monotonic() if now is None else now
        update = self.spec.update
        return self.pending.expire(now, update.pending_ttl_s, self.stats.steps, update.max_staleness)

    def _observe(self, seconds: float, samples: int, weight: float, microbatches: int = 1) -> None:
        """Count a compute call; ``weight`` is the share of a full fwd+bwd it did (peer/stage/throughput.py)."""
        self.stats.busy_seconds += seconds
        self.stats.samples += samples if weight >= 2 / 3 else 0
        self.speed.observe(seconds, samples, weight, microbatches)

    def assume_throughput(self, microbatches_per_s: float) -> None:
        """Seed the estimate (e.g. after moving here) until real measurements take over."""
        self.speed.assume(microbatches_per_s)

    def throughput(self) -> float:
        """Micro-batches per second this stage can compute (forward + backward)."""
        return self.speed.microbatches_per_s()
