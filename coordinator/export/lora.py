"""LoRA runs of the llama family: the adapter names and shapes a stage holds, a PEFT adapter folder, and
the weights merged into the base folder's (``base + lora_alpha / lora_rank * B @ A``), after checking
that the base is the one the run trained on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from swarmpipe.coordinator.export.llama import (
    HEAD,
    hf_name,
    linear_shapes,
    llama_shapes,
    model_type,
    module_path,
    swarm_name,
)
from swarmpipe.coordinator.export.reader import (
    ExportError,
    OpenFiles,
    Shapes,
    StageFiles,
    some_names,
    wrong_shapes,
)
from swarmpipe.coordinator.export.writer import as_float, copy_base_files, save_tensors, weights_summary, write_json
from swarmpipe.peer.spec import RunSpec

PEFT_PREFIX = "base_model.model.model."


def lora_shapes(run: RunSpec, stage: int) -> Shapes:
    """``param.`` names -> shapes of one stage's adapters: ``lora_A`` (rank, in), ``lora_B`` (out, rank)."""
    f, shapes = run.finetune, linear_shapes(run)
    model_type(run)  # refuse an unknown hf_model_type before anything is read
    required: Shapes = {}
    for i in run.block_range(stage):
        for target in f.lora_targets:
            name = f"layers.{i}.{module_path(target)}"
            out_features, in_features = shapes[target]
            required[f"{name}.lora_A"] = (f.lora_rank, in_features)
            required[f"{name}.lora_B"] = (out_features, f.lora_rank)
    return required


def write_peft(
    run: RunSpec, stages: StageFiles, folder: Path, base: str | Path | None, base_dir: Path | None
) -> dict[str, Any]:
    """A PEFT adapter folder for ``PeftModel.from_pretrained(base, folder)``; the base is checked when it
    is on this machine."""
    f = run.finetune
    if base_dir is not None:
        check_base(run, base_dir)
    tensors = {f"{PEFT_PREFIX}{name}.weight": as_float(t) for name, t in stages.tensors()}
    base_name = str(base_dir.resolve()) if base_dir is not None else str(base or run.model.checkpoint)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": f.lora_rank,
        "lora_alpha": f.lora_alpha,
        "lora_dropout": f.lora_dropout,
        "target_modules": sorted(set(f.lora_targets)),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "revision": None,
    }
    write_json(folder / "adapter_config.json", config)
    save_tensors(tensors, folder / "adapter_model.safetensors")
    copy_base_files(base_dir, folder, generation=False)
    return {"family": "llama", "architecture": "PEFT LoRA adapter", **weights_summary(tensors), "base": base_name}


def _base_index(base_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file of the base folder that holds it."""
    index = base_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: base_dir / file for name, file in weight_map.items()}
    files = sorted(base_dir.glob("*.safetensors"))
    if not files:
        raise ExportError(f"the base folder {base_dir} holds no *.safetensors weights")
    found: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            found.update(dict.fromkeys(f.keys(), path))
    return found


def _base_expected(run: RunSpec) -> tuple[Shapes, set[str]]:
    """HF names -> shapes the base must hold, and the names it may lack: the head (a tied base) and the
    optional biases."""
    expected: Shapes = {}
    optional = {HEAD}
    for s in range(run.num_stages):
        required, maybe = llama_shapes(run, s)
        expected.update({hf_name(name): shape for name, shape in {**required, **maybe}.items()})
        optional.update(hf_name(name) for name in maybe)
    return expected, optional


def check_base(run: RunSpec, base_dir: Path) -> tuple[dict[str, Path], Shapes]:
    """The base folder is the one the run trained on (its digest, when the spec has one) and holds every
    tensor the spec describes with its shape. Returns (tensor -> file, expected HF names -> shapes)."""
    if run.model.base_digest:
        from swarmpipe.peer.model.hf_checkpoint import HFCheckpoint

        try:
            digest = HFCheckpoint.open(base_dir).digest()
        except ValueError as e:
            raise ExportError(f"cannot use the base folder {base_dir}: {e}") from e
        if digest != run.model.base_digest:
            raise ExportError(
                f"the base folder {base_dir} has digest {digest!r}, but the run trained on base "
                f"{run.model.base_digest!r}: pass --base with the run's base model"
            )
    index = _base_index(base_dir)
    expected, optional = _base_expected(run)
    missing = [n for n in expected if n not in index and n not in optional]
    if missing:
        raise ExportError(
            f"the base folder {base_dir} lacks {some_names(missing)}: it is not the base the spec describes"
        )
    with OpenFiles() as files:
        found = {n: tuple(files.get(index[n]).get_slice(n).get_shape()) for n in expected if n in index}
    wrong = wrong_shapes(found, expected)
    if wrong:
        raise ExportError(f"the base folder {base_dir} does not match the spec: {some_names(wrong)}")
    return index, expected


def merged(run: RunSpec, stages: StageFiles, base_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(swarmpipe name, merged weight) for the whole model: base tensors one at a time, plus
    ``scaling * B @ A`` on every adapted projection."""
    index, expected = check_base(run, base_dir)
    adapters = dict(stages.tensors())
    scaling = run.finetune.lora_alpha / run.finetune.lora_rank
    with OpenFiles() as files:

        def read(hf: str) -> torch.Tensor:
            return files.get(index[hf]).get_tensor(hf).float()

        for hf in expected:
            if hf not in index:
                if hf == HEAD:  # a tied base: the head is the embedding
                    yield HEAD, read("model.embed_tokens.weight")
                continue  # an optional bias the base lacks (write_llama adds zeros where needed)
            name = swarm_name(hf)
            weight = read(hf)
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and f"{module}.lora_A" in adapters:
                a = adapters.pop(f"{module}.lora_A").float()
                b = adapters.pop(f"{module}.lora_B").float()
                weight = weight + scaling * (b @ a)
            yield name, weight
    if adapters:
        raise ExportError(f"adapters without a base weight: {some_names(sorted(adapters))}")
