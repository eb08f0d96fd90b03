"""Export a checkpoint as a Hugging Face folder: ``swarmpipe export --checkpoint DIR --out DIR``.

A checkpoint (see :mod:`swarmpipe.coordinator.checkpoints`) holds one ``stage-K.safetensors`` per
pipeline stage, with the weights as ``param.<name>`` (optimizer state, ``optim.*``, is ignored here),
and ``spec.json``, the run spec that says how the names and shapes fit together. The export is:

* ``llama`` family, full training: ``config.json`` for ``LlamaForCausalLM`` / ``MistralForCausalLM`` /
  ``Qwen2ForCausalLM`` (the spec's ``hf_model_type``) and ``model.safetensors`` (sharded with an index
  above 2 GB), the base folder's tokenizer files and generation config when it is on this machine.
  The head is its own trained copy: ``tie_word_embeddings`` is true only when it still equals the
  embedding bit for bit.
* ``llama`` family, LoRA: a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``)
  for ``PeftModel.from_pretrained(base, out)``; with ``merge`` a full model folder whose weights are the
  base folder's plus ``lora_alpha / lora_rank * B @ A`` (the base is read one tensor at a time).
* ``bytegpt``: a ``GPT2LMHeadModel`` folder (same computation: learned positions, pre-norm blocks,
  exact GELU, untied head; GPT-2's Conv1D weights are the transpose of ``nn.Linear``'s).

Everything is checked before anything is written: every stage present, every expected tensor there
with its shape, nothing unexpected, adapters trained on the base the spec names. The folder is written
next to ``out`` and renamed into place, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from swarmpipe.coordinator.export.gpt2 import CONV1D, GPT2_BLOCK, bytegpt_shapes, gpt2_config, gpt2_name, write_gpt2
from swarmpipe.coordinator.export.llama import (
    ARCHITECTURES,
    ATTENTION,
    MLP,
    bias_projections,
    linear_shapes,
    llama_config,
    llama_shapes,
    module_path,
    write_llama,
)
from swarmpipe.coordinator.export.lora import PEFT_PREFIX, lora_shapes, merged, write_peft
from swarmpipe.coordinator.export.reader import (
    SPEC_FILE,
    ExportError,
    Shapes,
    StageFiles,
    base_folder,
    read_spec,
    resolve_checkpoint,
)
from swarmpipe.coordinator.export.writer import MAX_SHARD_BYTES, TOKENIZER_FILES, staged_folder, write_weights
from swarmpipe.peer.spec import RunSpec

__all__ = [
    "ARCHITECTURES",
    "ATTENTION",
    "CONV1D",
    "GPT2_BLOCK",
    "MAX_SHARD_BYTES",
    "MLP",
    "PEFT_PREFIX",
    "SPEC_FILE",
    "TOKENIZER_FILES",
    "ExportError",
    "Shapes",
    "StageFiles",
    "bias_projections",
    "bytegpt_shapes",
    "export_checkpoint",
    "gpt2_config",
    "gpt2_name",
    "linear_shapes",
    "llama_config",
    "llama_shapes",
    "lora_shapes",
    "module_path",
    "read_spec",
    "resolve_checkpoint",
    "write_weights",
]

log = logging.getLogger("swarmpipe.export")


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    merge: bool = False,
    base: str | Path | None = None,
    spec: RunSpec | str | Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> dict[str, Any]:
    """Write the checkpoint at ``checkpoint`` (a checkpoint root, whose ``latest`` is followed, or one
    ``ckpt-*`` folder) as a Hugging Face folder at ``out`` (absent or empty). ``spec`` (a RunSpec, or a
    spec file: TOML or JSON) replaces the checkpoint's ``spec.json``; ``base`` replaces the spec's
    ``model.checkpoint`` as the base folder (LoRA, tokenizer files). Returns a summary; raises
    :class:`ExportError`."""
    folder = resolve_checkpoint(checkpoint)
    run = read_spec(folder, spec)
    stages = StageFiles(folder, run)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"output folder {out} exists and is not empty")
    base_dir = base_folder(run, base)
    m, f = run.model, run.finetune
    if f.method == "lora" and m.family != "llama":
        raise ExportError(f"LoRA export supports the llama family only, not {m.family!r}")
    if merge and f.method != "lora":
        raise ExportError("--merge merges LoRA adapters into their base; this run trained every weight (method full)")
    if m.family == "bytegpt":
        fmt, expected = "gpt2", {s: (bytegpt_shapes(run, s), {}) for s in range(run.num_stages)}
    elif f.method == "lora":
        fmt, expected = ("merged" if merge else "peft"), {s: (lora_shapes(run, s), {}) for s in range(run.num_stages)}
    else:
        fmt, expected = "llama", {s: llama_shapes(run, s) for s in range(run.num_stages)}
    for s, (required, optional) in expected.items():
        stages.check(s, required, optional)

    with staged_folder(out) as tmp:
        if fmt == "gpt2":
            summary = write_gpt2(run, stages, tmp, max_shard_bytes)
        elif fmt == "llama":
            summary = write_llama(run, stages.tensors(), tmp, max_shard_bytes, base_dir)
        elif fmt == "peft":
            summary = write_peft(run, stages, tmp, base, base_dir)
        else:
            if base_dir is None:
                where = f" (the spec names {m.checkpoint!r}, not a folder here)" if m.checkpoint else ""
                raise ExportError(f"merging needs the base model folder: pass --base DIR{where}")
            summary = write_llama(run, merged(run, stages, base_dir), tmp, max_shard_bytes, base_dir)
    summary.update(
        format=fmt,
        checkpoint=str(folder),
        step=stages.step,
        out=str(out),
        files=sorted(p.name for p in out.iterdir()),
    )
    log.info("exported %s (step %s) to %s as %s", folder, stages.step, out, fmt)
    return summary
