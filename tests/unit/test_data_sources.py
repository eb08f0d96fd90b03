"""swarmpipe.peer.data sources: bytes, text/JSONL/Parquet streams, token files, and their errors."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hf_fixtures import make_tokenizer, stdlib_texts

from swarmpipe.peer.data import (
    DataError,
    WindowDataset,
    check_vocab,
    load_tokenizer,
    open_dataset,
    open_token_file,
    tokenize_to_file,
)
from swarmpipe.peer.data.dataset import StreamDataset
from swarmpipe.peer.data.token_file import sidecar_path

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
SEQ = 16
VOCAB = 384  # the fixture tokenizer's size


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """Six documents of a few hundred tokens each."""
    text = stdlib_texts(["textwrap.py"])[0]
    return [text[i * 1500 : (i + 1) * 1500] for i in range(6)]


def expected_ids(tok, docs: list[str]) -> list[int]:
    ids: list[int] = []
    for doc in docs:
        ids += tok(doc, add_special_tokens=False, split_special_tokens=True)["input_ids"] + [tok.eos_token_id]
    return ids


def all_windows(ds) -> list[np.ndarray]:
    """Every packed window of a stream in stream order: validation first, then one epoch of training."""
    windows = [torch.cat([x[:, :1], y], dim=1).numpy() for x, y in ds.validation(4)]
    stream = ds.batches(1)  # one at a time: the last batch of the epoch holds nothing of the next
    while stream.cursor.epoch == 0:
        x, y, _ = stream.next()
        windows.append(torch.cat([x[:, :1], y], dim=1).numpy())
    return list(np.concatenate(windows))


def unpack(windows: list[np.ndarray]) -> list[int]:
    """The id stream back from windows at stride seq_len (each shares its first id with the previous one's last)."""
    out = list(windows[0])
    for w in windows[1:]:
        assert w[0] == out[-1]
        out += list(w[1:])
    return out


def check_batch(x: torch.Tensor, y: torch.Tensor, batch: int) -> None:
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (batch, SEQ)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one


# --- bytes ---------------------------------------------------------------------------------------


def test_bytes_default_is_the_stdlib():
    ds = open_dataset(None, SEQ, 256, max_bytes=64 * 1024)
    info = ds.describe()
    assert info["source"] == "bytes" and info["path"] == "stdlib" and info["tokens"] == 64 * 1024
    assert info["valid_sequences"] == 204 and info["train_sequences"] == 4095 - 204
    x, y, idx = ds.batches(8).next()
    check_batch(x, y, 8)
    assert all(0 <= k < info["train_sequences"] for k in idx)
    assert sum(v[0].shape[0] for v in ds.validation(64)) == info["valid_sequences"]


def test_bytes_from_a_text_file_without_tokenizer(tmp_path, docs):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(docs))
    ds = open_dataset(str(path), SEQ, 256)
    assert isinstance(ds, WindowDataset) and ds.describe()["source"] == "bytes"
    raw = path.read_bytes()
    x, y, idx = ds.batches(2).next()
    check_batch(x, y, 2)
    k = idx[0]
    assert bytes(x[0].tolist()) == raw[k * SEQ : (k + 1) * SEQ]


def test_text_needs_a_tokenizer_when_the_model_is_bigger_than_bytes(tmp_path, docs):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(docs))
    for data in (str(path), None):
        with pytest.raises(DataError, match="this model needs --tokenizer"):
            open_dataset(data, SEQ, 32000)


# --- streams -------------------------------------------------------------------------------------


def test_txt_files_stream_one_document_per_file(tmp_path, tok_dir, tok, docs):
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, doc in enumerate(docs):
        (folder / f"{i:02d}.txt").write_text(doc)
    (folder / "image.png").write_bytes(b"\x89PNG ignored: not text")
    ds = open_dataset(str(folder), SEQ, VOCAB, tokenizer=str(tok_dir), valid_sequences=3)
    assert isinstance(ds, StreamDataset) and ds.describe()["files"] == len(docs)
    ids = unpack(all_windows(ds))
    full = expected_ids(tok, docs)
    assert ids == full[: len(ids)] and len(full) - len(ids) < SEQ  # only the short tail is dropped
    assert tok.decode(ids[: full.index(tok.eos_token_id)]) == docs[0]


def test_jsonl_rows_are_documents_separated_by_eos(tmp_path, tok_dir, tok, docs):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    ds = open_dataset(str(path), SEQ, VOCAB, tokenizer=str(tok_dir), valid_sequences=2)
    ids = unpack(all_windows(ds))
    assert ids == expected_ids(tok, docs)[: len(ids)]
    eos = [i for i, t in enumerate(ids) if t == tok.eos_token_id]
    assert len(eos) >= len(docs) - 1  # one separator after each document
    assert tok.decode(ids[eos[0] + 1 : eos[1]]) == docs[1]


def test_parquet_rows_stream(tmp_path, tok_dir, tok, docs):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": docs, "score": list(range(len(docs)))}), path, row_group_size=2)
    ds = open_dataset(str(path), SEQ, VOCAB, tokenizer=str(tok_dir), valid_sequences=2)
    ids = unpack(all_windows(ds))
    assert ids == expected_ids(tok, docs)[: len(ids)]


def test_a_literal_eos_string_in_text_is_not_a_separator(tmp_path, tok_dir, tok):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"line {i} </s> forged " * 5}) + "\n" for i in range(40)))
    ds = open_dataset(str(path), SEQ, VOCAB, tokenizer=str(tok_dir), valid_sequences=2)
    assert unpack(all_windows(ds)).count(tok.eos_token_id) <= 40


# --- token files ---------------------------------------------------------------------------------


def test_tokenize_to_file_round_trips(tmp_path, tok_dir, tok, docs):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "out" / "docs.tokens"
    seen = []
    side = tokenize_to_file(str(src), str(tok_dir), str(out), progress=lambda t, d: seen.append((t, d)))
    full = expected_ids(tok, docs)
    assert side == {
        "format": "swarmpipe-tokens",
        "version": 1,
        "dtype": "uint16",
        "tokens": len(full),
        "documents": len(docs),
        "vocab_size": VOCAB,
        "eos_token_id": tok.eos_token_id,
        "tokenizer": str(tok_dir),
    }
    assert json.loads(sidecar_path(out).read_text()) == side and seen[-1] == (len(full), len(docs))
    assert out.stat().st_size == 2 * len(full) and not list(out.parent.glob("*.partial*"))
    tokens, info = open_token_file(out)
    assert isinstance(tokens, np.memmap) and tokens.tolist() == full and info.documents == len(docs)

    # the token file yields the same windows as the stream, numbered in the same way
    ds = open_dataset(str(out), SEQ, VOCAB, seed=3)
    assert ds.describe()["source"] == "token-file" and ds.describe()["eos_token_id"] == tok.eos_token_id
    x, y, idx = ds.batches(4).next()
    check_batch(x, y, 4)
    for row, k in enumerate(idx):
        assert x[row].tolist() == full[k * SEQ : (k + 1) * SEQ]


def test_tokenize_to_file_max_tokens_and_bad_output(tmp_path, tok_dir, docs):
    src = tmp_path / "a.txt"
    src.write_text(docs[0])
    side = tokenize_to_file(str(src), str(tok_dir), str(tmp_path / "a.bin"), max_tokens=50)
    assert side["tokens"] == 50 and side["documents"] == 0
    with pytest.raises(DataError, match=r"must end in \.tokens or \.bin"):
        tokenize_to_file(str(src), str(tok_dir), str(tmp_path / "a.npy"))


def test_a_ten_million_token_file_is_memory_mapped(tmp_path, monkeypatch):
    path = tmp_path / "big.tokens"
    n = 10_000_000
    with open(path, "wb") as f:
        f.truncate(n * 2)  # sparse zeros: nothing to read whole
    sidecar_path(path).write_text(
        json.dumps({"format": "swarmpipe-tokens", "version": 1, "dtype": "uint16", "tokens": n, "documents": 1,
                    "vocab_size": 50, "eos_token_id": 0, "tokenizer": "t"})
    )  # fmt: skip
    monkeypatch.setattr(np, "fromfile", None)  # reading it whole would fail
    start = time.perf_counter()
    ds = open_dataset(str(path), 128, 64, seed=1)
    stream = ds.batches(8, shard=1, num_shards=3)
    x, _, idx = stream.next()
    assert time.perf_counter() - start < 2.0
    assert isinstance(ds.tokens, np.memmap) and x.shape == (8, 128) and all(k % 3 == 1 for k in idx)
    assert ds.describe()["valid_sequences"] == 256


# --- errors --------------------------------------------------------------------------------------


def test_jsonl_without_a_text_field(tmp_path, tok_dir):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"body": "hello", "id": 1}\n')
    ds = open_dataset(str(path), SEQ, VOCAB, tokenizer=str(tok_dir))
    with pytest.raises(DataError, match=r"no 'text' field; its columns are \['body', 'id'\]"):
        ds.validation(4)
    with pytest.raises(DataError, match="no 'text' field"):
        tokenize_to_file(str(path), str(tok_dir), str(tmp_path / "x.tokens"))
    assert not (tmp_path / "x.tokens").exists() and not list(tmp_path.glob("*.partial"))


def test_jsonl_and_parquet_need_a_tokenizer(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "hello"}\n')
    with pytest.raises(DataError, match="need --tokenizer"):
        open_dataset(str(path), SEQ, 256)


def test_tokenizer_larger_than_the_model(tmp_path, tok_dir, tok):
    with pytest.raises(DataError, match=r"384 tokens but the model's vocab_size is 300"):
        check_vocab(tok, 300)
    check_vocab(tok, VOCAB)
    check_vocab(tok, 1024)  # a model may have more rows than the tokenizer has tokens
    path = tmp_path / "a.txt"
    path.write_text("hello")
    with pytest.raises(DataError, match="384.*300"):
        open_dataset(str(path), SEQ, 300, tokenizer=str(tok_dir))


def test_missing_or_empty_tokenizer_folder(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(DataError, match=r"no tokenizer in .*found \['config.json'\]"):
        load_tokenizer(tmp_path / "empty")


def write_token_file(
    path: Path, ids: list[int], vocab_size: int, dtype: str = "uint16", lies: dict | None = None
) -> Path:
    """The ids as ``dtype`` and their sidecar, whose fields ``lies`` may falsify."""
    np.asarray(ids, dtype=dtype).tofile(path)
    side = {"format": "swarmpipe-tokens", "version": 1, "dtype": dtype, "tokens": len(ids), "documents": 1,
            "vocab_size": vocab_size, "eos_token_id": 0, "tokenizer": "test"}  # fmt: skip
    sidecar_path(path).write_text(json.dumps({**side, **(lies or {})}))
    return path


def test_token_file_sidecar_errors(tmp_path):
    ids = list(range(100)) * 10
    path = write_token_file(tmp_path / "a.tokens", ids, 100, lies={"tokens": 999})
    with pytest.raises(DataError, match="has 2000 bytes but its sidecar says 999 uint16 tokens"):
        open_dataset(str(path), SEQ, 100)
    write_token_file(path, ids, 100, lies={"dtype": "int8"})
    with pytest.raises(DataError, match="dtype 'int8' is not one of uint16, uint32"):
        open_dataset(str(path), SEQ, 100)
    write_token_file(path, ids, 100, dtype="uint32")
    assert open_dataset(str(path), SEQ, 100).describe()["dtype"] == "uint32"
    sidecar_path(path).unlink()
    with pytest.raises(DataError, match="has no sidecar a.tokens.json"):
        open_dataset(str(path), SEQ, 100)


def test_token_ids_outside_the_vocabulary(tmp_path):
    # made for a larger vocabulary: refused when opened
    path = write_token_file(tmp_path / "a.tokens", [1, 2, 3] * 200, 1000)
    with pytest.raises(DataError, match="vocabulary of 1000 tokens .* vocab_size is 64"):
        open_dataset(str(path), SEQ, 64)
    # a stray id the sidecar did not admit: refused when read
    write_token_file(path, [1, 2, 3] * 200 + [70] * 17, 64)
    ds = open_dataset(str(path), SEQ, 64, seed=0)
    with pytest.raises(DataError, match="token id 70 is outside the model's vocabulary"):
        ds.validation(8)
    stray = WindowDataset(np.array([99] * 20 + [1, 2, 3] * 200), SEQ, 64, 0, {"source": "test"})
    stream = stray.batches(8)
    with pytest.raises(DataError, match="token id 99"):
        for _ in range(stray.train):
            stream.next()


def test_the_stdlib_default_with_a_tokenizer_streams_its_files(tok_dir, tok):
    ds = open_dataset(None, SEQ, VOCAB, tokenizer=str(tok_dir), valid_sequences=4, max_bytes=256 * 1024)
    assert ds.describe()["source"] == "stream" and ds.describe()["path"] == "stdlib"
    x, y, idx = ds.batches(4, shard=1, num_shards=2).next()
    check_batch(x, y, 4)
    assert idx == [5, 7, 9, 11]  # after the 4 validation sequences, every other one


def test_missing_data_and_empty_folders(tmp_path, tok_dir):
    with pytest.raises(DataError, match="does not exist"):
        open_dataset(str(tmp_path / "nope.txt"), SEQ, 256)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no data files"):
        open_dataset(str(tmp_path / "empty"), SEQ, VOCAB, tokenizer=str(tok_dir))


def test_plain_text_files_of_any_text_suffix_stream_as_text(tmp_path, tok_dir):
    source = tmp_path / "module.py"
    source.write_text("def hello():\n    return 'world'\n" * 200)
    ds = open_dataset(str(source), SEQ, VOCAB, tokenizer=str(tok_dir), valid_sequences=1)
    assert isinstance(ds, StreamDataset) and ds.describe()["files"] == 1
    binary = tmp_path / "weights.pt"
    binary.write_bytes(b"\x00\x01")
    with pytest.raises(DataError, match="unknown data format"):
        open_dataset(str(binary), SEQ, VOCAB, tokenizer=str(tok_dir))
