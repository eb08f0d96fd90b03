"""Moved to ``swarmpipe.peer.data.corpus``; re-exported so existing imports keep working."""

from __future__ import annotations

from swarmpipe.peer.data.corpus import (
    DEFAULT_MAX_BYTES,
    TEXT_SUFFIXES,
    BatchSampler,
    CorpusSplit,
    load_corpus,
    stdlib_dir,
)

__all__ = ["DEFAULT_MAX_BYTES", "TEXT_SUFFIXES", "BatchSampler", "CorpusSplit", "load_corpus", "stdlib_dir"]
