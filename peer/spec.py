"""The run spec: everything every participant of one run must agree on.

The coordinator publishes it in the DHT under ``{run_id}.spec`` as a plain dict
(msgpack on the wire, never pickle); peers and trainers rebuild it with
:func:`spec_from_dict`, which refuses unknown schema versions and bad values.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from swarmpipe.peer.transport import codecs

SCHEMA_VERSION = 1
MAX_STAGES = 256  # one run's stages (DHT validators precompute this many stage keys)
MAX_LR = 1.0  # a learning rate beyond this is an attack or a typo, not a setting
_RUN_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
# Fields that older versions had and that never did anything: accepted and ignored, per table path.
RETIRED_FIELDS: dict[str, set[str]] = {"": {"checkpoint_every"}}  # the coordinator's --checkpoint-every counts
# Fields added after peers were already out in swarms, per table path, with a default that must never change:
# left out of a published spec while at that default, so peers of the version before them (which refuse
# unknown fields) still accept a spec that does not use them, and a swarm can upgrade one peer at a time.
OPTIONAL_AT_DEFAULT: dict[str, dict[str, Any]] = {"optimizer": {"rotation_factor_dtype": "float32"}}
log = logging.getLogger("swarmpipe.spec")


class SpecError(ValueError):
    """A run spec that cannot be used: unknown schema, bad field, inconsistent split."""


MODEL_FAMILIES = ("bytegpt", "llama")  # one module each in peer/model/
FINETUNE_METHODS = ("full", "lora")
AVERAGING_AGGREGATES = ("centered_clip", "trimmed_mean", "mean")  # peer/state/robust_aggregate.py


@dataclass
class ModelSpec:
    """The model every replica builds. ``family`` picks the module in peer/model/; with ``checkpoint``
    (a Hugging Face folder) the coordinator fills the fields below from its config.json before it
    publishes the spec, so peers without the files build the same shapes."""

    family: str = "bytegpt"  # bytegpt | llama (Llama, Mistral and Qwen2 checkpoints)
    checkpoint: str = ""  # HF folder: config.json, *.safetensors, tokenizer; "" for a random init
    base_digest: str = ""  # identity of that checkpoint (config + tensor index), set with it
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 64
    mlp_ratio: int = 4  # bytegpt: MLP width / d_model
    # llama family (ignored by bytegpt)
    n_kv_heads: int = 0  # grouped-query attention: key/value heads (0: n_heads)
    head_dim: int = 0  # 0: d_model // n_heads
    intermediate_size: int = 0  # SwiGLU width (0: mlp_ratio * d_model)
    rope_theta: float = 10000.0
    rope_scaling: str = ""  # the HF config's rope_scaling as JSON ("" none)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # the head starts as the embedding (two copies once trained apart)
    attention_bias: bool = False  # Qwen2: biases on q/k/v
    mlp_bias: bool = False
    max_position: int = 0  # HF max_position_embeddings (0: seq_len)
    hf_model_type: str = "llama"  # llama | mistral | qwen2: the config export writes
    bos_token_id: int = -1
    eos_token_id: int = -1  # the document separator of tokenized data (-1: none)

    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_heads


@dataclass
class FinetuneSpec:
    """``full``: every weight trains. ``lora``: the base weights are frozen and only low-rank adapters on
    the ``lora_targets`` linear layers train, carry optimizer state, travel and get checkpointed."""

    method: str = "full"  # full | lora
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class OptimizerSpec:
    # basis_rotation won bench/convergence.py (async, P=8): see bench/CONVERGENCE.md
    kind: str = "basis_rotation"  # adamw | nesterov | basis_rotation
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    warmup_steps: int = 20
    total_steps: int = 0  # 0: constant lr after warm-up; else cosine decay to 10 %
    momentum_decay: float = 0.004  # nesterov (NAdam psi)
    nesterov_beta1: float = 0.99  # nesterov: beta1 (replaces betas[0]; betas[1] stays beta2)
    rotation_every: int = 10  # basis_rotation: power-iteration period f
    # False: peers keep no weight snapshots (less memory; a backward differentiates the live weights),
    # and nesterov switches to its no-stash corrections
    stash: bool = True
    # the delay those corrections assume: formula (P - 1 - k) | measured (running average of the delays the
    # stage measures for each gradient it applies, told to the optimizer at every step)
    delay_source: str = "formula"
    # within one step (update.step_every > 1) each gradient weighted (1 + delay) ** -power, normalised (0: the mean)
    delay_weight_power: float = 0.0
    # basis_rotation with stashing: gradient += lambda * (curvature its preconditioner implies) * (live - stashed
    # weights), in the eigenbasis, the correction's norm capped at compensation_cap x the gradient's (0: off)
    delay_compensation: float = 0.0
    compensation_cap: float = 3.0  # bench/convergence.py seed 0, lambda 1: cap 1 -> 2.04, 3 -> 2.00, 10 -> 1.99
    # basis_rotation: a matrix side longer than this keeps the identity basis (no m x m factors: bounds the
    # state at 2mn + 2 min(m, n)^2 for very wide matrices); 0: rotate every side
    rotation_max_dim: int = 0
    # basis_rotation: storage of its m x m / n x n factors and bases: float32 | bfloat16 (half their memory;
    # the EMAs are rounded stochastically; bench/CONVERGENCE.md "Cost at scale" has the effect on loss)
    rotation_factor_dtype: str = "float32"


@dataclass
class UpdateSpec:
    step_every: int = 1  # optimizer step every k backwards
    max_staleness: int = 32  # gradients older than this (in local steps) are dropped
    pending_ttl_s: float = 120.0  # forward records with no backward expire after this
    # stashed weight snapshots: at most this many MiB (0: half the device's free memory on an accelerator,
    # unbounded on the CPU beyond max_staleness); past it the oldest version's forwards are dropped (counted;
    # their backwards are replayed on the live weights, nothing is lost)
    max_stash_mb: int = 0


@dataclass
class PrecisionSpec:
    """How stages compute (peer/stage/precision.py); the wire keeps the [compression] codecs regardless."""

    compute: str = "auto"  # auto (bf16 on CUDA, fp32 elsewhere) | bf16 | fp16 (CUDA, with loss scaling) | fp32
    weights: str = "fp32"  # fp32 (master weights and optimizer state) | bf16 (half the memory, less exact)


@dataclass
class BatchingSpec:
    """Server-side batching: requests that queue behind a busy stage run as one compute call."""

    max_microbatches: int = 4  # requests merged into one forward / backward (1 disables batching)
    wait_ms: float = 0.0  # how long a lone request waits for company (0: batches form only under load)
    backward_wait_ms: float = 10.0  # a backward waits this long for the rest of its forward batch


@dataclass
class CompressionSpec:
    """Codec per tensor role, by name from peer/transport/codecs.py; "auto" (activations, gradients)
    lets each link choose from the bandwidth it measures."""

    activations: str = "fp16"
    gradients: str = "fp16"
    state: str = "none"


@dataclass
class LimitsSpec:
    max_message_mb: int = 64
    max_tensor_elements: int = 64 * 1024 * 1024
    max_stream_mb: int = 1024  # cap on one chunked stream (a large Forward/Backward), all tensors together


@dataclass
class RunSpec:
    schema_version: int = SCHEMA_VERSION
    run_id: str = "demo"
    num_stages: int = 2
    layer_split: list[int] = field(default_factory=list)  # blocks per stage; empty: even split
    microbatch_size: int = 16
    seed: int = 0
    averaging_period: int = 50  # replica averaging: at least this many local steps between rounds
    averaging_interval_s: float = 30.0  # rounds at clock-aligned slots this far apart (0 disables averaging)
    # how a replica combines its siblings' weights with its own: centered_clip | trimmed_mean | mean (unprotected)
    averaging_aggregate: str = "centered_clip"
    model: ModelSpec = field(default_factory=ModelSpec)
    finetune: FinetuneSpec = field(default_factory=FinetuneSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    update: UpdateSpec = field(default_factory=UpdateSpec)
    batching: BatchingSpec = field(default_factory=BatchingSpec)
    precision: PrecisionSpec = field(default_factory=PrecisionSpec)
    compression: CompressionSpec = field(default_factory=CompressionSpec)
    limits: LimitsSpec = field(default_factory=LimitsSpec)

    def blocks_per_stage(self) -> list[int]:
        if self.layer_split:
            return list(self.layer_split)
        base, extra = divmod(self.model.n_layers, self.num_stages)
        return [base + (1 if s < extra else 0) for s in range(self.num_stages)]

    def block_range(self, stage: int) -> range:
        counts = self.blocks_per_stage()
        start = sum(counts[:stage])
        return range(start, start + counts[stage])

    def validate(self) -> RunSpec:
        if self.schema_version != SCHEMA_VERSION:
            raise SpecError(
                f"spec schema version {self.schema_version} is not supported (this peer knows {SCHEMA_VERSION})"
            )
        if not 1 <= self.num_stages <= MAX_STAGES:
            raise SpecError(f"num_stages must be within 1..{MAX_STAGES}")
        if not _RUN_ID.match(self.run_id):
            raise SpecError(f"run_id must be 1-128 letters, digits, '.', '_' or '-', got {self.run_id[:40]!r}")
        self._check_sane_bounds()
        m = self.model
        if m.family not in MODEL_FAMILIES:
            raise SpecError(f"unknown model family {m.family!r}; known: {', '.join(MODEL_FAMILIES)}")
        if min(m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.seq_len) < 1:
            raise SpecError("model: vocab_size, d_model, n_layers, n_heads and seq_len must be >= 1")
        if m.family == "bytegpt" and m.d_model % m.n_heads:
            raise SpecError(f"d_model {m.d_model} is not divisible by n_heads {m.n_heads}")
        if m.family == "llama":
            if m.hf_model_type not in ("llama", "mistral", "qwen2"):
                raise SpecError(f"hf_model_type {m.hf_model_type!r} is not one of llama, mistral, qwen2")
            if m.n_kv_heads < 0 or m.n_heads % m.kv_heads():
                raise SpecError(f"n_heads {m.n_heads} is not a multiple of n_kv_heads {m.kv_heads()}")
            if not m.head_dim and m.d_model % m.n_heads:
                raise SpecError(f"d_model {m.d_model} is not divisible by n_heads {m.n_heads} (or set head_dim)")
        if m.checkpoint and not m.base_digest:
            log.debug("spec: checkpoint %s not resolved yet (the coordinator fills the model fields)", m.checkpoint)
        f = self.finetune
        if f.method not in FINETUNE_METHODS:
            raise SpecError(f"unknown finetune method {f.method!r}; known: {', '.join(FINETUNE_METHODS)}")
        if f.method == "lora" and (f.lora_rank < 1 or f.lora_alpha <= 0 or not 0 <= f.lora_dropout < 1):
            raise SpecError("finetune: lora_rank must be >= 1, lora_alpha > 0 and lora_dropout in [0, 1)")
        if f.method == "lora" and not f.lora_targets:
            raise SpecError("finetune: lora_targets names no module")
        counts = self.blocks_per_stage()
        unresolved = m.checkpoint and not m.base_digest  # n_layers comes from the checkpoint (resolve_spec)
        if not unresolved and (len(counts) != self.num_stages or sum(counts) != m.n_layers or min(counts) < 0):
            raise SpecError(f"layer_split {counts} does not split {m.n_layers} blocks into {self.num_stages} stages")
        for role in codecs.ROLES:
            codec, allowed = getattr(self.compression, role), codecs.allowed_in_spec(role)
            if codec not in allowed:
                raise SpecError(f"codec {codec!r} cannot be used for {role}; allowed: {', '.join(allowed)}")
        if self.averaging_aggregate not in AVERAGING_AGGREGATES:
            raise SpecError(
                f"unknown averaging_aggregate {self.averaging_aggregate[:40]!r}; known: {', '.join(AVERAGING_AGGREGATES)}"
            )
        if self.optimizer.kind not in ("adamw", "nesterov", "basis_rotation"):
            raise SpecError(f"unknown optimizer kind {self.optimizer.kind!r}")
        if self.optimizer.delay_source not in ("formula", "measured"):
            raise SpecError(
                f"optimizer.delay_source must be formula or measured, got {str(self.optimizer.delay_source)[:40]!r}"
            )
        if self.optimizer.delay_compensation > 0 and (
            self.optimizer.kind != "basis_rotation" or not self.optimizer.stash
        ):
            raise SpecError(
                "optimizer.delay_compensation needs kind = basis_rotation and stash = true (drift of stashed weights)"
            )
        if self.microbatch_size < 1 or self.update.step_every < 1:
            raise SpecError("microbatch_size and update.step_every must be >= 1")
        p = self.precision
        if p.compute not in ("auto", "bf16", "fp16", "fp32") or p.weights not in ("fp32", "bf16"):
            raise SpecError("precision: compute must be auto|bf16|fp16|fp32 and weights fp32|bf16")
        if p.weights == "bf16" and p.compute not in ("auto", "bf16"):
            raise SpecError("precision: bf16 weights need bf16 compute (autocast)")
        if self.update.max_stash_mb < 0:
            raise SpecError("update.max_stash_mb must be >= 0")
        b = self.batching
        if b.max_microbatches < 1 or not 0 <= b.wait_ms <= 1000 or not 0 <= b.backward_wait_ms <= 1000:
            raise SpecError("batching: max_microbatches must be >= 1 and waits within 0..1000 ms")
        return self

    def _check_sane_bounds(self) -> None:
        """A spec comes from the DHT: even a correctly signed one must not ask a volunteer for absurd limits."""
        m, o, lim = self.model, self.optimizer, self.limits
        for name, value, top in (
            ("model.vocab_size", m.vocab_size, 1 << 22),
            ("model.d_model", m.d_model, 1 << 16),
            ("model.n_layers", m.n_layers, 4096),
            ("model.n_heads", m.n_heads, 1024),
            ("model.seq_len", m.seq_len, 1 << 20),
            ("model.intermediate_size", m.intermediate_size, 1 << 18),
            ("model.mlp_ratio", m.mlp_ratio, 64),
            ("microbatch_size", self.microbatch_size, 1 << 16),
            ("limits.max_message_mb", lim.max_message_mb, 2047),  # gRPC's ceiling is 2 GiB
            ("limits.max_stream_mb", lim.max_stream_mb, 16 * 1024),
            ("limits.max_tensor_elements", lim.max_tensor_elements, 1 << 31),
            ("update.max_staleness", self.update.max_staleness, 1 << 20),
        ):
            if not 0 <= value <= top:
                raise SpecError(f"{name} = {value} is outside the sane range 0..{top}")
        if min(lim.max_message_mb, lim.max_stream_mb, lim.max_tensor_elements) < 1:
            raise SpecError("limits must be >= 1")
        if not (0 <= o.lr <= MAX_LR and all(0 <= b < 1 for b in o.betas) and 0 < o.eps <= 1 and o.clip_norm >= 0):
            raise SpecError(f"optimizer: lr must be in [0, {MAX_LR}], betas in [0, 1), eps in (0, 1], clip_norm >= 0")
        if not 0 <= o.weight_decay <= 1 or not 0 <= o.nesterov_beta1 < 1:
            raise SpecError("optimizer: weight_decay must be in [0, 1] and nesterov_beta1 in [0, 1)")
        if not (0 <= o.delay_weight_power <= 8 and 0 <= o.delay_compensation <= 100 and 0 < o.compensation_cap <= 100):
            raise SpecError(
                "optimizer: delay_weight_power must be in [0, 8], delay_compensation in [0, 100], compensation_cap in (0, 100]"
            )
        if o.rotation_factor_dtype not in ("float32", "bfloat16"):
            raise SpecError(
                f"optimizer.rotation_factor_dtype must be float32 or bfloat16, got {str(o.rotation_factor_dtype)[:40]!r}"
            )
        if not 0 <= o.rotation_max_dim <= 1 << 20:
            raise SpecError(f"optimizer.rotation_max_dim = {o.rotation_max_dim} is outside the sane range 0..{1 << 20}")

    def to_dict(self) -> dict[str, Any]:
        """The spec as published and saved: every field, except the ``OPTIONAL_AT_DEFAULT`` ones at their default."""
        data = dataclasses.asdict(self)
        for path, fields in OPTIONAL_AT_DEFAULT.items():
            table = data.get(path, {})
            for name, default in fields.items():
                if table.get(name) == default:
                    del table[name]
        return data


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _build(cls: type, data: dict[str, Any], path: str) -> Any:
    if not isinstance(data, dict):
        raise SpecError(f"{path or 'spec'} must be a table, got {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    retired = RETIRED_FIELDS.get(path, set()) & set(data)
    if retired:  # published by an older coordinator, or an old spec file: they meant nothing
        log.warning("spec: ignoring retired field(s) %s", ", ".join(f"{path}.{r}".lstrip(".") for r in sorted(retired)))
        data = {k: v for k, v in data.items() if k not in retired}
    unknown = set(data) - set(known)
    if unknown:
        raise SpecError(f"unknown field(s) in {path or 'spec'}: {', '.join(sorted(unknown))}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        default = getattr(cls(), name)
        where = f"{path}.{name}" if path else name
        if dataclasses.is_dataclass(default):
            kwargs[name] = _build(type(default), value, where)
        elif isinstance(default, tuple):
            if (
                not isinstance(value, (list, tuple))
                or len(value) != len(default)
                or not all(_is_number(v) for v in value)
            ):
                raise SpecError(f"{where} must be a list of {len(default)} numbers, got {repr(value)[:60]}")
            kwargs[name] = tuple(float(v) for v in value)
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise SpecError(f"{where} must be a boolean")
            kwargs[name] = value
        elif isinstance(default, (int, float)):
            if not _is_number(value) or (isinstance(default, int) and float(value) != int(value)):
                raise SpecError(
                    f"{where} must be a number{' (an integer)' if isinstance(default, int) else ''}, got {repr(value)[:60]}"
                )
            kwargs[name] = type(default)(value)
        elif isinstance(default, list) and default and isinstance(default[0], str):
            if not isinstance(value, list) or not all(isinstance(v, str) and 0 < len(v) <= 64 for v in value):
                raise SpecError(f"{where} must be a list of names, got {repr(value)[:60]}")
            kwargs[name] = list(value)
        elif isinstance(default, list):
            if not isinstance(value, list) or not all(_is_number(v) and float(v) == int(v) for v in value):
                raise SpecError(f"{where} must be a list of integers, got {repr(value)[:60]}")
            kwargs[name] = [int(v) for v in value]
        else:
            if not isinstance(value, str):
                raise SpecError(f"{where} must be a string, got {type(value).__name__}")
            kwargs[name] = value
    return cls(**kwargs)


def spec_from_dict(data: dict[str, Any]) -> RunSpec:
    return _build(RunSpec, data, "").validate()


def load_spec(path: str | Path | None = None, **overrides: Any) -> RunSpec:
    """Default spec, or a TOML file, with top-level overrides (e.g. num_stages, run_id)."""
    data: dict[str, Any] = {}
    if path:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    data.update({k: v for k, v in overrides.items() if v is not None})
    return spec_from_dict(data)
