"""swarmpipe.peer.swarm.records: DHT records are validated on read; forged or malformed ones are dropped."""

from __future__ import annotations

import logging

import pytest
from hivemind.utils import ValueWithExpiration
from pydantic import ValidationError

from swarmpipe.peer.swarm.identity import load_identity
from swarmpipe.peer.swarm.records import (
    MAX_VAL_LOSS,
    MAX_VERSION,
    RUNS_INDEX_KEY,
    WIRE_PROTOCOL,
    CheckpointRecord,
    RunIndexRecord,
    StageRecord,
    TrainerRecord,
    checkpoint_key,
    parse_record,
    parse_subkeyed,
    spec_key,
    stage_key,
    trainer_key,
)

pytestmark = pytest.mark.unit

GOOD_STAGE = {
    "address": "127.0.0.1:50051",
    "state": "online",
    "throughput": 12.5,
    "queue": 3,
    "version": 7,
    "updated_at": 1700000000.0,
}


def vwe(value, expiration: float = 1e10) -> ValueWithExpiration:
    return ValueWithExpiration(value, expiration)


def found(items: dict) -> ValueWithExpiration:
    """What ``dht.get(key, latest=True)`` returns for a subkeyed key."""
    return vwe({k: vwe(v) for k, v in items.items()})


def test_keys() -> None:
    assert stage_key("r", 2) == "r.stage.2"
    assert spec_key("r") == "r.spec"
    assert trainer_key("r") == "r.trainer"
    assert checkpoint_key("r") == "r.checkpoint"
    assert RUNS_INDEX_KEY == "swarmpipe.runs"


@pytest.mark.parametrize("address", ["127.0.0.1:50051", "peer-3.example.org:1", "[::1]:8080", "host_name:65535"])
@pytest.mark.parametrize("state", ["joining", "online", "draining"])
def test_valid_stage_record(address: str, state: str) -> None:
    r = parse_record(StageRecord, {**GOOD_STAGE, "address": address, "state": state})
    assert r is not None and r.address == address and r.state == state
    assert r.throughput == 12.5 and r.queue == 3 and r.version == 7 and r.metrics_address == ""


def test_extra_fields_ignored_and_record_frozen() -> None:
    r = parse_record(StageRecord, {**GOOD_STAGE, "future_field": [1, 2], "metrics_address": "127.0.0.1:9100"})
    assert r is not None and not hasattr(r, "future_field") and r.metrics_address == "127.0.0.1:9100"
    with pytest.raises(ValidationError):
        r.throughput = 1e6  # type: ignore[misc]


def test_round_trip_through_model_dump() -> None:
    r = StageRecord(**GOOD_STAGE)
    assert parse_record(StageRecord, r.model_dump()) == r


@pytest.mark.parametrize(
    "field, value",
    [
        ("address", "127.0.0.1"),  # no port
        ("address", "127.0.0.1:"),
        ("address", "127.0.0.1:123456"),  # six-digit port
        ("address", "http://127.0.0.1:80"),
        ("address", "evil host:80"),
        ("address", "a;rm -rf /:1"),
        ("address", "x" * 300 + ":80"),
        ("address", ""),
        ("address", 5),
        ("address", None),
        ("throughput", -1.0),
        ("throughput", 2e9),
        ("throughput", float("nan")),
        ("throughput", float("inf")),
        ("throughput", "fast"),
        ("throughput", [1.0]),
        ("queue", -1),
        ("queue", 10_000_000),
        ("queue", 1.5),
        ("queue", "many"),
        ("version", -3),
        ("version", {"v": 1}),
        ("state", "ONLINE"),
        ("state", "offline"),
        ("state", "banned"),
        ("state", 1),
        ("updated_at", "yesterday"),
        ("updated_at", None),
    ],
)
def test_malformed_stage_record_rejected(field: str, value, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="swarmpipe.records"):
        assert parse_record(StageRecord, {**GOOD_STAGE, field: value}, "peer X") is None
    assert "ignoring malformed StageRecord record peer X" in caplog.text


@pytest.mark.parametrize("field", list(GOOD_STAGE))
def test_missing_required_field_rejected(field: str) -> None:
    data = {k: v for k, v in GOOD_STAGE.items() if k != field}
    assert parse_record(StageRecord, data) is None


@pytest.mark.parametrize("raw", [None, "online", 42, [GOOD_STAGE], b"\x80\x81", ValueWithExpiration(GOOD_STAGE, 1.0)])
def test_non_mapping_rejected(raw) -> None:
    assert parse_record(StageRecord, raw) is None


@pytest.mark.parametrize("address", ["127.0.0.1:99999", "127.0.0.1:0"])
def test_out_of_range_port_rejected(address: str) -> None:
    assert parse_record(StageRecord, {**GOOD_STAGE, "address": address}) is None


def test_trainer_record() -> None:
    good = {"step": 3, "loss": 2.5, "samples_per_s": 10.0, "updated_at": 1.0}
    r = parse_record(TrainerRecord, good)
    assert r is not None and r.microbatches_lost == 0 and r.loss == 2.5
    assert parse_record(TrainerRecord, {**good, "loss": None}).loss is None
    assert parse_record(TrainerRecord, {**good, "step": -1}) is None
    assert parse_record(TrainerRecord, {**good, "samples_per_s": -0.1}) is None
    assert parse_record(TrainerRecord, {**good, "microbatches_retried": -2}) is None
    assert parse_record(TrainerRecord, {**good, "loss": "low"}) is None


def test_trainer_record_val_loss_is_optional_and_bounded() -> None:
    good = {"step": 3, "loss": 2.5, "samples_per_s": 10.0, "updated_at": 1.0}
    assert parse_record(TrainerRecord, good).val_loss is None  # a record from before validation losses
    for value in (0.0, 2, 3.25, MAX_VAL_LOSS):
        assert parse_record(TrainerRecord, {**good, "val_loss": value}).val_loss == value
    assert parse_record(TrainerRecord, {**good, "val_loss": None}).val_loss is None


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), float("-inf"), -0.1, MAX_VAL_LOSS * 1.01, 10**400, "1.5", True, [1.0], {}]
)
def test_forged_trainer_val_loss_rejected(value) -> None:
    good = {"step": 3, "loss": 2.5, "samples_per_s": 10.0, "updated_at": 1.0}
    assert parse_record(TrainerRecord, {**good, "val_loss": value}) is None
    with pytest.raises(ValidationError):
        TrainerRecord(**{**good, "val_loss": value})


def test_checkpoint_record() -> None:
    good = {"step": 100, "versions": [3, 4], "digests": ["ab", "cd"], "created_at": 5.0}
    r = parse_record(CheckpointRecord, good)
    assert r is not None and r.versions == [3, 4] and r.url == ""
    assert parse_record(CheckpointRecord, {**good, "versions": "3,4"}) is None
    assert parse_record(CheckpointRecord, {**good, "versions": [3, "x"]}) is None
    assert parse_record(CheckpointRecord, {**good, "digests": [1, 2]}) is None
    assert parse_record(CheckpointRecord, {**good, "step": -5}) is None


def test_run_index_record() -> None:
    good = {"run_id": "demo", "num_stages": 2, "updated_at": 1.0}
    r = parse_record(RunIndexRecord, good)
    assert r is not None and r.coordinator == ""
    assert parse_record(RunIndexRecord, {**good, "num_stages": 0}) is None
    assert parse_record(RunIndexRecord, {**good, "run_id": None}) is None
    assert parse_record(RunIndexRecord, {"num_stages": 2, "updated_at": 1.0}) is None


# ------------------------------------------------------------------ parse_subkeyed


@pytest.fixture(scope="module")
def ids():
    """Three real identities: subkeys carry real public keys, so the key-to-peer-id binding is the real one."""
    out = [load_identity(None) for _ in range(3)]
    for identity in out:
        identity.forget_file()
    return out


def test_parse_subkeyed_keeps_valid_and_skips_forged(ids) -> None:
    a, b, c = ids
    items = {
        a.owner_subkey(): GOOD_STAGE,
        b.owner_subkey(): {**GOOD_STAGE, "address": "10.0.0.9:1", "state": "draining"},
        c.owner_subkey(): {**GOOD_STAGE, "throughput": -5.0},
    }
    out = parse_subkeyed(StageRecord, found(items))
    assert set(out) == {a.peer_id, b.peer_id}
    assert out[a.peer_id] == StageRecord(**GOOD_STAGE)
    assert out[b.peer_id].state == "draining"


@pytest.mark.parametrize("bad", [{**GOOD_STAGE, "address": "not an address"}, {**GOOD_STAGE, "state": "supreme"}])
def test_parse_subkeyed_skips_malformed_values(ids, bad) -> None:
    assert parse_subkeyed(StageRecord, found({ids[0].owner_subkey(): bad})) == {}


def test_parse_subkeyed_skips_unsigned_subkeys(ids) -> None:
    """Plain strings, other types and a plain value never count: only a signed subkey names a peer."""
    out = parse_subkeyed(
        StageRecord,
        vwe({7: vwe(GOOD_STAGE), None: vwe(GOOD_STAGE), "ok": vwe(GOOD_STAGE), b"x" * 300: vwe(GOOD_STAGE)}),
    )
    assert out == {}


def test_parse_subkeyed_refuses_a_peer_id_signed_with_another_key(ids) -> None:
    victim, attacker, _ = ids
    impersonation = victim.peer_id.encode() + attacker.validator.local_public_key
    assert parse_subkeyed(StageRecord, found({impersonation: GOOD_STAGE})) == {}


def test_parse_subkeyed_item_without_value_wrapper(ids) -> None:
    a, b, _ = ids
    out = parse_subkeyed(StageRecord, vwe({a.owner_subkey(): GOOD_STAGE, b.owner_subkey(): vwe(GOOD_STAGE)}))
    assert set(out) == {b.peer_id}


@pytest.mark.parametrize("value", ["spec", 42, [GOOD_STAGE], None])
def test_parse_subkeyed_non_dict_value(value) -> None:
    assert parse_subkeyed(StageRecord, vwe(value)) == {}


def test_parse_subkeyed_none_and_empty() -> None:
    assert parse_subkeyed(StageRecord, None) == {}
    assert parse_subkeyed(StageRecord, found({})) == {}


def test_parse_subkeyed_index_entries_only_from_trusted_signers(ids) -> None:
    coordinator, stranger, _ = ids
    runs = parse_subkeyed(
        RunIndexRecord,
        found(
            {
                coordinator.owner_subkey("demo"): {"run_id": "demo", "num_stages": 2, "updated_at": 1.0},
                coordinator.owner_subkey("bad"): {"run_id": "bad", "num_stages": -1, "updated_at": 1.0},
                stranger.owner_subkey("trap"): {"run_id": "trap", "num_stages": 1, "updated_at": 1.0},
            }
        ),
        signers=frozenset({coordinator.peer_id}),
    )
    assert list(runs) == ["demo"] and runs["demo"].num_stages == 2


def test_records_bound_versions_and_sizes() -> None:
    assert parse_record(StageRecord, {**GOOD_STAGE, "version": MAX_VERSION + 1}) is None
    assert parse_record(StageRecord, {**GOOD_STAGE, "version": 2**64 + 1}) is None
    assert parse_record(TrainerRecord, {"step": 1, "samples_per_s": 1e12, "updated_at": 1.0}) is None
    assert (
        parse_record(TrainerRecord, {"step": 1, "samples_per_s": 1.0, "loss": float("nan"), "updated_at": 1.0}) is None
    )
    ckpt = {"step": 1, "versions": [-1, 3], "digests": ["a", "b"], "created_at": 1.0}
    assert parse_record(CheckpointRecord, ckpt) is not None
    assert parse_record(CheckpointRecord, {**ckpt, "versions": [MAX_VERSION + 1]}) is None
    assert parse_record(CheckpointRecord, {**ckpt, "versions": [1] * 1000}) is None
    assert parse_record(CheckpointRecord, {**ckpt, "url": "x" * 5000}) is None
    assert parse_record(RunIndexRecord, {"run_id": "r" * 500, "num_stages": 1, "updated_at": 1.0}) is None


def test_stage_record_protocol_defaults_to_before_versioning() -> None:
    assert parse_record(StageRecord, GOOD_STAGE).protocol == 0
    assert parse_record(StageRecord, {**GOOD_STAGE, "protocol": WIRE_PROTOCOL}).protocol == WIRE_PROTOCOL
    assert parse_record(StageRecord, {**GOOD_STAGE, "protocol": -1}) is None
    assert parse_record(StageRecord, {**GOOD_STAGE, "protocol": "1"}) is None  # strict: no coercion


async def test_stage_peers_skips_peers_of_another_wire_protocol(ids, caplog: pytest.LogCaptureFixture) -> None:
    """A peer that speaks another protocol (older, newer, or unversioned) is not offered to callers,
    and is logged once, not on every refresh."""
    from swarmpipe.peer.swarm.dht import SwarmDHT

    current, old, new = ids
    items = {
        current.owner_subkey(): {**GOOD_STAGE, "protocol": WIRE_PROTOCOL},
        old.owner_subkey(): GOOD_STAGE,
        new.owner_subkey(): {**GOOD_STAGE, "address": "10.0.0.7:9", "protocol": WIRE_PROTOCOL + 1},
    }
    swarm = SwarmDHT.__new__(SwarmDHT)  # no DHT: only the record filtering is under test
    swarm.run_id, swarm._incompatible = "r", set()

    async def fake_get(key: str):
        assert key == stage_key("r", 0)
        return found(items)

    swarm._get = fake_get
    with caplog.at_level(logging.WARNING, logger="swarmpipe.dht"):
        for _ in range(3):
            assert set(await swarm.stage_peers(0)) == {current.peer_id}
    skipped = [r.getMessage() for r in caplog.records if "wire protocol" in r.getMessage()]
    assert len(skipped) == 2 and any("10.0.0.7:9" in m and f"protocol {WIRE_PROTOCOL + 1}" in m for m in skipped)


def test_a_trainers_ban_list_is_bounded_and_holds_peer_ids_only() -> None:
    """A forged trainer record cannot smuggle long strings or unbounded lists into the coordinator's events."""
    from swarmpipe.peer.swarm.records import TrainerRecord

    base = {"step": 1, "samples_per_s": 1.0, "updated_at": 1.0}
    assert TrainerRecord(**base, banned=["QmYwAPJzv5CZsnA"]).banned == ["QmYwAPJzv5CZsnA"]
    for banned in (["Qm"] * 33, ["x" * 65], ["0OIl"], ["peer id with spaces"], [7]):
        with pytest.raises(ValidationError):
            TrainerRecord(**base, banned=banned)
