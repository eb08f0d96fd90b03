"""Which address a peer announces, decided before it announces one: dialled directly, through a relay, or
not at all (it exits with advice).

1. The announce host: ``--announce-host``, else ``--host``; 'auto' (and a wildcard ``--host``) learns it
   from what a reachability checker observed.
2. The check (peer/transport/reachability.py): a node that can be dialled dials our address back. Reachable:
   announce it. Reachable at another address: announce that one. Unreachable: a relay (``--relay auto``),
   else exit with advice naming the fix.
3. Relayed: a tunnel to a relay with free capacity (peer/transport/relay_client.py); when the relay goes
   away, :meth:`ServingAddress.keep_relayed` finds another one and the peer re-announces at once.
No checker in the swarm yet (its first node): announce as configured, unless that address cannot work.
Unreachable with ``--relay auto`` while no relay has room (a home peer started before the public peers that
relay): the peer waits, says so, and checks again with backoff, as a trainer waits for replicas; only
``--relay off`` exits with advice.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

from swarmpipe.peer.config import PeerConfig
from swarmpipe.peer.events import EventLog
from swarmpipe.peer.swarm.dht import SwarmDHT
from swarmpipe.peer.swarm.records import PeerState, RelayRecord
from swarmpipe.peer.transport.addresses import HostKind, announce_problem, host_kind, join_host_port, split_host_port
from swarmpipe.peer.transport.reachability import ELSEWHERE, REACHABLE, UNKNOWN, Verdict, check_reachability
from swarmpipe.peer.transport.relay_client import RelayError, RelayTunnel

log = logging.getLogger("swarmpipe.peer")
RETRY_S = 2.0
MAX_RETRY_S = 30.0  # the longest wait between two looks for a relay with room


class NotReachable(LookupError):
    """Nobody can dial this peer and no relay will carry it: the message says what to change."""


class NoRelayYet(NotReachable):
    """Unreachable, and no relay has room now: worth waiting for one (``--relay auto``)."""


def advice(address: str, port: int, dht_port: int, why: str, relay: str) -> str:
    dht = f" and {dht_port}" if dht_port else " and the DHT port you set with --dht-port"
    relay_hint = (
        "start with --relay auto (a peer started with --relay-capacity N relays you; none has room now)"
        if relay == "off"
        else "wait: no relay in the swarm has free capacity now, and this peer looks again with backoff until one "
        "has (any public peer relays others with --relay-capacity N)"
    )
    return (
        f"the swarm cannot dial this peer at {address} ({why}). Fix one of: "
        f"(1) forward TCP port {port}{dht} on your router to this machine and start with "
        f"--host 0.0.0.0 --port {port} --dht-port <port> --announce-host <your public IP, or auto>; "
        f"(2) {relay_hint}."
    )


class ServingAddress:
    def __init__(
        self,
        cfg: PeerConfig,
        swarm: SwarmDHT,
        peer_id: str,
        events: EventLog,
        port: int,
        num_stages: int,
        swarm_hosts: list[str],
    ):
        self.cfg = cfg
        self.num_stages = num_stages
        self.swarm = swarm
        self.peer_id = peer_id
        self.events = events
        self.port = port
        self.swarm_hosts = swarm_hosts  # hosts of the bootstrap peers: where the rest of the swarm lives
        self.address = ""
        self.relay_peer = ""  # the relay's peer id while relayed
        self.tunnel: RelayTunnel | None = None
        self.verdict: Verdict | None = None
        self.relay_reason = ""

    def use_swarm(self, swarm: SwarmDHT) -> None:
        """Our DHT node restarted (as a client): read the swarm through the new one."""
        self.swarm = swarm

    @property
    def relayed(self) -> bool:
        return bool(self.relay_peer)

    @property
    def host(self) -> str:
        host = self.cfg.announce_host or self.cfg.host
        return "" if host == "auto" or host_kind(host) is HostKind.WILDCARD else host

    async def establish(self) -> str:
        """The address to announce; '' when it must be a relay's (then :meth:`relay`, which the daemon calls
        after restarting its DHT node in client mode); :class:`NotReachable` when there is none (``--relay off``).
        While no relay has room, checks again with backoff (a checker or a relay may appear meanwhile)."""
        return await self._with_backoff(self._establish_once)

    async def _with_backoff(self, attempt: Callable[[], Awaitable[str]]) -> str:
        delay, waited = RETRY_S, 0.0
        while True:
            try:
                return await attempt()
            except NoRelayYet as e:
                self.events.emit(
                    "waiting_for_relay",
                    level=logging.WARNING,
                    retry_in_s=round(delay, 1),
                    waited_s=round(waited, 1),
                    advice=str(e)[:800],
                )
            await asyncio.sleep(delay)
            waited += delay
            delay = min(2 * delay, MAX_RETRY_S)

    async def _establish_once(self) -> str:
        cfg = self.cfg
        if cfg.relay == "always":
            self.relay_reason = "--relay always"
            return ""
        host = self.host
        problem = announce_problem(host, self.swarm_hosts) if host else "its host is not known yet ('auto')"
        checkers = await self._checkers() if cfg.reachability_check else []
        candidate = join_host_port(host or "0.0.0.0", self.port)
        if checkers:
            verdict = self.verdict = await check_reachability(
                candidate, self.peer_id, checkers, tls_cert=self.swarm.security.cert_pem
            )
            self.events.emit(
                "reachability",
                outcome=verdict.outcome,
                address=candidate,
                observed=verdict.observed_host or "-",
                reachable_at=verdict.reachable_at or "-",
                checker=verdict.checker or "-",
                detail=verdict.detail[:160] or "-",
            )
            if verdict.outcome == REACHABLE:
                return self._direct(candidate)
            elsewhere_problem = ""
            if verdict.outcome == ELSEWHERE:  # the host a checker saw: never a loopback or private one for strangers
                elsewhere_problem = announce_problem(split_host_port(verdict.reachable_at)[0], self.swarm_hosts)
                if not elsewhere_problem:
                    return self._direct(verdict.reachable_at)
            if verdict.outcome != UNKNOWN:
                problem = elsewhere_problem or verdict.detail or "no checker could dial it"
        elif cfg.reachability_check:
            self.events.emit("reachability", outcome=UNKNOWN, address=candidate, detail="no checker in the swarm yet")
        if not problem:
            return self._direct(candidate)  # nothing says it fails: the swarm's first node, or checks are off
        if cfg.relay == "off":
            raise NotReachable(advice(candidate, self.port, cfg.dht_port, problem, "off"))
        if not await self._relays(frozenset()):  # wait for one now, not after restarting the DHT node
            raise NoRelayYet(advice(candidate, self.port, cfg.dht_port, problem, cfg.relay))
        self.relay_reason = problem
        return ""

    async def relay(self) -> str:
        """Serve through a relay (after :meth:`establish` returned ''): the relayed address, once one takes us."""
        return await self._with_backoff(lambda: self._relay(self.relay_reason))

    def _direct(self, address: str) -> str:
        self.address = address
        return address

    async def _checkers(self) -> list[str]:
        """Addresses that answer CheckReachability: relay records (coordinators included) and online peers
        dialled directly."""
        addresses = {r.address for pid, r in (await self.swarm.relays()).items() if pid != self.peer_id}
        for stage in await self.swarm.all_stages(self.num_stages):
            for pid, record in stage.items():
                if pid != self.peer_id and not record.relay and record.state is PeerState.ONLINE:
                    addresses.add(record.address)
        return sorted(addresses)

    async def _relay(self, why: str, avoid: frozenset[str] = frozenset()) -> str:
        relays = await self._relays(avoid)
        tried = []
        for peer, record in relays:
            tunnel = RelayTunnel(record.address, self.peer_id, self.cfg.host, self.port, security=self.swarm.security)
            try:
                address = await tunnel.open()
            except (RelayError, ValueError) as e:
                tried.append(f"{peer[-6:]}: {str(e)[:80]}")
                await tunnel.close()
                continue
            self.tunnel, self.relay_peer, self.address = tunnel, peer, address
            self.events.emit("relayed", relay=peer[-6:], relay_address=record.address, address=address, why=why[:160])
            return address
        detail = "; ".join(tried) or "no relay with free capacity in the swarm"
        raise NoRelayYet(
            advice(join_host_port(self.host or "?", self.port), self.port, self.cfg.dht_port, why, self.cfg.relay)
            + f" [{detail}]"
        )

    async def _relays(self, avoid: frozenset[str]) -> list[tuple[str, RelayRecord]]:
        found = [
            (p, r)
            for p, r in (await self.swarm.relays()).items()
            if r.free > 0 and p not in avoid and p != self.peer_id
        ]
        random.shuffle(found)  # spread relayed peers over relays with room
        return sorted(found, key=lambda pr: -pr[1].free)

    async def keep_relayed(self, on_change: Callable[[], Awaitable[None]], stopping: asyncio.Event) -> None:
        """While relayed: when the relay goes away, take another one and re-announce (within a period)."""
        while self.tunnel is not None and not stopping.is_set():
            reason = await self.tunnel.run()
            if stopping.is_set():
                return
            lost = self.relay_peer
            self.events.emit("relay_lost", level=logging.WARNING, relay=lost[-6:], reason=reason[:160])
            await self.tunnel.close()
            self.tunnel = None
            avoid = frozenset({lost})  # first another relay; then any, the lost one back included
            while not stopping.is_set():
                try:
                    await self._relay(f"relay {lost[-6:]} lost", avoid=avoid)
                except NotReachable as e:
                    log.warning("peer %s: no relay yet (%s); retrying", self.peer_id[-6:], str(e)[-120:])
                    avoid = frozenset()
                    await asyncio.sleep(RETRY_S)
                    continue
                try:
                    await on_change()
                except Exception as e:  # the DHT hiccups: the next periodic announce carries the new address
                    log.warning("peer %s: announcing the new relay failed: %s", self.peer_id[-6:], e)
                break

    async def close(self) -> None:
        if self.tunnel is not None:
            await self.tunnel.close()
            self.tunnel = None
