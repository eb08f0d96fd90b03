"""A byte-level GPT, built whole or as one pipeline stage.

Every block is initialised from its own seed (run seed, block index), so a
stage built alone has exactly the weights the same blocks have in the whole
model, and every fresh replica of a stage starts identical.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from swarmpipe.peer.spec import ModelSpec, RunSpec

EMBEDDING_SEED_OFFSET = 10_000
HEAD_SEED_OFFSET = 20_000


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelSpec):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: ModelSpec):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.fc_out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


def _init_(module: nn.Module, seed: int, n_layers: int) -> None:
    """GPT-2 style init from a private generator: independent of global RNG state.

    Decided by module type, not parameter name (a bare LayerNorm's parameters are
    just ``weight``/``bias``); residual output projections get the scaled std.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, sub in module.named_modules():
            if isinstance(sub, nn.LayerNorm):
                sub.weight.fill_(1.0)
                sub.bias.zero_()
            elif isinstance(sub, (nn.Linear, nn.Embedding)):
                residual = name.endswith(("proj", "fc_out"))
                std = 0.02 / math.sqrt(2 * n_layers) if residual else 0.02
                sub.weight.copy_(torch.randn(sub.weight.shape, generator=gen) * std)
                if getattr(sub, "bias", None) is not None:
                    sub.bias.zero_()


class PipelineStage(nn.Module):
    """Blocks ``first..last`` of the model; stage 0 adds embeddings, the last stage norm and head.

    Input: token ids ``[B, T]`` (int64) on stage 0, else hidden states ``[B, T, D]``.
    Output: logits ``[B, T, V]`` on the last stage, else hidden states.
    """

    def __init__(self, spec: RunSpec, stage: int):
        super().__init__()
        if not 0 <= stage < spec.num_stages:
            raise ValueError(f"stage {stage} out of range for {spec.num_stages} stages")
        cfg = spec.model
        self.stage = stage
        self.is_first = stage == 0
        self.is_last = stage == spec.num_stages - 1
        self.block_indices = list(spec.block_range(stage))
        if self.is_first:
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
            _init_(self.tok_emb, spec.seed * 100_003 + EMBEDDING_SEED_OFFSET, cfg.n_layers)
            _init_(self.pos_emb, spec.seed * 100_003 + EMBEDDING_SEED_OFFSET + 1, cfg.n_layers)
        self.blocks = nn.ModuleList()
        for index in self.block_indices:
            block = Block(cfg)
            _init_(block, spec.seed * 100_003 + index, cfg.n_layers)
            self.blocks.append(block)
        if self.is_last:
            self.norm = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            _init_(self.norm, 0, cfg.n_layers)
            _init_(self.head, spec.seed * 100_003 + HEAD_SEED_OFFSET, cfg.n_layers)
        self.seq_len = cfg.seq_len
        self.d_model = cfg.d_model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            t = x.shape[1]
            x = self.tok_emb(x) + self.pos_emb(torch.arange(t, device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            x = self.head(self.norm(x))
        return x

    def input_spec(self) -> tuple[torch.dtype, int]:
        """(dtype, rank) this stage accepts: token ids on stage 0, hidden states elsewhere."""
        return (torch.int64, 2) if self.is_first else (torch.float32, 3)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class ByteGPT(nn.Module):
    """The whole model as a chain of all stages (used by tests and the delay simulator)."""

    def __init__(self, spec: RunSpec):
        super().__init__()
        self.stages = nn.ModuleList(PipelineStage(spec, s) for s in range(spec.num_stages))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for stage in self.stages:
            x = stage(x)
        return x


def build_stage(spec: RunSpec, stage: int, empty: bool = False) -> PipelineStage:
    """``empty`` is for families with checkpoints; byte-level stages always start from the run's seed."""
    return PipelineStage(spec, stage)
