"""swarmpipe.coordinator.export: a checkpoint's stages as a Hugging Face folder that transformers (and PEFT)
load with the same logits; the checks that refuse incomplete, mismatched or foreign checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_fixtures import make_tiny_llama
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from swarmpipe.cli.main import main as cli_main
from swarmpipe.coordinator.checkpoints import CheckpointStore
from swarmpipe.coordinator.export import ExportError, export_checkpoint
from swarmpipe.peer.model.bytegpt import ByteGPT
from swarmpipe.peer.spec import FinetuneSpec, ModelSpec, RunSpec, spec_from_dict
from swarmpipe.peer.state.format import StageState

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]
ATOL = 1e-5
TOKENS = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(7))
LORA_TARGETS = ["q_proj", "v_proj", "down_proj"]


# ------------------------------------------------------------------------------------------------ helpers


def llama_spec(cfg, base: Path | str = "", **finetune) -> RunSpec:
    """The run spec of a 2-stage [2, 1] pipeline of the model ``cfg`` describes."""
    rope = dict(cfg.rope_parameters)
    theta = rope.pop("rope_theta")
    model = ModelSpec(
        family="llama",
        checkpoint=str(base),
        vocab_size=cfg.vocab_size,
        d_model=cfg.hidden_size,
        n_layers=cfg.num_hidden_layers,
        n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size,
        seq_len=16,
        rope_theta=theta,
        rope_scaling=json.dumps(rope) if rope.get("rope_type", "default") != "default" else "",
        norm_eps=cfg.rms_norm_eps,
        tie_embeddings=cfg.tie_word_embeddings,
        attention_bias=bool(getattr(cfg, "attention_bias", cfg.model_type == "qwen2")),
        max_position=cfg.max_position_embeddings,
        hf_model_type=cfg.model_type,
        bos_token_id=1,
        eos_token_id=2,
    )
    return RunSpec(run_id="export", num_stages=2, layer_split=[2, 1], model=model, finetune=FinetuneSpec(**finetune))


def split_llama(hf: dict[str, torch.Tensor], spec: RunSpec) -> list[dict[str, torch.Tensor]]:
    """Hugging Face tensors -> per-stage swarmpipe names (the head its own copy, also when tied)."""
    last = spec.num_stages - 1
    stages: list[dict[str, torch.Tensor]] = [{} for _ in range(spec.num_stages)]
    for hf_name, tensor in hf.items():
        name = hf_name.removeprefix("model.")
        if name.startswith("layers."):
            index = int(name.split(".")[1])
            stage = next(s for s in range(spec.num_stages) if index in spec.block_range(s))
        else:
            stage = 0 if name == "embed_tokens.weight" else last
        stages[stage][name] = tensor.clone()
    stages[last].setdefault("lm_head.weight", hf["model.embed_tokens.weight"].clone())
    return stages


def save_checkpoint(
    root: Path, spec: RunSpec, stages: list[dict[str, torch.Tensor]], meta=None, with_spec: bool = True
) -> Path:
    """A coordinator checkpoint of ``stages`` (with optimizer state export must ignore)."""
    store = CheckpointStore(root, spec.num_stages, spec=spec if with_spec else None)
    states = {}
    for s, tensors in enumerate(stages):
        named = {f"param.{n}": t.clone() for n, t in tensors.items()}
        named.update({f"optim.{i}.exp_avg": torch.ones_like(t) for i, t in enumerate(tensors.values())})
        states[s] = StageState(named, {"stage": s, "version": 5, "run_id": spec.run_id, **(meta or {})})
    store.save(states)
    return root


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(TOKENS).logits


def load(folder: Path):
    return AutoModelForCausalLM.from_pretrained(str(folder))


def random_adapters(spec: RunSpec, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    m, f = spec.model, spec.finetune
    hd = m.head_size()
    shapes = {
        "q_proj": (m.n_heads * hd, m.d_model),
        "v_proj": (m.kv_heads() * hd, m.d_model),
        "down_proj": (m.d_model, m.intermediate_size),
    }
    where = {"q_proj": "self_attn", "v_proj": "self_attn", "down_proj": "mlp"}
    stages: list[dict[str, torch.Tensor]] = [{} for _ in range(spec.num_stages)]
    for s in range(spec.num_stages):
        for i in spec.block_range(s):
            for target in f.lora_targets:
                out_f, in_f = shapes[target]
                name = f"layers.{i}.{where[target]}.{target}"
                stages[s][f"{name}.lora_A"] = torch.randn(f.lora_rank, in_f, generator=gen) * 0.2
                stages[s][f"{name}.lora_B"] = torch.randn(out_f, f.lora_rank, generator=gen) * 0.2
    return stages


@pytest.fixture
def tiny(tmp_path: Path):
    base = tmp_path / "base"
    cfg = make_tiny_llama(base)
    return base, cfg, load_file(str(base / "model.safetensors"))


# ------------------------------------------------------------------------------------------------ llama, full


@pytest.mark.parametrize(
    ("model_type", "tie"), [("llama", False), ("llama", True), ("mistral", False), ("qwen2", False)]
)
def test_round_trip_same_logits(tmp_path: Path, model_type: str, tie: bool):
    base = tmp_path / "base"
    cfg = make_tiny_llama(base, tie=tie, model_type=model_type)
    (base / "tokenizer_config.json").write_text("{}")  # copied along when the base is on this machine
    spec = llama_spec(cfg, base=base)
    root = save_checkpoint(tmp_path / "ckpt", spec, split_llama(load_file(str(base / "model.safetensors")), spec))

    summary = export_checkpoint(str(root), str(tmp_path / "out"))

    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(load(base)).__name__] and config["tie_word_embeddings"] is tie
    assert summary["tie_word_embeddings"] is tie and summary["step"] == 1 and summary["format"] == "llama"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tie
    assert (out / "tokenizer_config.json").is_file() and (out / "generation_config.json").is_file()
    exported = load(out)
    assert exported.config.num_key_value_heads == 2 and exported.config.rope_parameters["rope_theta"] == 10000.0
    torch.testing.assert_close(logits(exported), logits(load(base)), atol=ATOL, rtol=0)


def test_tied_head_trained_apart_exports_untied(tmp_path: Path):
    base = tmp_path / "base"
    cfg = make_tiny_llama(base, tie=True)
    spec = llama_spec(cfg, base=base)
    stages = split_llama(load_file(str(base / "model.safetensors")), spec)
    stages[1]["lm_head.weight"] += 0.01 * torch.randn(stages[1]["lm_head.weight"].shape)
    root = save_checkpoint(tmp_path / "ckpt", spec, stages)

    export_checkpoint(root, tmp_path / "out")

    exported = load(tmp_path / "out")
    assert exported.config.tie_word_embeddings is False
    untied = LlamaForCausalLM(LlamaConfig(**{**cfg.to_dict(), "tie_word_embeddings": False}))
    state = {("" if n == "lm_head.weight" else "model.") + n: t for s in stages for n, t in s.items()}
    untied.load_state_dict(state, strict=False)
    assert torch.equal(untied.lm_head.weight, stages[1]["lm_head.weight"])
    torch.testing.assert_close(logits(exported), logits(untied), atol=ATOL, rtol=0)


def test_sharded_above_the_shard_size_with_rope_scaling(tmp_path: Path):
    base = tmp_path / "base"
    cfg = make_tiny_llama(base, rope_scaling={"rope_type": "linear", "factor": 2.0})
    spec = llama_spec(cfg, base=base)
    assert json.loads(spec.model.rope_scaling)["factor"] == 2.0
    root = save_checkpoint(tmp_path / "ckpt", spec, split_llama(load_file(str(base / "model.safetensors")), spec))

    export_checkpoint(root / "ckpt-000001", tmp_path / "out", max_shard_bytes=20_000)

    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (out / "model.safetensors").exists()
    exported = load(out)
    assert exported.config.rope_parameters["rope_type"] == "linear"
    torch.testing.assert_close(logits(exported), logits(load(base)), atol=ATOL, rtol=0)


def test_llama_attention_bias_and_a_bias_the_class_lacks(tmp_path: Path):
    """Llama's attention_bias: q/k/v/o biases (a missing o_proj bias is written as zeros); Qwen2 has no
    o_proj bias, so a checkpoint that holds one is refused rather than exported without it."""
    base = tmp_path / "base"
    cfg = make_tiny_llama(base, attention_bias=True)
    spec = llama_spec(cfg, base=base)
    hf = load_file(str(base / "model.safetensors"))
    root = save_checkpoint(tmp_path / "ckpt", spec, split_llama(hf, spec))
    export_checkpoint(root, tmp_path / "out")
    torch.testing.assert_close(logits(load(tmp_path / "out")), logits(load(base)), atol=ATOL, rtol=0)

    no_o_bias = {n: t for n, t in hf.items() if not n.endswith("o_proj.bias")}
    root = save_checkpoint(tmp_path / "ckpt2", spec, split_llama(no_o_bias, spec))
    export_checkpoint(root, tmp_path / "out2")
    reference = load(base)
    with torch.no_grad():
        for layer in reference.model.layers:
            layer.self_attn.o_proj.bias.zero_()
    torch.testing.assert_close(logits(load(tmp_path / "out2")), logits(reference), atol=ATOL, rtol=0)

    qwen = tmp_path / "qwen"
    qwen_cfg = make_tiny_llama(qwen, model_type="qwen2")
    qwen_spec = llama_spec(qwen_cfg, base=qwen)
    qwen_hf = load_file(str(qwen / "model.safetensors"))
    qwen_hf["model.layers.0.self_attn.o_proj.bias"] = torch.ones(qwen_cfg.hidden_size)
    root = save_checkpoint(tmp_path / "ckpt3", qwen_spec, split_llama(qwen_hf, qwen_spec))
    with pytest.raises(ExportError, match=r"unexpected tensor\(s\) layers\.0\.self_attn\.o_proj\.bias"):
        export_checkpoint(root, tmp_path / "out3")


def test_checkpoint_store_writes_spec_json_and_the_cli_exports(tmp_path: Path, tiny, capsys):
    base, cfg, hf = tiny
    spec = llama_spec(cfg, base=base)
    root = save_checkpoint(tmp_path / "ckpt", spec, split_llama(hf, spec))
    stored = json.loads((root / "ckpt-000001" / "spec.json").read_text())
    assert spec_from_dict(stored) == spec

    code = cli_main(["export", "--checkpoint", str(root), "--out", str(tmp_path / "out")])

    assert code == 0
    assert "exported step 1" in capsys.readouterr().out
    torch.testing.assert_close(logits(load(tmp_path / "out")), logits(load(base)), atol=ATOL, rtol=0)
    assert cli_main(["export", "--checkpoint", str(root), "--out", str(tmp_path / "out")]) == 2  # not empty
    assert "not empty" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ LoRA


@pytest.mark.parametrize("tie", [False, True])
def test_lora_peft_adapter_merge_and_manual_agree(tmp_path: Path, tie: bool):
    base = tmp_path / "base"
    cfg = make_tiny_llama(base, tie=tie)
    hf = load_file(str(base / "model.safetensors"))
    spec = llama_spec(
        cfg, base=base, method="lora", lora_rank=4, lora_alpha=8.0, lora_targets=list(LORA_TARGETS)
    ).validate()
    adapters = random_adapters(spec)
    root = save_checkpoint(tmp_path / "ckpt", spec, adapters)

    peft_summary = export_checkpoint(root, tmp_path / "peft")
    merged_summary = export_checkpoint(root, tmp_path / "merged", merge=True)

    adapter_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8.0
    assert adapter_config["base_model_name_or_path"] == str(base.resolve())
    assert peft_summary["format"] == "peft" and merged_summary["format"] == "merged"
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), framework="pt") as f:
        assert "base_model.model.model.layers.2.mlp.down_proj.lora_B.weight" in f.keys()
        assert len(list(f.keys())) == 2 * len(LORA_TARGETS) * cfg.num_hidden_layers

    peft_model = PeftModel.from_pretrained(load(base), str(tmp_path / "peft"))
    manual = dict(hf)
    for stage in adapters:
        for name, a in stage.items():
            if name.endswith("lora_A"):
                module = name.removesuffix(".lora_A")
                manual[f"model.{module}.weight"] = hf[f"model.{module}.weight"] + 2.0 * stage[f"{module}.lora_B"] @ a
    reference = LlamaForCausalLM(cfg)
    missing, unexpected = reference.load_state_dict(manual, strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if tie else [])
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is tie
    expected = logits(reference)
    assert not torch.allclose(expected, logits(load(base)), atol=1e-3)  # the adapters change the model
    torch.testing.assert_close(logits(peft_model), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits(load(tmp_path / "merged")), expected, atol=ATOL, rtol=0)


def test_lora_refuses_adapters_of_another_base(tmp_path: Path, tiny):
    base, cfg, _ = tiny
    spec = llama_spec(cfg, base=base, method="lora", lora_rank=2, lora_targets=["q_proj", "v_proj"])
    spec.model.base_digest = "b" * 32
    root = save_checkpoint(tmp_path / "ckpt", spec, random_adapters(spec), meta={"base_digest": "a" * 32})

    with pytest.raises(ExportError, match="another base"):
        export_checkpoint(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_lora_merge_refuses_a_base_folder_with_another_digest(tmp_path: Path, tiny):
    from swarmpipe.peer.model.hf_checkpoint import HFCheckpoint

    base, cfg, _ = tiny
    other = tmp_path / "other"
    make_tiny_llama(other, seed=1, rms_norm_eps=1e-5)  # the digest covers config.json and the tensor index
    spec = llama_spec(cfg, base=base, method="lora", lora_rank=2, lora_targets=["q_proj"])
    spec.model.base_digest = HFCheckpoint.open(base).digest()
    root = save_checkpoint(tmp_path / "ckpt", spec, random_adapters(spec), meta={"base_digest": spec.model.base_digest})

    with pytest.raises(ExportError, match="pass --base with the run's base"):
        export_checkpoint(root, tmp_path / "out", merge=True, base=str(other))
    export_checkpoint(root, tmp_path / "out", merge=True)  # the spec's own base
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_lora_merge_needs_the_base(tmp_path: Path, tiny):
    _, cfg, _ = tiny
    spec = llama_spec(cfg, base="", method="lora", lora_rank=2, lora_targets=["q_proj"])
    root = save_checkpoint(tmp_path / "ckpt", spec, random_adapters(spec))

    with pytest.raises(ExportError, match="merging needs the base model folder"):
        export_checkpoint(root, tmp_path / "out", merge=True)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


# ------------------------------------------------------------------------------------------------ bytegpt


def test_bytegpt_exports_as_gpt2_with_the_same_logits(tmp_path: Path):
    spec = RunSpec(
        num_stages=2, layer_split=[1, 2], model=ModelSpec(vocab_size=50, d_model=32, n_layers=3, n_heads=4, seq_len=16)
    ).validate()
    model = ByteGPT(spec).eval()
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    stages = [{n: p.detach().clone() for n, p in stage.named_parameters()} for stage in model.stages]
    root = save_checkpoint(tmp_path / "ckpt", spec, stages)

    summary = export_checkpoint(root, tmp_path / "out")

    exported = load(tmp_path / "out").eval()
    assert summary["architecture"] == "GPT2LMHeadModel" and exported.config.n_inner == 128
    tokens = torch.randint(0, 50, (2, 16), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, model(tokens), atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------------ refusals


def test_missing_stage_file(tmp_path: Path, tiny):
    _, cfg, hf = tiny
    spec = llama_spec(cfg)
    root = save_checkpoint(tmp_path / "ckpt", spec, split_llama(hf, spec)[:1])  # stage 1 never checkpointed

    with pytest.raises(ExportError, match=r"stage 1 of 2 is missing .*\(no stage-1\.safetensors\)"):
        export_checkpoint(root, tmp_path / "out")


def test_wrong_shape_and_unexpected_tensor(tmp_path: Path, tiny):
    _, cfg, hf = tiny
    spec = llama_spec(cfg)
    stages = split_llama(hf, spec)
    stages[1]["layers.2.mlp.up_proj.weight"] = stages[1]["layers.2.mlp.up_proj.weight"][:-1]
    root = save_checkpoint(tmp_path / "ckpt", spec, stages)
    with pytest.raises(ExportError, match=r"stage 1 .* wrong shape: layers\.2\.mlp\.up_proj\.weight \[63, 32\]"):
        export_checkpoint(root, tmp_path / "out")

    stages = split_llama(hf, spec)
    stages[0]["layers.0.extra.weight"] = torch.zeros(2)
    root = save_checkpoint(tmp_path / "ckpt2", spec, stages)
    with pytest.raises(ExportError, match=r"stage 0 .* unexpected tensor\(s\) layers\.0\.extra\.weight"):
        export_checkpoint(root, tmp_path / "out")

    stages = split_llama(hf, spec)
    del stages[0]["layers.1.input_layernorm.weight"]
    root = save_checkpoint(tmp_path / "ckpt3", spec, stages)
    with pytest.raises(ExportError, match=r"stage 0 .* lacks layers\.1\.input_layernorm\.weight"):
        export_checkpoint(root, tmp_path / "out")


def test_checkpoint_without_spec_json_needs_a_spec(tmp_path: Path, tiny, capsys):
    base, cfg, hf = tiny
    spec = llama_spec(cfg)
    root = save_checkpoint(tmp_path / "ckpt", spec, split_llama(hf, spec), with_spec=False)
    assert not (root / "ckpt-000001" / "spec.json").exists()

    with pytest.raises(ExportError, match="this checkpoint predates spec.json; pass --spec"):
        export_checkpoint(root, tmp_path / "out")
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec.to_dict()))
    assert (
        cli_main(["export", "--checkpoint", str(root), "--out", str(tmp_path / "out"), "--spec", str(spec_file)]) == 0
    )
    export_checkpoint(root, tmp_path / "out2", spec=spec)
    torch.testing.assert_close(logits(load(tmp_path / "out2")), logits(load(base)), atol=ATOL, rtol=0)


def test_merge_of_a_full_run_and_a_folder_that_is_no_checkpoint(tmp_path: Path, tiny):
    _, cfg, hf = tiny
    spec = llama_spec(cfg)
    root = save_checkpoint(tmp_path / "ckpt", spec, split_llama(hf, spec))
    with pytest.raises(ExportError, match="method full"):
        export_checkpoint(root, tmp_path / "out", merge=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="neither a checkpoint root"):
        export_checkpoint(tmp_path / "empty", tmp_path / "out")
