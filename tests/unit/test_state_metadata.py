"""A state stream's metadata JSON is checked in one place (peer/state/format.py ``check_meta``): every field its
readers use has its JSON type and bounds, else StateError (a ValueError: INVALID_ARGUMENT on the servers), never
an AttributeError or TypeError from deep inside (issue 36). No sockets."""

from __future__ import annotations

import json

import pytest
import torch

from swarmpipe.peer.state.errors import StateError
from swarmpipe.peer.state.format import (
    MAX_NAMES,
    MAX_STAGES,
    MAX_STATE_VERSION,
    StageState,
    capture,
    check_meta,
    from_chunks,
    to_chunks,
)
from swarmpipe.peer.transport.wire import encode
from swarmpipe.protos import swarm_pb2

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

GOOD = {"run_id": "test", "stage": 0, "version": 1, "names": ["param.w"]}
BAD = {
    "an array": [1, 2],
    "a string": "state",
    "a number": 7,
    "null": None,
    "names a number": dict(GOOD, names=5),
    "names an object": dict(GOOD, names={"param.w": 1}),
    "a name a number": dict(GOOD, names=[5]),
    "a name of neither kind": dict(GOOD, names=["weights"]),
    "an optimizer index not a number": dict(GOOD, names=["optim.x.exp_avg"]),
    "a name too long": dict(GOOD, names=["param." + "w" * 600]),
    "too many names": dict(GOOD, names=[f"param.w{i}" for i in range(MAX_NAMES + 1)]),
    "version a string": dict(GOOD, version="1"),
    "version a float": dict(GOOD, version=1.5),
    "version true": dict(GOOD, version=True),
    "version negative": dict(GOOD, version=-1),
    "version past int64": dict(GOOD, version=MAX_STATE_VERSION + 1),
    "stage an array": dict(GOOD, stage=[0]),
    "stage past the last": dict(GOOD, stage=MAX_STAGES),
    "run id an object": dict(GOOD, run_id={"a": 1}),
    "run id of 10 KB": dict(GOOD, run_id="r" * 10_240),
    "digest a number": dict(GOOD, digest=12),
    "base a string": dict(GOOD, base="yes"),
    "signed_at a string": dict(GOOD, signed_at="now"),
    "signer a list": dict(GOOD, signer=["key"]),
    "optimizer an array": dict(GOOD, optimizer=[]),
    "optimizer kind a number": dict(GOOD, optimizer={"kind": 3}),
    "param groups an object": dict(GOOD, optimizer={"param_groups": {}}),
    "a param group a number": dict(GOOD, optimizer={"param_groups": [1]}),
    "a group's params strings": dict(GOOD, optimizer={"param_groups": [{"params": ["a"]}]}),
    "scalars an array": dict(GOOD, optimizer={"scalars": []}),
    "a scalars key not an index": dict(GOOD, optimizer={"scalars": {"x": {}}}),
    "a scalars entry a number": dict(GOOD, optimizer={"scalars": {"0": 1}}),
}


def _stream(metadata_json: str) -> list[swarm_pb2.StateChunk]:
    return [
        swarm_pb2.StateChunk(name="", version=1, metadata_json=metadata_json, index=0, total=2),
        swarm_pb2.StateChunk(name="param.w", tensor=encode(torch.ones(4)), version=1, index=1, total=2),
    ]


@pytest.mark.parametrize("what", sorted(BAD))
def test_metadata_of_the_wrong_type_or_out_of_bounds_is_a_state_error(what: str):
    with pytest.raises(StateError) as refused:
        check_meta(BAD[what])
    assert len(str(refused.value)) < 300, str(refused.value)[:400]
    for purpose in (None, "push", "download"):  # the parser's paths: local, pushed, downloaded
        with pytest.raises(StateError) as refused:
            from_chunks(_stream(json.dumps(BAD[what])), purpose=purpose)
        assert "metadata" in str(refused.value) and len(str(refused.value)) < 300, str(refused.value)[:400]


@pytest.mark.parametrize("raw", ["", "{", "[" * 100_000 + "]" * 100_000, '{"names": ["param.w"]'])
def test_metadata_that_is_not_json_is_a_state_error(raw: str):
    with pytest.raises(StateError) as refused:
        from_chunks(_stream(raw))
    assert len(str(refused.value)) < 300


def test_what_a_stage_exports_passes_and_round_trips():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    module(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    state = capture(module, optimizer, {"run_id": "test", "stage": 1, "version": 3, "finetune": "full"})
    for shard in range(2):
        meta, tensors = from_chunks(to_chunks(state, shard, 2))
        assert meta["version"] == 3 and meta["optimizer"]["param_groups"]
    assert check_meta(dict(GOOD, base=True, params_only=False, signed_at=1.5e9, optimizer=None)) is not None


def test_unknown_fields_are_left_alone():
    meta = dict(GOOD, blend_scale=0.5, anything={"nested": [1, 2]})
    assert check_meta(meta) == meta
    state = StageState({"param.w": torch.ones(4)}, dict(meta))
    got, tensors = from_chunks(to_chunks(state))
    assert got["anything"] == {"nested": [1, 2]} and torch.equal(tensors["param.w"], torch.ones(4))
