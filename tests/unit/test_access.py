"""Who a private swarm admits (peer/swarm/access.py): the allow-list file, the settings' consistency, and member
records on a DHT node (RunRecordValidator) and for readers (``admitted``), against strangers."""

from __future__ import annotations

import pickle
import time
from types import SimpleNamespace

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration

from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.swarm.access import (
    PROOF_FIELD,
    RecordAdmission,
    SwarmAccess,
    admitted,
    key_id,
    read_allow_list,
)
from swarmpipe.peer.swarm.identity import load_identity
from swarmpipe.peer.swarm.record_validator import RunRecordValidator
from swarmpipe.peer.swarm.records import RUNS_INDEX_KEY, spec_key, stage_key, trainer_key

pytestmark = pytest.mark.unit

TOKEN = b"0123456789abcdef-private"
STAGE = {"address": "127.0.0.1:5000", "state": "online", "throughput": 3.0, "queue": 0, "version": 1, "updated_at": 1.0}
TRAINER = {"step": 3, "samples_per_s": 2.0, "updated_at": 1.0}


@pytest.fixture(scope="module")
def keys():
    coordinator, member, stranger = (load_identity(None) for _ in range(3))
    for identity in (coordinator, member, stranger):
        identity.forget_file()
    return coordinator, member, stranger


def record(key: str, subkey, value) -> DHTRecord:
    return DHTRecord(key_id(key), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), time.time() + 60)


def proven(admission: RecordAdmission, key: str, signer: str, value: dict) -> dict:
    return {**value, PROOF_FIELD: admission.proof(key_id(key), signer)}


# ------------------------------------------------------------------ settings


def test_allow_list_takes_peer_ids_and_public_keys(tmp_path, keys) -> None:
    _, member, stranger = keys
    public = stranger.key.get_public_key().to_bytes().decode()
    path = tmp_path / "allow.txt"
    path.write_text(f"# the lab\n{member.peer_id}   # alice\n\n{public} bob@lab\n")
    assert read_allow_list(str(path)) == {member.peer_id, stranger.peer_id}


@pytest.mark.parametrize("text", ["", "# nobody\n", "not-a-peer-id\n", "ssh-rsa AAAAnotakey\n"])
def test_bad_allow_lists_are_refused(tmp_path, text: str) -> None:
    path = tmp_path / "allow.txt"
    path.write_text(text)
    with pytest.raises(ValueError):
        read_allow_list(str(path))


def test_the_identity_command_prints_the_peer_id(tmp_path, capsys) -> None:
    from swarmpipe.cli.main import main

    path = tmp_path / "alice.key"
    assert main(["identity", "--identity", str(path)]) == 0
    first = capsys.readouterr().out
    assert main(["identity", "--identity", str(path)]) == 0  # the same key, created once
    assert capsys.readouterr().out == first and f"peer id: {load_identity(str(path)).peer_id}" in first
    assert "ssh-rsa " in first


def test_settings_are_consistent(tmp_path) -> None:
    assert SwarmAccess().mode == "open" and not SwarmAccess().active
    with pytest.raises(ValueError, match="choose one"):
        SwarmAccess(token=TOKEN, allowed=frozenset({"x"}))
    with pytest.raises(ValueError, match="at least 16"):
        SwarmAccess(token=b"short")
    with pytest.raises(ValueError, match="go together"):
        SwarmAccess(tls=True, tls_cert="c.pem")
    (tmp_path / "token").write_bytes(TOKEN + b"\n")
    cfg = SimpleNamespace(auth_token="", auth_token_file=str(tmp_path / "token"), tls=True)
    access = SwarmAccess.from_config(cfg)
    assert access.token == TOKEN and access.mode == "token" and access.tls
    assert TOKEN.decode() not in repr(access)  # never in a log line
    with pytest.raises(ValueError, match="pass one"):
        SwarmAccess.from_config(SimpleNamespace(auth_token=TOKEN.decode(), auth_token_file=str(tmp_path / "token")))


# ------------------------------------------------------------------ the DHT: token mode


def test_token_mode_admits_proven_member_records_only(keys) -> None:
    coordinator, member, stranger = keys
    admission = SwarmAccess(token=TOKEN).admission(frozenset({coordinator.peer_id}))
    validator = pickle.loads(pickle.dumps(RunRecordValidator("r", {coordinator.peer_id}, admission)))  # to the DHT
    key = stage_key("r", 0)
    assert validator.validate(record(key, member.owner_subkey(), proven(admission, key, member.peer_id, STAGE)))
    assert not validator.validate(record(key, stranger.owner_subkey(), STAGE))  # no proof
    wrong = SwarmAccess(token=b"another token, also 16+ bytes").admission(frozenset())
    assert not validator.validate(record(key, stranger.owner_subkey(), proven(wrong, key, stranger.peer_id, STAGE)))
    # a member's proof copied into a stranger's record: it names the member
    copied = proven(admission, key, member.peer_id, STAGE)
    assert not validator.validate(record(key, stranger.owner_subkey(), copied))
    # a proof for the trainer key does not open the stage key
    other_key = proven(admission, trainer_key("r"), stranger.peer_id, STAGE)
    assert not validator.validate(record(key, stranger.owner_subkey(), other_key))
    # hostile proof values
    for bad in (None, 12, "x" * 10_000, ["a"]):
        assert not validator.validate(record(key, stranger.owner_subkey(), {**STAGE, PROOF_FIELD: bad}))
    # the coordinator's control records need its signature only; its index entry needs the proof too
    assert validator.validate(record(spec_key("r"), coordinator.owner_subkey(), RunSpec(run_id="r").to_dict()))
    index = {"run_id": "r", "num_stages": 2, "updated_at": 1.0}
    assert not validator.validate(record(RUNS_INDEX_KEY, coordinator.owner_subkey("r"), index))
    assert validator.validate(
        record(
            RUNS_INDEX_KEY, coordinator.owner_subkey("r"), proven(admission, RUNS_INDEX_KEY, coordinator.peer_id, index)
        )
    )
    assert not validator.validate(record(RUNS_INDEX_KEY, stranger.owner_subkey("fake"), {**index, "run_id": "fake"}))


def test_open_swarms_admit_any_signer(keys) -> None:
    coordinator, _, stranger = keys
    validator = RunRecordValidator("r", {coordinator.peer_id})
    assert validator.validate(record(stage_key("r", 0), stranger.owner_subkey(), STAGE))


# ------------------------------------------------------------------ the DHT: allow-list mode


def test_allow_list_mode_admits_listed_signers_and_coordinators(keys) -> None:
    coordinator, member, stranger = keys
    admission = SwarmAccess(allowed=frozenset({member.peer_id})).admission(frozenset({coordinator.peer_id}))
    validator = RunRecordValidator("r", {coordinator.peer_id}, admission)
    assert validator.validate(record(stage_key("r", 1), member.owner_subkey(), STAGE))
    assert validator.validate(record(trainer_key("r"), coordinator.owner_subkey(), TRAINER))
    assert not validator.validate(record(stage_key("r", 1), stranger.owner_subkey(), STAGE))
    assert not validator.validate(record(trainer_key("r"), stranger.owner_subkey(), TRAINER))


def test_readers_drop_what_a_lying_node_returns(keys) -> None:
    coordinator, member, stranger = keys
    admission = SwarmAccess(token=TOKEN).admission(frozenset({coordinator.peer_id}))
    key = stage_key("r", 0)
    found = ValueWithExpiration(
        {
            member.owner_subkey(): ValueWithExpiration(proven(admission, key, member.peer_id, STAGE), 1.0),
            stranger.owner_subkey(): ValueWithExpiration(STAGE, 1.0),
            b"plain": ValueWithExpiration(STAGE, 1.0),
        },
        2.0,
    )
    kept = admitted(admission, key, found)
    assert list(kept.value) == [member.owner_subkey()] and kept.expiration_time == 2.0
    assert admitted(RecordAdmission(), key, found) is found  # open: nothing to check
    assert admitted(admission, key, None) is None
