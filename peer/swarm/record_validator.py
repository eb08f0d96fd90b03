"""Every DHT node of a run refuses records of that run that are unsigned, foreign or out of bounds.

hivemind's ``RSASignatureValidator`` (which runs first) proves that the holder of the key named in a subkey
``b"<name>[owner:<key>]"`` signed the record, but accepts anything that names no key at all. This validator,
added once the node knows its run, closes the rest for the run's keys (the DHT only sees their hashes):

- the spec and the checkpoint record: signed, and the signer is one of the run's coordinators;
- a stage or trainer record: signed, under the signer's own peer id (nobody stands in for another peer);
- the run's entry in the swarm-wide index: signed by a coordinator (other runs' entries: signed by someone);
- every value: at most ``MAX_RECORD_BYTES`` and of its record type's schema (bounded fields, strict types);
- in a private swarm (:mod:`swarmpipe.peer.swarm.access`), member records and index entries only from members:
  signers on the allow-list, or records that carry the proof of the swarm's token.

Readers apply the same rules again (:mod:`swarmpipe.peer.swarm.dht`), since a lying DHT node may answer anything.
"""

from __future__ import annotations

import logging
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from swarmpipe.peer.swarm.access import RecordAdmission
from swarmpipe.peer.swarm.identity import split_signed_subkey
from swarmpipe.peer.swarm.records import (
    MAX_STAGES,
    RUNS_INDEX_KEY,
    CheckpointRecord,
    RelayRecord,
    RunIndexRecord,
    StageRecord,
    TrainerRecord,
    checkpoint_key,
    relays_key,
    spec_key,
    stage_key,
    trainer_key,
)

log = logging.getLogger("swarmpipe.dht")
MAX_RECORD_BYTES = 64 * 1024


CONTROL, MEMBER, INDEX = "control", "member", "index"


def _key_id(key: str) -> bytes:
    return DHTID.generate(source=key).to_bytes()


class RunRecordValidator(RecordValidatorBase):
    """Picklable (it travels into hivemind's DHT process): plain fields only, key ids computed on construction."""

    def __init__(self, run_id: str, coordinators: frozenset[str] | set[str], admission: RecordAdmission | None = None):
        if not coordinators:
            raise ValueError("a run's records need at least one trusted coordinator peer id")
        self.run_id = run_id
        self.coordinators = frozenset(coordinators)
        self.admission = admission or RecordAdmission()  # an open swarm admits every signer
        self.kinds: dict[bytes, tuple[str, str]] = {
            _key_id(spec_key(run_id)): (CONTROL, "spec"),
            _key_id(checkpoint_key(run_id)): (CONTROL, "checkpoint"),
            _key_id(trainer_key(run_id)): (MEMBER, "trainer"),
            _key_id(relays_key(run_id)): (MEMBER, "relay"),
            _key_id(RUNS_INDEX_KEY): (INDEX, "index"),
        }
        for stage in range(MAX_STAGES):
            self.kinds[_key_id(stage_key(run_id, stage))] = (MEMBER, "stage")

    @property
    def priority(self) -> int:
        return 5  # after RSASignatureValidator (10): we see the value with its signature stripped

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False  # one per run, each judges only its own keys

    def validate(self, record: DHTRecord) -> bool:
        kind = self.kinds.get(record.key)
        if kind is None:
            return True  # not this run's key
        problem = self.problem(kind, record)
        if problem:
            log.debug("dht: refusing a %s record of run %s: %s", kind[1], self.run_id, problem)
        return not problem

    def problem(self, kind: tuple[str, str], record: DHTRecord) -> str:
        """Why the record is refused ('' when it is accepted)."""
        role, what = kind
        if len(record.value) > MAX_RECORD_BYTES:
            return f"{len(record.value)} bytes > {MAX_RECORD_BYTES}"
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:
            return "undecodable subkey"
        signed = split_signed_subkey(subkey)
        if signed is None:
            return "not signed by a peer key (plain value or plain subkey)"
        name, signer = signed
        if role == CONTROL and not (name == signer and signer in self.coordinators):
            return f"signed by {signer[-6:]}, not by a coordinator of the run"
        if role == MEMBER and name != signer:
            return f"subkey names peer {name[-6:]!r} but {signer[-6:]} signed it"
        if role == INDEX and name == self.run_id and signer not in self.coordinators:
            return f"an index entry for this run signed by {signer[-6:]}, not by its coordinator"
        try:
            value = MSGPackSerializer.loads(record.value)
        except Exception:
            return "undecodable value"
        if role != CONTROL and self.admission.active:  # control records: the coordinator's signature suffices
            refused = self.admission.problem(record.key, signer, value)
            if refused:
                return refused
        return schema_problem(what, value)


def schema_problem(what: str, value: Any) -> str:
    """'' when ``value`` is a valid record of its kind; the reason otherwise."""
    from pydantic import ValidationError

    from swarmpipe.peer.spec import SpecError, spec_from_dict

    if value is None:
        return ""  # hivemind's deletion marker: the signature already says its owner wrote it
    if not isinstance(value, dict):
        return f"value is a {type(value).__name__}, not a table"
    try:
        if what == "spec":
            spec_from_dict(value)
        else:
            kinds = {"checkpoint": CheckpointRecord, "trainer": TrainerRecord, "stage": StageRecord}
            cls = {**kinds, "relay": RelayRecord}.get(what, RunIndexRecord)
            cls.model_validate(value)
    except (SpecError, ValidationError, TypeError, ValueError) as e:
        return str(e).splitlines()[0][:200]
    return ""
