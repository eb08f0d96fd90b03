"""Training data for the trainer: byte-level text, memory-mapped token files, tokenized streams.

``open_dataset`` picks the source from the path; ``Dataset.batches`` hands one shard its
micro-batches with a resumable ``DataCursor``; ``tokenize_to_file`` writes token files.
Modules: ``corpus`` (byte-level stdlib corpus), ``tokenizer`` (HF tokenizers and vocabulary checks),
``token_file`` (flat id arrays and their sidecar), ``text_stream`` (text/JSONL/Parquet to packed ids),
``sequences`` (shards, cursors, micro-batches), ``dataset`` (sources and ``open_dataset``),
``tokenize`` (the tokenize command's logic).
"""

from __future__ import annotations

from swarmpipe.peer.data.corpus import (
    DEFAULT_MAX_BYTES,
    BatchSampler,
    CorpusSplit,
    load_corpus,
    stdlib_dir,
)
from swarmpipe.peer.data.dataset import Dataset, StreamDataset, WindowDataset, open_dataset
from swarmpipe.peer.data.errors import DataError
from swarmpipe.peer.data.sequences import DataCursor, MicrobatchStream
from swarmpipe.peer.data.token_file import TokenFileInfo, open_token_file, read_sidecar
from swarmpipe.peer.data.tokenize import tokenize_to_file
from swarmpipe.peer.data.tokenizer import check_vocab, load_tokenizer

__all__ = [
    "DEFAULT_MAX_BYTES",
    "BatchSampler",
    "CorpusSplit",
    "DataCursor",
    "DataError",
    "Dataset",
    "MicrobatchStream",
    "StreamDataset",
    "TokenFileInfo",
    "WindowDataset",
    "check_vocab",
    "load_corpus",
    "load_tokenizer",
    "open_dataset",
    "open_token_file",
    "read_sidecar",
    "stdlib_dir",
    "tokenize_to_file",
]
