"""The llama family (``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM``): the names and
shapes a stage holds, ``config.json`` for the spec's ``hf_model_type``, and a full model folder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from swarmpipe.coordinator.export.reader import ExportError, Shapes
from swarmpipe.coordinator.export.writer import (
    as_float,
    copy_base_files,
    token_ids,
    weights_summary,
    write_json,
    write_weights,
)
from swarmpipe.peer.spec import RunSpec

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
HEAD = "lm_head.weight"  # the one tensor outside ``model.`` in a Hugging Face llama


def hf_name(name: str) -> str:
    """The Hugging Face name of a swarmpipe llama parameter."""
    return name if name == HEAD else f"model.{name}"


def swarm_name(hf: str) -> str:
    """The swarmpipe name of a Hugging Face llama tensor (the inverse of :func:`hf_name`)."""
    return hf if hf == HEAD else hf.removeprefix("model.")


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


def model_type(run: RunSpec) -> str:
    """The spec's ``hf_model_type``, refused unless it is one of :data:`ARCHITECTURES`."""
    kind = run.model.hf_model_type
    if kind not in ARCHITECTURES:
        raise ExportError(f"unknown hf_model_type {kind!r}; known: {', '.join(ARCHITECTURES)}")
    return kind


def bias_projections(run: RunSpec) -> tuple[set[str], set[str]]:
    """(required, optional) projections with a bias, as peer/model/llama.py builds each class's own
    decoder layer: Llama as its config says (``attention_bias``: q/k/v and o; the o one optional here,
    zeros compute the same as none), Qwen2 always q/k/v, Mistral none."""
    m, kind = run.model, model_type(run)
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
        required[HEAD] = (m.vocab_size, d)
    return required, optional


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


def _base_config(base_dir: Path | None) -> dict[str, Any]:
    if base_dir is None:
        return {}
    try:
        config = json.loads((base_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def llama_config(run: RunSpec, tie: bool, base_dir: Path | None = None) -> dict[str, Any]:
    """config.json for the spec's ``hf_model_type``: legacy ``rope_theta``/``rope_scaling`` keys, which
    transformers 4.x reads as they are and 5.x converts into ``rope_parameters``. A sliding window (and
    ``pad_token_id``) comes from the base folder's config when it is here: the spec does not keep it (the
    run trained within the window)."""
    m = run.model
    kind = model_type(run)
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
        **token_ids(run),
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


def write_llama(
    run: RunSpec,
    named: Iterator[tuple[str, torch.Tensor]],
    folder: Path,
    max_shard_bytes: int,
    base_dir: Path | None,
) -> dict[str, Any]:
    """A full model folder from (swarmpipe name, tensor) pairs of the whole llama model."""
    tensors = {hf_name(name): as_float(tensor) for name, tensor in named}
    shapes, maybe_bias = linear_shapes(run), bias_projections(run)[1]
    for i in range(run.model.n_layers):  # a bias the class has and the trained model lacks: zeros
        for proj in maybe_bias:
            tensors.setdefault(f"model.layers.{i}.{module_path(proj)}.bias", torch.zeros(shapes[proj][0]))
    head, embed = tensors[HEAD], tensors["model.embed_tokens.weight"]
    tie = head.dtype == embed.dtype and torch.equal(head, embed)
    if tie:
        del tensors[HEAD]
    config = llama_config(run, tie, base_dir)
    write_json(folder / "config.json", config)
    copied = copy_base_files(base_dir, folder, generation=True)
    if "generation_config.json" not in copied and any(v is not None for v in token_ids(run).values()):
        write_json(folder / "generation_config.json", token_ids(run))
    write_weights(tensors, folder, max_shard_bytes)
    return {
        "family": "llama",
        "architecture": config["architectures"][0],
        "tie_word_embeddings": tie,
        **weights_summary(tensors),
    }
