"""Signed state shards: the receiver learns who sent a shard and refuses a tampered, stale or unsigned one."""

from __future__ import annotations

import json
import time

import pytest
import torch

from swarmpipe.peer.state.format import StageState, StateError, assemble, from_chunks, to_chunks
from swarmpipe.peer.state.signing import MAX_CLOCK_SKEW_S, verify_meta
from swarmpipe.peer.swarm.identity import load_identity

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def donor():
    identity = load_identity(None)
    identity.forget_file()
    return identity


@pytest.fixture(scope="module")
def stranger():
    identity = load_identity(None)
    identity.forget_file()
    return identity


def _state(version: int = 7) -> StageState:
    gen = torch.Generator().manual_seed(0)
    tensors = {f"param.w{i}": torch.randn(4, 3, generator=gen) for i in range(3)}
    tensors["optim.0.exp_avg"] = torch.zeros(4, 3)
    return StageState(tensors, {"stage": 1, "version": version, "run_id": "r"})


@pytest.mark.parametrize("num_shards", [1, 3])
def test_a_signed_state_names_its_sender(donor, num_shards) -> None:
    shards = [
        from_chunks(to_chunks(_state(), s, num_shards, signer=donor, purpose="download"), purpose="download")
        for s in range(num_shards)
    ]
    assert {meta["signed_by"] for meta, _ in shards} == {donor.peer_id}
    state = assemble(shards)
    assert state.version == 7 and state.digest() == _state().digest()
    assert "signature" not in state.meta and "signer" not in state.meta


def test_an_unsigned_state_is_refused_where_a_signature_is_required() -> None:
    with pytest.raises(StateError, match="not signed"):
        from_chunks(to_chunks(_state()), purpose="push")


def test_a_state_signed_for_download_cannot_be_pushed(donor) -> None:
    with pytest.raises(StateError, match="signed for 'download'"):
        from_chunks(to_chunks(_state(), signer=donor, purpose="download"), purpose="push")


def test_tampered_tensors_are_refused(donor) -> None:
    chunks = to_chunks(_state(), signer=donor, purpose="push")
    chunks[1].tensor.CopyFrom(to_chunks(StageState({chunks[1].name: torch.full((4, 3), 1e30)}, {}))[1].tensor)
    with pytest.raises(StateError, match="not the ones its sender signed"):
        from_chunks(chunks, purpose="push")


def test_a_dropped_chunk_is_refused(donor) -> None:
    chunks = to_chunks(_state(), signer=donor, purpose="push")
    meta = json.loads(chunks[0].metadata_json)
    meta["names"] = meta["names"][1:]  # pretend the first tensor never existed
    chunks[0].metadata_json = json.dumps(meta)
    with pytest.raises(StateError):
        from_chunks([chunks[0], *chunks[2:]][: len(chunks) - 1], purpose="push")


def test_edited_metadata_breaks_the_signature(donor) -> None:
    chunks = to_chunks(_state(), signer=donor, purpose="push")
    meta = json.loads(chunks[0].metadata_json)
    meta["version"] = 2**62  # the version is what a receiver trusts most
    chunks[0].metadata_json = json.dumps(meta)
    with pytest.raises(StateError, match="does not verify"):
        from_chunks(chunks, purpose="push")


def test_a_stranger_cannot_re_sign_as_the_donor(donor, stranger) -> None:
    chunks = to_chunks(_state(), signer=stranger, purpose="push")
    meta = json.loads(chunks[0].metadata_json)
    meta["signer"] = donor.key.get_public_key().to_bytes().decode()  # claim the donor's key
    chunks[0].metadata_json = json.dumps(meta)
    with pytest.raises(StateError, match="does not verify"):
        from_chunks(chunks, purpose="push")


def test_a_stale_signature_is_refused(donor) -> None:
    chunks = to_chunks(_state(), signer=donor, purpose="push")
    meta = json.loads(chunks[0].metadata_json)
    hasher_value = meta["chunk_hash"]
    assert verify_meta(meta, hasher_value, "push") == donor.peer_id
    with pytest.raises(StateError, match="stale"):
        verify_meta(meta, hasher_value, "push", now=time.time() + MAX_CLOCK_SKEW_S + 60)


def test_a_forwarded_state_is_re_signed_by_its_new_sender(donor, stranger) -> None:
    """The coordinator serves a checkpoint a replica pushed: the shard then carries the coordinator's signature."""
    meta, tensors = from_chunks(to_chunks(_state(), signer=donor, purpose="push"), purpose="push")
    stored = StageState(tensors, meta)
    again, _ = from_chunks(to_chunks(stored, signer=stranger, purpose="download"), purpose="download")
    assert again["signed_by"] == stranger.peer_id
