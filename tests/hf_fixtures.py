"""Tiny Hugging Face artifacts built offline for tests: a BPE tokenizer trained on local text.

Kept small and importable on its own (transformers and tokenizers are imported inside the helpers).
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterable
from pathlib import Path

STDLIB_SAMPLES = ("textwrap.py", "json/encoder.py", "csv.py")  # small, stable, present everywhere


def stdlib_texts(names: Iterable[str] = STDLIB_SAMPLES) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / name).read_text(encoding="utf-8") for name in names]


def make_tokenizer(folder: str | Path, texts: Iterable[str] | None = None, vocab_size: int = 384) -> Path:
    """Train a byte-level BPE tokenizer of ``vocab_size`` tokens (at least 260: the 256 byte symbols
    and 4 specials) on ``texts`` (default: a few stdlib modules) and save it as a transformers
    ``PreTrainedTokenizerFast`` folder with pad/bos/eos/unk tokens (ids 0..3). Returns the folder."""
    from swarmpipe.peer.model.tiny import train_tokenizer

    tokenizer = train_tokenizer(list(texts) if texts is not None else stdlib_texts(), vocab_size)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))
    return folder


def make_tiny_llama(
    folder: str | Path,
    *,
    tie: bool = False,
    kv_heads: int = 2,
    layers: int = 3,
    vocab: int = 97,
    hidden: int = 32,
    heads: int = 4,
    intermediate: int = 64,
    model_type: str = "llama",
    seed: int = 0,
    **config: object,
):
    """Save a tiny random ``LlamaForCausalLM`` (or ``mistral`` / ``qwen2``, by ``model_type``) to ``folder``
    as safetensors; every weight random (norm scales around 1, biases nonzero), so a wrong mapping shows
    in the logits. ``config``: more config fields (e.g. ``attention_bias=True``). Returns its config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        **config,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
    folder = Path(folder)
    model.save_pretrained(str(folder))
    return model.config
