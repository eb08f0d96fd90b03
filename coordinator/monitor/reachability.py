"""Reachability history: the health page dials every announced peer now and then and remembers what happened.

A record in the DHT says a peer announced itself; only a call says it answers. Each round, every listed peer gets
one ``Info`` call (bounded in time and in calls at once) at the address it announced, relayed or not, and the
outcome joins that peer's history: ``ok`` (it answered, as the peer id it announced), ``wrong_peer`` (something
else answers there), ``unreachable`` (no answer), ``absent`` (no longer announced). Memory is bounded whatever the
DHT holds: at most ``MAX_PEERS`` histories (the least recently seen are forgotten) of ``HISTORY`` outcomes each.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

HISTORY = 60  # outcomes kept per peer
MAX_PEERS = 4096
PROBE_TIMEOUT_S = 3.0
PROBES_AT_ONCE = 16

Dial = Callable[[str], grpc.aio.Channel]


class ReachabilityHistory:
    def __init__(self, max_peers: int = MAX_PEERS, history: int = HISTORY) -> None:
        self.max_peers = max_peers
        self.history = history
        self._peers: OrderedDict[str, deque[tuple[float, str]]] = OrderedDict()

    def record(self, peer_id: str, outcome: str, at: float | None = None) -> None:
        entries = self._peers.pop(peer_id, None) or deque(maxlen=self.history)
        entries.append((time.time() if at is None else at, outcome))
        self._peers[peer_id] = entries  # most recently seen last
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)

    def mark_absent(self, listed: set[str]) -> None:
        """Peers we have a history of that no run lists any more: ``absent`` once (not again every round)."""
        for peer_id, entries in list(self._peers.items()):
            if peer_id not in listed and entries[-1][1] != "absent":
                entries.append((time.time(), "absent"))

    def of(self, peer_id: str) -> list[tuple[float, str]]:
        return list(self._peers.get(peer_id, ()))

    def summary(self, peer_id: str) -> dict[str, Any]:
        entries = self._peers.get(peer_id, ())
        probed = [o for _, o in entries if o != "absent"]
        return {
            "last": entries[-1][1] if entries else "unknown",
            "ok_fraction": round(sum(o == "ok" for o in probed) / len(probed), 3) if probed else None,
            "history": "".join(_GLYPH[o] for _, o in entries),
        }

    def __len__(self) -> int:
        return len(self._peers)


_GLYPH = {"ok": "+", "unreachable": "x", "wrong_peer": "!", "absent": "."}


async def probe(address: str, peer_id: str, dial: Dial, timeout: float = PROBE_TIMEOUT_S) -> str:
    """One ``Info`` call at ``address``: what answered there."""
    try:
        async with dial(address) as channel:
            info = await swarm_pb2_grpc.StageStub(channel).Info(swarm_pb2.InfoRequest(), timeout=timeout)
    except (grpc.RpcError, OSError, ValueError, asyncio.TimeoutError):
        return "unreachable"
    return "ok" if info.peer_id == peer_id else "wrong_peer"


async def probe_all(
    targets: dict[str, str],
    history: ReachabilityHistory,
    dial: Dial,
    prober: Callable[[str, str, Dial], Awaitable[str]] = probe,
    at_once: int = PROBES_AT_ONCE,
) -> None:
    """Probe every ``peer id -> address`` (at most ``at_once`` calls in flight) into ``history``."""
    gate = asyncio.Semaphore(at_once)

    async def one(peer_id: str, address: str) -> None:
        async with gate:
            history.record(peer_id, await prober(address, peer_id, dial))

    await asyncio.gather(*(one(pid, address) for pid, address in targets.items()))
    history.mark_absent(set(targets))
