"""The relayed peer's side of a reverse tunnel (see :mod:`relay_server`): only outbound connections.

:class:`RelayTunnel` dials the relay, opens the ``Tunnel`` stream and learns the address the relay accepts
callers on for us. For each caller the relay announces, it opens a ``Connect`` stream and a TCP connection
to our own gRPC server on loopback (from a loopback alias standing for that caller, so per-caller quotas
still tell callers apart) and pumps bytes between the two. :meth:`RelayTunnel.run` returns when the relay
goes away (its stream ends, or no heartbeat for ``3 x HEARTBEAT_S``); the owner then finds another relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from swarmpipe.peer.transport import security as process_security
from swarmpipe.peer.transport.addresses import loopback_alias, split_host_port
from swarmpipe.peer.transport.channels import channel_options
from swarmpipe.peer.transport.relay_server import CHUNK_BYTES, HEARTBEAT_S
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

log = logging.getLogger("swarmpipe.relay")
DEAD_AFTER_S = 3 * HEARTBEAT_S
OPEN_TIMEOUT_S = 10.0
# Relayed callers served at once (the relay itself admits 32 per relayed peer): a hostile relay that announces
# callers without end gets this many local connections, not one per message.
MAX_CONNECTIONS = 64


class RelayError(Exception):
    """The relay refused us or could not be reached."""


class RelayTunnel:
    def __init__(
        self,
        relay_address: str,
        peer_id: str,
        local_host: str,
        local_port: int,
        max_message_mb: int = 64,
        security: process_security.Security | None = None,
    ):
        self.relay_address = relay_address
        self.peer_id = peer_id
        self.local_host = "127.0.0.1" if local_host in ("", "0.0.0.0", "::", "localhost") else local_host
        self.local_port = local_port
        self.security = security or process_security.current()
        self.channel = self.security.channel(relay_address, channel_options(max_message_mb))
        self.stub = swarm_pb2_grpc.RelayStub(self.channel)
        self.address = ""  # where callers reach us through this relay, once opened
        self.connections = 0
        self.refused = 0  # callers announced while MAX_CONNECTIONS were being served
        self._call = None
        self._tasks: set[asyncio.Task] = set()
        self._alias_ok = True

    async def open(self) -> str:
        """Open the tunnel; the address to announce. :class:`RelayError` when the relay refuses or is gone."""
        self._call = self.stub.Tunnel()
        try:
            await asyncio.wait_for(self._call.write(swarm_pb2.TunnelUp(peer_id=self.peer_id)), OPEN_TIMEOUT_S)
            first = await asyncio.wait_for(self._call.read(), OPEN_TIMEOUT_S)
        except (grpc.RpcError, asyncio.TimeoutError) as e:
            await self.close()
            raise RelayError(_describe(e)) from None
        if first is grpc.aio.EOF or not first.address:
            await self.close()
            raise RelayError("the relay ended the tunnel without an address")
        split_host_port(first.address)  # a relay's garbage address is not announced
        self.address = first.address
        return self.address

    async def run(self) -> str:
        """Serve callers until the relay goes away; returns why."""
        heartbeat = asyncio.ensure_future(self._heartbeats())
        try:
            while True:
                try:
                    message = await asyncio.wait_for(self._call.read(), DEAD_AFTER_S)
                except asyncio.TimeoutError:
                    return f"no word from the relay for {DEAD_AFTER_S:.0f}s"
                except grpc.RpcError as e:
                    return _describe(e)
                if message is grpc.aio.EOF:
                    return "the relay ended the tunnel"
                if message.connection and len(self._tasks) < MAX_CONNECTIONS:
                    self._spawn(self._serve_connection(message.connection, message.caller))
                elif message.connection:
                    self.refused += 1
                    if self.refused == 1:
                        log.warning(
                            "relay client %s: %d relayed callers at once; refusing more",
                            self.peer_id[-6:],
                            MAX_CONNECTIONS,
                        )
        finally:
            heartbeat.cancel()

    async def _heartbeats(self) -> None:
        with contextlib.suppress(grpc.RpcError, asyncio.CancelledError):
            while True:
                await asyncio.sleep(HEARTBEAT_S)
                await self._call.write(swarm_pb2.TunnelUp(heartbeat=True))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _dial_local(self, caller: str):
        if self.local_host.startswith("127.") and self._alias_ok:
            try:
                return await asyncio.open_connection(
                    self.local_host, self.local_port, local_addr=(loopback_alias(caller), 0), limit=CHUNK_BYTES
                )
            except OSError:
                self._alias_ok = False  # no 127/8 aliases here (not Linux): all relayed callers share one host
        return await asyncio.open_connection(self.local_host, self.local_port, limit=CHUNK_BYTES)

    async def _serve_connection(self, connection: int, caller: str) -> None:
        try:
            reader, writer = await self._dial_local(caller)
        except OSError as e:
            log.warning("relay client %s: our own server refused a relayed caller: %s", self.peer_id[-6:], e)
            return
        self.connections += 1
        call = self.stub.Connect()
        try:
            await call.write(swarm_pb2.RelayChunk(connection=connection))
            to_relay = asyncio.ensure_future(self._local_to_relay(reader, call))
            while True:
                chunk = await call.read()
                if chunk is grpc.aio.EOF:
                    break
                writer.write(chunk.data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
            await asyncio.wait({to_relay}, timeout=5.0)
            to_relay.cancel()
        except (grpc.RpcError, ConnectionError, OSError):
            pass
        finally:
            self.connections -= 1
            call.cancel()
            writer.close()

    @staticmethod
    async def _local_to_relay(reader: asyncio.StreamReader, call) -> None:
        with contextlib.suppress(grpc.RpcError, ConnectionError, OSError):
            while True:
                data = await reader.read(CHUNK_BYTES)
                if not data:
                    break
                await call.write(swarm_pb2.RelayChunk(data=data))
            await call.done_writing()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._call is not None:
            self._call.cancel()
        await self.channel.close(grace=None)


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {(error.details() or '')[:160]}"
    if isinstance(error, asyncio.TimeoutError):
        return "timed out"
    return str(error)[:160]
