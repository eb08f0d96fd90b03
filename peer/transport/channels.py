"""gRPC channel and server options in one place, and a pool of reusable channels (dialed through the
process's :class:`~swarmpipe.peer.transport.security.Security`: TLS to pinned certificates, call credentials)."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time

import grpc

from swarmpipe.peer.transport import security as process_security
from swarmpipe.peer.transport.overload import PENDING_OPTIONS
from swarmpipe.peer.transport.security import Security
from swarmpipe.protos import swarm_pb2_grpc

MB = 1024 * 1024
RETIRE_GRACE_S = 60.0  # a channel replaced (its pinned certificates changed) is closed once its calls are done
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_allocator_tuned = False


def tune_allocator(keep_mb: int = 512) -> bool:
    """Serve large buffers (messages, tensors) from the reusable heap instead of fresh mmaps.

    By default glibc maps every allocation above a (dynamic) threshold freshly and unmaps it on
    free, so each multi-MB message pays a page fault per 4 KiB page on first touch: on the
    benchmark machine that caps copies of fresh 16 MiB buffers at ~1-2 GB/s instead of ~10+.
    Raising the mmap threshold and the trim threshold keeps up to ``keep_mb`` of freed memory
    for reuse. Process-wide, idempotent; a no-op where mallopt is unavailable.
    """
    global _allocator_tuned
    if _allocator_tuned:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 256 * MB) and libc.mallopt(_M_TRIM_THRESHOLD, keep_mb * MB)
    except (OSError, AttributeError):
        ok = False
    if not ok:
        logging.getLogger("swarmpipe").debug("mallopt unavailable; large buffers stay mmap-backed")
    _allocator_tuned = bool(ok)
    return _allocator_tuned


def message_options(max_message_mb: int) -> list[tuple[str, int]]:
    limit = max_message_mb * MB
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        # Big initial windows: activations are MBs, default BDP probing ramps up too slowly.
        ("grpc.http2.bdp_probe", 1),
        ("grpc.http2.lookahead_bytes", 8 * MB),
    ]


def server_options(max_message_mb: int) -> list[tuple[str, int]]:
    return message_options(max_message_mb) + [
        ("grpc.so_reuseport", 0),  # port 0 must really mean a fresh port
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        *PENDING_OPTIONS,  # a burst of calls waits for the server, not CANCELLED by grpc-core (overload.py)
    ]


def channel_options(max_message_mb: int) -> list[tuple[str, int]]:
    return message_options(max_message_mb) + [
        # Detect a silently vanished peer (SIGSTOP, partition) within ~15 s even mid-call.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Fail fast when a peer is gone instead of backing off for minutes.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        ("grpc.enable_retries", 0),
    ]


class ChannelPool:
    """One long-lived grpc.aio channel per peer address, shared by all calls to it. A channel is made again
    when the certificates pinned for its address change (the peer restarted with a new one)."""

    def __init__(self, max_message_mb: int, security: Security | None = None):
        self.max_message_mb = max_message_mb
        self._security = security  # None: the process's (read when a channel is made)
        tune_allocator()
        self._channels: dict[str, tuple[tuple[str, ...] | None, grpc.aio.Channel]] = {}  # address -> (pin, channel)
        self._stubs: dict[str, tuple[grpc.aio.Channel, swarm_pb2_grpc.StageStub]] = {}
        self._retired: list[tuple[float, grpc.aio.Channel]] = []

    @property
    def security(self) -> Security:
        return self._security or process_security.current()

    def channel(self, address: str) -> grpc.aio.Channel:
        """The pooled channel; :class:`~swarmpipe.peer.transport.security.UntrustedAddress` (an UNAVAILABLE
        call error) when TLS is required and no signed record pinned a certificate for ``address``."""
        security = self.security
        pin = security.pin(address)
        key = pin.fingerprints if pin is not None else None
        entry = self._channels.get(address)
        if entry is not None and entry[0] == key:
            return entry[1]
        if entry is not None:
            self._retire(entry[1])
        channel = security.channel(address, channel_options(self.max_message_mb), pin=pin)
        self._channels[address] = (key, channel)
        return channel

    def stub(self, address: str) -> swarm_pb2_grpc.StageStub:
        stub = self._stubs.get(address)
        channel = self.channel(address)
        if stub is None or stub[0] is not channel:
            stub = (channel, swarm_pb2_grpc.StageStub(channel))
            self._stubs[address] = stub
        return stub[1]

    def _retire(self, channel: grpc.aio.Channel) -> None:
        """Close a replaced channel later (calls on it may still run); close the long-retired ones now."""
        now = time.monotonic()
        self._retired.append((now, channel))
        due = [c for t, c in self._retired if now - t > RETIRE_GRACE_S]
        self._retired = [(t, c) for t, c in self._retired if now - t <= RETIRE_GRACE_S]
        if due:
            loop = asyncio.get_running_loop()  # channels are made and used on the event loop
            for old in due:
                loop.create_task(old.close(grace=None))

    async def drop(self, address: str) -> None:
        entry = self._channels.pop(address, None)
        self._stubs.pop(address, None)
        if entry is not None:
            await entry[1].close(grace=None)

    async def close(self) -> None:
        for address in list(self._channels):
            await self.drop(address)
        retired, self._retired = self._retired, []
        for _, channel in retired:
            await channel.close(grace=None)
