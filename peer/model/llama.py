"""The Llama-family decoder (Llama, Mistral, Qwen2) as pipeline stages, built from transformers' own layers.

The three architectures share one decoder: RoPE, RMSNorm, a SwiGLU MLP and grouped-query attention;
Qwen2 adds biases on q/k/v. A stage holds transformers' own decoder layers of the checkpoint's
architecture (``LlamaDecoderLayer``, ``MistralDecoderLayer``, ``Qwen2DecoderLayer``), so the arithmetic
is exactly ``LlamaForCausalLM``'s (and its siblings'); stage 0 adds the token embedding, the last stage
the final norm and the head.

Parameter names are the Hugging Face checkpoint's without the leading ``model.``
(``layers.<global index>.self_attn.q_proj.weight``, ``embed_tokens.weight``, ``norm.weight``,
``lm_head.weight``), so loading a stage from safetensors and exporting one are renames, not
conversions. Layers are keyed by their global index: replicas of one stage, checkpoints and exports
agree on every name.

Tied embeddings: when the first and the last stage are different peers, the head starts as a copy of
the embedding and the two train as separate copies (there is no cheap way to sum their gradients
across peers); export writes them tied only while they are still equal.
"""

from __future__ import annotations

import importlib
import json

import torch
from torch import nn

from swarmpipe.peer.spec import ModelSpec, RunSpec

EMBEDDING_SEED_OFFSET = 10_000
HEAD_SEED_OFFSET = 20_000
INIT_STD = 0.02  # transformers' initializer_range for these models


# hf_model_type -> transformers' module and class prefix: the same decoder, each with its own layer class
# (Qwen2 has biases on q/k/v but not on o; Mistral's sliding window never binds while seq_len fits in it)
ARCHITECTURES = {
    "llama": ("transformers.models.llama.modeling_llama", "Llama"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "Mistral"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
}


def llama_config(m: ModelSpec):
    """transformers' config for this spec (the attention runs through SDPA, causal, no mask)."""
    from transformers import AutoConfig

    rope = {"rope_theta": m.rope_theta, "rope_type": "default"}
    if m.rope_scaling:
        rope.update(json.loads(m.rope_scaling))
    config = AutoConfig.for_model(
        m.hf_model_type,
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        intermediate_size=m.intermediate_size or m.mlp_ratio * m.d_model,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.kv_heads(),
        head_dim=m.head_size(),
        max_position_embeddings=m.max_position or m.seq_len,
        rms_norm_eps=m.norm_eps,
        rope_parameters=rope,
        attention_bias=m.attention_bias,
        mlp_bias=m.mlp_bias,
        tie_word_embeddings=m.tie_embeddings,
        attention_dropout=0.0,
    )
    config._attn_implementation = "sdpa"
    return config


def layer_classes(m: ModelSpec) -> tuple[type, type, type]:
    """(decoder layer, RMSNorm, rotary embedding) classes of the spec's architecture."""
    module_name, prefix = ARCHITECTURES[m.hf_model_type]
    module = importlib.import_module(module_name)
    return tuple(getattr(module, f"{prefix}{kind}") for kind in ("DecoderLayer", "RMSNorm", "RotaryEmbedding"))


def _init_(module: nn.Module, seed: int) -> None:
    """transformers' init for these models (normal 0.02, zero biases, unit norms) from a private generator,
    so every replica of a layer starts identical without any global RNG state."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and not name.endswith("bias"):  # RMSNorm scales
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * INIT_STD)


class LlamaStage(nn.Module):
    """Layers ``block_range(stage)`` of a Llama-family model; stage 0 adds the embedding, the last stage the
    final norm and the head.

    Input: token ids ``[B, T]`` (int64) on stage 0, else hidden states ``[B, T, d_model]``.
    Output: logits ``[B, T, vocab]`` on the last stage, else hidden states.

    ``empty=True`` builds the parameters on the meta device (shapes only, no memory): the stage's weights
    come from a checkpoint afterwards, and a peer never holds a random copy next to the real one.
    """

    def __init__(self, spec: RunSpec, stage: int, empty: bool = False):
        super().__init__()
        if not 0 <= stage < spec.num_stages:
            raise ValueError(f"stage {stage} out of range for {spec.num_stages} stages")
        m = spec.model
        config = llama_config(m)
        decoder_layer, rms_norm, rotary = layer_classes(m)
        self.stage = stage
        self.is_first = stage == 0
        self.is_last = stage == spec.num_stages - 1
        self.block_indices = list(spec.block_range(stage))
        self.seq_len = m.seq_len
        self.d_model = m.d_model
        seed = spec.seed * 100_003
        with torch.device("meta" if empty else "cpu"):
            if self.is_first:
                self.embed_tokens = nn.Embedding(m.vocab_size, m.d_model)
            self.layers = nn.ModuleDict({str(i): decoder_layer(config, layer_idx=i) for i in self.block_indices})
            if self.is_last:
                self.norm = rms_norm(m.d_model, eps=m.norm_eps)
                self.lm_head = nn.Linear(m.d_model, m.vocab_size, bias=False)
        self.rotary_emb = rotary(config)  # buffers only, computed from the config
        if not empty:
            if self.is_first:
                _init_(self.embed_tokens, seed + EMBEDDING_SEED_OFFSET)
            for i in self.block_indices:
                _init_(self.layers[str(i)], seed + i)
            if self.is_last:
                _init_(self.norm, 0)
                # tied: the head starts as the embedding (same generator), as in the tied whole model
                _init_(self.lm_head, seed + (EMBEDDING_SEED_OFFSET if m.tie_embeddings else HEAD_SEED_OFFSET))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.embed_tokens(x)
        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(x, position_ids)
        for layer in self.layers.values():
            x = layer(x, position_ids=position_ids, position_embeddings=position_embeddings)
        if self.is_last:
            x = self.lm_head(self.norm(x))
        return x


def build_stage(spec: RunSpec, stage: int, empty: bool = False) -> LlamaStage:
    return LlamaStage(spec, stage, empty=empty)


def checkpoint_name(spec: RunSpec, name: str) -> str:
    """The Hugging Face checkpoint's name for a stage parameter (a tied head reads the embedding: tied
    checkpoints store it once)."""
    if name == "lm_head.weight":
        return "model.embed_tokens.weight" if spec.model.tie_embeddings else name
    return f"model.{name}"
