"""A real swarm fine-tunes a Hugging Face Llama checkpoint with LoRA on a local text file.

The peers have no copy of the checkpoint (the path in the spec is a link removed once the coordinator
has resolved it): the first replica of each stage downloads its base weights from the coordinator, the
second (joining after some training) its base and the trained adapters from that replica. The trainer tokenizes the text, validation loss falls, nothing is lost; a
trainer stopped mid-run and restarted from its state file never trains a sequence twice; the
coordinator's checkpoint exports to a folder transformers and PEFT load, with the swarm's logits.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from swarm_support import events_of

from swarmpipe.cli.launcher import wait_for
from tests.hf_fixtures import make_tokenizer, stdlib_texts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
SEQ = 32


def make_checkpoint(folder: Path, pretrain_on: Path) -> None:
    """A tiny Llama and its BPE tokenizer in one folder, pretrained for a few seconds on ``pretrain_on``
    (LoRA adapts features; a random base has none worth adapting)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from swarmpipe.peer.data import open_dataset

    tokenizer = make_tokenizer(folder, vocab_size=320)
    vocab = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = open_dataset(str(pretrain_on), SEQ, vocab, str(folder), seed=0).batches(16)
    for _ in range(150):
        inputs, targets, _ = batches.next()
        logits = model(inputs).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(str(folder))


def data_events(swarm, trainer_log_from: int) -> list[list[int]]:
    return [e["sequences"] for e in events_of(swarm, "data")[trainer_log_from:]]


def test_lora_swarm_on_a_hf_checkpoint(swarm, tmp_path):
    pretraining = tmp_path / "pretraining.txt"
    pretraining.write_text("\n\n".join(stdlib_texts(("textwrap.py", "csv.py", "json/decoder.py", "string.py"))))
    real = tmp_path / "tiny-llama"
    make_checkpoint(real, pretraining)
    link = tmp_path / "llama-link"
    link.symlink_to(real)
    # the fine-tuning data: regular code of one kind, so the held-out start of the stream is like the rest and
    # LoRA's effect stands far above the noise of asynchronous training
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"def handler_{i}(request):\n    return response(request, {i})\n\n" for i in range(3000)))
    spec = swarm.write_spec(
        2,
        microbatch_size=8,
        lr=5e-3,
        warmup_steps=0,
        settings={
            "layer_split": [2, 2],
            "model": {"family": "llama", "checkpoint": str(link), "seq_len": SEQ},
            "finetune": {
                "method": "lora",
                "lora_rank": 8,
                "lora_alpha": 16.0,
                "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            },
        },
    )
    swarm.start_coordinator(spec, "--checkpoint-every", "3")
    link.unlink()  # from here on no peer can read the checkpoint locally: the swarm serves it
    peers = [swarm.wait_ready(swarm.start_peer(stage)) for stage in (0, 1)]
    assert [e["source"] for e in events_of(swarm, "base_loaded")] == ["coordinator"] * 2
    _hostile_base_requests(swarm, peers)
    _swarm_forward_equals_transformers(peers, real)

    trainer, report_path = swarm.start_trainer(
        60, "--data", str(text), "--tokenizer", str(real), "--eval-every", "20", "--eval-batches", "4"
    )
    report = swarm.wait_report(trainer, report_path, timeout=240)
    assert trainer.proc.returncode == 0, trainer.log_text()[-3000:]
    assert report["microbatches_lost"] == 0, report
    steps, val = zip(*report["val_losses"])
    assert steps[0] == 0 and len(val) >= 4, report["val_losses"]  # the base model's loss first
    # a synchronous run of the same length: 4.5 -> 3.0; asynchronous updates are noisier
    assert min(val[1:]) < val[0] - 0.3 and val[-1] < val[0] - 0.1, report["val_losses"]

    # --- second replicas: the frozen base from a replica, the adapters (and their optimizer) from a replica
    second = [swarm.start_peer(stage, wait=False) for stage in (0, 1)]
    for peer in second:
        swarm.wait_ready(peer)
    assert sorted(e["source"] for e in events_of(swarm, "base_loaded")) == ["coordinator"] * 2 + ["replicas"] * 2
    assert [e["source"] for e in events_of(swarm, "state_loaded")] == ["replicas"] * 2

    # --- resume: stop a trainer mid-run, restart it from its state file: no sequence twice
    state = tmp_path / "trainer-state.json"
    before = len(events_of(swarm, "data"))
    args = (
        "--data",
        str(text),
        "--tokenizer",
        str(real),
        "--state-file",
        str(state),
        "--shard",
        "1",
        "--num-shards",
        "2",
    )
    trainer, report_path = swarm.start_trainer(40, *args, name="resumable")
    wait_for(lambda: len(events_of(swarm, "data")) - before >= 12, 120, "the trainer to take 12 micro-batches")
    trainer.proc.send_signal(signal.SIGTERM)
    stopped = swarm.wait_report(trainer, report_path, timeout=120)
    saved = json.loads(state.read_text())
    assert saved["cursor"]["position"] > 0 and saved["counters"]["completed"] == stopped["microbatches_completed"]
    middle = len(events_of(swarm, "data"))
    trainer, report_path = swarm.start_trainer(40, *args, name="resumed")
    resumed = swarm.wait_report(trainer, report_path, timeout=240)
    assert resumed["microbatches_completed"] == 40 and resumed["microbatches_lost"] == 0, resumed
    first_run = [k for seqs in data_events(swarm, before)[: middle - before] for k in seqs]
    second_run = [k for seqs in data_events(swarm, middle) for k in seqs]
    assert not set(first_run) & set(second_run), "a sequence was trained twice"
    assert len(set(first_run + second_run)) == len(first_run + second_run)
    assert all(k % 2 == 1 for k in first_run + second_run)  # shard 1 of 2

    # --- export the coordinator's checkpoint and load it with transformers + PEFT
    ckpt_root = swarm.workdir / "checkpoints"
    wait_for(lambda: (ckpt_root / "latest").exists() and _has_both_stages(ckpt_root), 60, "a checkpoint of both stages")
    out = tmp_path / "export"
    from swarmpipe.cli.main import main

    assert main(["export", "--checkpoint", str(ckpt_root), "--out", str(out), "--base", str(real)]) == 0
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(real)), str(out)).eval()
    tokens = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exported = model(tokens).logits
    assert torch.allclose(exported, _swarm_logits(ckpt_root, real, tokens), atol=1e-4)


def _has_both_stages(root: Path) -> bool:
    manifest = json.loads((root / (root / "latest").read_text().strip() / "manifest.json").read_text())
    return all(manifest["stages"].get(str(s), {}).get("version", 0) > 0 for s in (0, 1))


def _swarm_logits(ckpt_root: Path, base: Path, tokens: torch.Tensor) -> torch.Tensor:
    """What the swarm's stages compute with the checkpointed adapters (the peers' own code)."""
    from safetensors.torch import load_file

    from swarmpipe.peer.spec import spec_from_dict
    from swarmpipe.peer.stage.base_weights import read_local_base
    from swarmpipe.peer.stage.runtime import StageRuntime
    from swarmpipe.peer.state.format import StageState

    folder = ckpt_root / (ckpt_root / "latest").read_text().strip()
    spec = spec_from_dict(json.loads((folder / "spec.json").read_text()))
    x = tokens
    for stage in range(spec.num_stages):
        runtime = StageRuntime(spec, stage)
        read_local_base(str(base), runtime)
        meta = json.loads((folder / f"stage-{stage}.json").read_text())
        runtime.weights.import_state(StageState(load_file(str(folder / f"stage-{stage}.safetensors")), meta))
        x = runtime.evaluate(x)
    return x


def _hostile_base_requests(swarm, peers: list[dict]) -> None:
    """DownloadState(base=true) for a stage that does not exist, the wrong stage or the wrong run gets a
    clear error from the coordinator and from a peer, and changes nothing."""
    import grpc

    from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

    coordinator = wait_for(lambda: swarm.api().get("coordinator", {}).get("checkpoint_server"), 30, "checkpoint server")
    cases = [
        (coordinator, "test", 7, grpc.StatusCode.INVALID_ARGUMENT, "stage 7 does not exist"),
        (coordinator, "other-run", 0, grpc.StatusCode.INVALID_ARGUMENT, "wrong run id"),
        (peers[0]["address"], "test", 1, grpc.StatusCode.FAILED_PRECONDITION, "wrong stage"),
        (peers[0]["address"], "other-run", 0, grpc.StatusCode.FAILED_PRECONDITION, "run"),
    ]
    for address, run_id, stage, code, fragment in cases:
        with grpc.insecure_channel(address) as channel:
            request = swarm_pb2.DownloadStateRequest(run_id=run_id, stage=stage, base=True)
            with pytest.raises(grpc.RpcError) as failure:
                list(swarm_pb2_grpc.StageStub(channel).DownloadState(request, timeout=30))
        assert failure.value.code() == code and fragment in failure.value.details(), (address, failure.value)


def _swarm_forward_equals_transformers(peers: list[dict], base: Path) -> None:
    """Forward-only calls through the two peers (fp32 on the wire) give LlamaForCausalLM's logits: the
    adapters start at zero, so the swarm computes exactly the base checkpoint."""
    import grpc
    from transformers import AutoModelForCausalLM

    from swarmpipe.peer.transport.wire import decode, encode
    from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

    tokens = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(1))
    x = tokens
    for stage, peer in enumerate(peers):
        with grpc.insecure_channel(peer["address"]) as channel:
            request = swarm_pb2.ForwardRequest(
                run_id="test",
                stage=stage,
                microbatch_id=f"eval-{stage}",
                input=encode(x, "none"),
                reply_codec="none",
                evaluate=True,
            )
            x = decode(swarm_pb2_grpc.StageStub(channel).Forward(request, timeout=30).output)
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(str(base)).eval()(tokens).logits
    torch.testing.assert_close(x, expected, atol=1e-4, rtol=1e-4)
