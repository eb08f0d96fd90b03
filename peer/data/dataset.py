"""The trainer's data: ``open_dataset`` picks a source from the path, ``Dataset`` hands out batches.

Two kinds of source:
* random access (bytes in RAM, a memory-mapped token file): windows at stride ``seq_len``, the
  last 5 % held out for validation, the rest visited in a fresh seeded order every epoch;
* a stream (text/JSONL/Parquet tokenized on the fly): the first ``valid_sequences`` packed
  sequences are the validation set, the rest is read in stream order every epoch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from swarmpipe.peer.data.corpus import DEFAULT_MAX_BYTES, corpus_files, load_corpus
from swarmpipe.peer.data.errors import DataError
from swarmpipe.peer.data.sequences import (
    DataCursor,
    MicrobatchStream,
    ShardSource,
    check_shard,
    epoch_order,
    fixed_batches,
    shard_size,
    split_windows,
)
from swarmpipe.peer.data.text_stream import SourceFile, TokenStream, pack_windows, stream_files
from swarmpipe.peer.data.token_file import is_token_file, open_token_file
from swarmpipe.peer.data.tokenizer import check_vocab, eos_token_id, load_tokenizer, tokenizer_vocab_size

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BYTE_VOCAB = 256
NEEDS_TOKENIZER = (".jsonl", ".parquet")  # rows, not text: their bytes are no corpus (a .json file still is, as before)


class Dataset(ABC):
    """Packed sequences of ``seq_len + 1`` token ids: inputs are ``[:-1]``, targets ``[1:]``."""

    def __init__(self, seq_len: int, vocab_size: int, seed: int):
        if seq_len < 1 or vocab_size < 1:
            raise DataError(f"seq_len ({seq_len}) and vocab_size ({vocab_size}) must be >= 1")
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What the trainer logs and reports: the source, its size, its tokenizer."""

    @abstractmethod
    def validation(self, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The held-out sequences as fixed micro-batches, the same on every call and every trainer."""

    @abstractmethod
    def shard(self, shard: int, num_shards: int) -> ShardSource:
        """The shard's view of the training sequences."""

    def batches(
        self, batch_size: int, shard: int = 0, num_shards: int = 1, cursor: DataCursor | None = None
    ) -> MicrobatchStream:
        """This shard's micro-batches from ``cursor`` on (default: the start of epoch 0)."""
        check_shard(shard, num_shards)
        return MicrobatchStream(self.shard(shard, num_shards), batch_size, self.vocab_size, cursor)


@dataclass
class _WindowShard:
    tokens: np.ndarray
    seq_len: int
    train: int
    shard: int
    num_shards: int
    seed: int

    def sequences(self, epoch: int, start: int) -> Iterator[tuple[int, np.ndarray]]:
        order = epoch_order(self.train, self.shard, self.num_shards, self.seed, epoch)
        if start > order.size:
            raise DataError(
                f"cursor position {start} is past shard {self.shard}'s {order.size} sequences "
                "(were the data, seq_len or the number of shards changed?)"
            )
        span = self.seq_len + 1
        for k in order[start:].tolist():
            # slicing a memmap reads just these pages
            yield k, np.asarray(self.tokens[k * self.seq_len : k * self.seq_len + span])


class WindowDataset(Dataset):
    """A random-access array of ids (bytes in RAM or a memory-mapped token file)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int, seed: int, info: dict[str, Any]):
        super().__init__(seq_len, vocab_size, seed)
        self.tokens = tokens
        windows = (len(tokens) - 1) // seq_len
        if windows < 2:
            raise DataError(f"{info.get('path') or 'the data'} has {len(tokens)} tokens: too few for seq_len {seq_len}")
        self.train, self.valid = split_windows(windows)
        self.info = info

    def describe(self) -> dict[str, Any]:
        return {
            **self.info,
            "tokens": len(self.tokens),
            "seq_len": self.seq_len,
            "vocab_size": self.vocab_size,
            "train_sequences": self.train,
            "valid_sequences": self.valid,
        }

    def _window(self, k: int) -> np.ndarray:
        return np.asarray(self.tokens[k * self.seq_len : (k + 1) * self.seq_len + 1])

    def validation(self, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        windows = [self._window(k) for k in range(self.train, self.train + self.valid)]
        return fixed_batches(windows, batch_size, self.vocab_size)

    def shard(self, shard: int, num_shards: int) -> ShardSource:
        check_shard(shard, num_shards)
        if shard_size(self.train, shard, num_shards) == 0:
            raise DataError(f"shard {shard} of {num_shards} gets none of the {self.train} training sequences")
        return _WindowShard(self.tokens, self.seq_len, self.train, shard, num_shards, self.seed)


@dataclass
class _StreamShard:
    stream: TokenStream
    seq_len: int
    valid: int
    shard: int
    num_shards: int

    def sequences(self, epoch: int, start: int) -> Iterator[tuple[int, np.ndarray]]:
        # every epoch re-reads the stream in the same order; resuming re-reads and skips
        skipped = 0
        for k, window in enumerate(pack_windows(self.stream, self.seq_len)):
            if k < self.valid or k % self.num_shards != self.shard:
                continue
            if skipped < start:
                skipped += 1
                continue
            yield k, window
        if skipped < start:
            raise DataError(
                f"cursor position {start} is past shard {self.shard}'s {skipped} sequences "
                "(were the data, seq_len or the number of shards changed?)"
            )


class StreamDataset(Dataset):
    """Text, JSONL or Parquet files tokenized as they are read."""

    def __init__(
        self,
        files: list[SourceFile],
        tokenizer: PreTrainedTokenizerBase,
        seq_len: int,
        vocab_size: int,
        seed: int,
        valid_sequences: int,
        info: dict[str, Any],
    ):
        super().__init__(seq_len, vocab_size, seed)
        if valid_sequences < 1:
            raise DataError(f"valid_sequences must be >= 1, got {valid_sequences}")
        check_vocab(tokenizer, vocab_size)
        self.files = files
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id(tokenizer)
        self.valid = valid_sequences
        self.info = info
        self._valid_windows: list[np.ndarray] | None = None

    def _stream(self) -> TokenStream:
        return TokenStream(self.files, self.tokenizer, self.eos_token_id)

    def _validation_windows(self) -> list[np.ndarray]:
        if self._valid_windows is None:
            # one more than the validation set: a stream with nothing left to train on is refused here
            head = list(islice(pack_windows(self._stream(), self.seq_len), self.valid + 1))
            if len(head) <= self.valid:
                raise DataError(
                    f"{self.info.get('path')}: only {len(head)} sequence(s) of {self.seq_len + 1} tokens; "
                    f"need more than the {self.valid} validation sequences"
                )
            self._valid_windows = head[: self.valid]
        return self._valid_windows

    def describe(self) -> dict[str, Any]:
        return {
            **self.info,
            "files": len(self.files),
            "seq_len": self.seq_len,
            "vocab_size": self.vocab_size,
            "valid_sequences": self.valid,
            "tokenizer_vocab_size": tokenizer_vocab_size(self.tokenizer),
            "eos_token_id": self.eos_token_id,
        }

    def validation(self, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return fixed_batches(self._validation_windows(), batch_size, self.vocab_size)

    def shard(self, shard: int, num_shards: int) -> ShardSource:
        check_shard(shard, num_shards)
        return _StreamShard(self._stream(), self.seq_len, self.valid, shard, num_shards)


def _bytes_dataset(data: str | None, seq_len: int, vocab_size: int, seed: int, max_bytes: int) -> WindowDataset:
    corpus = np.frombuffer(load_corpus(data or None, max_bytes=max_bytes), dtype=np.uint8)
    top = int(corpus.max())
    if top >= vocab_size:
        raise DataError(f"byte-level data holds byte {top} but the model's vocab_size is {vocab_size} (need 256)")
    info = {"source": "bytes", "path": data or "stdlib", "tokenizer": None, "eos_token_id": None}
    return WindowDataset(corpus, seq_len, vocab_size, seed, info)


def open_dataset(
    data: str | None,
    seq_len: int,
    vocab_size: int,
    tokenizer: str | None = None,
    seed: int = 0,
    valid_sequences: int = 32,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Dataset:
    """The source for ``data``:

    * None or "": the Python stdlib's source as bytes (with ``tokenizer``: those files tokenized);
    * ``*.tokens`` / ``*.bin`` (or any file with a swarmpipe sidecar): a memory-mapped token file;
    * .txt/.jsonl/.json/.parquet, or a folder of them, with ``tokenizer``: tokenized as a stream;
    * text without ``tokenizer``: its bytes (only for models with vocab_size <= 256).

    ``max_bytes`` caps the byte-level corpus held in RAM (16 MiB)."""
    if data and is_token_file(data):
        tokens, meta = open_token_file(data)
        if meta.vocab_size > vocab_size:
            raise DataError(
                f"token file {data} was made for a vocabulary of {meta.vocab_size} tokens "
                f"({meta.tokenizer or 'unknown tokenizer'}) but the model's vocab_size is {vocab_size}"
            )
        info = {
            "source": "token-file",
            "path": str(data),
            "dtype": meta.dtype,
            "documents": meta.documents,
            "tokenizer": meta.tokenizer,
            "eos_token_id": meta.eos_token_id,
        }
        return WindowDataset(tokens, seq_len, vocab_size, seed, info)
    if data and not Path(data).expanduser().exists():
        raise DataError(f"data path {data} does not exist")
    if tokenizer:
        if data:
            files = stream_files(data)
        else:  # the stdlib default, tokenized: the same files the byte corpus reads
            files = [SourceFile(path, "text") for path in corpus_files(None, max_bytes)]
        tok = load_tokenizer(tokenizer)
        info = {"source": "stream", "path": data or "stdlib", "tokenizer": str(tokenizer)}
        return StreamDataset(files, tok, seq_len, vocab_size, seed, valid_sequences, info)
    if data and Path(data).suffix in NEEDS_TOKENIZER:
        raise DataError(f"{data}: JSONL and Parquet data need --tokenizer (a Hugging Face tokenizer folder)")
    if vocab_size > BYTE_VOCAB:
        raise DataError(
            f"this model needs --tokenizer: its vocab_size is {vocab_size}, "
            f"and text without a tokenizer is read as bytes (ids 0..{BYTE_VOCAB - 1})"
        )
    return _bytes_dataset(data, seq_len, vocab_size, seed, max_bytes)
