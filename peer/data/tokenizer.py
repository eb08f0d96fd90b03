"""Hugging Face tokenizers from a local folder, and the checks that they fit the model.

transformers is imported only here and only when a tokenizer is asked for: the byte-level default
never pays for it. Only local folders are read (``local_files_only``): a peer never downloads.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmpipe.peer.data.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# any one of these makes a folder a tokenizer folder (fast, SentencePiece, BPE vocab/merges, tiktoken)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(path, local_files_only=True)`` with clear errors."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise DataError(f"tokenizer folder {folder} does not exist")
    if not folder.is_dir():
        raise DataError(f"tokenizer {folder} is not a folder (expected a Hugging Face folder with tokenizer.json)")
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        found = sorted(p.name for p in folder.iterdir())[:10]
        raise DataError(
            f"no tokenizer in {folder}: expected one of {', '.join(TOKENIZER_FILES)}; found {found or 'nothing'}"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for broken folders
        raise DataError(f"cannot load the tokenizer in {folder}: {type(exc).__name__}: {exc}") from exc


def tokenizer_vocab_size(tokenizer: PreTrainedTokenizerBase) -> int:
    """Every id the tokenizer can produce is below this (base vocabulary plus added tokens)."""
    return len(tokenizer)


def check_vocab(tokenizer: PreTrainedTokenizerBase, model_vocab_size: int) -> None:
    """Refuse a tokenizer that can produce ids the model has no embedding for.

    A model whose vocab_size is larger than the tokenizer's (padded for speed) is fine."""
    size = tokenizer_vocab_size(tokenizer)
    if size > model_vocab_size:
        raise DataError(
            f"the tokenizer has {size} tokens but the model's vocab_size is {model_vocab_size}: "
            f"ids {model_vocab_size}..{size - 1} have no embedding (use the model's own tokenizer)"
        )


def eos_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The document separator packing inserts; a tokenizer without one cannot pack documents."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(
            f"tokenizer {tokenizer_name(tokenizer)} has no eos token: documents cannot be separated when packed"
        )
    return int(eos)


def tokenizer_name(tokenizer: PreTrainedTokenizerBase) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def encode_batch(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of each text without special tokens (packing adds the separators itself).

    ``split_special_tokens``: a literal "</s>" in a document is text, not a forged document boundary.
    ``verbose=False``: documents are longer than the model's context by design; the sequences are cut later."""
    encoded: Any = tokenizer(
        texts, add_special_tokens=False, split_special_tokens=True, return_attention_mask=False, verbose=False
    )
    return encoded["input_ids"]
