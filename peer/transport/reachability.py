"""Can the swarm dial me? Asked of a node that can be dialled, before a peer announces itself.

Server side (:class:`ReachabilityChecker`, behind ``Relay.CheckReachability`` on the coordinator and on
directly reachable peers): dial the address the caller would announce, and the caller's observed host at the
same port, and run a real ``Info`` call; the answer names the caller's peer id or it does not count. Bounded:
one check per caller host per ``min_interval_s``, ``max_concurrent`` dials at once, ``DIAL_TIMEOUT_S`` each,
so the RPC cannot be turned into a port scanner or an amplifier.

Client side (:func:`check_reachability`): ask up to three checkers; the first that answers decides.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import re
import time
from collections import OrderedDict
from dataclasses import dataclass

import grpc

from swarmpipe.peer.transport import security as process_security
from swarmpipe.peer.transport.addresses import HostKind, host_kind, join_host_port, observed_host, split_host_port
from swarmpipe.peer.transport.channels import channel_options
from swarmpipe.peer.transport.tls import MAX_CERT_CHARS, TLSPins
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

log = logging.getLogger("swarmpipe.reachability")
DIAL_TIMEOUT_S = 3.0
ASK_TIMEOUT_S = 2 * DIAL_TIMEOUT_S + 4.0  # the checker may dial twice
REACHABLE, UNREACHABLE, ELSEWHERE, UNKNOWN = "reachable", "unreachable", "reachable_elsewhere", "unknown"
_PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{1,64}$")


@dataclass(frozen=True)
class Verdict:
    outcome: str  # REACHABLE | UNREACHABLE | ELSEWHERE | UNKNOWN (no checker answered)
    observed_host: str = ""
    reachable_at: str = ""
    detail: str = ""
    checker: str = ""

    @property
    def dialable(self) -> bool:
        return self.outcome in (REACHABLE, ELSEWHERE)


class ReachabilityChecker:
    def __init__(
        self,
        own_id: str,
        security: process_security.Security | None = None,
        min_interval_s: float = 2.0,
        max_concurrent: int = 4,
        max_callers: int = 4096,
    ):
        self.own_id = own_id
        self._security = security
        self.min_interval_s = min_interval_s
        self.max_callers = max_callers
        self._slots = asyncio.Semaphore(max_concurrent)
        self._last: OrderedDict[str, float] = OrderedDict()  # caller host -> last check (bounded)
        self.checks = 0

    @property
    def security(self) -> process_security.Security:
        return self._security or process_security.current()

    async def check(self, request, context) -> swarm_pb2.ReachabilityResponse:
        try:
            host, port = split_host_port(request.address)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"CheckReachability: {e}")
        if not _PEER_ID.match(request.peer_id):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "CheckReachability: peer_id is not a base58 peer id")
        if len(request.tls_cert) > MAX_CERT_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "CheckReachability: tls_cert too long")
        seen = observed_host(context.peer() or "")
        if not self._admit(seen or "?"):
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"one reachability check per {self.min_interval_s:.0f}s per host"
            )
        try:
            await asyncio.wait_for(self._slots.acquire(), DIAL_TIMEOUT_S)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many reachability checks at once")
        try:
            self.checks += 1
            candidates = [request.address] if _may_dial(host, seen) else []
            if seen and seen != host:
                candidates.append(join_host_port(seen, port))
            detail = f"{request.address}: not dialled (a wildcard, or loopback of another machine)"
            for candidate in candidates:
                detail = await self._dial(candidate, request.peer_id, request.tls_cert)
                if not detail:
                    outcome = REACHABLE if candidate == request.address else ELSEWHERE
                    return swarm_pb2.ReachabilityResponse(
                        outcome=outcome, observed_host=seen, reachable_at=candidate, checker_id=self.own_id
                    )
            return swarm_pb2.ReachabilityResponse(
                outcome=UNREACHABLE, observed_host=seen, detail=detail[:300], checker_id=self.own_id
            )
        finally:
            self._slots.release()

    def _admit(self, host: str) -> bool:
        now = time.monotonic()
        last = self._last.get(host)
        if last is not None and now - last < self.min_interval_s:
            return False
        self._last[host] = now
        self._last.move_to_end(host)
        while len(self._last) > self.max_callers:
            self._last.popitem(last=False)
        return True

    async def _dial(self, address: str, peer_id: str, tls_cert: str) -> str:
        """'' when ``Info`` at ``address`` answered as ``peer_id``; else why not."""
        pin = None
        if tls_cert:
            pins = TLSPins()
            if pins.learn(address, tls_cert):
                pin = pins.pin(address)
        try:
            channel = self.security.channel(address, channel_options(4), pin=pin)
        except grpc.RpcError as e:  # --tls and no certificate for it
            return f"{address}: {e.details()}"
        try:
            stub = swarm_pb2_grpc.StageStub(channel)
            info = await stub.Info(swarm_pb2.InfoRequest(), timeout=DIAL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            return f"{address}: {e.code().name} ({(e.details() or '')[:120]})"
        finally:
            await channel.close(grace=None)
        if info.peer_id != peer_id:
            return f"{address}: answered as peer {info.peer_id[-6:] or '?'}, not {peer_id[-6:]}"
        return ""


async def check_reachability(
    address: str,
    peer_id: str,
    checkers: list[str],
    tls_cert: str = "",
    security: process_security.Security | None = None,
    ask: int = 3,
) -> Verdict:
    """Ask up to ``ask`` of ``checkers`` (addresses of nodes that serve ``CheckReachability``), in random
    order; the first consistent answer decides. UNKNOWN when none answers (a swarm with no other reachable node).

    Checkers are strangers: an answer whose ``reachable_at`` is not our own address, or our port at the host it
    says it saw, is ignored; "reachable at another address" is believed only when a second checker, asked to dial
    that address, reaches us there (or when no other checker answers: a swarm's first nodes)."""
    security = security or process_security.current()
    order = random.sample(checkers, len(checkers))[: max(1, ask)]
    asked: set[str] = set()  # a checker answers each caller host once per min_interval_s: ask none twice
    for checker in order:
        if checker in asked:
            continue
        asked.add(checker)
        verdict = await _ask(checker, address, peer_id, tls_cert, security)
        if verdict is None:
            continue
        if verdict.outcome != ELSEWHERE:
            return verdict
        if await _confirm(verdict, [c for c in order if c not in asked], asked, peer_id, tls_cert, security):
            return verdict
        log.warning("reachability: checker %s named %s, where another could not dial us", checker, verdict.reachable_at)
    return Verdict(UNKNOWN, detail=f"no reachability checker answered consistently (asked {len(asked)})")


async def _confirm(
    verdict: Verdict,
    others: list[str],
    asked: set[str],
    peer_id: str,
    tls_cert: str,
    security: process_security.Security,
) -> bool:
    """True when the first other checker that answers reaches us at ``verdict.reachable_at`` (or none answers)."""
    for other in others:
        asked.add(other)
        second = await _ask(other, verdict.reachable_at, peer_id, tls_cert, security)
        if second is not None:
            return second.outcome == REACHABLE
    return True


async def _ask(
    checker: str, address: str, peer_id: str, tls_cert: str, security: process_security.Security
) -> Verdict | None:
    """One checker's answer, None when it did not answer or answered inconsistently."""
    try:
        channel = security.channel(checker, channel_options(4))
    except grpc.RpcError:
        return None
    try:
        answer = await swarm_pb2_grpc.RelayStub(channel).CheckReachability(
            swarm_pb2.ReachabilityRequest(address=address, peer_id=peer_id, tls_cert=tls_cert),
            timeout=ASK_TIMEOUT_S,
        )
    except grpc.aio.AioRpcError as e:
        log.info("reachability: checker %s did not answer: %s", checker, e.code().name)
        return None
    finally:
        await channel.close(grace=None)
    seen = _clean_host(answer.observed_host)
    if answer.outcome == REACHABLE:
        reachable_at = address  # what we asked it to dial, whatever it says
    elif answer.outcome == ELSEWHERE:
        # the checker dials our port at the host it saw us from, and nothing else
        reachable_at = join_host_port(seen, split_host_port(address)[1]) if seen else ""
        if not reachable_at or answer.reachable_at != reachable_at:
            log.warning("reachability: checker %s gave an inconsistent answer; ignored", checker)
            return None
    elif answer.outcome == UNREACHABLE:
        reachable_at = ""
    else:
        return None
    return Verdict(answer.outcome, seen, reachable_at, answer.detail[:300], checker)


def _clean_host(host: str) -> str:
    """A checker's word for our host, '' unless it is an IP address (a liar's text is never announced)."""
    try:
        return str(ipaddress.ip_address(host[:64]))
    except ValueError:
        return ""


def _may_dial(host: str, caller_host: str) -> bool:
    """Never dial a wildcard (it means "this machine" to the dialler), nor our own loopback for a caller on
    another machine (its services are not the caller's to probe)."""
    kind = host_kind(host)
    if kind is HostKind.WILDCARD:
        return False
    return kind is not HostKind.LOOPBACK or host_kind(caller_host) is HostKind.LOOPBACK
