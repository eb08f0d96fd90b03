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

import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from swarmpipe.peer.spec import RunSpec, load_spec, spec_from_dict

log = logging.getLogger("swarmpipe.export")

SPEC_FILE = "spec.json"
MAX_SHARD_BYTES = 2 * 1024**3
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
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
PEFT_PREFIX = "base_model.model.model."

Shapes = dict[str, tuple[int, ...]]


class ExportError(ValueError):
    """A checkpoint that cannot be exported: missing stage or tensor, wrong shape, wrong base, no spec."""


# ---------------------------------------------------------------------------------------------------------------------
# Entry point


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
    base_dir = _base_folder(run, base)
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

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if fmt == "gpt2":
            summary = _write_gpt2(run, stages, tmp, max_shard_bytes)
        elif fmt == "llama":
            summary = _write_llama(run, stages.tensors(), tmp, max_shard_bytes, base_dir)
        elif fmt == "peft":
            summary = _write_peft(run, stages, tmp, base, base_dir)
        else:
            if base_dir is None:
                where = f" (the spec names {m.checkpoint!r}, not a folder here)" if m.checkpoint else ""
                raise ExportError(f"merging needs the base model folder: pass --base DIR{where}")
            summary = _write_llama(run, _merged(run, stages, base_dir), tmp, max_shard_bytes, base_dir)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary.update(
        format=fmt,
        checkpoint=str(folder),
        step=stages.step,
        out=str(out),
        files=sorted(p.name for p in out.iterdir()),
    )
    log.info("exported %s (step %s) to %s as %s", folder, stages.step, out, fmt)
    return summary


# ---------------------------------------------------------------------------------------------------------------------
# Reading the checkpoint


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint root (follow ``latest``) or one ``ckpt-*`` folder -> the checkpoint folder."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"no checkpoint folder at {path}")
    latest = path / "latest"
    if latest.is_file():
        name = latest.read_text().strip()
        if not name or not (path / name).is_dir():
            raise ExportError(f"{latest} names {name!r}, which is not a folder in {path}")
        return path / name
    if (path / "manifest.json").is_file() or any(path.glob("stage-*.safetensors")):
        return path
    raise ExportError(f"{path} is neither a checkpoint root (no `latest`) nor a checkpoint folder (no stage files)")


def read_spec(folder: Path, spec: RunSpec | str | Path | None = None) -> RunSpec:
    """The explicit ``spec`` (object or file), else the checkpoint's ``spec.json``."""
    if isinstance(spec, RunSpec):
        try:
            return spec.validate()
        except ValueError as e:
            raise ExportError(f"cannot use the spec: {e}") from e
    path = Path(spec) if spec is not None else folder / SPEC_FILE
    if not path.is_file():
        if spec is not None:
            raise ExportError(f"no spec file at {path}")
        raise ExportError(f"{folder} has no {SPEC_FILE}: this checkpoint predates spec.json; pass --spec")
    try:
        if path.suffix == ".json":
            return spec_from_dict(json.loads(path.read_text()))
        return load_spec(path)
    except (ValueError, OSError) as e:
        raise ExportError(f"cannot use the spec in {path}: {e}") from e


class StageFiles:
    """The stage files of one checkpoint folder, opened lazily; only ``param.*`` tensors are read."""

    def __init__(self, folder: Path, spec: RunSpec):
        self.folder = folder
        self.spec = spec
        self.step: int | None = None
        manifest = folder / "manifest.json"
        if manifest.is_file():
            self.step = int(json.loads(manifest.read_text()).get("step", 0))
        self.paths: list[Path] = []
        for s in range(spec.num_stages):
            path = folder / f"stage-{s}.safetensors"
            if not path.is_file():
                raise ExportError(
                    f"stage {s} of {spec.num_stages} is missing from {folder} (no {path.name}): "
                    "no replica of it was ever checkpointed; export an older or a later checkpoint"
                )
            self._check_meta(s, folder / f"stage-{s}.json")
            self.paths.append(path)

    def _check_meta(self, stage: int, path: Path) -> None:
        if not path.is_file():
            return
        try:
            meta = json.loads(path.read_text())
        except ValueError as e:
            raise ExportError(f"{path} is not JSON: {e}") from e
        if "stage" in meta and int(meta["stage"]) != stage:
            raise ExportError(f"{path} holds stage {meta['stage']}, not stage {stage}")
        digest = meta.get("base_digest")
        if digest and digest != self.spec.model.base_digest:
            raise ExportError(
                f"stage {stage} was trained on base {digest!r}, but the spec names base "
                f"{self.spec.model.base_digest or '(none)'!r}: these adapters belong to another base model"
            )

    def shapes(self, stage: int) -> Shapes:
        with safe_open(str(self.paths[stage]), framework="pt") as f:
            return {k[6:]: tuple(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith("param.")}

    def check(self, stage: int, required: Shapes, optional: Shapes) -> None:
        found = self.shapes(stage)
        where = f"stage {stage} ({self.paths[stage]})"
        missing = [n for n in required if n not in found]
        if missing:
            raise ExportError(f"{where} lacks {_some(missing)}: the checkpoint does not match the spec")
        unexpected = [n for n in found if n not in required and n not in optional]
        if unexpected:
            raise ExportError(
                f"{where} holds unexpected tensor(s) {_some(unexpected)}: the spec does not describe them"
            )
        wrong = [
            f"{n} {list(found[n])} (expected {list(shape)})"
            for n, shape in {**required, **optional}.items()
            if n in found and found[n] != shape
        ]
        if wrong:
            raise ExportError(f"{where} has tensor(s) of the wrong shape: {_some(wrong)}")

    def stage_tensors(self, stage: int) -> Iterator[tuple[str, torch.Tensor]]:
        with safe_open(str(self.paths[stage]), framework="pt") as f:
            for key in f.keys():
                if key.startswith("param."):
                    yield key[6:], f.get_tensor(key)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every stage in order, one tensor at a time."""
        for s in range(self.spec.num_stages):
            yield from self.stage_tensors(s)


def _some(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# ---------------------------------------------------------------------------------------------------------------------
# Expected names and shapes


def linear_shapes(run: RunSpec) -> dict[str, tuple[int, int]]:
    """nn.Linear weight shape (out, in) of each llama projection, by its last name."""
    m = run.model
    d, hd, inner = m.d_model, m.head_size(), m.intermediate_size or m.mlp_ratio * m.d_model
    q, kv = m.n_heads * hd, m.kv_heads() * hd
    return {
        "q_proj": (q, d),
        "k_proj": (kv, d),
        "v_proj": (kv, d),
        "o_proj": (d, q),
        "gate_proj": (inner, d),
        "up_proj": (inner, d),
        "down_proj": (d, inner),
    }


def module_path(target: str) -> str:
    if target in ATTENTION:
        return f"self_attn.{target}"
    if target in MLP:
        return f"mlp.{target}"
    raise ExportError(f"unknown LoRA target {target!r}; known: {', '.join(ATTENTION + MLP)}")


def _model_type(run: RunSpec) -> str:
    kind = run.model.hf_model_type
    if kind not in ARCHITECTURES:
        raise ExportError(f"unknown hf_model_type {kind!r}; known: {', '.join(ARCHITECTURES)}")
    return kind


def bias_projections(run: RunSpec) -> tuple[set[str], set[str]]:
    """(required, optional) projections with a bias, as peer/model/llama.py builds each class's own
    decoder layer: Llama as its config says (``attention_bias``: q/k/v and o; the o one optional here,
    zeros compute the same as none), Qwen2 always q/k/v, Mistral none."""
    m, kind = run.model, _model_type(run)
    if kind == "qwen2":
        return {"q_proj", "k_proj", "v_proj"}, set()
    if kind == "mistral":
        return set(), set()
    required = ({"q_proj", "k_proj", "v_proj"} if m.attention_bias else set()) | (set(MLP) if m.mlp_bias else set())
    return required, ({"o_proj"} if m.attention_bias else set())


def llama_shapes(run: RunSpec, stage: int) -> tuple[Shapes, Shapes]:
    """(required, optional) ``param.`` names -> shapes of one stage of the llama family."""
    m, shapes = run.model, linear_shapes(run)
    with_bias, maybe_bias = bias_projections(run)
    d, required = m.d_model, {}
    if stage == 0:
        required["embed_tokens.weight"] = (m.vocab_size, d)
    optional: Shapes = {}
    for i in run.block_range(stage):
        p = f"layers.{i}"
        for name in ATTENTION + MLP:
            required[f"{p}.{module_path(name)}.weight"] = shapes[name]
            if name in with_bias:
                required[f"{p}.{module_path(name)}.bias"] = (shapes[name][0],)
            elif name in maybe_bias:
                optional[f"{p}.{module_path(name)}.bias"] = (shapes[name][0],)
        required[f"{p}.input_layernorm.weight"] = (d,)
        required[f"{p}.post_attention_layernorm.weight"] = (d,)
    if stage == run.num_stages - 1:
        required["norm.weight"] = (d,)
        required["lm_head.weight"] = (m.vocab_size, d)
    return required, optional


def lora_shapes(run: RunSpec, stage: int) -> Shapes:
    f, shapes = run.finetune, linear_shapes(run)
    _model_type(run)
    required: Shapes = {}
    for i in run.block_range(stage):
        for target in f.lora_targets:
            name = f"layers.{i}.{module_path(target)}"
            out_features, in_features = shapes[target]
            required[f"{name}.lora_A"] = (f.lora_rank, in_features)
            required[f"{name}.lora_B"] = (out_features, f.lora_rank)
    return required


def bytegpt_shapes(run: RunSpec, stage: int) -> Shapes:
    m = run.model
    d, inner = m.d_model, m.mlp_ratio * m.d_model
    required: Shapes = {}
    if stage == 0:
        required.update({"tok_emb.weight": (m.vocab_size, d), "pos_emb.weight": (m.seq_len, d)})
    block = {
        "ln1.weight": (d,),
        "ln1.bias": (d,),
        "attn.qkv.weight": (3 * d, d),
        "attn.qkv.bias": (3 * d,),
        "attn.proj.weight": (d, d),
        "attn.proj.bias": (d,),
        "ln2.weight": (d,),
        "ln2.bias": (d,),
        "fc.weight": (inner, d),
        "fc.bias": (inner,),
        "fc_out.weight": (d, inner),
        "fc_out.bias": (d,),
    }
    for j in range(len(run.block_range(stage))):
        required.update({f"blocks.{j}.{k}": v for k, v in block.items()})
    if stage == run.num_stages - 1:
        required.update({"norm.weight": (d,), "norm.bias": (d,), "head.weight": (m.vocab_size, d)})
    return required


# ---------------------------------------------------------------------------------------------------------------------
# Writing


def _float(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous() if t.is_floating_point() else t.contiguous()


def write_weights(tensors: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> int:
    """``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` shards and their index above
    ``max_shard_bytes``. Returns the bytes written."""
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    total = sum(sizes.values())
    if total <= max_shard_bytes:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
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
        save_file({n: tensors[n] for n in names}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _base_folder(run: RunSpec, base: str | Path | None) -> Path | None:
    if base is not None and str(base):
        path = Path(base)
        if not (path / "config.json").is_file():
            raise ExportError(f"--base {path} is not a Hugging Face model folder (no config.json)")
        return path
    if run.model.checkpoint and (Path(run.model.checkpoint) / "config.json").is_file():
        return Path(run.model.checkpoint)
    return None


def _copy_base_files(base_dir: Path | None, folder: Path, generation: bool) -> list[str]:
    if base_dir is None:
        return []
    names = [
        n for n in TOKENIZER_FILES + (("generation_config.json",) if generation else ()) if (base_dir / n).is_file()
    ]
    for name in names:
        shutil.copy2(base_dir / name, folder / name)
    return names


def _token_ids(run: RunSpec) -> dict[str, int | None]:
    m = run.model
    return {
        "bos_token_id": m.bos_token_id if m.bos_token_id >= 0 else None,
        "eos_token_id": m.eos_token_id if m.eos_token_id >= 0 else None,
    }


def _rope_scaling(run: RunSpec) -> dict[str, Any] | None:
    text = run.model.rope_scaling.strip()
    if not text:
        return None
    try:
        scaling = json.loads(text)
    except ValueError as e:
        raise ExportError(f"model.rope_scaling is not JSON: {e}") from e
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ExportError(f"model.rope_scaling must be a JSON object, got {text!r}")
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}  # written as its own field
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return None
    return scaling


def llama_config(run: RunSpec, tie: bool, base_dir: Path | None = None) -> dict[str, Any]:
    """config.json for the spec's ``hf_model_type``: legacy ``rope_theta``/``rope_scaling`` keys, which
    transformers 4.x reads as they are and 5.x converts into ``rope_parameters``. A sliding window (and
    ``pad_token_id``) comes from the base folder's config when it is here: the spec does not keep it (the
    run trained within the window)."""
    m = run.model
    kind = _model_type(run)
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.intermediate_size or m.mlp_ratio * m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads(),
        "head_dim": m.head_size(),
        "hidden_act": "silu",
        "max_position_embeddings": m.max_position or m.seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": _rope_scaling(run),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": tie,
        "use_cache": True,
        "torch_dtype": "float32",
        **_token_ids(run),
    }
    if kind == "llama":
        config.update(attention_bias=m.attention_bias, mlp_bias=m.mlp_bias, pretraining_tp=1)
    elif kind == "mistral":
        config.update(sliding_window=None)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.n_layers)
    base_config = _base_config(base_dir)
    if base_config.get("model_type") == kind:
        keep = ("sliding_window", "use_sliding_window", "max_window_layers", "pad_token_id")
        config.update({k: base_config[k] for k in keep if k in base_config})
    return config


def _base_config(base_dir: Path | None) -> dict[str, Any]:
    if base_dir is None:
        return {}
    try:
        config = json.loads((base_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _write_llama(
    run: RunSpec,
    named: Iterator[tuple[str, torch.Tensor]],
    folder: Path,
    max_shard_bytes: int,
    base_dir: Path | None,
) -> dict[str, Any]:
    """A full model folder from (swarmpipe name, tensor) pairs of the whole llama model."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        tensors[name if name == "lm_head.weight" else f"model.{name}"] = _float(tensor)
    shapes = linear_shapes(run)
    for i in range(run.model.n_layers):  # a bias the class has and the trained model lacks: zeros
        for proj in bias_projections(run)[1]:
            tensors.setdefault(f"model.layers.{i}.{module_path(proj)}.bias", torch.zeros(shapes[proj][0]))
    head, embed = tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]
    tie = head.dtype == embed.dtype and torch.equal(head, embed)
    if tie:
        del tensors["lm_head.weight"]
    config = llama_config(run, tie, base_dir)
    _write_json(folder / "config.json", config)
    copied = _copy_base_files(base_dir, folder, generation=True)
    if "generation_config.json" not in copied and any(v is not None for v in _token_ids(run).values()):
        _write_json(folder / "generation_config.json", _token_ids(run))
    size = write_weights(tensors, folder, max_shard_bytes)
    return {
        "family": "llama",
        "architecture": config["architectures"][0],
        "tie_word_embeddings": tie,
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
        "bytes": size,
    }


def _write_peft(
    run: RunSpec, stages: StageFiles, folder: Path, base: str | Path | None, base_dir: Path | None
) -> dict[str, Any]:
    f = run.finetune
    if base_dir is not None:
        _check_base(run, base_dir)
    tensors = {f"{PEFT_PREFIX}{name}.weight": _float(t) for name, t in stages.tensors()}
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
    _write_json(folder / "adapter_config.json", config)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    _copy_base_files(base_dir, folder, generation=False)
    return {
        "family": "llama",
        "architecture": "PEFT LoRA adapter",
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "base": base_name,
    }


# ---------------------------------------------------------------------------------------------------------------------
# The base model (LoRA)


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


def _base_expected(run: RunSpec) -> Shapes:
    """HF names -> shapes the base must hold (``lm_head.weight`` may be absent: a tied base)."""
    expected: Shapes = {}
    for s in range(run.num_stages):
        required, optional = llama_shapes(run, s)
        for name, shape in {**required, **optional}.items():
            expected[name if name == "lm_head.weight" else f"model.{name}"] = shape
    return expected


def _check_base(run: RunSpec, base_dir: Path) -> tuple[dict[str, Path], Shapes]:
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
    expected = _base_expected(run)
    optional = {"lm_head.weight"}
    for s in range(run.num_stages):
        optional.update(f"model.{n}" for n in llama_shapes(run, s)[1])
    missing = [n for n in expected if n not in index and n not in optional]
    if missing:
        raise ExportError(f"the base folder {base_dir} lacks {_some(missing)}: it is not the base the spec describes")
    wrong = []
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for name, shape in expected.items():
            if name not in index:
                continue
            path = index[name]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            found = tuple(handles[path].get_slice(name).get_shape())
            if found != shape:
                wrong.append(f"{name} {list(found)} (expected {list(shape)})")
    if wrong:
        raise ExportError(f"the base folder {base_dir} does not match the spec: {_some(wrong)}")
    return index, expected


def _merged(run: RunSpec, stages: StageFiles, base_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(swarmpipe name, merged weight) for the whole model: base tensors one at a time, plus
    ``scaling * B @ A`` on every adapted projection."""
    index, expected = _check_base(run, base_dir)
    adapters = dict(stages.tensors())
    scaling = run.finetune.lora_alpha / run.finetune.lora_rank
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def read(name: str) -> torch.Tensor:
            path = index[name]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            return handles[path].get_tensor(name).float()

        for hf_name in expected:
            if hf_name not in index:
                if hf_name == "lm_head.weight":  # a tied base: the head is the embedding
                    yield "lm_head.weight", read("model.embed_tokens.weight")
                continue  # an optional bias the base lacks (_write_llama adds zeros where needed)
            name = hf_name if hf_name == "lm_head.weight" else hf_name[len("model.") :]
            weight = read(hf_name)
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and f"{module}.lora_A" in adapters:
                a = adapters.pop(f"{module}.lora_A").float()
                b = adapters.pop(f"{module}.lora_B").float()
                weight = weight + scaling * (b @ a)
            yield name, weight
    if adapters:
        raise ExportError(f"adapters without a base weight: {_some(sorted(adapters))}")


# ---------------------------------------------------------------------------------------------------------------------
# bytegpt -> GPT-2

GPT2_BLOCK = {
    "ln1": "ln_1",
    "attn.qkv": "attn.c_attn",
    "attn.proj": "attn.c_proj",
    "ln2": "ln_2",
    "fc": "mlp.c_fc",
    "fc_out": "mlp.c_proj",
}
CONV1D = {"attn.qkv", "attn.proj", "fc", "fc_out"}  # GPT-2 stores these transposed


def gpt2_name(run: RunSpec, stage: int, name: str) -> tuple[str, bool]:
    """HF GPT-2 name of a bytegpt stage parameter, and whether its weight is transposed."""
    top = {
        "tok_emb.weight": "transformer.wte.weight",
        "pos_emb.weight": "transformer.wpe.weight",
        "norm.weight": "transformer.ln_f.weight",
        "norm.bias": "transformer.ln_f.bias",
        "head.weight": "lm_head.weight",
    }
    if name in top:
        return top[name], False
    _, local, rest = name.split(".", 2)  # blocks.<local j>.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    index = run.block_range(stage)[int(local)]
    return f"transformer.h.{index}.{GPT2_BLOCK[module]}.{kind}", module in CONV1D and kind == "weight"


def gpt2_config(run: RunSpec) -> dict[str, Any]:
    m = run.model
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": m.vocab_size,
        "n_positions": m.seq_len,
        "n_embd": m.d_model,
        "n_layer": m.n_layers,
        "n_head": m.n_heads,
        "n_inner": m.mlp_ratio * m.d_model,
        "activation_function": "gelu",  # bytegpt: F.gelu, the exact (erf) GELU
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "summary_first_dropout": 0.0,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": "float32",
        **_token_ids(run),
    }


def _write_gpt2(run: RunSpec, stages: StageFiles, folder: Path, max_shard_bytes: int) -> dict[str, Any]:
    tensors: dict[str, torch.Tensor] = {}
    for s in range(run.num_stages):
        for name, tensor in stages.stage_tensors(s):
            hf_name, transpose = gpt2_name(run, s, name)
            tensors[hf_name] = _float(tensor.t() if transpose else tensor)
    _write_json(folder / "config.json", gpt2_config(run))
    size = write_weights(tensors, folder, max_shard_bytes)
    return {
        "family": "bytegpt",
        "architecture": "GPT2LMHeadModel",
        "tie_word_embeddings": False,
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
        "bytes": size,
    }
