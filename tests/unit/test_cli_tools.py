"""``swarmpipe tiny-llama`` and ``swarmpipe tokenize`` run in-process: a random Llama checkpoint with its
own tokenizer that transformers and the swarm load, and a token file whose sidecar fits that tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_fixtures import make_tokenizer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from swarmpipe.cli.main import main as cli_main
from swarmpipe.peer.data import open_token_file
from swarmpipe.peer.model.hf_checkpoint import resolve_spec
from swarmpipe.peer.model.tiny import MIN_VOCAB_SIZE, SPECIAL_TOKENS, make_tiny_llama_checkpoint, train_tokenizer
from swarmpipe.peer.spec import spec_from_dict

pytestmark = [pytest.mark.unit, pytest.mark.timeout(15)]

SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--seq-len", "64"]
ODD_TEXT = "héllo wörld ✓ 𝄞 \x00\x7f tab\there\r\n"  # multi-byte, astral, control characters


def text_file(tmp_path: Path, name: str = "corpus.txt", repeat: int = 40) -> Path:
    path = tmp_path / name
    path.write_text("\n".join(f"def f{i}(x):\n    return x * {i}  # the quick brown fox" for i in range(repeat)))
    return path


def test_tiny_llama_loads_in_transformers_and_resolves_as_a_swarm_checkpoint(tmp_path: Path, capsys):
    out = tmp_path / "tiny"

    assert cli_main(["tiny-llama", "--out", str(out), "--seq-len", "128"]) == 0  # default text: the stdlib

    line = capsys.readouterr().out.strip()
    assert line.startswith(f"wrote a random LlamaForCausalLM to {out}: 4 layers, hidden 128, vocab 512")
    assert "Python standard library" in line and "\n" not in line
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert len(tok) == cfg.vocab_size == 512
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 128, 4, 2)
    assert cfg.intermediate_size == 384 and cfg.max_position_embeddings == 128 and not cfg.tie_word_embeddings
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (0, 1, 2)
    assert tok.model_max_length == 128
    ids = tok(ODD_TEXT, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == ODD_TEXT  # every byte encodable
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 512) and torch.isfinite(logits).all()

    spec = resolve_spec(spec_from_dict({"num_stages": 2, "model": {"family": "llama", "checkpoint": str(out)}}))
    m = spec.model
    assert (m.vocab_size, m.n_layers, m.d_model, m.n_kv_heads, m.max_position) == (512, 4, 128, 2, 128)
    assert (m.bos_token_id, m.eos_token_id) == (1, 2)


def test_tiny_llama_from_text_seeded_and_tied(tmp_path: Path, capsys):
    corpus = text_file(tmp_path)
    args = ["tiny-llama", "--text", str(corpus), "--vocab-size", "300", *SMALL]

    assert cli_main([*args, "--out", str(tmp_path / "a"), "--tie"]) == 0
    assert cli_main([*args, "--out", str(tmp_path / "b"), "--tie"]) == 0
    assert cli_main([*args, "--out", str(tmp_path / "c"), "--seed", "1", "--intermediate", "96"]) == 0

    assert str(corpus) in capsys.readouterr().out
    a, b, c = (load_file(tmp_path / name / "model.safetensors") for name in "abc")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # same seed, same weights
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert "lm_head.weight" not in a and "lm_head.weight" in c  # tied heads are not stored twice
    assert a["model.embed_tokens.weight"].shape == (300, 64)
    assert c["model.layers.0.mlp.up_proj.weight"].shape == (96, 64)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"), local_files_only=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_train_tokenizer_vocab_bounds_and_specials():
    tok = train_tokenizer(["aaaa bbbb " * 50], 400)
    assert MIN_VOCAB_SIZE <= len(tok) <= 400  # a tiny text has few pairs to merge
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS.values()] == [0, 1, 2, 3]
    ids = tok(ODD_TEXT, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == ODD_TEXT
    with pytest.raises(ValueError, match="at least 260"):
        train_tokenizer(["text"], 259)


def test_tokenize_writes_a_token_file_for_the_tokenizer(tmp_path: Path, capsys):
    folder = make_tokenizer(tmp_path / "tok", vocab_size=320)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": f"document {i}: {ODD_TEXT}"}) for i in range(5)))
    out = tmp_path / "data.tokens"

    assert cli_main(["tokenize", "--data", str(docs), "--tokenizer", str(folder), "--out", str(out)]) == 0

    line = capsys.readouterr().out.strip()
    ids, info = open_token_file(out)
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert info.vocab_size == len(tok) == 320 and info.eos_token_id == tok.eos_token_id
    assert info.documents == 5 and info.tokens == ids.size and info.dtype == "uint16"
    assert line == f"tokenized {info.tokens:,} tokens in 5 documents as uint16 into {out}"
    first = tok("document 0: " + ODD_TEXT, add_special_tokens=False)["input_ids"]
    assert ids[: len(first) + 1].tolist() == [*first, tok.eos_token_id]
    assert json.loads((tmp_path / "data.tokens.json").read_text())["vocab_size"] == 320

    assert (
        cli_main(["tokenize", "--data", str(docs), "--tokenizer", str(folder), "--out", str(out), "--max-tokens", "7"])
        == 0
    )
    assert np.asarray(open_token_file(out)[0]).size == 7
    assert "tokenized 7 tokens" in capsys.readouterr().out


def test_tokenize_the_tiny_llama_tokenizer(tmp_path: Path, capsys):
    corpus = text_file(tmp_path)
    assert (
        cli_main(["tiny-llama", "--out", str(tmp_path / "m"), "--text", str(corpus), "--vocab-size", "290", *SMALL])
        == 0
    )
    out = tmp_path / "c.tokens"
    assert cli_main(["tokenize", "--data", str(corpus), "--tokenizer", str(tmp_path / "m"), "--out", str(out)]) == 0
    ids, info = open_token_file(out)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert info.vocab_size == config["vocab_size"] == 290 and info.eos_token_id == config["eos_token_id"]
    assert int(ids.max()) < 290 and info.documents == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["tiny-llama", "--text", "{tmp}/missing.txt", "--out", "{tmp}/m"],
            "text path {tmp}/missing.txt does not exist",
        ),
        (["tiny-llama", "--text", "{tmp}/empty", "--out", "{tmp}/m"], "has no text files"),
        (["tiny-llama", "--out", "{tmp}/m", "--hidden", "66"], "hidden 66 is not a multiple of heads 4"),
        (["tiny-llama", "--out", "{tmp}/m", "--vocab-size", "100"], "vocab_size must be at least 260"),
        (["tiny-llama", "--out", "{tmp}/full"], "output {tmp}/full exists and is not an empty folder"),
        (["tiny-llama"], "--out is required"),
        (
            ["tokenize", "--data", "{tmp}/a.txt", "--tokenizer", "{tmp}/nope", "--out", "{tmp}/a.tokens"],
            "tokenizer folder {tmp}/nope does not exist",
        ),
        (
            ["tokenize", "--data", "{tmp}/a.txt", "--tokenizer", "{tmp}/empty", "--out", "{tmp}/a.tokens"],
            "no tokenizer in {tmp}/empty",
        ),
        (
            ["tokenize", "--data", "{tmp}/a.txt", "--tokenizer", "{tmp}/empty"],
            "--data, --tokenizer and --out are required",
        ),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(tmp_path: Path, capsys, argv: list[str], message: str):
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "a.txt").write_text("some text")
    command = argv[0]

    assert cli_main([a.format(tmp=tmp_path) for a in argv]) == 2

    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"swarmpipe {command}: error: ")
    assert message.format(tmp=tmp_path) in captured.err
    assert not (tmp_path / "m").exists() and not (tmp_path / "a.tokens").exists()


def test_library_refuses_a_file_as_output(tmp_path: Path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not an empty folder"):
        make_tiny_llama_checkpoint(tmp_path / "f")
