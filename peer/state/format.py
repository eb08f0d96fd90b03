"""A stage's full state as named tensors + JSON metadata, and its chunked wire form.

The stage runtime exports, imports and blends it (:meth:`StageRuntime.export_state` and friends,
built on :func:`capture`, :func:`load_into`, :func:`blend_into`); state transfer (``DownloadState`` /
``PushState``), the drain handoff and the coordinator's checkpoints (safetensors + JSON) move it. Tensors are named
``param.<name>`` and ``optim.<index>.<key>``; everything else (version, optimizer
scalars and param groups) lives in the metadata. Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmpipe.peer.state.errors import MixedState, StateError
from swarmpipe.peer.state.robust_aggregate import clip_scale
from swarmpipe.peer.state.signing import (
    MAX_SIGNATURE_CHARS,
    ChunkHasher,
    chunks_hash,
    sign_meta,
    unsigned,
    verify_meta,
)
from swarmpipe.peer.swarm.identity import Identity
from swarmpipe.peer.transport.wire import decode, encode
from swarmpipe.protos import swarm_pb2

MAX_NAMES = 1 << 16  # tensors one state lists (a 70B model's stage has a few thousand)
MAX_NAME_CHARS = 512
MAX_TEXT_CHARS = 256  # run id, digests, kinds
MAX_SIGNER_CHARS = 4096  # an RSA public key
MAX_STAGES = 256  # as a spec's num_stages
MAX_STATE_VERSION = (1 << 63) - 1  # a StateChunk's int64; whether a version is believable is the caller's rule
MAX_PARAM_GROUPS = 1024
_TENSOR_NAME = re.compile(r"param\.\S+|optim\.\d{1,9}\.\S+")  # what capture() names (load_into parses optim.<i>)
_TEXTS = {"run_id": MAX_TEXT_CHARS, "digest": MAX_TEXT_CHARS, "base_digest": MAX_TEXT_CHARS}
_TEXTS.update(finetune=MAX_TEXT_CHARS, purpose=MAX_TEXT_CHARS, chunk_hash=MAX_TEXT_CHARS)
_TEXTS.update(signer=MAX_SIGNER_CHARS, signature=MAX_SIGNATURE_CHARS)
_INTS = {"version": (0, MAX_STATE_VERSION), "stage": (0, MAX_STAGES - 1)}
_FLAGS = ("base", "params_only")


@dataclass
class StageState:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]  # {"stage", "version", "run_id", "optimizer": {...}, "names": [...]}
    _digests: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    @property
    def version(self) -> int:
        return int(self.meta.get("version", 0))

    def digest(self) -> str:
        """Content hash over parameters only: equal weights give equal digests (computed once)."""
        return self.wire_digest("none")

    def wire_digest(self, codec: str) -> str:
        """The digest of the weights as a receiver decodes them under ``codec`` (a lossy state codec
        changes them): what a donor announces, so the joiner can check what it assembled."""
        if codec not in self._digests:
            h = hashlib.sha256()
            for name in sorted(k for k in self.tensors if k.startswith("param.")):
                t = self.tensors[name].detach()
                if codec != "none":
                    t = decode(encode(t, codec), max_elements=t.numel(), check_finite=False)
                h.update(name.encode())
                h.update(t.contiguous().float().numpy().tobytes())
            self._digests[codec] = h.hexdigest()[:16]
        return self._digests[codec]


def trainable(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a state carries: those that train (frozen LoRA base weights stay where they are)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def capture(module: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any]) -> StageState:
    """Copies of a module's trainable weights and its optimizer's state; ``meta`` names run, stage, version."""
    # host copies in fp32 whatever the device and weights dtype: states travel and are saved as such
    tensors: dict[str, torch.Tensor] = {
        f"param.{n}": p.detach().to("cpu", torch.float32, copy=True) for n, p in trainable(module)
    }
    opt = optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in opt["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"optim.{index}.{key}"] = value.detach().to("cpu", copy=True)
            else:
                scalars.setdefault(str(index), {})[key] = value
    meta = dict(meta)
    meta["optimizer"] = dict(meta.get("optimizer", {}), param_groups=_jsonable(opt["param_groups"]), scalars=scalars)
    return StageState(tensors, meta)


def check_params(module: torch.nn.Module, state: StageState, what: str = "state") -> None:
    """Every trainable parameter of ``module`` is in ``state`` with its shape; raises :class:`StateError`."""
    for name, p in trainable(module):
        value = state.tensors.get(f"param.{name}")
        if value is None:
            raise StateError(f"{what} lacks parameter {name}")
        if value.shape != p.shape:
            raise StateError(f"{what}: parameter {name} has shape {list(value.shape)}, this stage {list(p.shape)}")


def load_into(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: StageState) -> None:
    """Copy weights (and the optimizer state when given) into place; shapes checked first."""
    check_params(module, state)
    with torch.no_grad():
        for name, p in trainable(module):
            p.copy_(state.tensors[f"param.{name}"])
    if optimizer is not None:
        optimizer.load_state_dict(_optimizer_state_dict(state, state.meta.get("optimizer") or {}))


def blend_into(module: torch.nn.Module, other: StageState, weight: float, radius: float | None = None) -> float:
    """p <- p + w s (p_other - p) for every parameter (shapes and finiteness checked first), where s brings the
    whole displacement ||p_other - p|| within ``radius`` (s = 1 without one). Returns s."""
    check_params(module, other, what="cannot average: state")
    params = trainable(module)
    theirs = [other.tensors[f"param.{name}"] for name, _ in params]
    if not all(bool(torch.isfinite(t).all()) for t in theirs):
        raise StateError("cannot average: the state has NaN or Inf weights")
    with torch.no_grad():
        scale = 1.0
        if radius is not None:
            squares = sum(
                float((t.to(p.device, torch.float32) - p.float()).square().sum()) for t, (_, p) in zip(theirs, params)
            )
            scale = clip_scale(math.sqrt(squares), radius)
        for t, (_, p) in zip(theirs, params):
            p.add_((t.to(p.device, p.dtype) - p) * (weight * scale))
    return scale


def _optimizer_state_dict(state: StageState, opt_meta: dict[str, Any]) -> dict[str, Any]:
    entries: dict[int, dict[str, Any]] = {}
    for name, value in state.tensors.items():
        if name.startswith("optim."):
            _, index, key = name.split(".", 2)
            entries.setdefault(int(index), {})[key] = value.clone()
    for index, scalars in (opt_meta.get("scalars") or {}).items():
        entries.setdefault(int(index), {}).update(scalars)
    return {"state": entries, "param_groups": opt_meta.get("param_groups", [])}


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else value.tolist()
    return value


# ---------------------------------------------------------------- metadata from the wire
def _json_kind(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_meta(meta: Any) -> dict[str, Any]:
    """``meta`` (a state stream's parsed metadata JSON) when every field a reader of it uses has its JSON type
    and bounds; :class:`StateError` (a ValueError: INVALID_ARGUMENT on the servers) with a short reason
    otherwise. The one check for every state from elsewhere: a pushed state, a donor's shard, a checkpoint.
    Fields no reader uses are left as they are."""
    if not isinstance(meta, dict):
        raise StateError(f"state metadata is a JSON {_json_kind(meta)}, not an object")
    names = meta.get("names", [])
    if not isinstance(names, list):
        raise StateError(f"state metadata 'names' is a JSON {_json_kind(names)}, not an array")
    if len(names) > MAX_NAMES:
        raise StateError(f"state metadata lists {len(names)} tensors, more than {MAX_NAMES}")
    for name in names:
        if not isinstance(name, str) or len(name) > MAX_NAME_CHARS or not _TENSOR_NAME.fullmatch(name):
            shown = name[:64] if isinstance(name, str) else _json_kind(name)
            raise StateError(f"state metadata lists a tensor {shown!r} that is not a param.* or optim.<i>.* name")
    for key, limit in _TEXTS.items():
        value = meta.get(key)
        if value is not None and (not isinstance(value, str) or len(value) > limit):
            raise StateError(f"state metadata {key!r} must be a string of at most {limit} characters")
    for key, (low, high) in _INTS.items():
        value = meta.get(key)
        if value is not None and (not _is_int(value) or not low <= value <= high):
            shown = value if _is_int(value) else _json_kind(value)
            raise StateError(f"state metadata {key!r} must be an integer in [{low}, {high}], not {str(shown)[:32]}")
    for key in _FLAGS:
        if meta.get(key) is not None and not isinstance(meta[key], bool):
            raise StateError(f"state metadata {key!r} must be true or false, not a JSON {_json_kind(meta[key])}")
    signed_at = meta.get("signed_at")
    if signed_at is not None and (not isinstance(signed_at, (int, float)) or isinstance(signed_at, bool)):
        raise StateError(f"state metadata 'signed_at' must be a number, not a JSON {_json_kind(signed_at)}")
    _check_optimizer(meta.get("optimizer"))
    return meta


def _check_optimizer(optimizer: Any) -> None:
    """The optimizer part of a state's metadata: what :func:`load_into` hands to ``load_state_dict``."""
    if optimizer is None:
        return
    if not isinstance(optimizer, dict):
        raise StateError(f"state metadata 'optimizer' is a JSON {_json_kind(optimizer)}, not an object")
    kind = optimizer.get("kind")
    if kind is not None and (not isinstance(kind, str) or len(kind) > MAX_TEXT_CHARS):
        raise StateError(f"state metadata optimizer 'kind' must be a string of at most {MAX_TEXT_CHARS} characters")
    groups = optimizer.get("param_groups", [])
    if not isinstance(groups, list) or len(groups) > MAX_PARAM_GROUPS or not all(isinstance(g, dict) for g in groups):
        raise StateError(
            f"state metadata optimizer 'param_groups' must be an array of at most {MAX_PARAM_GROUPS} objects"
        )
    for group in groups:
        params = group.get("params", [])
        if not isinstance(params, list) or len(params) > MAX_NAMES or not all(_is_int(i) for i in params):
            raise StateError("state metadata optimizer param group 'params' must be an array of integers")
    scalars = optimizer.get("scalars", {})
    if not isinstance(scalars, dict):
        raise StateError(f"state metadata optimizer 'scalars' is a JSON {_json_kind(scalars)}, not an object")
    for index, entry in scalars.items():
        if not re.fullmatch(r"\d{1,9}", index) or not isinstance(entry, dict):
            raise StateError(
                f"state metadata optimizer scalars {index[:16]!r} must be a parameter index with an object"
            )


# ---------------------------------------------------------------- wire form
def to_chunks(
    state: StageState,
    shard: int = 0,
    num_shards: int = 1,
    codec: str = "none",
    signer: Identity | None = None,
    purpose: str = "download",
) -> list[swarm_pb2.StateChunk]:
    """Metadata first (in every shard), then this shard's tensors: entries i with i % num_shards == shard.
    With ``signer`` the metadata carries its signature over the shard (:mod:`state_signing`)."""
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise StateError(f"shard {shard} of {num_shards} does not exist")
    names = sorted(state.tensors)
    mine = [n for i, n in enumerate(names) if i % num_shards == shard]
    meta = dict(unsigned(state.meta), names=names, digest=state.wire_digest(codec))
    meta.pop("signed_by", None)
    tensors = [
        swarm_pb2.StateChunk(
            name=name, tensor=encode(state.tensors[name], codec), version=state.version, index=i, total=len(mine) + 1
        )
        for i, name in enumerate(mine, start=1)
    ]
    if signer is not None:
        meta = sign_meta(meta, chunks_hash(tensors), signer, purpose)
    head = swarm_pb2.StateChunk(
        name="", version=state.version, metadata_json=json.dumps(meta), index=0, total=len(mine) + 1
    )
    return [head, *tensors]


def from_chunks(
    chunks: Iterable[swarm_pb2.StateChunk], max_elements: int = 1 << 28, purpose: str | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Validate one shard's stream; returns (metadata, tensors). A stream cut short raises StateError.

    ``purpose``: the shard must be signed for it; the signer's peer id is returned as ``meta["signed_by"]``
    for the caller to judge. Without it a signature is not required (state read back from local disk)."""
    meta: dict[str, Any] | None = None
    tensors: dict[str, torch.Tensor] = {}
    listed: set[str] = set()
    total = None
    count = 0
    hasher = ChunkHasher()
    for chunk in chunks:
        if count > 0:
            hasher.add(chunk)
        if count == 0:
            if not chunk.metadata_json:
                raise StateError("state stream does not start with metadata")
            try:
                meta = check_meta(json.loads(chunk.metadata_json))
            except RecursionError:  # nesting deeper than the parser's stack
                raise StateError("state metadata is nested too deeply") from None
            except StateError:
                raise
            except ValueError as e:
                raise StateError(f"state metadata is not JSON: {str(e)[:80]}") from None
            listed = set(meta.get("names", ()))
            total = chunk.total
        else:
            if chunk.name not in listed:
                raise StateError(f"state chunk {chunk.name[:64]!r} is not listed in the metadata")
            tensors[chunk.name] = decode(chunk.tensor, max_elements=max_elements, what=f"state {chunk.name}").clone()
        count += 1
    if meta is None or count != total:
        raise StateError(f"state stream ended after {count} of {total or '?'} chunks")
    signed_by = verify_meta(meta, hasher.hexdigest(), purpose) if purpose is not None else None
    meta = unsigned(meta)
    meta.pop("signed_by", None)  # only what we verified ourselves says who sent it
    if signed_by is not None:
        meta["signed_by"] = signed_by
    return meta, tensors


def assemble(shards: list[tuple[dict[str, Any], dict[str, torch.Tensor]]]) -> StageState:
    """Join shards into one state. Every shard must come from the same snapshot (same version and
    announced digest), every listed tensor must have arrived, and the joined weights must hash to the
    announced digest: a set mixed from replicas at different versions, or tampered on the way, raises
    :class:`MixedState` (a :class:`StateError`) and is never loaded."""
    if not shards:
        raise StateError("no state shards")
    origins = {(int(m.get("version", 0)), str(m.get("digest", ""))) for m, _ in shards}
    if len(origins) > 1:
        raise MixedState(
            f"state shards come from {len(origins)} different snapshots: "
            + ", ".join(f"version {v} digest {d[:16]}" for v, d in sorted(origins))
        )
    meta = shards[0][0]
    tensors: dict[str, torch.Tensor] = {}
    for _, part in shards:
        tensors.update(part)
    missing = [n for n in meta.get("names", []) if n not in tensors]
    if missing:
        raise StateError(f"state is missing {len(missing)} tensors, e.g. {missing[0][:64]}")
    state = StageState(tensors, meta)
    announced = str(meta.get("digest", ""))
    if announced and state.digest() != announced:
        raise MixedState(f"state weights hash to {state.digest()}, their donor announced {announced[:16]}")
    return state
