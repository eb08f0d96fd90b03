"""How much device memory a stage needs before a peer commits to it.

A peer that picks a stage too big for its accelerator fails late (an out-of-memory error in the middle of
a run, after it downloaded the state); :func:`estimate_stage_memory` answers from the spec alone, on a
stage built on the meta device (names and shapes, no memory), so ``--stage auto`` can choose among the
stages that fit and a manual choice fails early with the numbers (:func:`check_fits`).

What a running :class:`~swarmpipe.peer.stage.runtime.StageRuntime` holds, part by part:

* ``weights``: every parameter, frozen base and trainable, in the weights' dtype;
* ``grads``: one accumulated ``.grad`` per trainable parameter (kept between steps when ``step_every > 1``);
* ``optimizer``: the state its optimizer keeps per trainable parameter (see :func:`optimizer_bytes`);
* ``stash``: one clone of the trainable parameters per weight version a pending forward still needs;
* ``activations``: the autograd graph and the input/output each in-flight micro-batch keeps.

The first four are exact byte counts of the steady state (after the first optimizer step). The activations
are an estimate from the model's shapes (:func:`_graph_elements_per_token`), counted from the tensors
autograd saves in each family's block on PyTorch 2.x with fused attention, and checked against a
measurement in tests/unit/test_stage_memory_estimate.py. Not counted: transients (the gradient
``autograd.grad`` returns before it is cloned into ``.grad``, the optimizer's per-step temporaries, a
recomputed forward of a late batch sibling), the CUDA context and allocator fragmentation: that is what
the headroom of :func:`check_fits` is for.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch
from torch import nn

from swarmpipe.peer.model import build_stage
from swarmpipe.peer.model.lora import LoRALinear
from swarmpipe.peer.optim.basis_rotation import is_rotated_param
from swarmpipe.peer.spec import RunSpec, spec_from_dict

MIB = 1 << 20
DEFAULT_HEADROOM = 0.9  # share of the free memory a stage may plan to use
INDEX_BYTES = 8  # token ids and targets are int64
ADAMW_STEP_BYTES = 4  # torch AdamW keeps its step count as a float32 scalar tensor per parameter

# Activation constants: elements autograd saves per token of one transformer block, by family, counted
# from the saved tensors of one forward (PyTorch 2.x, fused SDPA) and checked by the tests.
# d-wide tensors around the two norms: bytegpt (LayerNorm) keeps each norm's input and output; llama
# (RMSNorm, computed as x * rsqrt(mean x^2) * weight) keeps input, normalised and scaled copies of each.
BLOCK_NORM_COPIES = {"bytegpt": 4, "llama": 6}
# Per-row statistics: LayerNorm keeps mean and 1/std, RMSNorm 1/rms, two norms per block.
BLOCK_NORM_STATS = {"bytegpt": 4, "llama": 2}
# MLP-wide tensors: bytegpt keeps fc's output and gelu's; llama's SwiGLU keeps gate, silu(gate), up and
# their product (down_proj's input).
BLOCK_FFN_COPIES = {"bytegpt": 2, "llama": 4}
# Attention scores: fused SDPA kernels (flash / memory-efficient on CUDA, flash on CPU) keep one log-sum-exp
# per head and row, never the [seq, seq] probabilities; a math-fallback kernel would keep seq of them.
ATTENTION_SCORE_COLUMNS = 1


@dataclass
class MemoryEstimate:
    """Bytes a stage needs on its device, by part (see the module docstring for what each part holds)."""

    weights: int
    grads: int
    optimizer: int
    stash: int
    activations: int
    stage: int = -1
    in_flight: int = 0
    stash_versions: int = 0

    PARTS = ("weights", "grads", "optimizer", "stash", "activations")

    @property
    def total_bytes(self) -> int:
        return sum(self.parts().values())

    def parts(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.PARTS}

    def biggest(self, count: int = 2) -> list[tuple[str, int]]:
        """The ``count`` largest parts, largest first: what to shrink when the stage does not fit."""
        return sorted(self.parts().items(), key=lambda kv: kv[1], reverse=True)[:count]

    def describe(self) -> str:
        parts = ", ".join(f"{name} {_mib(b)}" for name, b in self.parts().items())
        return (
            f"stage {self.stage}: {_mib(self.total_bytes)} MiB ({parts} MiB; "
            f"{self.in_flight} micro-batches in flight, {self.stash_versions} stashed versions)"
        )


class StageDoesNotFit(ValueError):
    """A stage whose estimated memory exceeds what the device has free (with headroom)."""


def _mib(n: float) -> str:
    return f"{n / MIB:.1f}"


def shape_stage(spec: RunSpec, stage: int) -> nn.Module:
    """The stage with every tensor on the meta device: names, shapes and requires_grad, no memory.

    ``build_stage(empty=True)`` alone still allocates bytegpt stages (they always start from the seed)
    and LoRA adapters; under the meta device context they cost nothing either."""
    with torch.device("meta"):
        return build_stage(spec, stage, empty=True)


def optimizer_bytes(
    named: list[tuple[str, nn.Parameter]], kind: str, weights_bytes: int, max_dim: int = 0, factor_bytes: int = 0
) -> int:
    """Steady-state optimizer state of the trainable ``named`` parameters (states in the weights' dtype).

    * adamw (torch AdamW): exp_avg and exp_avg_sq per element, plus a float32 step tensor per parameter;
    * nesterov (PipelineNesterov): exp_avg and exp_avg_sq; its step and mu_product are plain floats;
    * basis_rotation (BasisRotationAdam): for a rotated m x n matrix the two moments (2 m n), the gradient
      covariances gg_left, gg_right (m^2 + n^2) and the eigenbases q_left, q_right (m^2 + n^2), a side
      longer than ``max_dim`` (rotation_max_dim, 0: none) leaving out its two, each of ``factor_bytes``
      (rotation_factor_dtype; 0: the weights'); every other parameter the two AdamW moments (its step is a
      plain float).
    """
    elements = 0
    extra = 0
    factor_bytes = factor_bytes or weights_bytes
    for name, p in named:
        if not p.requires_grad:
            continue
        elements += 2 * p.numel()
        if kind == "adamw":
            extra += ADAMW_STEP_BYTES
        elif kind == "basis_rotation" and is_rotated_param(name, p):
            m, n = p.shape
            extra += factor_bytes * 2 * sum(k * k for k in (m, n) if not max_dim or k <= max_dim)
        elif kind not in ("adamw", "nesterov", "basis_rotation"):
            raise ValueError(f"unknown optimizer kind {kind!r}")
    return elements * weights_bytes + extra


def _graph_elements_per_token(spec: RunSpec, module: nn.Module) -> int:
    """Elements the autograd graph of one forward of this stage saves per token, apart from the stage's
    input and output (held by the forward record anyway)."""
    m = spec.model
    fam = m.family
    d = m.d_model
    if fam == "llama":
        q_dim, kv_dim = m.n_heads * m.head_size(), m.kv_heads() * m.head_size()
        ffn = m.intermediate_size or m.mlp_ratio * d
    else:
        q_dim = kv_dim = d
        ffn = m.mlp_ratio * d
    block = (
        BLOCK_NORM_COPIES[fam] * d
        + 2 * q_dim  # queries and the attention output (o_proj's input)
        + 2 * kv_dim  # keys and values
        + BLOCK_FFN_COPIES[fam] * ffn
        + m.n_heads * ATTENTION_SCORE_COLUMNS
        + BLOCK_NORM_STATS[fam]
    )
    blocks = len(getattr(module, "block_indices", []))
    # each adapter keeps its rank-wide intermediate x A^T (LoRA's small extra)
    lora = sum(sub.lora_A.shape[0] for sub in module.modules() if isinstance(sub, LoRALinear))
    elements = blocks * block + lora
    if blocks and not module.is_first:
        elements -= d  # the first block's saved input is the stage input, counted as held
    # (on the first stage the first block's input is the embedding output, no double count)
    if module.is_last:
        # the final norm's input (unless it is the stage input), stats and output(s), then cross-entropy's
        # log-softmax over the vocabulary
        norm_input = d if blocks or module.is_first else 0
        elements += norm_input + ((2 + d) if fam == "bytegpt" else (1 + 2 * d)) + m.vocab_size
    return elements


def _activation_bytes(spec: RunSpec, module: nn.Module, in_flight: int, act_bytes: int) -> int:
    """Bytes of the graphs, inputs and outputs of ``in_flight`` micro-batches (an estimate: see module doc)."""
    m = spec.model
    tokens = spec.microbatch_size * m.seq_len  # seq_len bounds every micro-batch's length
    inputs = INDEX_BYTES if module.is_first else m.d_model * act_bytes
    outputs = m.vocab_size * act_bytes + INDEX_BYTES if module.is_last else m.d_model * act_bytes  # + targets
    held = tokens * (inputs + outputs)
    graph = tokens * _graph_elements_per_token(spec, module) * act_bytes
    # one compute call at a time, joining up to max_microbatches requests
    live = min(in_flight, spec.batching.max_microbatches)
    if module.is_last:
        # ForwardBackward runs forward, loss and backward in one call on the live weights: nothing is held
        # between calls
        return live * (held + graph)
    if spec.optimizer.stash:
        return in_flight * (held + graph)  # every pending forward keeps its graph until its backward
    # no stash: a forward keeps its input and output; its backward recomputes the graph then
    return in_flight * held + live * graph


def default_stash_versions(spec: RunSpec, stage: int, in_flight: int) -> int:
    """Weight versions the stash holds at worst: one per in-flight forward (1F1B with step_every 1 steps
    between any two), never more than the staleness bound lets live; none on the last stage (its
    ForwardBackward runs on the live weights) or without stashing."""
    if not spec.optimizer.stash or stage == spec.num_stages - 1:
        return 0
    return min(in_flight, spec.update.max_staleness + 1)


def estimate_stage_memory(
    spec: RunSpec,
    stage: int,
    in_flight: int,
    stash_versions: int | None = None,
    weights_bytes: int = 4,
    activation_bytes: int | None = None,
) -> MemoryEstimate:
    """The memory stage ``stage`` needs with ``in_flight`` micro-batches awaiting their backward.

    ``weights_bytes``: 4 for float32, 2 for bf16; gradients, optimizer states and stashed copies share the
    weights' dtype. ``activation_bytes``: the compute dtype's size (default: the weights'; 2 under bf16
    autocast with float32 weights). Nothing is allocated."""
    if in_flight < 0:
        raise ValueError("in_flight must be >= 0")
    module = shape_stage(spec, stage)
    named = list(module.named_parameters())
    trainable = sum(p.numel() for _, p in named if p.requires_grad)
    if stash_versions is None:
        stash_versions = default_stash_versions(spec, stage, in_flight)
    elif not spec.optimizer.stash:
        stash_versions = 0
    return MemoryEstimate(
        weights=sum(p.numel() for _, p in named) * weights_bytes,
        grads=trainable * weights_bytes,
        optimizer=optimizer_bytes(
            named,
            spec.optimizer.kind,
            weights_bytes,
            spec.optimizer.rotation_max_dim,
            2 if spec.optimizer.rotation_factor_dtype == "bfloat16" else weights_bytes,
        ),
        stash=stash_versions * trainable * weights_bytes,
        activations=_activation_bytes(spec, module, in_flight, activation_bytes or weights_bytes),
        stage=stage,
        in_flight=in_flight,
        stash_versions=stash_versions,
    )


@functools.lru_cache(maxsize=64)
def _state_bytes(spec_json: str, stage: int) -> int:
    estimate = estimate_stage_memory(spec_from_dict(json.loads(spec_json)), stage, in_flight=0, stash_versions=0)
    return estimate.weights + estimate.optimizer


def state_bytes_bound(spec: RunSpec, stage: int) -> int:
    """The most bytes a transferred state of ``stage`` can take on the wire (weights and optimizer state,
    with room for encoding): what a receiver lets one sender make it buffer."""
    return 2 * _state_bytes(json.dumps(spec.to_dict(), sort_keys=True), stage) + (1 << 20)


def check_fits(estimate: MemoryEstimate, free_bytes: int, device_name: str, headroom: float = DEFAULT_HEADROOM) -> None:
    """Raise :class:`StageDoesNotFit` when the estimate exceeds ``headroom`` of the device's free memory."""
    usable = headroom * free_bytes
    if estimate.total_bytes <= usable:
        return
    biggest = ", ".join(f"{name} {_mib(b)} MiB" for name, b in estimate.biggest(3))
    raise StageDoesNotFit(
        f"stage {estimate.stage} needs about {_mib(estimate.total_bytes)} MiB but {device_name} has "
        f"{_mib(free_bytes)} MiB free ({_mib(usable)} MiB usable at {headroom:.0%} headroom); biggest parts: "
        f"{biggest} ({estimate.in_flight} micro-batches in flight, {estimate.stash_versions} stashed versions). "
        "Pick another stage, lower the in-flight micro-batches, or train with LoRA or without stashing."
    )


def stages_that_fit(
    spec: RunSpec,
    free_bytes: int,
    in_flight: int,
    weights_bytes: int = 4,
    headroom: float = DEFAULT_HEADROOM,
    activation_bytes: int | None = None,
) -> list[int]:
    """The stages whose estimate fits in ``headroom`` of ``free_bytes`` (the candidates of ``--stage auto``)."""
    fit = []
    for stage in range(spec.num_stages):
        estimate = estimate_stage_memory(
            spec, stage, in_flight, weights_bytes=weights_bytes, activation_bytes=activation_bytes
        )
        if estimate.total_bytes <= headroom * free_bytes:
            fit.append(stage)
    return fit


# ---------------------------------------------------------------- a peer choosing and bounding its stage
def default_in_flight(spec: RunSpec) -> int:
    """Micro-batches a stage may hold at once: the trainer's default (two per stage)."""
    return 2 * spec.num_stages


def weights_dtype_bytes(spec: RunSpec) -> int:
    """Bytes per weight (and per gradient, optimizer and stashed value): bf16 or float32."""
    return 2 if spec.precision.weights == "bf16" else 4


def activation_dtype_bytes(autocast: bool) -> int:
    """Bytes per activation value: 2 under (bf16 or fp16) autocast, else float32's 4."""
    return 2 if autocast else 4


def estimate_for_peer(spec: RunSpec, stage: int, autocast: bool) -> MemoryEstimate:
    """What ``stage`` needs on a peer that computes under ``autocast`` or not, with the trainer's default
    micro-batches in flight and the spec's weight dtype."""
    return estimate_stage_memory(
        spec,
        stage,
        default_in_flight(spec),
        weights_bytes=weights_dtype_bytes(spec),
        activation_bytes=activation_dtype_bytes(autocast),
    )


def stages_that_fit_peer(spec: RunSpec, free_bytes: int, autocast: bool) -> list[int]:
    """:func:`stages_that_fit` for a peer as :func:`estimate_for_peer` sees it."""
    return stages_that_fit(
        spec,
        free_bytes,
        default_in_flight(spec),
        weights_dtype_bytes(spec),
        activation_bytes=activation_dtype_bytes(autocast),
    )


def stash_bound_bytes(spec: RunSpec, budget_bytes: int, bounded: bool) -> int:
    """Bytes a stage's stashed weight snapshots may take: the spec's ``max_stash_mb``, else half the peer's
    memory budget when ``bounded`` (an accelerator, or a peer given --max-memory-mb), else 0: none beyond
    max_staleness (a CPU host swaps before it crashes, and tests run there)."""
    if spec.update.max_stash_mb:
        return spec.update.max_stash_mb << 20
    return budget_bytes // 2 if bounded else 0
