"""The llama family: stages built from a Hugging Face checkpoint compute exactly what transformers'
``LlamaForCausalLM`` computes, train like it, read only their own tensors, and LoRA trains only adapters."""

from __future__ import annotations

import json

import pytest
import torch

from swarmpipe.peer.model.hf_checkpoint import CheckpointError, HFCheckpoint, resolve_spec
from swarmpipe.peer.spec import SpecError, spec_from_dict
from swarmpipe.peer.stage.base_weights import read_local_base
from swarmpipe.peer.stage.runtime import StageRuntime
from tests.hf_fixtures import make_tiny_llama

pytestmark = pytest.mark.timeout(120)
SEQ = 16


def llama_spec(folder, split=(2, 1), **extra):
    data = {
        "num_stages": len(split),
        "layer_split": list(split),
        "model": {"family": "llama", "checkpoint": str(folder), "seq_len": SEQ},
        "optimizer": {"kind": "adamw", "lr": 1e-2, "warmup_steps": 0, "clip_norm": 0.0, "weight_decay": 0.0},
    }
    for key, value in extra.items():
        data.setdefault(key, {}).update(value) if isinstance(value, dict) else data.__setitem__(key, value)
    return resolve_spec(spec_from_dict(data))


def load_stages(spec, folder):
    stages = []
    for s in range(spec.num_stages):
        runtime = StageRuntime(spec, s)
        assert runtime.weights.awaiting_base
        read_local_base(str(folder), runtime)
        assert not runtime.weights.awaiting_base
        stages.append(runtime)
    return stages


def reference(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa").float().eval()


@pytest.mark.parametrize(
    "kind",
    [
        dict(tie=False, kv_heads=4),
        dict(tie=True, kv_heads=2),
        dict(tie=False, kv_heads=1, model_type="qwen2"),
        dict(tie=False, kv_heads=2, model_type="mistral"),
    ],
    ids=["untied-mha", "tied-gqa", "qwen2-mqa-bias", "mistral-gqa"],
)
def test_stages_compute_the_logits_of_the_whole_hf_model(tmp_path, kind):
    make_tiny_llama(tmp_path, **kind)
    spec = llama_spec(tmp_path)
    assert spec.model.hf_model_type == kind.get("model_type", "llama")
    assert spec.model.tie_embeddings is kind["tie"] and spec.model.kv_heads() == kind["kv_heads"]
    tokens = torch.randint(0, spec.model.vocab_size, (3, SEQ), generator=torch.Generator().manual_seed(0))
    x = tokens
    for runtime in load_stages(spec, tmp_path):
        x = runtime.evaluate(x)
    with torch.no_grad():
        expected = reference(tmp_path)(tokens).logits
    torch.testing.assert_close(x, expected, atol=1e-4, rtol=1e-4)


def test_one_synchronous_step_matches_transformers_and_torch_adamw(tmp_path):
    make_tiny_llama(tmp_path, tie=False, kv_heads=2)
    spec = llama_spec(tmp_path)
    first, last = load_stages(spec, tmp_path)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec.model.vocab_size, (2, SEQ + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    hidden = first.forward("mb-0", inputs)
    result = last.forward_backward(hidden, targets)
    first.backward("mb-0", result.grad_input)
    assert first.version == last.version == 1

    model = reference(tmp_path).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    logits = model(inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    opt.step()
    assert result.loss == pytest.approx(loss.item(), abs=1e-5)
    ours = {}
    for runtime in (first, last):
        ours.update(
            {(n if n.startswith("lm_head") else f"model.{n}"): p for n, p in runtime.weights.trainable().items()}
        )
    theirs = dict(model.named_parameters())
    assert set(ours) == set(theirs)
    for name, p in theirs.items():
        torch.testing.assert_close(ours[name].detach(), p.detach(), atol=1e-6, rtol=1e-5, msg=name)


def test_a_stage_reads_only_its_own_tensors(tmp_path):
    make_tiny_llama(tmp_path, layers=4, tie=False)
    spec = llama_spec(tmp_path, split=(1, 2, 1))
    total = len(HFCheckpoint.open(tmp_path).files)
    per_layer = 9  # q k v o, gate up down, two norms
    for stage, own in enumerate([1 + per_layer, 2 * per_layer, per_layer + 2]):
        runtime = StageRuntime(spec, stage)
        assert all(p.is_meta for p in runtime.weights.module.parameters())  # nothing allocated before the load
        ckpt = read_local_base(str(tmp_path), runtime)
        assert ckpt.tensors_read == own < total


def test_random_init_llama_from_inline_fields_is_identical_across_replicas():
    spec = spec_from_dict(
        {
            "num_stages": 2,
            "model": {
                "family": "llama",
                "vocab_size": 50,
                "d_model": 16,
                "n_layers": 2,
                "n_heads": 4,
                "n_kv_heads": 2,
                "intermediate_size": 24,
                "seq_len": 8,
                "tie_embeddings": True,
            },
        }
    )
    a, b = StageRuntime(spec, 1), StageRuntime(spec, 1)
    assert not a.weights.awaiting_base
    for (name, p), q in zip(a.weights.module.named_parameters(), b.weights.module.parameters()):
        assert torch.equal(p, q), name
    first = StageRuntime(spec, 0)
    assert torch.equal(
        first.weights.module.embed_tokens.weight, a.weights.module.lm_head.weight
    )  # tied: the head starts equal
    out = a.evaluate(first.evaluate(torch.zeros(2, 8, dtype=torch.long)))
    assert out.shape == (2, 8, 50)


def test_lora_trains_only_adapters_and_transfers_only_them(tmp_path):
    make_tiny_llama(tmp_path, tie=False)
    spec = llama_spec(
        tmp_path,
        finetune={
            "method": "lora",
            "lora_rank": 4,
            "lora_alpha": 8.0,
            "lora_targets": ["q_proj", "v_proj", "down_proj"],
        },
    )
    first, last = load_stages(spec, tmp_path)
    base_before = {
        n: p.detach().clone()
        for r in (first, last)
        for n, p in r.weights.module.named_parameters()
        if not p.requires_grad
    }
    adapters_before = {n: p.detach().clone() for r in (first, last) for n, p in r.weights.trainable().items()}
    assert all(".lora_" in n for n in adapters_before) and len(adapters_before) == 3 * 3 * 2
    gen = torch.Generator().manual_seed(2)
    for i in range(3):
        tokens = torch.randint(0, spec.model.vocab_size, (2, SEQ + 1), generator=gen)
        hidden = first.forward(f"mb-{i}", tokens[:, :-1])
        result = last.forward_backward(hidden, tokens[:, 1:])
        first.backward(f"mb-{i}", result.grad_input)
    for r in (first, last):
        for n, p in r.weights.module.named_parameters():
            if not p.requires_grad:
                assert torch.equal(p, base_before[n]), f"base weight {n} changed"
    changed = [
        n for r in (first, last) for n, p in r.weights.trainable().items() if not torch.equal(p, adapters_before[n])
    ]
    assert len(changed) == len(adapters_before)
    state = first.weights.export_state()
    params = [k for k in state.tensors if k.startswith("param.")]
    assert params and all(".lora_" in k for k in params)
    state_bytes = sum(t.numel() * t.element_size() for t in state.tensors.values())
    base_bytes = sum(
        t.numel() * t.element_size()
        for n, t in base_before.items()
        if n in dict(first.weights.module.named_parameters())
    )
    assert state_bytes < base_bytes / 2
    assert state.meta["base_digest"] == spec.model.base_digest
    fresh = StageRuntime(spec, 0)  # a joiner: base from the checkpoint, adapters and optimizer from the state
    read_local_base(str(tmp_path), fresh)
    fresh.weights.import_state(state)
    for n, p in first.weights.trainable().items():
        assert torch.equal(p, fresh.weights.trainable()[n])


@pytest.mark.parametrize("optimizer", ["adamw", "nesterov", "basis_rotation"])
def test_every_optimizer_steps_lora_adapters(tmp_path, optimizer):
    make_tiny_llama(tmp_path, tie=False)
    spec = llama_spec(tmp_path, split=(3,), finetune={"method": "lora", "lora_rank": 2}, optimizer={"kind": optimizer})
    (stage,) = load_stages(spec, tmp_path)
    before = {n: p.detach().clone() for n, p in stage.weights.trainable().items()}
    tokens = torch.randint(0, spec.model.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        result = stage.forward_backward(tokens[:, :-1], tokens[:, 1:])
        assert result.applied and result.loss > 0
    assert any(not torch.equal(p, before[n]) for n, p in stage.weights.trainable().items())


def test_adapters_refuse_another_base(tmp_path):
    make_tiny_llama(tmp_path / "a", seed=0)
    make_tiny_llama(tmp_path / "b", seed=1)
    lora = {"method": "lora", "lora_rank": 2}
    a = load_stages(llama_spec(tmp_path / "a", split=(3,), finetune=lora), tmp_path / "a")[0]
    spec_b = llama_spec(tmp_path / "b", split=(3,), finetune=lora)
    assert spec_b.model.base_digest != a.spec.model.base_digest
    b = load_stages(spec_b, tmp_path / "b")[0]
    with pytest.raises(ValueError, match="base"):
        b.weights.import_state(a.weights.export_state())
    with pytest.raises(CheckpointError, match="not this run's base"):
        read_local_base(str(tmp_path / "a"), StageRuntime(spec_b, 0))


def test_bad_checkpoints_get_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        llama_spec(tmp_path)
    make_tiny_llama(tmp_path / "ok")
    with pytest.raises(SpecError, match="does not add up to the checkpoint's 3 layers"):
        llama_spec(tmp_path / "ok", split=(2, 2))
    with pytest.raises(SpecError, match="max_position_embeddings"):
        resolve_spec(
            spec_from_dict(
                {"model": {"family": "llama", "checkpoint": str(tmp_path / "ok"), "seq_len": 100}, "num_stages": 1}
            )
        )
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
        llama_spec(gpt2)
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        llama_spec(empty)
    with pytest.raises(SpecError, match="no checkpoint format"):
        resolve_spec(spec_from_dict({"model": {"checkpoint": str(tmp_path / "ok")}, "num_stages": 1}))
    with pytest.raises(SpecError, match="match no linear layer"):
        StageRuntime(llama_spec(tmp_path / "ok", split=(3,), finetune={"method": "lora", "lora_targets": ["nope"]}), 0)
