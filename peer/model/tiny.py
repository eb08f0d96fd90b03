"""A small random Llama checkpoint with its own tokenizer, made entirely offline.

For trying the swarm (and the README's "Fine-tune a model" walkthrough) without downloading a model:
a byte-level BPE tokenizer trained on local text (default: a deterministic few hundred KB of the
Python standard library's own source) and a ``LlamaForCausalLM`` of that vocabulary with a seeded
random init, saved as an ordinary Hugging Face folder (safetensors, tokenizer files, config.json).
``swarmpipe tiny-llama`` is the command; the folder works as ``[model] checkpoint`` in a run spec.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# ids 0..3 in this order (the trainer's special tokens come first in the vocabulary)
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte symbol plus the specials
DEFAULT_TEXT_BYTES = 300_000  # of the stdlib: enough for a few hundred merges, trained in about a second
STDLIB_MAX_FILE_BYTES = 40_000  # smaller modules, more of them: varied text rather than one big file
MAX_TEXT_BYTES = 64 * 1024 * 1024  # of --text: more adds little to a tiny vocabulary and costs memory
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".toml", ".yaml", ".yml", ".html", ".c", ".h")


def stdlib_texts(max_bytes: int = DEFAULT_TEXT_BYTES) -> tuple[list[str], str]:
    """The standard library's public top-level modules under 40 KB, in sorted order, until ``max_bytes``
    are covered (the same selection on every run of one Python version); returns the texts and a
    description."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        if total >= max_bytes:
            break
        try:
            if path.name.startswith("_") or path.stat().st_size > STDLIB_MAX_FILE_BYTES:
                continue
            data = path.read_bytes()
        except OSError:
            continue
        texts.append(data.decode("utf-8", errors="replace"))
        total += len(data)
    if not texts:
        raise ValueError(f"no Python source in {root} to train the tokenizer on; pass --text")
    return texts, f"{len(texts)} modules of the Python standard library ({root})"


def read_texts(path: str | Path, max_bytes: int = MAX_TEXT_BYTES) -> tuple[list[str], str]:
    """A text file, or a folder's text files (by suffix, sorted, hidden ones skipped), up to
    ``max_bytes``; returns the texts and a description. Raises ``ValueError`` for a path with no text."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ValueError(f"text path {root} does not exist")
    if root.is_dir():
        files = sorted(
            p
            for p in root.rglob("*")
            if p.is_file()
            and p.suffix.lower() in TEXT_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
        if not files:
            raise ValueError(f"text folder {root} has no text files ({', '.join(TEXT_SUFFIXES)})")
    else:
        files = [root]
    texts: list[str] = []
    total = 0
    for file in files:
        if total >= max_bytes:
            break
        try:
            with file.open("rb") as fh:
                data = fh.read(max_bytes - total)
        except OSError as exc:
            raise ValueError(f"cannot read text file {file}: {exc.strerror or exc}") from exc
        if data.strip():
            texts.append(data.decode("utf-8", errors="replace"))
            total += len(data)
    if not texts:
        raise ValueError(f"text path {root} holds no text to train the tokenizer on")
    return texts, f"{len(texts)} file(s) under {root}" if root.is_dir() else str(root)


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, model_max_length: int | None = None
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of at most ``vocab_size`` tokens (fewer when the text has too few
    pairs to merge) trained on ``texts``: <pad> <s> </s> <unk> are ids 0..3, every byte is encodable
    (no text is ever unknown), decoding gives the text back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be at least {MIN_VOCAB_SIZE} (256 bytes and 4 special tokens), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    extra: dict[str, Any] = {} if model_max_length is None else {"model_max_length": model_max_length}
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS, **extra)


def default_intermediate(hidden: int) -> int:
    """Llama's SwiGLU width: 8/3 of the hidden size, rounded up to a multiple of 64."""
    return -(-8 * hidden // (3 * 64)) * 64


def _check_shapes(
    vocab_size: int, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, seq_len: int
):
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("kv_heads", kv_heads)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be at least {MIN_VOCAB_SIZE} (256 bytes and 4 special tokens), got {vocab_size}"
        )
    if intermediate < 0:
        raise ValueError(
            f"intermediate must be >= 0 (0: {default_intermediate(hidden)} for hidden {hidden}), got {intermediate}"
        )
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if hidden % heads:
        raise ValueError(f"hidden {hidden} is not a multiple of heads {heads}")
    if (hidden // heads) % 2:
        raise ValueError(f"head size hidden/heads = {hidden // heads} must be even (rotary embeddings)")
    if heads % kv_heads:
        raise ValueError(f"heads {heads} is not a multiple of kv_heads {kv_heads}")


def make_tiny_llama_checkpoint(
    out: str | Path,
    *,
    text: str | Path | None = None,
    vocab_size: int = 512,
    layers: int = 4,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 0,
    seq_len: int = 256,
    tie: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Train a tokenizer on ``text`` (a file or folder; default: the stdlib sample) and save it with a
    random ``LlamaForCausalLM`` of its vocabulary into ``out`` (absent or empty). ``intermediate`` 0:
    Llama's 8/3 of ``hidden``. Same arguments and text, same files. Returns a summary."""
    _check_shapes(vocab_size, layers, hidden, heads, kv_heads, intermediate, seq_len)
    target = Path(out).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"output {target} exists and is not an empty folder")
    texts, source = read_texts(text) if text else stdlib_texts()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    tokenizer = train_tokenizer(texts, vocab_size, model_max_length=seq_len)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or default_intermediate(hidden),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    target.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(target))
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a few MB: no "Writing model shards" bar
    try:
        model.save_pretrained(str(target))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return {
        "out": str(target),
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": config.vocab_size,
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "intermediate": config.intermediate_size,
        "seq_len": seq_len,
        "tie": tie,
        "seed": seed,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "text": source,
        "text_bytes": sum(len(t.encode("utf-8")) for t in texts),
    }
