"""RunRecordValidator: a DHT node of the run refuses unsigned, foreign and out-of-bounds records of the run.

The signature itself is hivemind's RSASignatureValidator's job; these records carry real public keys so the
subkey-to-peer-id binding is the real one.
"""

from __future__ import annotations

import pickle
import time

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.swarm.identity import load_identity
from swarmpipe.peer.swarm.record_validator import MAX_RECORD_BYTES, RunRecordValidator
from swarmpipe.peer.swarm.records import RUNS_INDEX_KEY, checkpoint_key, spec_key, stage_key, trainer_key

pytestmark = pytest.mark.unit

STAGE = {"address": "127.0.0.1:5000", "state": "online", "throughput": 3.0, "queue": 0, "version": 1, "updated_at": 1.0}
TRAINER = {"step": 3, "samples_per_s": 2.0, "updated_at": 1.0}
CHECKPOINT = {"step": 1, "versions": [1, 2], "digests": ["a", "b"], "created_at": 1.0}
INDEX = {"run_id": "r", "num_stages": 2, "updated_at": 1.0}


@pytest.fixture(scope="module")
def keys():
    coordinator, peer, stranger = (load_identity(None) for _ in range(3))
    for identity in (coordinator, peer, stranger):
        identity.forget_file()
    return coordinator, peer, stranger


@pytest.fixture(scope="module")
def validator(keys):
    return RunRecordValidator("r", {keys[0].peer_id})


def record(key: str, subkey, value) -> DHTRecord:
    return DHTRecord(
        DHTID.generate(source=key).to_bytes(),
        MSGPackSerializer.dumps(subkey),
        MSGPackSerializer.dumps(value),
        time.time() + 60,
    )


def test_honest_records_pass(validator, keys) -> None:
    coordinator, peer, _ = keys
    assert validator.validate(record(spec_key("r"), coordinator.owner_subkey(), RunSpec().to_dict()))
    assert validator.validate(record(checkpoint_key("r"), coordinator.owner_subkey(), CHECKPOINT))
    assert validator.validate(record(RUNS_INDEX_KEY, coordinator.owner_subkey("r"), INDEX))
    assert validator.validate(record(stage_key("r", 3), peer.owner_subkey(), STAGE))
    assert validator.validate(record(trainer_key("r"), peer.owner_subkey(), TRAINER))


@pytest.mark.parametrize("key", [spec_key("r"), checkpoint_key("r")])
def test_control_records_only_from_the_coordinator(validator, keys, key) -> None:
    _, peer, stranger = keys
    value = RunSpec().to_dict() if key == spec_key("r") else CHECKPOINT
    assert not validator.validate(record(key, stranger.owner_subkey(), value))
    assert not validator.validate(record(key, peer.owner_subkey(), value))
    assert not validator.validate(record(key, None, value))  # a plain value
    assert not validator.validate(record(key, "coordinator", value))  # a plain subkey
    # named as the coordinator, signed by the stranger
    assert not validator.validate(record(key, stranger.owner_subkey(keys[0].peer_id), value))


def test_member_records_only_under_their_signers_id(validator, keys) -> None:
    _, peer, stranger = keys
    # the plain value that replaced every replica's record and blocked re-announcements
    assert not validator.validate(record(stage_key("r", 0), None, STAGE))
    assert not validator.validate(record(stage_key("r", 0), peer.peer_id, STAGE))  # unsigned plain string subkey
    assert not validator.validate(record(stage_key("r", 0), stranger.owner_subkey(peer.peer_id), STAGE))
    assert not validator.validate(record(trainer_key("r"), stranger.owner_subkey(peer.peer_id), TRAINER))


def test_index_entry_of_this_run_only_from_its_coordinator(validator, keys) -> None:
    _, _, stranger = keys
    assert not validator.validate(record(RUNS_INDEX_KEY, stranger.owner_subkey("r"), INDEX))
    assert not validator.validate(record(RUNS_INDEX_KEY, "r", INDEX))
    # another run's entry: signed by whoever runs it, not ours to judge beyond signature and schema
    assert validator.validate(record(RUNS_INDEX_KEY, stranger.owner_subkey("other"), {**INDEX, "run_id": "other"}))


@pytest.mark.parametrize(
    "value",
    [
        {**STAGE, "throughput": 1e12},
        {**STAGE, "version": 2**63 - 1},
        {**STAGE, "address": "x" * 300 + ":1"},
        {**STAGE, "throughput": "fast"},
        "a string",
        [STAGE],
    ],
)
def test_out_of_bounds_member_values_are_refused(validator, keys, value) -> None:
    assert not validator.validate(record(stage_key("r", 1), keys[1].owner_subkey(), value))


def test_a_spec_beyond_sane_bounds_is_refused_even_from_the_coordinator(validator, keys) -> None:
    spec = RunSpec().to_dict()
    spec["optimizer"]["lr"] = 1000.0
    assert not validator.validate(record(spec_key("r"), keys[0].owner_subkey(), spec))
    spec = RunSpec().to_dict()
    spec["limits"]["max_stream_mb"] = 1 << 20
    assert not validator.validate(record(spec_key("r"), keys[0].owner_subkey(), spec))


def test_oversized_values_are_refused(validator, keys) -> None:
    value = {**STAGE, "device": "x" * (MAX_RECORD_BYTES + 1)}
    assert not validator.validate(record(stage_key("r", 1), keys[1].owner_subkey(), value))


def test_other_keys_are_left_alone(validator) -> None:
    assert validator.validate(record("another.run.stage.0", None, "anything"))
    assert validator.validate(record(stage_key("r", 999), None, "beyond the run's stages"))


def test_the_validator_travels_into_the_dht_process(validator, keys) -> None:
    copy = pickle.loads(pickle.dumps(validator))
    assert copy.validate(record(stage_key("r", 0), keys[1].owner_subkey(), STAGE))
    assert not copy.validate(record(stage_key("r", 0), None, STAGE))


def test_a_run_needs_a_trusted_coordinator() -> None:
    with pytest.raises(ValueError, match="coordinator"):
        RunRecordValidator("r", set())


def test_relay_records_only_under_their_signers_id_and_in_bounds(validator, keys) -> None:
    from swarmpipe.peer.swarm.records import relays_key

    peer, stranger = keys[1], keys[2]
    good = {"address": "10.0.0.5:4000", "capacity": 4, "in_use": 0, "updated_at": 1.0}
    assert validator.validate(record(relays_key("r"), peer.owner_subkey(), good))
    assert not validator.validate(record(relays_key("r"), stranger.owner_subkey(peer.peer_id), good))
    for bad in ({"address": "0.0.0.0:4000"}, {"capacity": -3}, {"in_use": 10**6}, {"role": "root"}):
        assert not validator.validate(record(relays_key("r"), peer.owner_subkey(), {**good, **bad}))
