"""A stage's weights as the rest of the peer sees them: the module and its optimizer, which parameters
train, where the base comes from, the snapshot forwards are stashed on, and their state for transfer,
checkpoints and replica averaging. :class:`StageWeights` is owned by the runtime (``runtime.weights``).

Every method runs on the runtime's compute thread (``StageRuntime.run``), never beside a step.
Only trainable parameters travel: all of them in full training, the adapters alone with LoRA (the
frozen base is loaded once, from the checkpoint or the swarm, and never copied, averaged or saved).
"""

from __future__ import annotations

import torch

from swarmpipe.peer.model import build_stage, has_base_checkpoint
from swarmpipe.peer.model.lora import is_adapter
from swarmpipe.peer.optim import StepInputs, build_optimizer, set_learning_rate, tell_drift
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.stage.precision import Precision
from swarmpipe.peer.stage.stash import PendingForwards, tensor_bytes
from swarmpipe.peer.state.format import StageState, StateError, blend_into, capture, check_params, load_into
from swarmpipe.peer.state.robust_aggregate import flatten, trust_radius


class StageWeights:
    """The live weights of one stage, their optimizer and version (optimizer steps applied, or more after
    a blend or an import)."""

    def __init__(self, spec: RunSpec, stage: int, device: torch.device, precision: Precision, pending: PendingForwards):
        self.spec = spec
        self.stage = stage
        self.device = device
        self.precision = precision
        # the forwards stashed on snapshots of these weights: bounded before a new snapshot, dropped when
        # the weights are replaced (they can no longer be differentiated exactly)
        self._pending = pending
        # A stage whose weights come from a checkpoint is built empty (meta tensors, no memory) and gets its
        # weights from load_base or import_state: the peer never holds a random copy next to the real one.
        self.awaiting_base = has_base_checkpoint(spec)
        self.module = build_stage(spec, stage, empty=self.awaiting_base)
        self.module.train()
        if not self.awaiting_base:
            self._place()  # on the device, in the weights' dtype
        self.optimizer = build_optimizer(self.module.named_parameters(), spec.optimizer, stage, spec.num_stages)
        self.version = 0  # optimizer steps applied to the live weights (jumps when another replica's are blended in)
        self._snapshot: tuple[int, dict[str, torch.Tensor]] | None = None  # see snapshot
        self._anchor: torch.Tensor | None = None  # see set_anchor

    def trainable(self) -> dict[str, torch.nn.Parameter]:
        """The parameters that train (all of them, or only the LoRA adapters): what is stashed,
        differentiated, stepped, averaged, transferred and checkpointed."""
        return {n: p for n, p in self.module.named_parameters() if p.requires_grad}

    def base_names(self) -> list[str]:
        """The parameters that come from the base checkpoint (every one except the adapters)."""
        return [n for n, _ in self.module.named_parameters() if not is_adapter(n)]

    def load_base(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the stage's weights from the base checkpoint (names as in :meth:`base_names`): assigned,
        not copied, so the stage's memory is one copy of its weights. Fresh optimizer state."""
        names = self.base_names()
        missing = [n for n in names if n not in tensors]
        if missing:
            raise StateError(f"base weights lack {len(missing)} tensor(s) of stage {self.stage}, e.g. {missing[0]}")
        params = dict(self.module.named_parameters())
        for name in names:
            want, got = params[name].shape, tensors[name].shape
            if want != got:
                raise StateError(f"base weight {name} has shape {list(got)}, stage {self.stage} needs {list(want)}")
        self._assign({n: tensors[n] for n in names})

    def _assign(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, value in tensors.items():
            owner, _, leaf = name.rpartition(".")
            module = self.module.get_submodule(owner) if owner else self.module
            old = getattr(module, leaf)
            weights = value.detach().to(self.device, self.precision.weights).contiguous()
            setattr(module, leaf, torch.nn.Parameter(weights, old.requires_grad))
        self.awaiting_base = any(p.is_meta for p in self.module.parameters())
        if not self.awaiting_base:
            self._place()  # the adapters and buffers too
        # the optimizer held the replaced parameters (it has no state yet: nothing trained before the weights)
        self.optimizer = build_optimizer(
            self.module.named_parameters(), self.spec.optimizer, self.stage, self.spec.num_stages
        )
        self._snapshot = None

    def _place(self) -> None:
        """Every parameter and buffer on the runtime's device, floating parameters in the weights' dtype."""
        self.module.to(self.device)
        for p in self.module.parameters():
            if p.is_floating_point() and p.dtype != self.precision.weights:
                p.data = p.data.to(self.precision.weights)

    def export_base(self) -> StageState:
        """The frozen base weights (params only), for a joiner without the checkpoint files. Only while they
        are still the base: with LoRA they never change; full fine-tuning trains them (serve the state)."""
        if self.awaiting_base:
            raise StateError(f"stage {self.stage} has no weights yet")
        if self.spec.finetune.method != "lora":
            raise StateError("this replica has trained its base weights; download its state instead")
        params = dict(self.module.named_parameters())
        meta = {"run_id": self.spec.run_id, "stage": self.stage, "version": 0, "base": True}
        meta["base_digest"] = self.spec.model.base_digest
        # frozen tensors, never written in place: shared, not copied
        return StageState({f"param.{n}": params[n].detach().cpu() for n in self.base_names()}, meta)

    def export_state(self) -> StageState:
        """A consistent copy of the trainable weights, optimizer state and version."""
        meta = {
            "run_id": self.spec.run_id,
            "stage": self.stage,
            "version": self.version,
            "optimizer": {"kind": self.spec.optimizer.kind},
            "finetune": self.spec.finetune.method,
            "base_digest": self.spec.model.base_digest,
        }
        return capture(self.module, self.optimizer, meta)

    def import_state(self, state: StageState, load_optimizer: bool = True) -> None:
        """Serve ``state`` from now on: weights, the optimizer state when its kind matches, the version."""
        if int(state.meta.get("stage", self.stage)) != self.stage:
            raise StateError(f"state is for stage {state.meta.get('stage')}, this runtime serves stage {self.stage}")
        digest = state.meta.get("base_digest", "")
        if digest and digest != self.spec.model.base_digest:
            raise StateError(
                f"state was trained on base {digest[:16]}, this run's base is {self.spec.model.base_digest[:16]}"
            )
        if self.awaiting_base:  # full fine-tuning joins with a replica's weights and needs no base download
            if self.spec.finetune.method == "lora":
                raise StateError("load the base weights before the adapters")
            check_params(self.module, state)
            self._assign({n: state.tensors[f"param.{n}"] for n in self.trainable()})
        same_kind = (state.meta.get("optimizer") or {}).get("kind") == self.spec.optimizer.kind
        load_into(self.module, self.optimizer if load_optimizer and same_kind else None, state)
        self.version = max(self.version, state.version)
        self._pending.clear()  # forwards on the old weights can no longer be differentiated exactly
        self._snapshot = None  # the next forward must see the new weights

    def blend(self, other: StageState, weight: float = 0.5, radius: float | None = None) -> float:
        """Average another replica's weights into ours (a drain hand-off): p <- (1 - w) p + w p_other. With
        ``radius`` (a state pushed by a sibling we do not trust: :meth:`push_radius`) the displacement
        p_other - p is clipped to it first, and an outlier beyond it has no pull at all
        (:func:`~swarmpipe.peer.state.robust_aggregate.clip_scale`). Returns the factor applied (1: not clipped)."""
        scale = blend_into(self.module, other, weight, radius)
        self.version = max(self.version, other.version)
        self._snapshot = None
        return scale

    # ---------------------------------------------------------------- where our own movement is measured from
    def set_anchor(self, vector: torch.Tensor | None = None) -> None:
        """Measure our own movement from here on: ``vector`` (flat, as :func:`flatten` of :meth:`copies`, e.g. an
        averaging round's aggregate) or the live weights. Set when serving starts, after each averaging round and
        after each pushed state: one flat fp32 copy of the trainable weights in host memory."""
        self._anchor = flatten(self.copies()) if vector is None else vector

    def anchor(self) -> torch.Tensor | None:
        return self._anchor

    def push_radius(self) -> float:
        """How far a pushed state may pull our weights: the averaging rounds' tau, from how far our own weights
        moved since the anchor (at least a floor relative to ||w||). Re-anchor after the push, so pushes one
        after another (one per sibling, but Sybils are cheap) each get only what we moved in between."""
        return trust_radius(flatten(self.copies()), self._anchor)

    def export_params(self) -> StageState:
        """A copy of the trainable weights only (no optimizer state): what a sibling's averaging round pulls."""
        meta = {
            "run_id": self.spec.run_id,
            "stage": self.stage,
            "version": self.version,
            "params_only": True,
            "finetune": self.spec.finetune.method,
            "base_digest": self.spec.model.base_digest,
        }
        tensors = {f"param.{n}": p.detach().to("cpu", torch.float32, copy=True) for n, p in self.trainable().items()}
        return StageState(tensors, meta)

    def copies(self) -> list[torch.Tensor]:
        """Copies of the trainable weights, in parameter order (the averaging round's starting point);
        zeros of their shapes while the weights have not arrived (the averager only needs the shapes then)."""
        return [
            torch.zeros(p.shape) if p.is_meta else p.detach().to("cpu", torch.float32, copy=True)
            for p in self.trainable().values()
        ]

    def add_correction(self, before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
        """Add ``after - before`` to the live weights: an averaging round's result, keeping the updates
        made while it ran."""
        with torch.no_grad():
            for p, b, a in zip(self.trainable().values(), before, after):
                p.add_((a - b).to(p.device, p.dtype))
        self._snapshot = None

    # ---------------------------------------------------------------- updates
    def step(self, inputs: StepInputs) -> None:
        """One optimizer step on the gradients accumulated in ``p.grad`` (``inputs``: the step's mean delay
        and drift, from the runtime's accumulator); the version goes up by one."""
        opt = self.spec.optimizer
        params = [p for p in self.trainable().values() if p.grad is not None]
        set_learning_rate(self.optimizer, opt, self.version, self.stage, self.spec.num_stages, delay=inputs.delay)
        if opt.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, opt.clip_norm)
        tell_drift(self.optimizer, inputs)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    # ---------------------------------------------------------------- weight stashing
    def snapshot(self) -> dict[str, torch.Tensor]:
        """Detached copies of the live weights at the current version, shared by its forwards. Before a new
        one the stash makes room for it (:meth:`PendingForwards.make_room`)."""
        if self._snapshot is None or self._snapshot[0] != self.version:
            self._pending.make_room(tensor_bytes(self.trainable().values()))
            params = {n: p.detach().clone().requires_grad_(True) for n, p in self.trainable().items()}
            self._snapshot = (self.version, params)
        return self._snapshot[1]

    def held_snapshot(self) -> dict[str, torch.Tensor] | None:
        """The last snapshot :meth:`snapshot` took (its memory is held until a newer one replaces it, steps
        in between or not); None once the weights were replaced, blended or corrected since."""
        return None if self._snapshot is None else self._snapshot[1]
