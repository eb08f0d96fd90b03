"""Flat binary token files: a little-endian array of uint16 or uint32 ids plus a JSON sidecar.

The array is memory-mapped (the OS pages in only the windows read), so a corpus of billions of
tokens opens instantly and costs no RAM. The sidecar ``<file>.json`` says how to read it and which
vocabulary it was made for, so a file tokenized for another model is refused before training.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from swarmpipe.peer.data.errors import DataError

SIDECAR_FORMAT = "swarmpipe-tokens"
SIDECAR_VERSION = 1
TOKEN_SUFFIXES = (".tokens", ".bin")
DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def sidecar_path(path: str | Path) -> Path:
    return Path(str(path) + ".json")


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest dtype that holds every id below ``vocab_size``."""
    return "uint16" if vocab_size - 1 <= np.iinfo(np.uint16).max else "uint32"


@dataclass(frozen=True)
class TokenFileInfo:
    """The sidecar's content."""

    dtype: str
    tokens: int
    documents: int
    vocab_size: int
    eos_token_id: int
    tokenizer: str

    def to_dict(self) -> dict[str, Any]:
        return {"format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> TokenFileInfo:
        if not isinstance(raw, dict):
            raise DataError(f"{where}: the sidecar must be a JSON object")
        if raw.get("format") != SIDECAR_FORMAT:
            raise DataError(f"{where}: format is {raw.get('format')!r}, expected {SIDECAR_FORMAT!r}")
        if raw.get("version") != SIDECAR_VERSION:
            raise DataError(f"{where}: version {raw.get('version')!r} is not supported (expected {SIDECAR_VERSION})")
        dtype = raw.get("dtype")
        if dtype not in DTYPES:
            raise DataError(f"{where}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        ints = {}
        for key in ("tokens", "documents", "vocab_size", "eos_token_id"):
            value = raw.get(key)
            # bool is an int in Python; a sidecar saying "tokens": true is broken, not 1
            if not isinstance(value, int) or isinstance(value, bool):
                raise DataError(f"{where}: {key} must be an integer, got {value!r}")
            ints[key] = value
        if ints["tokens"] < 0 or ints["documents"] < 0 or ints["vocab_size"] < 1:
            raise DataError(f"{where}: tokens and documents must be >= 0 and vocab_size >= 1")
        if ints["vocab_size"] - 1 > np.iinfo(DTYPES[dtype]).max:
            raise DataError(f"{where}: vocab_size {ints['vocab_size']} does not fit in {dtype}")
        if not -1 <= ints["eos_token_id"] < ints["vocab_size"]:
            raise DataError(f"{where}: eos_token_id {ints['eos_token_id']} is outside the vocabulary")
        tokenizer = raw.get("tokenizer", "")
        if not isinstance(tokenizer, str):
            raise DataError(f"{where}: tokenizer must be a string")
        return cls(dtype=dtype, tokenizer=tokenizer, **ints)


def read_sidecar(path: str | Path) -> TokenFileInfo:
    """The validated sidecar of the token file at ``path``; its size must match the sidecar's count."""
    path = Path(path)
    side = sidecar_path(path)
    if not path.is_file():
        raise DataError(f"token file {path} does not exist")
    if not side.is_file():
        raise DataError(f"token file {path} has no sidecar {side.name} (write both with `swarmpipe tokenize`)")
    try:
        raw = json.loads(side.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{side}: not readable JSON: {exc}") from exc
    info = TokenFileInfo.from_dict(raw, str(side))
    size = path.stat().st_size
    expected = info.tokens * DTYPES[info.dtype].itemsize
    if size != expected:
        raise DataError(
            f"token file {path} has {size} bytes but its sidecar says {info.tokens} {info.dtype} tokens "
            f"({expected} bytes): the file is truncated or the sidecar belongs to another file"
        )
    return info


def open_token_file(path: str | Path) -> tuple[np.ndarray, TokenFileInfo]:
    """The ids as a read-only memory map (nothing is read until sliced) and the sidecar."""
    info = read_sidecar(path)
    if info.tokens == 0:
        raise DataError(f"token file {path} is empty")
    return np.memmap(path, dtype=DTYPES[info.dtype], mode="r", shape=(info.tokens,)), info


def is_token_file(path: str | Path) -> bool:
    """A path that names a token file: a token suffix, or any file next to a swarmpipe sidecar."""
    path = Path(path)
    if path.suffix in TOKEN_SUFFIXES:
        return True
    side = sidecar_path(path)
    if not (path.is_file() and side.is_file()):
        return False
    try:
        return json.loads(side.read_text()).get("format") == SIDECAR_FORMAT
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False


class TokenFileWriter:
    """Appends ids chunk by chunk (bounded memory); ``finish`` writes the sidecar.

    Both files are written under temporary names and renamed at the end, so an interrupted run
    never leaves a token file whose sidecar lies about it."""

    def __init__(self, path: str | Path, vocab_size: int, eos_token_id: int, tokenizer: str):
        self.path = Path(path)
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.tokenizer = tokenizer
        self.dtype = dtype_for_vocab(vocab_size)
        self.tokens = 0
        self.documents = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(self.path.name + ".partial")
        self._file = open(self._tmp, "wb")  # closed by finish or abort

    def write(self, ids: np.ndarray, documents: int = 0) -> None:
        if ids.size:
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.vocab_size:
                raise DataError(
                    f"token id {high if high >= self.vocab_size else low} is outside [0, {self.vocab_size})"
                )
            self._file.write(np.ascontiguousarray(ids, dtype=DTYPES[self.dtype]).tobytes())
            self.tokens += int(ids.size)
        self.documents += documents

    def finish(self) -> TokenFileInfo:
        self._file.close()
        info = TokenFileInfo(
            dtype=self.dtype,
            tokens=self.tokens,
            documents=self.documents,
            vocab_size=self.vocab_size,
            eos_token_id=self.eos_token_id,
            tokenizer=self.tokenizer,
        )
        side_tmp = self._tmp.with_name(self._tmp.name + ".json")
        side_tmp.write_text(json.dumps(info.to_dict(), indent=2) + "\n")
        os.replace(self._tmp, self.path)
        os.replace(side_tmp, sidecar_path(self.path))
        return info

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
