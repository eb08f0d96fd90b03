"""Byte-level corpora (token ids are the bytes 0..255) and the legacy random-window sampler.

The default corpus is the Python standard library's own source on the running machine: real,
varied text that exists everywhere and needs no download. It is held in RAM, so it is capped.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from swarmpipe.peer.data.errors import DataError

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".toml", ".cfg", ".json", ".c", ".h")
MIN_CORPUS_BYTES = 1024


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _collect_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DataError(f"data path {root} does not exist")
    # third-party code and the stdlib's own tests are skipped: the corpus is the library itself. They are pruned
    # from the walk, not filtered after it: site-packages alone can hold tens of thousands of entries (a trainer
    # spent 3-5 CPU-seconds of its start listing them)
    skip = {"site-packages", "__pycache__", "test", "tests", "idlelib"}
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in skip]
        files += [p for p in (Path(folder) / name for name in names) if p.suffix in TEXT_SUFFIXES and p.is_file()]
    return sorted(files)


def corpus_files(path: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> list[Path]:
    """The files ``load_corpus`` reads, in order, stopping once ``max_bytes`` are covered
    (the tokenized stdlib stream reads the same files)."""
    root = Path(path) if path else stdlib_dir()
    chosen: list[Path] = []
    total = 0
    for file in _collect_files(root):
        try:
            size = file.stat().st_size
        except OSError:
            continue
        chosen.append(file)
        total += size
        if total >= max_bytes:
            break
    return chosen


def load_corpus(path: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """All text files under ``path`` (default: the stdlib), sorted, concatenated, capped."""
    root = Path(path) if path else stdlib_dir()
    chunks: list[bytes] = []
    total = 0
    for file in _collect_files(root):
        try:
            data = file.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = b"\n".join(chunks)[:max_bytes]
    if len(corpus) < MIN_CORPUS_BYTES:
        raise DataError(f"corpus at {root} has only {len(corpus)} bytes; need at least {MIN_CORPUS_BYTES}")
    return corpus


@dataclass
class CorpusSplit:
    """The legacy split: the last ``valid_fraction`` of the bytes is held out."""

    train: torch.Tensor  # uint8
    valid: torch.Tensor

    @classmethod
    def from_bytes(cls, corpus: bytes, valid_fraction: float = 0.05) -> CorpusSplit:
        data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        cut = int(len(data) * (1 - valid_fraction))
        return cls(train=data[:cut], valid=data[cut:])


class BatchSampler:
    """Random windows of ``seq_len + 1`` bytes; inputs and next-byte targets, int64.

    Kept for the convergence bench and tests that want i.i.d. windows; the trainer's resumable,
    sharded reader is ``open_dataset`` (sequences.py, dataset.py)."""

    def __init__(self, data: torch.Tensor, batch_size: int, seq_len: int, seed: int):
        if len(data) <= seq_len + 1:
            raise DataError(f"data of {len(data)} bytes is shorter than a window of {seq_len + 1}")
        self.data = data
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (self.batch_size,), generator=self.generator)
        offsets = torch.arange(self.seq_len + 1)
        windows = self.data[starts[:, None] + offsets[None, :]].long()
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def fixed_batches(self, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.next() for _ in range(count)]
