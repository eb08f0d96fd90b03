"""A stage's full state as named tensors + JSON metadata, and its chunked wire form.

Used by state transfer (``DownloadState`` / ``PushState``), the drain handoff and the
coordinator's checkpoints (safetensors + JSON). Tensors are named
``param.<name>`` and ``optim.<index>.<key>``; everything else (version, optimizer
scalars and param groups) lives in the metadata. Nothing is pickled.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from swarmpipe.peer.transport.wire import decode, encode
from swarmpipe.protos import swarm_pb2


class StateError(ValueError):
    """A state that does not fit this stage, or a transfer that ended early."""


@dataclass
class StageState:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]  # {"stage", "version", "run_id", "optimizer": {...}, "names": [...]}

    @property
    def version(self) -> int:
        return int(self.meta.get("version", 0))

    def digest(self) -> str:
        """Content hash over parameters only: equal weights give equal digests."""
        h = hashlib.sha256()
        for name in sorted(k for k in self.tensors if k.startswith("param.")):
            h.update(name.encode())
            h.update(self.tensors[name].detach().contiguous().float().numpy().tobytes())
        return h.hexdigest()[:16]


def export_state(runtime) -> StageState:
    """Snapshot of a :class:`StageRuntime` (call on its compute thread for consistency)."""
    tensors: dict[str, torch.Tensor] = {f"param.{n}": p.detach().clone() for n, p in runtime.module.named_parameters()}
    opt = runtime.optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in opt["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"optim.{index}.{key}"] = value.detach().clone()
            else:
                scalars.setdefault(str(index), {})[key] = value
    meta = {
        "run_id": runtime.spec.run_id,
        "stage": runtime.stage,
        "version": runtime.version,
        "optimizer": {"kind": runtime.spec.optimizer.kind, "param_groups": _jsonable(opt["param_groups"]), "scalars": scalars},
    }
    return StageState(tensors, meta)


def import_state(runtime, state: StageState, load_optimizer: bool = True) -> None:
    """Load weights (and optimizer state when it matches) into a runtime; checks every shape."""
    if int(state.meta.get("stage", runtime.stage)) != runtime.stage:
        raise StateError(f"state is for stage {state.meta.get('stage')}, this runtime serves stage {runtime.stage}")
    params = dict(runtime.module.named_parameters())
    missing = [n for n in params if f"param.{n}" not in state.tensors]
    if missing:
        raise StateError(f"state lacks parameters: {', '.join(missing[:5])}")
    for name, p in params.items():
        value = state.tensors[f"param.{name}"]
        if value.shape != p.shape:
            raise StateError(f"parameter {name}: shape {list(value.shape)} does not match {list(p.shape)}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state.tensors[f"param.{name}"])
    opt_meta = state.meta.get("optimizer") or {}
    if load_optimizer and opt_meta.get("kind") == runtime.spec.optimizer.kind:
        runtime.optimizer.load_state_dict(_optimizer_state_dict(state, opt_meta))
    runtime.version = max(runtime.version, state.version)
    runtime.pending.clear()
    runtime._snapshot = None  # the next forward must see the new weights


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


def average_into(runtime, other: StageState, weight: float = 0.5) -> None:
    """Blend another replica's weights into ours: p <- (1 - w) p + w p_other (shapes checked)."""
    params = dict(runtime.module.named_parameters())
    for name, p in params.items():
        value = other.tensors.get(f"param.{name}")
        if value is None or value.shape != p.shape:
            raise StateError(f"cannot average: parameter {name} missing or of another shape")
    with torch.no_grad():
        for name, p in params.items():
            p.mul_(1 - weight).add_(other.tensors[f"param.{name}"].to(p.dtype), alpha=weight)
    runtime.version = max(runtime.version, other.version)
    runtime._snapshot = None


# ---------------------------------------------------------------- wire form
def to_chunks(state: StageState, shard: int = 0, num_shards: int = 1, codec: str = "none") -> list[swarm_pb2.StateChunk]:
    """Metadata first (in every shard), then this shard's tensors: entries i with i % num_shards == shard."""
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise StateError(f"shard {shard} of {num_shards} does not exist")
    names = sorted(state.tensors)
    mine = [n for i, n in enumerate(names) if i % num_shards == shard]
    meta = dict(state.meta, names=names, digest=state.digest())
    chunks = [swarm_pb2.StateChunk(name="", version=state.version, metadata_json=json.dumps(meta), index=0, total=len(mine) + 1)]
    for i, name in enumerate(mine, start=1):
        t = state.tensors[name]
        chunks.append(swarm_pb2.StateChunk(name=name, tensor=encode(t, codec if t.is_floating_point() else "none"),
                                           version=state.version, index=i, total=len(mine) + 1))
    return chunks


def from_chunks(chunks: Iterable[swarm_pb2.StateChunk], max_elements: int = 1 << 28) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Validate one shard's stream; returns (metadata, tensors). A stream cut short raises StateError."""
    meta: dict[str, Any] | None = None
    tensors: dict[str, torch.Tensor] = {}
    total = None
    count = 0
    for chunk in chunks:
        if count == 0:
            if not chunk.metadata_json:
                raise StateError("state stream does not start with metadata")
            try:
                meta = json.loads(chunk.metadata_json)
            except ValueError as e:
                raise StateError(f"state metadata is not JSON: {e}") from None
            total = chunk.total
        else:
            if chunk.name not in meta.get("names", ()):
                raise StateError(f"state chunk {chunk.name!r} is not listed in the metadata")
            tensors[chunk.name] = decode(chunk.tensor, max_elements=max_elements, what=f"state {chunk.name}").clone()
        count += 1
    if meta is None or count != total:
        raise StateError(f"state stream ended after {count} of {total or '?'} chunks")
    return meta, tensors


def assemble(shards: list[tuple[dict[str, Any], dict[str, torch.Tensor]]]) -> StageState:
    """Join shards from several donors; every listed tensor must have arrived."""
    if not shards:
        raise StateError("no state shards")
    meta = max((m for m, _ in shards), key=lambda m: int(m.get("version", 0)))
    tensors: dict[str, torch.Tensor] = {}
    for _, part in shards:
        tensors.update(part)
    missing = [n for n in meta.get("names", []) if n not in tensors]
    if missing:
        raise StateError(f"state is missing {len(missing)} tensors, e.g. {missing[0]}")
    return StageState(tensors, meta)
