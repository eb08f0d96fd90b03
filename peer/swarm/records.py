"""DHT records: typed, validated on write and on read.

Keys (values expire; the subkey is the owner's peer id):
  ``{run_id}.spec``                    -> the run spec (dict)
  ``{run_id}.stage.{s}`` / peer id     -> :class:`StageRecord`
  ``{run_id}.trainer`` / peer id       -> :class:`TrainerRecord`
  ``{run_id}.checkpoint``              -> :class:`CheckpointRecord`
  ``{run_id}.relays`` / peer id        -> :class:`RelayRecord` (nodes that check reachability and relay)
  ``swarmpipe.runs`` / run id          -> :class:`RunIndexRecord` (swarm-wide index of runs)
Every subkey is ``b"<name>[owner:<public key>]"``, signed by that key (see :mod:`swarmpipe.peer.swarm.identity`);
a record that is unsigned, signed by someone else or fails validation is skipped with a warning, never trusted.
"""

from __future__ import annotations

import logging
import re
import time
from enum import Enum
from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_serializer,
    field_validator,
)

from swarmpipe.peer.spec import MAX_STAGES  # one bound for spec, records and validators
from swarmpipe.peer.swarm.identity import split_signed_subkey
from swarmpipe.peer.transport.tls import MAX_CERT_CHARS, check_cert_pem

log = logging.getLogger("swarmpipe.records")

RUNS_INDEX_KEY = "swarmpipe.runs"
# The stage RPC protocol this code speaks (protos/swarm.proto and the framing in peer/streaming.py).
# Bump it on any change an older peer or trainer would misread; peers of another protocol are not
# routed to (a record without the field predates versioning: protocol 0).
# 2: the ``evaluate`` flags (an older peer would train on a validation batch).
# 3: signed state shards (an older peer's unsigned push is refused) and forward tickets.
WIRE_PROTOCOL = 3
MAX_VAL_LOSS = 1e4  # a trainer's validation loss in nats: finite, 0..MAX_VAL_LOSS, or no record
MAX_VERSION = 1 << 53  # weight versions and steps: far beyond any run, exact in a float, far from int64 overflow
_PEER_ID = r"^[1-9A-HJ-NP-Za-km-z]{1,64}$"  # base58, as libp2p writes peer ids
_ADDRESS = re.compile(r"^[A-Za-z0-9_.:\-\[\]]{1,255}:\d{1,5}$")
_OPTIONAL_PEER_ID = r"^([1-9A-HJ-NP-Za-km-z]{1,64})?$"


def _dialable(value: str) -> str:
    """host:port with a port in range and a host someone can dial (a wildcard bind address is not)."""
    host, port = value.rsplit(":", 1)
    if not 0 < int(port) < 65536:
        raise ValueError(f"port {port} out of range")
    if host.strip("[]") in ("0.0.0.0", "::", "0:0:0:0:0:0:0:0", ""):
        raise ValueError(f"{host} is a wildcard bind address, not one to dial")
    return value


class PeerState(str, Enum):
    """Where a peer is in its life; its record says it, and one owner changes it (peer/stage/lifecycle.py)."""

    JOINING = "joining"  # serving soon: loading state, not yet routed to
    ONLINE = "online"  # takes new work
    DRAINING = "draining"  # finishes what it holds, takes nothing new, then leaves or moves

    def __str__(self) -> str:
        return self.value


class Record(BaseModel):
    # strict: a forged record with "1.5" where a number belongs is rejected, not coerced
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)


class StageRecord(Record):
    address: str = Field(pattern=_ADDRESS.pattern)
    state: PeerState = Field(strict=False)  # read from the DHT as its string value
    throughput: float = Field(ge=0, le=1e9)
    queue: int = Field(ge=0, le=1_000_000)
    version: int = Field(ge=0, le=MAX_VERSION)
    updated_at: float
    metrics_address: str = Field(default="", max_length=262)
    protocol: int = Field(ge=0, le=1_000_000, default=0)
    device: str = Field(default="", max_length=80)  # "cuda:0 (NVIDIA H200)", "cpu"
    device_memory_total: int = Field(ge=0, le=1 << 50, default=0)  # bytes
    device_memory_used: int = Field(ge=0, le=1 << 50, default=0)
    # --tls: the certificate the peer's gRPC server presents; clients pin it for ``address`` (one PEM, bounded)
    tls_cert: str = Field(default="", max_length=MAX_CERT_CHARS)
    relay: str = Field(default="", pattern=_OPTIONAL_PEER_ID)  # the relay carrying our calls ('' = dialled directly)

    @field_serializer("state")
    def _state_as_string(self, state: PeerState) -> str:
        return state.value  # msgpack in the DHT carries plain strings

    @field_validator("address")
    @classmethod
    def _port_in_range(cls, value: str) -> str:
        return _dialable(value)

    @field_validator("tls_cert")
    @classmethod
    def _tls_cert_parses(cls, value: str) -> str:
        return check_cert_pem(value)  # '' or exactly one certificate


class TrainerRecord(Record):
    step: int = Field(ge=0, le=MAX_VERSION)
    loss: float | None = Field(default=None, ge=0, le=MAX_VAL_LOSS, allow_inf_nan=False)
    samples_per_s: float = Field(ge=0, le=1e9)
    microbatches_completed: int = Field(ge=0, le=MAX_VERSION, default=0)
    microbatches_retried: int = Field(ge=0, le=MAX_VERSION, default=0)
    microbatches_lost: int = Field(ge=0, le=MAX_VERSION, default=0)
    val_loss: float | None = Field(default=None, ge=0, le=MAX_VAL_LOSS, allow_inf_nan=False)  # newest validation
    updated_at: float
    # bytes the trainer sent and received per micro-batch ended (hub: every activation twice; chain: tokens, loss)
    bytes_per_microbatch: float = Field(default=0.0, ge=0, le=1e12, allow_inf_nan=False)
    # peers this trainer banned because their answers failed verification (peer/trainer/verification.py)
    banned: list[Annotated[str, StringConstraints(pattern=_PEER_ID)]] = Field(default_factory=list, max_length=32)


class CheckpointRecord(Record):
    step: int = Field(ge=0, le=MAX_VERSION)
    versions: list[int] = Field(max_length=MAX_STAGES)
    digests: list[str] = Field(max_length=MAX_STAGES)
    created_at: float
    url: str = Field(default="", max_length=262)
    tls_cert: str = Field(default="", max_length=MAX_CERT_CHARS)  # the checkpoint server's, as in StageRecord

    @field_validator("tls_cert")
    @classmethod
    def _tls_cert_parses(cls, value: str) -> str:
        return check_cert_pem(value)  # '' or exactly one certificate

    @field_validator("versions")
    @classmethod
    def _versions_in_range(cls, value: list[int]) -> list[int]:
        if any(not -1 <= v <= MAX_VERSION for v in value):  # -1: no state of that stage yet
            raise ValueError(f"a version outside -1..{MAX_VERSION}")
        return value

    @field_validator("digests")
    @classmethod
    def _digests_short(cls, value: list[str]) -> list[str]:
        if any(len(d) > 128 for d in value):
            raise ValueError("a digest longer than 128 characters")
        return value


class RelayRecord(Record):
    """A node others may ask "can you dial me?" and, with ``capacity`` > 0, to relay them (peer/transport/relay_*)."""

    address: str = Field(pattern=_ADDRESS.pattern)
    capacity: int = Field(ge=0, le=10_000)  # peers it relays at most (0: it only checks reachability)
    in_use: int = Field(ge=0, le=10_000)
    rate_mbit: float = Field(ge=0, le=1e6, default=0.0)  # cap per relayed peer (0: none)
    role: str = Field(default="peer", pattern=r"^(peer|coordinator)$")
    tls_cert: str = Field(default="", max_length=MAX_CERT_CHARS)
    updated_at: float

    @field_validator("address")
    @classmethod
    def _address_dialable(cls, value: str) -> str:
        return _dialable(value)

    @field_validator("tls_cert")
    @classmethod
    def _tls_cert_parses(cls, value: str) -> str:
        return check_cert_pem(value)

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.in_use)


class RunIndexRecord(Record):
    run_id: str = Field(min_length=1, max_length=128)
    num_stages: int = Field(ge=1, le=MAX_STAGES)
    coordinator: str = Field(default="", max_length=1024)
    updated_at: float


def stage_key(run_id: str, stage: int) -> str:
    return f"{run_id}.stage.{stage}"


def spec_key(run_id: str) -> str:
    return f"{run_id}.spec"


def trainer_key(run_id: str) -> str:
    return f"{run_id}.trainer"


def checkpoint_key(run_id: str) -> str:
    return f"{run_id}.checkpoint"


def relays_key(run_id: str) -> str:
    return f"{run_id}.relays"


R = TypeVar("R", bound=Record)


def parse_record(cls: type[R], raw: Any, where: str = "") -> R | None:
    try:
        return cls.model_validate(raw)
    except (ValidationError, TypeError) as e:
        log.warning("ignoring malformed %s record %s: %s", cls.__name__, where, str(e).splitlines()[0])
        return None


def parse_subkeyed(cls: type[R], found: Any, signers: frozenset[str] | None = None) -> dict[str, R]:
    """The dict that ``dht.get(key, latest=True)`` returns for a subkeyed key -> {name: record}.

    Only signed subkeys count. Without ``signers`` the name must be the signer's own peer id (stage and
    trainer records: nobody announces for another peer); with ``signers`` the name is free (a run id in
    the index) but the signer must be one of them."""
    out: dict[str, R] = {}
    if found is None or not isinstance(found.value, dict):
        return out
    for subkey, item in found.value.items():
        signed = split_signed_subkey(subkey)
        if signed is None:
            continue
        name, signer = signed
        if (name != signer) if signers is None else (signer not in signers):
            continue
        record = parse_record(cls, getattr(item, "value", None), f"{cls.__name__}/{name[-6:]}")
        if record is not None:
            out[name] = record
    return out


def now() -> float:
    return time.time()
