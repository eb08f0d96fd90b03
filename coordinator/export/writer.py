"""Writing an export folder: staged next to ``out`` and renamed into place, safetensors weights (sharded
with an index above a size), JSON configs, and the base folder's tokenizer files."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from swarmpipe.peer.spec import RunSpec

MAX_SHARD_BYTES = 2 * 1024**3
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)


@contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """A fresh folder next to ``out``, renamed to ``out`` (absent or empty) when the block succeeds and
    removed either way, so a failed export leaves nothing behind."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def as_float(t: torch.Tensor) -> torch.Tensor:
    """Floating tensors as contiguous float32 (the ``torch_dtype`` every exported config names)."""
    return t.float().contiguous() if t.is_floating_point() else t.contiguous()


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    # transformers checks this format metadata when it loads safetensors weights
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_weights(tensors: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> int:
    """``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` shards and their index above
    ``max_shard_bytes``. Returns the bytes written."""
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    total = sum(sizes.values())
    if total <= max_shard_bytes:
        save_tensors(tensors, folder / "model.safetensors")
        return total
    shards: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes.items():
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    weight_map = {}
    for k, names in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_tensors({n: tensors[n] for n in names}, folder / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def weights_summary(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """The tensor count, parameter count and bytes of the weights written, for the export summary."""
    return {
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def copy_base_files(base_dir: Path | None, folder: Path, generation: bool) -> list[str]:
    """Copy the base folder's tokenizer files (and ``generation_config.json`` when ``generation``) that
    exist into ``folder``; returns their names."""
    if base_dir is None:
        return []
    names = [
        n for n in TOKENIZER_FILES + (("generation_config.json",) if generation else ()) if (base_dir / n).is_file()
    ]
    for name in names:
        shutil.copy2(base_dir / name, folder / name)
    return names


def token_ids(run: RunSpec) -> dict[str, int | None]:
    """``bos_token_id``/``eos_token_id`` for a config: the spec's negative "none" becomes null."""
    m = run.model
    return {
        "bos_token_id": m.bos_token_id if m.bos_token_id >= 0 else None,
        "eos_token_id": m.eos_token_id if m.eos_token_id >= 0 else None,
    }
