"""Typed, asynchronous access to the swarm's hivemind DHT.

hivemind runs the DHT in a forked child process; its calls return MPFutures
that we await with a deadline so an unreachable swarm never hangs a caller.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarmpipe.peer.spec import RunSpec, SpecError, spec_from_dict
from swarmpipe.peer.swarm.records import (
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

log = logging.getLogger("swarmpipe.dht")
DHT_TIMEOUT_S = 10.0


def start_dht(
    initial_peers: Sequence[str] = (),
    host: str = "127.0.0.1",
    port: int = 0,
    identity_path: str | None = None,
    announce_host: str | None = None,
    require_bootstrap: bool = True,
) -> hivemind.DHT:
    """``require_bootstrap=False``: start even when no initial peer answers (the coordinator may be
    down); the caller keeps pinging them with :func:`reconnect_bootstrap` until one does."""
    # Every node checks signatures: a record whose subkey names an owner key can only be changed
    # by the holder of that key (hivemind's RSASignatureValidator), so no one overwrites another
    # peer's announcement.
    kwargs: dict[str, Any] = dict(
        host_maddrs=[f"/ip4/{host}/tcp/{port}"], start=True, record_validators=[signature_validator()]
    )
    if identity_path:
        kwargs["identity_path"] = identity_path
    if announce_host and port:  # behind NAT or in a container: the address others should dial
        kwargs["announce_maddrs"] = [f"/ip4/{announce_host}/tcp/{port}"]
    try:
        return hivemind.DHT(initial_peers=list(initial_peers) or None, **kwargs)
    except Exception as e:  # p2pd and hivemind both refuse to start when no bootstrap peer answers
        if require_bootstrap or not initial_peers:
            raise
        log.warning(
            "none of the %d initial peers answered (%s); starting alone, retrying them",
            len(initial_peers),
            str(e).strip().splitlines()[-1][:160],
        )
        return hivemind.DHT(initial_peers=None, **kwargs)


_VALIDATOR: RSASignatureValidator | None = None


def signature_validator() -> RSASignatureValidator:
    """This process's signing identity (one RSA key per process)."""
    global _VALIDATOR
    if _VALIDATOR is None:
        _VALIDATOR = RSASignatureValidator(RSAPrivateKey())
    return _VALIDATOR


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]


async def _ping_bootstrap(maddrs: list[str], dht: hivemind.DHT, node: Any) -> int:
    """Runs inside the DHT process: reconnect to bootstrap peers and ping them, which also makes
    them add us to their routing tables. A restarted coordinator (same identity and port) starts
    with an empty table; this is how the swarm finds it again."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    answered = 0
    for maddr in maddrs:
        try:
            address, peer = maddr.rsplit("/p2p/", 1)
            peer_id = PeerID.from_base58(peer)
            await asyncio.wait_for(node.p2p._client.connect(peer_id, [Multiaddr(address)]), 5)
            if await asyncio.wait_for(node.protocol.call_ping(peer_id), 5) is not None:
                answered += 1
        except Exception:  # unreachable now: the next round tries again
            continue
    return answered


async def reconnect_bootstrap(dht: hivemind.DHT, maddrs: Sequence[str]) -> int:
    """How many bootstrap peers answered (see :func:`_ping_bootstrap`)."""
    if not maddrs:
        return 0
    future = dht.run_coroutine(functools.partial(_ping_bootstrap, list(maddrs)), return_future=True)
    try:
        return int(await asyncio.wait_for(future, 30))
    except Exception as e:
        log.debug("bootstrap reconnect failed: %s", e)
        return 0


class SwarmDHT:
    """The records of one run, read and written with deadlines."""

    def __init__(self, dht: hivemind.DHT, run_id: str):
        self.dht = dht
        self.run_id = run_id
        self.peer_id = dht.peer_id.to_base58()
        # "<peer id>[owner:<public key>]": our records are signed and only we can replace them.
        self.owner_subkey = self.peer_id.encode() + signature_validator().local_public_key
        self._incompatible: set[tuple[str, int]] = set()  # (peer, protocol) pairs already logged

    async def _get(self, key: str) -> Any:
        future = self.dht.get(key, latest=True, return_future=True)
        try:
            return await asyncio.wait_for(future, DHT_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("dht get %s timed out after %.0fs", key, DHT_TIMEOUT_S)
            return None

    async def _store(self, key: str, value: Any, ttl: float, subkey: str | None = None) -> bool:
        future = self.dht.store(key, value, get_dht_time() + ttl, subkey=subkey, return_future=True)
        try:
            return bool(await asyncio.wait_for(future, DHT_TIMEOUT_S))
        except asyncio.TimeoutError:
            log.warning("dht store %s timed out after %.0fs", key, DHT_TIMEOUT_S)
            return False

    # spec ------------------------------------------------------------------
    async def publish_spec(self, spec: RunSpec, ttl: float) -> bool:
        return await self._store(spec_key(self.run_id), spec.to_dict(), ttl)

    async def fetch_spec(self) -> RunSpec | None:
        found = await self._get(spec_key(self.run_id))
        if found is None:
            return None
        try:
            return spec_from_dict(found.value)
        except (SpecError, TypeError, ValueError) as e:
            raise SpecError(f"the run spec published for {self.run_id!r} is unusable: {e}") from e

    async def wait_for_spec(
        self, timeout: float = 60.0, poll: float = 1.0, initial_peers: Sequence[str] = (), reconnect_every: float = 5.0
    ) -> RunSpec:
        """Poll for the spec; meanwhile ping ``initial_peers`` now and then, so a node that started
        while its bootstrap peers were down (a restarting coordinator) joins once one is back."""
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
                raise TimeoutError(
                    f"no spec for run {self.run_id!r} in the DHT after {timeout:.0f}s; is the coordinator up?"
                )
            await asyncio.sleep(poll)

    # stages ----------------------------------------------------------------
    async def announce_stage(self, stage: int, record: StageRecord, ttl: float) -> bool:
        return await self._store(stage_key(self.run_id, stage), record.model_dump(), ttl, subkey=self.owner_subkey)

    async def stage_peers(self, stage: int) -> dict[str, StageRecord]:
        """The stage's peers that speak our wire protocol; others are skipped (logged once each)."""
        records = parse_subkeyed(StageRecord, await self._get(stage_key(self.run_id, stage)))
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

    # trainers, checkpoints, index -----------------------------------------------
    async def announce_trainer(self, record: TrainerRecord, ttl: float) -> bool:
        return await self._store(trainer_key(self.run_id), record.model_dump(), ttl, subkey=self.owner_subkey)

    async def trainers(self) -> dict[str, TrainerRecord]:
        return parse_subkeyed(TrainerRecord, await self._get(trainer_key(self.run_id)))

    async def publish_checkpoint(self, record: CheckpointRecord, ttl: float) -> bool:
        return await self._store(checkpoint_key(self.run_id), record.model_dump(), ttl)

    async def checkpoint(self) -> CheckpointRecord | None:
        found = await self._get(checkpoint_key(self.run_id))
        return None if found is None else parse_record(CheckpointRecord, found.value, "checkpoint")

    async def list_in_index(self, record: RunIndexRecord, ttl: float) -> bool:
        return await self._store(RUNS_INDEX_KEY, record.model_dump(), ttl, subkey=self.run_id)

    async def runs(self) -> dict[str, RunIndexRecord]:
        return parse_subkeyed(RunIndexRecord, await self._get(RUNS_INDEX_KEY))
