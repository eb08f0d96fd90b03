"""bytegpt as ``GPT2LMHeadModel``: the same computation (learned positions, pre-norm blocks, exact GELU,
untied head), with GPT-2's names and its Conv1D weights, the transpose of ``nn.Linear``'s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from swarmpipe.coordinator.export.reader import Shapes, StageFiles
from swarmpipe.coordinator.export.writer import as_float, token_ids, weights_summary, write_json, write_weights
from swarmpipe.peer.spec import RunSpec

GPT2_BLOCK = {
    "ln1": "ln_1",
    "attn.qkv": "attn.c_attn",
    "attn.proj": "attn.c_proj",
    "ln2": "ln_2",
    "fc": "mlp.c_fc",
    "fc_out": "mlp.c_proj",
}
CONV1D = {"attn.qkv", "attn.proj", "fc", "fc_out"}  # GPT-2 stores these transposed
GPT2_TOP = {
    "tok_emb.weight": "transformer.wte.weight",
    "pos_emb.weight": "transformer.wpe.weight",
    "norm.weight": "transformer.ln_f.weight",
    "norm.bias": "transformer.ln_f.bias",
    "head.weight": "lm_head.weight",
}


def bytegpt_shapes(run: RunSpec, stage: int) -> Shapes:
    """``param.`` names -> shapes of one bytegpt stage (its blocks are numbered from 0 in each stage)."""
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


def gpt2_name(run: RunSpec, stage: int, name: str) -> tuple[str, bool]:
    """HF GPT-2 name of a bytegpt stage parameter, and whether its weight is transposed."""
    if name in GPT2_TOP:
        return GPT2_TOP[name], False
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
        **token_ids(run),
    }


def write_gpt2(run: RunSpec, stages: StageFiles, folder: Path, max_shard_bytes: int) -> dict[str, Any]:
    """A ``GPT2LMHeadModel`` folder from every stage of a bytegpt checkpoint."""
    tensors: dict[str, torch.Tensor] = {}
    for s in range(run.num_stages):
        for name, tensor in stages.stage_tensors(s):
            hf_name, transpose = gpt2_name(run, s, name)
            tensors[hf_name] = as_float(tensor.t() if transpose else tensor)
    write_json(folder / "config.json", gpt2_config(run))
    write_weights(tensors, folder, max_shard_bytes)
    return {
        "family": "bytegpt",
        "architecture": "GPT2LMHeadModel",
        "tie_word_embeddings": False,
        **weights_summary(tensors),
    }
