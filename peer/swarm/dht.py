"""Typed, asynchronous access to the swarm's hivemind DHT.

hivemind runs the DHT in a forked child process; its calls return MPFutures
that we await with a deadline so an unreachable swarm never hangs a caller.

Every record we write is signed with the process's identity key, the same key that gives the DHT
node its peer id (:mod:`swarmpipe.peer.swarm.identity`); every record we read is checked again here:
member records under their signer's own id, control records (spec, checkpoint, index entry) only
from the run's trusted coordinators (``--coordinator-id``, else the peer ids of ``--initial-peers``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
from collections.abc import Iterable, Sequence
from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from swarmpipe.peer.spec import RunSpec, SpecError, spec_from_dict
from swarmpipe.peer.swarm.access import (
    PROOF_FIELD,
    RecordAdmission,
    SwarmAccess,
    admitted,
    current_access,
    key_id,
)
from swarmpipe.peer.swarm.bootstrap import reconnect_bootstrap  # noqa: F401 - callers import it from here
from swarmpipe.peer.swarm.child_processes import DHTProcess, guard_forks
from swarmpipe.peer.swarm.identity import (
    Identity,
    load_identity,
    peer_id_in_maddr,
    split_signed_subkey,
    write_key_file,
)
from swarmpipe.peer.swarm.record_validator import RunRecordValidator
from swarmpipe.peer.swarm.records import (
    RUNS_INDEX_KEY,
    WIRE_PROTOCOL,
    CheckpointRecord,
    RelayRecord,
    RunIndexRecord,
    StageRecord,
    TrainerRecord,
    checkpoint_key,
    parse_record,
    parse_subkeyed,
    relays_key,
    spec_key,
    stage_key,
    trainer_key,
)
from swarmpipe.peer.transport.addresses import dht_announce_maddr
from swarmpipe.peer.transport.security import Security
from swarmpipe.peer.transport.security import current as current_security
from swarmpipe.peer.transport.security import install as install_security

log = logging.getLogger("swarmpipe.dht")
DHT_TIMEOUT_S = 10.0
SPEC_TTL_S = 7 * 24 * 3600.0  # a run's spec does not change; it outlives a coordinator that is down for days


def start_dht(
    initial_peers: Sequence[str] = (),
    host: str = "127.0.0.1",
    port: int = 0,
    identity_path: str | None = None,
    announce_host: str | None = None,
    require_bootstrap: bool = True,
    coordinators: Iterable[str] = (),
    access: SwarmAccess | None = None,
    client_mode: bool = False,
) -> hivemind.DHT:
    """``require_bootstrap=False``: start even when no initial peer answers (the coordinator may be
    down); the caller keeps pinging them with :func:`reconnect_bootstrap` until one does.

    ``coordinators``: peer ids whose spec, checkpoint and index entries this process trusts (default:
    the peer ids in ``initial_peers``); read back with :func:`trusted_coordinators`.
    ``access``: private-swarm settings (default: the process's, :func:`~swarmpipe.peer.swarm.access.install_access`,
    whose ``--identity`` is used when ``identity_path`` is None); see :func:`_secure`."""
    guard_forks()  # the DHT process (and p2pd under it) dies with this process and obeys SIGTERM
    access = access or current_access()
    identity_path = identity_path or access.identity_path or None
    identity = load_identity(identity_path)
    # Every node checks signatures: a record whose subkey names an owner key can only be changed
    # by the holder of that key (hivemind's RSASignatureValidator), and that key is our peer id's.
    kwargs: dict[str, Any] = dict(
        host_maddrs=[f"/ip4/{host}/tcp/{port}"],
        start=True,
        record_validators=[identity.validator],
        identity_path=identity.path,
        client_mode=client_mode,  # nobody can dial us: read and store through others, stay out of routing tables
    )
    if not identity_path:
        kwargs["check_if_identity_free"] = False  # a key made a moment ago is nobody else's
    announced = dht_announce_maddr(announce_host or "", port)
    if announced:  # behind NAT or in a container: the address others should dial
        kwargs["announce_maddrs"] = [announced]
    try:
        try:
            dht = DHTProcess(initial_peers=list(initial_peers) or None, **kwargs)
        except Exception as e:  # p2pd and hivemind both refuse to start when no bootstrap peer answers
            if require_bootstrap or not initial_peers:
                raise
            log.warning(
                "none of the %d initial peers answered (%s); starting alone, retrying them",
                len(initial_peers),
                str(e).strip().splitlines()[-1][:160],
            )
            dht = DHTProcess(initial_peers=None, **kwargs)
    finally:
        identity.forget_file()
    trusted = set(coordinators) or {p for p in map(peer_id_in_maddr, initial_peers) if p}
    dht.swarmpipe_identity = identity  # type: ignore[attr-defined]
    dht.swarmpipe_coordinators = frozenset(trusted)  # type: ignore[attr-defined]
    _secure(dht, access, identity, frozenset(trusted))
    return dht


def restart_as_client(dht: hivemind.DHT, initial_peers: Sequence[str], host: str = "127.0.0.1") -> hivemind.DHT:
    """The same node (identity, trust, security) started again in client mode: it reads and stores through
    others and is never put into their routing tables, as a node nobody can dial must be. The old node
    stops once the new one has joined; if the new one cannot join, the old one stays and is returned."""
    identity = identity_of(dht)
    path = write_key_file(identity)
    try:
        kwargs = dict(host_maddrs=[f"/ip4/{host}/tcp/0"], start=True, client_mode=True, identity_path=path)
        kwargs["check_if_identity_free"] = False  # it is ours: the node we replace still holds it
        new = DHTProcess(initial_peers=list(initial_peers) or None, record_validators=[identity.validator], **kwargs)
    except Exception as e:
        log.warning("dht: could not restart in client mode (%s); staying a full node", str(e).splitlines()[-1][:160])
        return dht
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    for name in ("swarmpipe_identity", "swarmpipe_coordinators", "swarmpipe_access", "swarmpipe_security"):
        setattr(new, name, getattr(dht, name))
    dht.shutdown()
    log.info("dht: peer %s runs its DHT node in client mode (it cannot be dialled)", identity.peer_id[-6:])
    return new


def _secure(dht: hivemind.DHT, access: SwarmAccess, identity: Identity, trusted: frozenset[str]) -> None:
    """The gRPC security of ``access`` for this identity; the process's own (installed) when ``access`` is."""
    security = access.security(identity, trusted)
    if access is current_access():
        install_security(security)
    dht.swarmpipe_access = access  # type: ignore[attr-defined]
    dht.swarmpipe_security = security  # type: ignore[attr-defined]
    if access.active:
        log.info("dht: peer %s joins a private swarm: %s", identity.peer_id[-6:], security.describe())


def identity_of(dht: hivemind.DHT) -> Identity:
    identity = getattr(dht, "swarmpipe_identity", None)
    if identity is None:
        raise RuntimeError("this DHT was not started by swarmpipe.peer.swarm.dht.start_dht (no signing identity)")
    return identity


def security_of(dht: hivemind.DHT) -> Security:
    """The gRPC security :func:`start_dht` made for this DHT's process (pins learned from its reads go there)."""
    return getattr(dht, "swarmpipe_security", None) or current_security()


def trusted_coordinators(dht: hivemind.DHT) -> frozenset[str]:
    return getattr(dht, "swarmpipe_coordinators", frozenset())


def trust_coordinators(dht: hivemind.DHT, peer_ids: Iterable[str]) -> None:
    """Add coordinators this process trusts (the coordinator trusts itself)."""
    dht.swarmpipe_coordinators = trusted_coordinators(dht) | frozenset(peer_ids)  # type: ignore[attr-defined]


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]


OPEN = RecordAdmission()


@functools.lru_cache(maxsize=8)  # read on every DHT access; an allow-list may hold thousands of ids
def _admission(access: SwarmAccess, coordinators: frozenset[str]) -> RecordAdmission:
    return access.admission(coordinators)


class SwarmDHT:
    """The records of one run, read and written with deadlines, signed by us and checked on the way in."""

    access = SwarmAccess()  # an open swarm unless start_dht was given (or installed) private settings

    def __init__(self, dht: hivemind.DHT, run_id: str):
        self.dht = dht
        self.run_id = run_id
        self.identity = identity_of(dht)
        self.peer_id = self.identity.peer_id
        # "<peer id>[owner:<public key>]": our records are signed and only we can replace them.
        self.owner_subkey = self.identity.owner_subkey()
        self._incompatible: set[tuple[str, int]] = set()  # (peer, protocol) pairs already logged
        self.access: SwarmAccess = getattr(dht, "swarmpipe_access", None) or SwarmAccess()
        self.security = security_of(dht)  # TLS: our certificate goes into our records, others' into its pins

    @property
    def coordinators(self) -> frozenset[str]:
        return trusted_coordinators(self.dht)

    @property
    def admission(self) -> RecordAdmission:
        """Which member records count in a private swarm (the run's coordinators are always members)."""
        if self.access.mode == "open":
            return OPEN
        return _admission(self.access, self.coordinators)

    def protect(self) -> None:
        """Make our DHT node refuse records of this run that are unsigned, foreign or out of bounds
        (:class:`RunRecordValidator`). Called once the run is chosen: another run's records are not ours to judge."""
        guarded = getattr(self.dht, "swarmpipe_guarded", set())
        if self.run_id in guarded or not self.coordinators:
            return
        self.dht.add_validators([RunRecordValidator(self.run_id, self.coordinators, self.admission)])
        self.dht.swarmpipe_guarded = guarded | {self.run_id}  # type: ignore[attr-defined]

    async def _get(self, key: str) -> Any:
        future = self.dht.get(key, latest=True, return_future=True)
        try:
            return await asyncio.wait_for(future, DHT_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("dht get %s timed out after %.0fs", key, DHT_TIMEOUT_S)
            return None

    async def _store(self, key: str, value: Any, ttl: float, subkey: bytes, member: bool = False) -> bool:
        admission = self.admission
        if member and admission.dht_key:  # a private swarm's token: prove we hold it, for this key and signer
            value = {**value, PROOF_FIELD: admission.proof(key_id(key), self.peer_id)}
        future = self.dht.store(key, value, get_dht_time() + ttl, subkey=subkey, return_future=True)
        try:
            return bool(await asyncio.wait_for(future, DHT_TIMEOUT_S))
        except asyncio.TimeoutError:
            log.warning("dht store %s timed out after %.0fs", key, DHT_TIMEOUT_S)
            return False

    async def _from_coordinator(self, key: str) -> Any:
        """The newest value under ``key`` that a trusted coordinator signed (forgeries sit beside it, ignored)."""
        found = await self._get(key)
        if found is None or not isinstance(found.value, dict):
            return None
        best = None
        for subkey, item in found.value.items():
            signed = split_signed_subkey(subkey)
            if signed is None or signed[0] != signed[1] or signed[1] not in self.coordinators:
                continue
            if best is None or item.expiration_time > best.expiration_time:
                best = item
        return None if best is None else best.value

    # spec ------------------------------------------------------------------
    async def publish_spec(self, spec: RunSpec, ttl: float = SPEC_TTL_S) -> bool:
        return await self._store(spec_key(self.run_id), spec.to_dict(), ttl, self.owner_subkey)

    async def fetch_spec(self) -> RunSpec | None:
        value = await self._from_coordinator(spec_key(self.run_id))
        if value is None:
            return None
        try:
            return spec_from_dict(value)
        except (SpecError, TypeError, ValueError) as e:
            raise SpecError(f"the run spec published for {self.run_id!r} is unusable: {e}") from e

    async def wait_for_spec(
        self, timeout: float = 60.0, poll: float = 1.0, initial_peers: Sequence[str] = (), reconnect_every: float = 5.0
    ) -> RunSpec:
        """Poll for the spec; meanwhile ping ``initial_peers`` now and then, so a node that started
        while its bootstrap peers were down (a restarting coordinator) joins once one is back."""
        if not self.coordinators:
            raise ValueError(
                "no trusted coordinator: pass --coordinator-id PEER_ID, or --initial-peers with the coordinator's "
                "multiaddr (its /p2p/<peer id> names the key that signs the run's spec)"
            )
        self.protect()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        next_ping = loop.time()
        while True:
            if initial_peers and loop.time() >= next_ping:
                next_ping = loop.time() + reconnect_every
                if not await reconnect_bootstrap(self.dht, initial_peers):
                    log.warning(
                        "none of %d initial peers answers yet; retrying every %.0fs for up to %.0fs",
                        len(initial_peers),
                        reconnect_every,
                        max(0.0, deadline - loop.time()),
                    )
            spec = await self.fetch_spec()
            if spec is not None:
                return spec
            if loop.time() > deadline:
                trusted = ", ".join(sorted(p[-8:] for p in self.coordinators))
                raise TimeoutError(
                    f"no spec for run {self.run_id!r} signed by a trusted coordinator (peer ids ...{trusted}) in the "
                    f"DHT after {timeout:.0f}s; is the coordinator up, and is it the one --coordinator-id names?"
                )
            await asyncio.sleep(poll)

    # stages ----------------------------------------------------------------
    async def announce_stage(self, stage: int, record: StageRecord, ttl: float) -> bool:
        if self.security.cert_pem and not record.tls_cert:  # --tls: the certificate our stage server presents
            record = record.model_copy(update={"tls_cert": self.security.cert_pem})
        key = stage_key(self.run_id, stage)
        return await self._store(key, record.model_dump(), ttl, self.owner_subkey, member=True)

    async def stage_peers(self, stage: int) -> dict[str, StageRecord]:
        """The stage's peers that speak our wire protocol; others are skipped (logged once each)."""
        key = stage_key(self.run_id, stage)
        records = parse_subkeyed(StageRecord, admitted(self.admission, key, await self._get(key)))
        for record in records.values():
            if record.tls_cert:  # a signed record binds its address to this certificate
                self.security.pins.learn(record.address, record.tls_cert)
        return {peer: r for peer, r in records.items() if self._speaks_our_protocol(peer, r)}

    def _speaks_our_protocol(self, peer: str, record: StageRecord) -> bool:
        if record.protocol == WIRE_PROTOCOL:
            return True
        if (peer, record.protocol) not in self._incompatible:
            self._incompatible.add((peer, record.protocol))
            log.warning(
                "dht: skipping peer %s at %s: it speaks wire protocol %d, we speak %d (upgrade one of us)",
                peer[-6:],
                record.address,
                record.protocol,
                WIRE_PROTOCOL,
            )
        return False

    async def all_stages(self, num_stages: int) -> list[dict[str, StageRecord]]:
        return list(await asyncio.gather(*(self.stage_peers(s) for s in range(num_stages))))

    # relays ------------------------------------------------------------------
    async def announce_relay(self, record: RelayRecord, ttl: float) -> bool:
        if self.security.cert_pem and not record.tls_cert:
            record = record.model_copy(update={"tls_cert": self.security.cert_pem})
        return await self._store(relays_key(self.run_id), record.model_dump(), ttl, self.owner_subkey, member=True)

    async def relays(self) -> dict[str, RelayRecord]:
        """Nodes that check reachability (and relay, where ``capacity`` > 0), by peer id."""
        key = relays_key(self.run_id)
        records = parse_subkeyed(RelayRecord, admitted(self.admission, key, await self._get(key)))
        for record in records.values():
            if record.tls_cert:
                self.security.pins.learn(record.address, record.tls_cert)
        return records

    # trainers, checkpoints, index -----------------------------------------------
    async def announce_trainer(self, record: TrainerRecord, ttl: float) -> bool:
        return await self._store(trainer_key(self.run_id), record.model_dump(), ttl, self.owner_subkey, member=True)

    async def trainers(self) -> dict[str, TrainerRecord]:
        key = trainer_key(self.run_id)
        return parse_subkeyed(TrainerRecord, admitted(self.admission, key, await self._get(key)))

    async def publish_checkpoint(self, record: CheckpointRecord, ttl: float) -> bool:
        return await self._store(checkpoint_key(self.run_id), record.model_dump(), ttl, self.owner_subkey)

    async def checkpoint(self) -> CheckpointRecord | None:
        value = await self._from_coordinator(checkpoint_key(self.run_id))
        record = None if value is None else parse_record(CheckpointRecord, value, "checkpoint")
        if record is not None and record.tls_cert and record.url:
            self.security.pins.learn(record.url, record.tls_cert)
        return record

    async def list_in_index(self, record: RunIndexRecord, ttl: float) -> bool:
        subkey = self.identity.owner_subkey(self.run_id)
        return await self._store(RUNS_INDEX_KEY, record.model_dump(), ttl, subkey, member=True)

    async def runs(self) -> dict[str, RunIndexRecord]:
        """Runs in the swarm index whose entry a trusted coordinator signed (a stranger can list a fake run,
        but no volunteer who trusts only its own bootstrap peers will join it)."""
        found = admitted(self.admission, RUNS_INDEX_KEY, await self._get(RUNS_INDEX_KEY))
        return parse_subkeyed(RunIndexRecord, found, signers=self.coordinators)
