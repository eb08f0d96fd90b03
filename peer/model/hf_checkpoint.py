"""A Hugging Face checkpoint folder: its config as spec fields, its identity, and per-tensor reads.

A stage never loads the whole model: :meth:`HFCheckpoint.read` opens the safetensors files lazily
and reads exactly the tensors it is asked for (``tensors_read`` counts them), so a peer's memory holds
its own stage and nothing else.

The digest is a content hash (config.json and every weight file's bytes, streamed once and cached next
to the files): a peer that has the folder checks it is the run's base before using it, and adapters are
stored with it so nobody mixes them with another base (a fine-tune of the same architecture has the same
tensor names and shapes, so nothing cheaper would tell them apart). Weights that arrive over the network
are checked against their donor's digest (peer/state/format.py) as every state is.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from swarmpipe.peer.spec import RunSpec, SpecError

# model_type -> the architecture classes that share the Llama decoder (peer/model/llama.py)
SUPPORTED_MODEL_TYPES = {
    "llama": ("LlamaForCausalLM",),
    "mistral": ("MistralForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
}
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on a header
DIGEST_CACHE = ".swarmpipe-digests.json"


class CheckpointError(SpecError):
    """A checkpoint folder that cannot serve this run: missing files, unsupported model, wrong shapes."""


@dataclass
class HFCheckpoint:
    path: Path
    config: dict[str, Any]
    files: dict[str, Path]  # tensor name -> the safetensors file holding it
    tensors_read: int = 0
    sliding_window: int = 0
    _digest: str = field(default="", repr=False)

    @classmethod
    def open(cls, path: str | Path) -> HFCheckpoint:
        root = Path(path).resolve()  # the files stay readable if a link to the folder goes away
        if not root.is_dir():
            raise CheckpointError(f"checkpoint {root} is not a folder")
        config_file = root / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"checkpoint {root} has no config.json (expected a Hugging Face model folder)")
        if config_file.stat().st_size > MAX_CONFIG_BYTES:
            raise CheckpointError(f"{config_file} is larger than {MAX_CONFIG_BYTES} bytes")
        try:
            config = json.loads(config_file.read_text())
        except ValueError as e:
            raise CheckpointError(f"{config_file} is not JSON: {e}") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{config_file} is not a JSON object")
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"checkpoint {root}: model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} (the llama family)"
            )
        archs = config.get("architectures") or list(SUPPORTED_MODEL_TYPES[model_type])
        unsupported = [a for a in archs if a not in SUPPORTED_MODEL_TYPES[model_type]]
        if unsupported:
            raise CheckpointError(f"checkpoint {root}: architecture {unsupported[0]} is not supported")
        return cls(root, config, _index(root))

    # ------------------------------------------------------------ identity and spec
    def digest(self) -> str:
        """sha256 over config.json and every weight file's bytes (streamed, cached per file by size and
        mtime in ``.swarmpipe-digests.json`` next to them, so a restart does not hash again)."""
        if not self._digest:
            cache_file = self.path / DIGEST_CACHE
            try:
                cache = json.loads(cache_file.read_text())
            except (OSError, ValueError):
                cache = {}
            h = hashlib.sha256((self.path / "config.json").read_bytes())
            fresh: dict[str, Any] = {}
            for file in sorted(set(self.files.values())):
                stat = file.stat()
                key = f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}"
                if not isinstance(cache.get(key), str):
                    with open(file, "rb") as f:
                        cache[key] = hashlib.file_digest(f, "sha256").hexdigest()
                fresh[key] = cache[key]
                h.update(key.split(":")[0].encode() + cache[key].encode())
            try:
                if fresh != cache:
                    cache_file.write_text(json.dumps(fresh))
            except OSError:
                pass  # a read-only folder: hash again next time
            self._digest = h.hexdigest()[:32]
        return self._digest

    def model_fields(self) -> dict[str, Any]:
        """The spec's ``[model]`` fields this checkpoint fixes (read through transformers' own config
        classes, which normalise old and new field names)."""
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(str(self.path), local_files_only=True)
        window = getattr(c, "sliding_window", None)
        if window and (c.model_type == "mistral" or getattr(c, "use_sliding_window", False)):
            self.sliding_window = int(window)  # full attention is exact while seq_len fits the window
        rope = dict(getattr(c, "rope_parameters", None) or {})
        theta = float(rope.pop("rope_theta", getattr(c, "rope_theta", 10000.0)))
        if rope.get("rope_type", "default") == "default":
            rope = {}
        eos = c.eos_token_id[0] if isinstance(c.eos_token_id, list) else c.eos_token_id
        bos = c.bos_token_id[0] if isinstance(c.bos_token_id, list) else c.bos_token_id
        return {
            "family": "llama",
            "vocab_size": int(c.vocab_size),
            "d_model": int(c.hidden_size),
            "n_layers": int(c.num_hidden_layers),
            "n_heads": int(c.num_attention_heads),
            "n_kv_heads": int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads),
            "head_dim": int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads),
            "intermediate_size": int(c.intermediate_size),
            "rope_theta": theta,
            "rope_scaling": json.dumps(rope, sort_keys=True) if rope else "",
            "norm_eps": float(c.rms_norm_eps),
            "tie_embeddings": bool(getattr(c, "tie_word_embeddings", False)),
            "attention_bias": bool(getattr(c, "attention_bias", c.model_type == "qwen2")),
            "mlp_bias": bool(getattr(c, "mlp_bias", False)),
            "max_position": int(getattr(c, "max_position_embeddings", 0) or 0),
            "hf_model_type": c.model_type,
            "bos_token_id": -1 if bos is None else int(bos),
            "eos_token_id": -1 if eos is None else int(eos),
        }

    # ------------------------------------------------------------ tensors
    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Exactly these tensors (float32), each file opened lazily; a missing one is a CheckpointError."""
        from safetensors import safe_open

        missing = [n for n in names if n not in self.files]
        if missing:
            raise CheckpointError(
                f"checkpoint {self.path} lacks {len(missing)} tensor(s) this stage needs, e.g. {missing[0]}"
            )
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for file, wanted in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in wanted:
                    out[name] = f.get_tensor(name).float()
                    self.tensors_read += 1
        return out


def _index(root: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors.index.json or the headers of *.safetensors."""
    index_file = root / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_file} is not a safetensors index: {e}") from None
        files = {str(name): root / str(file) for name, file in weight_map.items()}
        absent = sorted({f.name for f in files.values() if not f.is_file()})
        if absent:
            raise CheckpointError(f"checkpoint {root}: the index names missing shard {absent[0]}")
        return files
    weight_files = sorted(root.glob("*.safetensors"))
    if not weight_files:
        raise CheckpointError(f"checkpoint {root} has no *.safetensors weights (pickled .bin files are not loaded)")
    files: dict[str, Path] = {}
    for file in weight_files:
        header = json.loads(_header_bytes(file))
        files.update({name: file for name in header if name != "__metadata__"})
    return files


def _header_bytes(file: Path) -> bytes:
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{file} is not a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > MAX_HEADER_BYTES:
            raise CheckpointError(f"{file}: safetensors header of {size} bytes")
        return f.read(size)


def resolve_spec(spec: RunSpec) -> RunSpec:
    """Fill a spec's ``[model]`` from its checkpoint's config.json (the coordinator does this before it
    publishes the spec); checks that the split and the sequence length fit the checkpoint."""
    m = spec.model
    if not m.checkpoint:
        return spec.validate()
    if m.family != "llama":
        raise CheckpointError(f'model family {m.family!r} has no checkpoint format; use family = "llama"')
    ckpt = HFCheckpoint.open(m.checkpoint)
    for name, value in ckpt.model_fields().items():
        setattr(m, name, value)
    m.base_digest = ckpt.digest()
    if ckpt.sliding_window and m.seq_len > ckpt.sliding_window:
        raise CheckpointError(
            f"seq_len {m.seq_len} exceeds the checkpoint's sliding window {ckpt.sliding_window} (not supported)"
        )
    if m.max_position and m.seq_len > m.max_position:
        raise CheckpointError(f"seq_len {m.seq_len} exceeds the checkpoint's max_position_embeddings {m.max_position}")
    counts = spec.blocks_per_stage()
    if sum(counts) != m.n_layers or len(counts) != spec.num_stages:
        raise CheckpointError(
            f"layer_split {counts} does not add up to the checkpoint's {m.n_layers} layers in {spec.num_stages} stages"
        )
    return spec.validate()
