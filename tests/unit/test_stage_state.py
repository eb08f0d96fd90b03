"""A stage's state: export/import round trips, chunked streams (also cut off), checkpoint folders."""

from __future__ import annotations

import json

import pytest
import torch

from swarmpipe.coordinator.checkpoints import CheckpointStore
from swarmpipe.peer.spec import load_spec
from swarmpipe.peer.stage.runtime import StageRuntime
from swarmpipe.peer.state.format import (
    MixedState,
    StageState,
    StateError,
    assemble,
    from_chunks,
    to_chunks,
)

pytestmark = pytest.mark.unit


def _trained_runtime(kind: str = "adamw", stage: int = 1, steps: int = 3) -> StageRuntime:
    spec = load_spec(
        num_stages=2,
        model={"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
        optimizer={"kind": kind, "warmup_steps": 0},
    )
    runtime = StageRuntime(spec, stage)
    gen = torch.Generator().manual_seed(0)
    for i in range(steps):
        if runtime.is_last:
            runtime.forward_backward(
                torch.randn(2, 16, 32, generator=gen), torch.randint(0, 256, (2, 16), generator=gen)
            )
        else:
            out = runtime.forward(f"mb{i}", torch.randint(0, 256, (2, 16), generator=gen))
            runtime.backward(f"mb{i}", torch.randn(out.shape, generator=gen))
    return runtime


def _same_weights(a: StageRuntime, b: StageRuntime) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.weights.module.parameters(), b.weights.module.parameters()))


@pytest.mark.parametrize("kind", ["adamw", "nesterov", "basis_rotation"])
def test_export_import_round_trip_continues_identically(kind: str):
    source = _trained_runtime(kind)
    fresh = StageRuntime(source.spec, source.stage)
    fresh.weights.import_state(source.weights.export_state())
    assert fresh.version == source.version == 3
    assert _same_weights(source, fresh)
    x = torch.randn(2, 16, 32)
    targets = torch.randint(0, 256, (2, 16))
    source.forward_backward(x, targets)
    fresh.forward_backward(x, targets)
    assert _same_weights(source, fresh), "optimizer state must travel too"


def test_chunks_round_trip_in_shards_and_digest():
    state = _trained_runtime().weights.export_state()
    shards = [from_chunks(to_chunks(state, shard, 3)) for shard in range(3)]
    joined = assemble(shards)
    assert set(joined.tensors) == set(state.tensors)
    assert joined.digest() == state.digest()
    assert joined.meta["digest"] == state.digest()


def test_stream_cut_off_midway_fails_cleanly():
    chunks = to_chunks(_trained_runtime().weights.export_state())
    with pytest.raises(StateError, match="ended after"):
        from_chunks(chunks[: len(chunks) // 2])
    with pytest.raises(StateError, match="does not start with metadata"):
        from_chunks(chunks[1:])
    with pytest.raises(StateError, match="missing"):
        assemble([from_chunks(to_chunks(_trained_runtime().weights.export_state(), 0, 2))])


def test_forged_chunk_rejected():
    chunks = to_chunks(_trained_runtime().weights.export_state())
    chunks[1].name = "param.evil"
    with pytest.raises(StateError, match="not listed"):
        from_chunks(chunks)
    chunks = to_chunks(_trained_runtime().weights.export_state())
    chunks[0].metadata_json = "{not json"
    with pytest.raises(StateError, match="not JSON"):
        from_chunks(chunks)


def test_import_refuses_wrong_stage_and_shapes():
    state = _trained_runtime(stage=1).weights.export_state()
    other = StageRuntime(state_spec := _trained_runtime().spec, 0)
    with pytest.raises(StateError, match="stage 1"):
        other.weights.import_state(state)
    bad = StageState(dict(state.tensors), dict(state.meta))
    name = next(k for k in bad.tensors if k.startswith("param."))
    bad.tensors[name] = torch.zeros(3)
    with pytest.raises(StateError, match="shape"):
        StageRuntime(state_spec, 1).weights.import_state(bad)


def test_average_into_blends_weights():
    a, b = _trained_runtime(steps=1), _trained_runtime(steps=4)
    expected = [(p + q) / 2 for p, q in zip(a.weights.module.parameters(), b.weights.module.parameters())]
    a.weights.blend(b.weights.export_state())
    assert all(torch.allclose(p, e) for p, e in zip(a.weights.module.parameters(), expected))
    assert a.version == 4


def test_checkpoint_store_round_trip_and_carry_over(tmp_path):
    store = CheckpointStore(tmp_path, num_stages=2)
    assert store.manifest() is None and store.load(0) is None
    first = _trained_runtime(stage=0).weights.export_state()
    second = _trained_runtime(stage=1).weights.export_state()
    m1 = store.save({0: first, 1: second})
    assert m1["step"] == 1 and m1["stages"]["0"]["digest"] == first.digest()
    loaded = store.load(1)
    assert loaded.digest() == second.digest() and loaded.version == second.version
    # Only stage 1 changes: stage 0 is carried over from the previous checkpoint.
    newer = _trained_runtime(stage=1, steps=5).weights.export_state()
    m2 = store.save({1: newer})
    assert m2["step"] == 2 and m2["stages"]["0"] == m1["stages"]["0"]
    assert store.load(0).digest() == first.digest() and store.load(1).version == 5
    assert (tmp_path / "latest").read_text() == "ckpt-000002"
    # A fresh store on the same folder continues where the last one left off (coordinator restart).
    again = CheckpointStore(tmp_path, num_stages=2)
    assert again.manifest()["step"] == 2
    restored = StageRuntime(_trained_runtime().spec, 1)
    restored.weights.import_state(again.load(1))
    assert restored.version == 5


def test_checkpoint_store_keeps_three_and_ignores_half_written(tmp_path):
    store = CheckpointStore(tmp_path, num_stages=2)
    state = _trained_runtime(stage=0, steps=1).weights.export_state()
    for _ in range(5):
        store.save({0: state})
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-000003", "ckpt-000004", "ckpt-000005"]
    (tmp_path / ".tmp-ckpt-000006-1").mkdir()  # a crash mid-write
    assert json.loads((tmp_path / "ckpt-000005" / "manifest.json").read_text())["step"] == 5
    assert store.manifest()["step"] == 5


def test_shards_of_different_versions_are_never_joined():
    """Two donors at different versions: each shard is valid alone, the mix is refused."""
    older = _trained_runtime(steps=2).weights.export_state()
    newer = _trained_runtime(steps=4).weights.export_state()
    mixed = [from_chunks(to_chunks(older, 0, 2)), from_chunks(to_chunks(newer, 1, 2))]
    with pytest.raises(MixedState, match="2 different snapshots"):
        assemble(mixed)
    assert assemble([from_chunks(to_chunks(newer, s, 2)) for s in range(2)]).digest() == newer.digest()


def test_weights_that_do_not_hash_to_the_announced_digest_are_refused():
    state = _trained_runtime().weights.export_state()
    chunks = to_chunks(state)
    for chunk in chunks[1:]:
        if chunk.name.startswith("param."):
            tampered = state.tensors[chunk.name] + 1.0
            chunk.tensor.CopyFrom(to_chunks(type(state)({chunk.name: tampered}, dict(state.meta)))[1].tensor)
            break
    with pytest.raises(MixedState, match="announced"):
        assemble([from_chunks(chunks)])


def test_lossy_state_codec_announces_the_digest_of_what_arrives():
    state = _trained_runtime().weights.export_state()
    joined = assemble([from_chunks(to_chunks(state, s, 2, codec="fp16")) for s in range(2)])
    assert joined.digest() == state.wire_digest("fp16") != state.digest()
