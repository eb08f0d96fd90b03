"""The relay's side of a reverse tunnel: serve a peer that nobody can dial.

A peer behind NAT dials out to a relay and keeps a ``Tunnel`` stream open. The relay then listens on a port
of its own for that peer: each TCP connection a caller makes there is announced down the tunnel (a random,
unguessable connection id), the relayed peer dials back with a ``Connect`` stream naming the id, and the
relay pumps the connection's bytes through that stream in both directions. The relay forwards bytes, not
calls: gRPC, TLS (end to end, with the relayed peer's own pinned certificate) and the swarm's credentials
pass through untouched, and every caller works unchanged with the address the relayed peer announces.

Bounded per relayed peer: ``max_connections`` open at once, ``rate_bytes_s`` forwarded (a token bucket over
both directions); per relay: ``capacity`` tunnels, ``max_per_host`` from one caller host. Each connection's memory is bounded by HTTP/2 flow
control on its own stream plus one chunk.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from dataclasses import dataclass, field

import grpc

from swarmpipe.peer.transport.addresses import join_host_port, observed_host
from swarmpipe.protos import swarm_pb2

log = logging.getLogger("swarmpipe.relay")
CHUNK_BYTES = 256 * 1024  # read size on the caller's socket, and the largest chunk a relayed peer may send
CLAIM_TIMEOUT_S = 10.0  # a caller's connection waits this long for the relayed peer's Connect
HEARTBEAT_S = 10.0
_PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{1,64}$")


class TokenBucket:
    """``rate`` bytes per second, bursts up to one second's worth; ``rate <= 0``: unlimited."""

    def __init__(self, rate: float):
        self.rate = rate
        self.tokens = rate
        self.stamp = time.monotonic()

    async def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        while True:
            now = time.monotonic()
            self.tokens = min(self.rate, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens >= min(n, self.rate):
                self.tokens -= n  # may go negative for a chunk above the burst: the next one waits longer
                return
            await asyncio.sleep((min(n, self.rate) - self.tokens) / self.rate)


@dataclass
class _Tunnel:
    peer_id: str
    host: str  # the relayed peer's host as we see it: Connect streams must come from there
    outbox: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(maxsize=256))
    listener: asyncio.base_events.Server | None = None
    address: str = ""
    pending: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Future]] = field(default_factory=dict)
    open_connections: int = 0
    bucket: TokenBucket = field(default_factory=lambda: TokenBucket(0))
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    forwarded_bytes: int = 0


class RelayServicer:
    """The ``swarmpipe.Relay`` tunnel methods (and, via ``checker``, ``CheckReachability``)."""

    def __init__(
        self,
        capacity: int,
        host: str,
        announce_host: str,
        rate_bytes_s: float = 0.0,
        max_connections: int = 32,
        max_per_host: int = 4,
        checker=None,
        role: str = "peer",
        own_id: str = "",
    ):
        self.capacity = capacity
        self.host = host  # where per-peer listeners bind
        self.announce_host = announce_host  # what relayed peers announce (our public host)
        self.rate_bytes_s = rate_bytes_s
        self.max_connections = max_connections
        self.checker = checker
        self.tag = f"{role} {own_id[-6:]}" if own_id else role
        self.max_per_host = max_per_host
        self.tunnels: dict[int, _Tunnel] = {}
        self._serial = 0

    def stop_relaying(self) -> None:
        """A peer that is itself relayed relays nobody: new tunnels are refused from now on."""
        self.capacity = 0

    def announce_at(self, host: str) -> None:
        """The public host relayed peers announce, once our own serving address is known."""
        self.announce_host = host

    @property
    def in_use(self) -> int:
        return len(self.tunnels)

    def stats(self) -> dict[str, int]:
        return {"relayed_peers": len(self.tunnels), "capacity": self.capacity}

    # ------------------------------------------------------------ reachability (delegated)
    async def CheckReachability(self, request, context):
        if self.checker is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this node does not check reachability")
        return await self.checker.check(request, context)

    # ------------------------------------------------------------ the control stream
    async def Tunnel(self, request_iterator, context):
        # Refusals come after the first message is read: a refusal before it races the caller's write, which then
        # fails as "INTERNAL: Internal error from Core" and the caller never learns why.
        first = await _first(request_iterator, context)
        if self.capacity <= 0:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node does not relay (--relay-capacity 0)")
        peer_id = first.peer_id
        if not _PEER_ID.match(peer_id):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Tunnel: the first message must carry a peer id")
        if len(self.tunnels) >= self.capacity:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"relay full: {self.capacity} peers relayed")
        host = observed_host(context.peer() or "")
        if sum(t.host == host for t in self.tunnels.values()) >= self.max_per_host:  # one host cannot take them all
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.max_per_host} tunnels from {host} already")
        # Keyed by a serial, not by the peer id it claims (unproven): a stranger naming a relayed peer's id
        # gets a tunnel of its own and cannot close or take over the real one. A reconnecting peer opens a new
        # tunnel; the old one ends when its stream does.
        self._serial += 1
        key = self._serial
        tunnel = _Tunnel(peer_id, host, bucket=TokenBucket(self.rate_bytes_s))
        tunnel.listener = await asyncio.start_server(
            lambda r, w: self._accept(tunnel, r, w), self.host, 0, limit=CHUNK_BYTES
        )
        port = tunnel.listener.sockets[0].getsockname()[1]
        tunnel.address = join_host_port(self.announce_host, port)
        self.tunnels[key] = tunnel
        log.info("%s relays peer %s at %s (%d/%d)", self.tag, peer_id[-6:], tunnel.address, self.in_use, self.capacity)
        reader = asyncio.ensure_future(self._drain_up(request_iterator, tunnel))
        try:
            yield swarm_pb2.TunnelDown(address=tunnel.address)
            while not tunnel.closed.is_set():
                try:
                    message = await asyncio.wait_for(tunnel.outbox.get(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    message = swarm_pb2.TunnelDown(heartbeat=True)
                if message is None:
                    break
                yield message
        finally:
            reader.cancel()
            self.tunnels.pop(key, None)
            await self._close(tunnel)
            log.info("%s stops relaying peer %s (%d bytes forwarded)", self.tag, peer_id[-6:], tunnel.forwarded_bytes)

    async def _drain_up(self, request_iterator, tunnel: _Tunnel) -> None:
        """The relayed peer's heartbeats; the tunnel ends when its stream does."""
        try:
            async for _ in request_iterator:
                pass
        except Exception:  # the stream broke: the same as ending it
            pass
        tunnel.closed.set()
        if not tunnel.outbox.full():
            tunnel.outbox.put_nowait(None)  # wakes the writer at once

    async def _close(self, tunnel: _Tunnel) -> None:
        tunnel.closed.set()
        if tunnel.listener is not None:
            tunnel.listener.close()
        for _, writer, claimed in list(tunnel.pending.values()):
            if not claimed.done():
                claimed.cancel()
            writer.close()
        tunnel.pending.clear()

    # ------------------------------------------------------------ callers' connections
    async def _accept(self, tunnel: _Tunnel, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if tunnel.closed.is_set() or tunnel.open_connections + len(tunnel.pending) >= self.max_connections:
            writer.close()
            return
        connection = secrets.randbits(63) or 1
        claimed: asyncio.Future = asyncio.get_running_loop().create_future()
        tunnel.pending[connection] = (reader, writer, claimed)
        sock = writer.get_extra_info("peername") or ("", 0)
        caller = f"ipv6:[{sock[0]}]:{sock[1]}" if ":" in str(sock[0]) else f"ipv4:{sock[0]}:{sock[1]}"
        try:
            tunnel.outbox.put_nowait(swarm_pb2.TunnelDown(connection=connection, caller=caller))
            await asyncio.wait_for(asyncio.shield(claimed), CLAIM_TIMEOUT_S)
        except (asyncio.QueueFull, asyncio.TimeoutError, asyncio.CancelledError):
            if tunnel.pending.pop(connection, None) is not None:
                writer.close()

    async def Connect(self, request_iterator, context):
        first = await _first(request_iterator, context)
        caller_host = observed_host(context.peer() or "")
        found = None
        for tunnel in self.tunnels.values():
            if first.connection in tunnel.pending and tunnel.host == caller_host:
                found = tunnel
                break
        if found is None:  # unknown, already claimed, or claimed from another host than the tunnel's
            await context.abort(grpc.StatusCode.NOT_FOUND, "Connect: no such pending connection for this caller")
        reader, writer, claimed = found.pending.pop(first.connection)
        claimed.set_result(True)
        found.open_connections += 1
        upstream = asyncio.ensure_future(self._to_caller(first, request_iterator, writer, found))
        try:
            while not found.closed.is_set():
                data = await reader.read(CHUNK_BYTES)
                if not data:
                    break
                await found.bucket.take(len(data))
                found.forwarded_bytes += len(data)
                yield swarm_pb2.RelayChunk(data=data)
            await asyncio.wait({upstream}, timeout=1.0)
        finally:
            upstream.cancel()
            found.open_connections -= 1
            writer.close()

    async def _to_caller(self, first, request_iterator, writer: asyncio.StreamWriter, tunnel: _Tunnel) -> None:
        """The relayed peer's bytes to the caller's socket; the socket's write side ends with the stream."""
        try:
            chunk = first
            while True:
                if len(chunk.data) > CHUNK_BYTES:
                    log.warning("%s: peer %s sent an oversized chunk; closing", self.tag, tunnel.peer_id[-6:])
                    break
                if chunk.data:
                    await tunnel.bucket.take(len(chunk.data))
                    tunnel.forwarded_bytes += len(chunk.data)
                    writer.write(chunk.data)
                    await writer.drain()
                chunk = await anext(request_iterator, None)
                if chunk is None:
                    break
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError, grpc.RpcError, asyncio.CancelledError):
            pass
        finally:
            if chunk is not None:
                writer.close()


async def _first(request_iterator, context):
    try:
        first = await asyncio.wait_for(anext(request_iterator, None), CLAIM_TIMEOUT_S)
    except asyncio.TimeoutError:
        first = None
    if first is None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "stream ended (or stalled) before its first message")
    return first
