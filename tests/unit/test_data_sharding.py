"""swarmpipe.peer.data sharding and resume: disjoint shards, cursors, epochs, for both kinds of source."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hf_fixtures import make_tokenizer, stdlib_texts

from swarmpipe.peer.data import DataCursor, DataError, WindowDataset, open_dataset

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
SEQ = 8


def window_dataset(windows: int = 203, seed: int = 7) -> WindowDataset:
    """``windows`` windows of ids 0..999 (0..9 training windows are 193 after 5 % validation)."""
    ids = np.arange(windows * SEQ + 1) % 1000
    return WindowDataset(ids.astype(np.uint16), SEQ, 1000, seed, {"source": "test"})


@pytest.fixture(scope="module")
def stream_path(tmp_path_factory) -> tuple[str, str]:
    """A JSONL corpus of ~90 documents and its tokenizer: a few hundred packed sequences."""
    root = tmp_path_factory.mktemp("stream")
    tok = make_tokenizer(root / "tok", vocab_size=300)
    text = stdlib_texts(["textwrap.py"])[0][:18000]
    path = root / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text[i : i + 200]}) + "\n" for i in range(0, len(text), 200)))
    return str(path), str(tok)


def open_stream(stream_path: tuple[str, str]):
    return open_dataset(stream_path[0], SEQ, 300, tokenizer=stream_path[1], valid_sequences=5)


def one_epoch(ds, shard: int, num_shards: int, batch: int = 4, cursor: DataCursor | None = None) -> list[int]:
    """The global indices a shard reads from ``cursor`` to the end of that epoch."""
    stream = ds.batches(batch, shard, num_shards, cursor)
    epoch = stream.cursor.epoch
    seen: list[int] = []
    while stream.cursor.epoch == epoch:
        before = stream.cursor.position
        _, _, idx = stream.next()
        seen += idx if stream.cursor.epoch == epoch else idx[: len(idx) - stream.cursor.position]
        assert stream.cursor.epoch > epoch or stream.cursor.position == before + batch
    return seen


# --- cursor --------------------------------------------------------------------------------------


def test_cursor_round_trips_and_validates():
    cursor = DataCursor(epoch=2, position=17)
    assert DataCursor.from_dict(json.loads(json.dumps(cursor.to_dict()))) == cursor
    assert DataCursor() == DataCursor(0, 0)
    for bad in ({"epoch": 1}, {"epoch": 1, "position": -1}, {"epoch": "1", "position": 0},
                {"epoch": True, "position": 0}, {"epoch": 0, "position": 0, "shard": 1}, [0, 0]):  # fmt: skip
        with pytest.raises(DataError, match="cursor"):
            DataCursor.from_dict(bad)


# --- random-access sources -----------------------------------------------------------------------


@pytest.mark.parametrize("num_shards", [2, 3])
def test_random_access_shards_are_disjoint_and_cover_the_epoch(num_shards):
    ds = window_dataset()
    assert (ds.train, ds.valid) == (193, 10)
    per_shard = [one_epoch(ds, i, num_shards) for i in range(num_shards)]
    for i, seen in enumerate(per_shard):
        assert len(seen) == len(set(seen)) and all(k % num_shards == i for k in seen)
    assert sorted(k for seen in per_shard for k in seen) == list(range(ds.train))  # no validation window


def test_random_access_epochs_are_new_permutations_and_seeded():
    ds = window_dataset()
    stream = ds.batches(1, 1, 2)
    first = [stream.next()[2][0] for _ in range(96)]
    assert stream.cursor == DataCursor(1, 0)  # the batch that ends the epoch already names the next
    second = [stream.next()[2][0] for _ in range(96)]
    assert sorted(first) == sorted(second) == list(range(1, 193, 2)) and first != second
    assert first != sorted(first)  # shuffled, not in file order
    assert one_epoch(window_dataset(seed=7), 1, 2, batch=1) == first  # same seed, same order
    assert one_epoch(window_dataset(seed=8), 1, 2, batch=1) != first


def test_a_batch_straddles_the_epoch_boundary():
    ds = window_dataset()
    stream = ds.batches(5, 0, 2, DataCursor(0, 95))  # shard 0 holds 97 sequences: 2 left, 3 from epoch 1
    _, _, idx = stream.next()
    assert stream.cursor == DataCursor(1, 3) and len(set(idx)) == 5
    assert idx[2:] == one_epoch(ds, 0, 2, batch=1, cursor=DataCursor(1, 0))[:3]


def test_random_access_resume_continues_without_repeats():
    ds = window_dataset()
    stream = ds.batches(4, 1, 3)
    seen = [k for _ in range(5) for k in stream.next()[2]]
    saved = json.dumps(stream.cursor.to_dict())
    reopened = window_dataset()  # a restarted trainer
    rest = one_epoch(reopened, 1, 3, cursor=DataCursor.from_dict(json.loads(saved)))
    assert len(seen + rest) == len(set(seen + rest)) == len(range(1, 193, 3))
    assert seen + rest == one_epoch(ds, 1, 3)


def test_validation_is_the_tail_and_fixed():
    ds = window_dataset()
    batches = ds.validation(4)
    assert [x.shape[0] for x, _ in batches] == [4, 4, 2]
    assert batches[0][0][0, 0].item() == (ds.train * SEQ) % 1000
    assert all((a == b).all() for (a, _), (b, _) in zip(batches, ds.validation(4)))


def test_bad_shards_and_cursors():
    ds = window_dataset()
    for shard, num in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(DataError, match="shard"):
            ds.batches(4, shard, num)
    with pytest.raises(DataError, match="past shard 0's 97 sequences"):
        ds.batches(4, 0, 2, DataCursor(0, 500)).next()
    with pytest.raises(DataError, match="too few"):
        WindowDataset(np.zeros(SEQ + 1, dtype=np.uint8), SEQ, 256, 0, {})


# --- the streaming source ------------------------------------------------------------------------


@pytest.mark.parametrize("num_shards", [2, 3])
def test_stream_shards_are_disjoint_and_cover_the_stream(stream_path, num_shards):
    ds = open_stream(stream_path)
    per_shard = [one_epoch(ds, i, num_shards) for i in range(num_shards)]
    for i, seen in enumerate(per_shard):
        assert seen == sorted(seen) and all(k % num_shards == i for k in seen)  # stream order
    everything = sorted(k for seen in per_shard for k in seen)
    assert everything == list(range(5, 5 + len(everything))) and len(everything) > 100  # validation first


def test_stream_resume_and_rollover(stream_path):
    ds = open_stream(stream_path)
    stream = ds.batches(4, 0, 2)
    seen = []
    for _ in range(5):
        x, _, idx = stream.next()
        seen += idx
    assert stream.cursor == DataCursor(0, 20)
    saved = stream.cursor.to_dict()
    expected_next = stream.next()

    reopened = open_stream(stream_path)  # a restarted trainer re-reads and skips
    resumed = reopened.batches(4, 0, 2, DataCursor.from_dict(saved))
    x, _, idx = resumed.next()
    assert idx == expected_next[2] and (x == expected_next[0]).all()
    rest = idx + one_epoch(reopened, 0, 2, cursor=resumed.cursor)
    full = one_epoch(ds, 0, 2)
    assert seen + rest == full and len(set(full)) == len(full)
    # the next epoch is the same stream again
    assert one_epoch(ds, 0, 2, cursor=DataCursor(1, 0)) == full


def test_stream_validation_is_the_head(stream_path):
    ds = open_stream(stream_path)
    batches = ds.validation(2)
    assert [x.shape for x, _ in batches] == [(2, SEQ)] * 2 + [(1, SEQ)]
    x, _, idx = ds.batches(1).next()
    assert idx == [5]
    assert x[0, 0] == batches[-1][1][0, -1]  # the first training window starts where validation ends
    with pytest.raises(DataError, match="need more than the 100000 validation sequences"):
        open_dataset(stream_path[0], SEQ, 300, tokenizer=stream_path[1], valid_sequences=100_000).validation(4)
