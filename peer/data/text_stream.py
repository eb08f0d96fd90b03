"""Text, JSONL and Parquet read as a stream of token ids, never the whole corpus in memory.

Files are read with Hugging Face ``datasets`` in streaming mode, in sorted order. A JSONL/JSON or
Parquet row is one document (its ``text`` field); a .txt file is one document, read line by line.
Each document's ids are followed by the tokenizer's EOS token, the separator the model learns.
``pack_windows`` cuts the id stream into sequences of ``seq_len + 1`` ids at stride ``seq_len``,
the same windows a token file of the same stream yields.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from swarmpipe.peer.data.corpus import TEXT_SUFFIXES
from swarmpipe.peer.data.errors import DataError
from swarmpipe.peer.data.token_file import TOKEN_SUFFIXES
from swarmpipe.peer.data.tokenizer import encode_batch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# suffix -> the datasets builder that reads it
STREAM_SUFFIXES = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
TEXT_FIELD = "text"
ROWS_PER_READ = 256  # rows fetched from datasets at once
CHARS_PER_ENCODE = 1 << 20  # characters handed to the tokenizer at once: its speed, our memory bound
TEXT_CHUNK_BYTES = 1 << 20  # how much of a .txt file datasets reads at once


@dataclass(frozen=True)
class SourceFile:
    path: Path
    builder: str  # "text" | "json" | "parquet"


def _builder(path: Path) -> str | None:
    """How a file is read: JSONL/JSON/Parquet rows, or plain text (.txt and the text suffixes the byte
    corpus reads: .py, .md, .rst, ...)."""
    if path.suffix in STREAM_SUFFIXES:
        return STREAM_SUFFIXES[path.suffix]
    return "text" if path.suffix in TEXT_SUFFIXES else None


def stream_files(path: str | Path) -> list[SourceFile]:
    """The file itself, or every data file under the folder (rows or plain text), sorted."""
    root = Path(path).expanduser()
    if root.is_file():
        builder = _builder(root)
        if builder is None:
            known = ", ".join(sorted(set(STREAM_SUFFIXES) | set(TEXT_SUFFIXES)))
            raise DataError(f"{root}: unknown data format (expected one of {known})")
        return [SourceFile(root, builder)]
    if not root.is_dir():
        raise DataError(f"data path {root} does not exist")
    files = [
        SourceFile(p, _builder(p))
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and _builder(p) is not None
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
        and not _is_sidecar(p)
    ]
    if not files:
        raise DataError(f"no data files (rows: {', '.join(STREAM_SUFFIXES)}; or text) in {root}")
    return files


def _is_sidecar(path: Path) -> bool:
    # a token file's <name>.tokens.json describes data; it is not data
    return path.suffix == ".json" and Path(path.stem).suffix in TOKEN_SUFFIXES


def iter_pieces(files: Iterable[SourceFile]) -> Iterator[tuple[str, bool]]:
    """(text, ends_document) pieces in file order; a document may arrive in several pieces."""
    from datasets import load_dataset

    for source in files:
        if source.builder == "text":
            # one .txt file is one document; its lines (line breaks kept) are joined into ~1 MB pieces
            ds = load_dataset(
                "text",
                data_files=[str(source.path)],
                streaming=True,
                split="train",
                keep_linebreaks=True,
                chunksize=TEXT_CHUNK_BYTES,
            )
            pending: list[str] = []
            size = 0
            started = False
            for batch in _batches(ds, source):
                for line in batch[TEXT_FIELD]:
                    pending.append(line)
                    size += len(line)
                if size >= CHARS_PER_ENCODE:
                    yield "".join(pending), False
                    pending, size, started = [], 0, True
            if started or size:  # an empty file is no document
                yield "".join(pending), True
        else:
            ds = load_dataset(source.builder, data_files=[str(source.path)], streaming=True, split="train")
            for batch in _batches(ds, source):
                if TEXT_FIELD not in batch:
                    raise DataError(
                        f"{source.path}: no {TEXT_FIELD!r} field; its columns are {sorted(batch)} "
                        f"(the text to train on must be in a column named {TEXT_FIELD!r})"
                    )
                for text in batch[TEXT_FIELD]:
                    if not text:
                        continue  # a row without text is no document
                    if not isinstance(text, str):
                        raise DataError(f"{source.path}: {TEXT_FIELD!r} holds {type(text).__name__}, not text")
                    yield text, True


def _batches(ds, source: SourceFile) -> Iterator[dict[str, list]]:
    """Rows of one file in batches; malformed files become a DataError naming the file."""
    try:
        yield from ds.iter(batch_size=ROWS_PER_READ)
    except DataError:
        raise
    except (UnicodeDecodeError, ValueError, OSError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{source.path}: cannot read it as {source.builder}: {type(exc).__name__}: {exc}") from exc


@dataclass
class TokenStream:
    """Token ids of ``files`` in chunks, EOS after each document. Iterate once per pass."""

    files: list[SourceFile]
    tokenizer: PreTrainedTokenizerBase
    eos_token_id: int
    documents: int = field(default=0, init=False)  # documents finished so far in this pass

    def __iter__(self) -> Iterator[np.ndarray]:
        self.documents = 0
        texts: list[str] = []
        ends: list[bool] = []
        size = 0
        for text, ends_document in iter_pieces(self.files):
            texts.append(text)
            ends.append(ends_document)
            size += len(text)
            if size >= CHARS_PER_ENCODE or len(texts) >= 4 * ROWS_PER_READ:
                yield self._encode(texts, ends)
                texts, ends, size = [], [], 0
        if texts:
            yield self._encode(texts, ends)

    def _encode(self, texts: list[str], ends: list[bool]) -> np.ndarray:
        parts: list[list[int]] = []
        for ids, ends_document in zip(encode_batch(self.tokenizer, texts), ends):
            parts.append(ids)
            if ends_document:
                parts.append([self.eos_token_id])
                self.documents += 1
        return np.array(list(chain.from_iterable(parts)), dtype=np.int64)


def pack_windows(chunks: Iterable[np.ndarray], seq_len: int) -> Iterator[np.ndarray]:
    """Windows of ``seq_len + 1`` ids at stride ``seq_len``: each id is a target exactly once.

    The tail shorter than a window is dropped."""
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    buf = np.empty(0, dtype=np.int64)
    for chunk in chunks:
        buf = np.concatenate([buf, chunk]) if buf.size else chunk
        count = (buf.size - 1) // seq_len
        for k in range(count):
            yield buf[k * seq_len : k * seq_len + seq_len + 1].copy()
        buf = buf[count * seq_len :] if count else buf
