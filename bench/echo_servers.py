"""The callee side of ``bench/dataplane.py``: one echo server per transport, in its own process.

    python bench/echo_servers.py stage|stage-inline|stage-canned|tcp|hivemind

Prints one line ``READY <address>`` (host:port, or a multiaddr for hivemind) and serves until
stdin closes. A stage peer is a process of its own in a real swarm, with its own interpreter,
event loop and core; measuring caller and callee in one process would make them share one GIL and
one event loop, which no deployment does. Every transport gets the same treatment.
  * stage: the real ``StageServicer`` (validation, finite check, codecs, unary and ``Stream``) over
    an identity stage;
  * tcp: a socket echo with ``recv_into`` / ``sendall`` into one reused buffer (the limit);
  * hivemind: ``P2P.add_protobuf_handler`` echoing a ``Tensor`` message (the RPC Petals uses).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from swarmpipe.peer.spec import LimitsSpec, ModelSpec, RunSpec  # noqa: E402
from swarmpipe.peer.stage.metrics import PeerMetrics  # noqa: E402
from swarmpipe.peer.stage.server import StageServicer, start_server  # noqa: E402
from swarmpipe.peer.stage.stash import PendingForwards, RuntimeStats  # noqa: E402
from swarmpipe.peer.swarm.records import PeerState  # noqa: E402
from swarmpipe.peer.transport.channels import tune_allocator  # noqa: E402
from swarmpipe.peer.transport.streaming import frames  # noqa: E402
from swarmpipe.peer.transport.wire import encode_parts  # noqa: E402
from swarmpipe.protos import swarm_pb2  # noqa: E402

WIDTH = 1024  # the identity stage's d_model
MAX_BYTES = 80 << 20


class IdentityRuntime:
    """Just enough of StageRuntime for the servicer: a middle stage whose forward is the identity,
    run on one compute thread as a real stage's is."""

    def __init__(self, spec: RunSpec):
        self.spec, self.stage, self.version = spec, 1, 0
        self.is_first = self.is_last = False
        self.stats = RuntimeStats()
        self.pending = PendingForwards(self.stats)  # the server's sibling waits and metrics read it
        self.device = torch.device("cpu")
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")

    def submit(self, fn: Callable[[], Any]) -> Future:
        return self._compute.submit(fn)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    def forward(self, mb_id: str, x: torch.Tensor) -> torch.Tensor:
        return x

    def forward_many(self, items: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        return [self.forward(mb, x) for mb, x in items]  # the server batches calls; identity needs no concat

    def throughput(self) -> float:
        return 0.0


def stage_spec(width: int = WIDTH) -> RunSpec:
    return RunSpec(
        run_id="bench",
        num_stages=3,
        model=ModelSpec(d_model=width, seq_len=1024),
        limits=LimitsSpec(max_message_mb=64, max_tensor_elements=1 << 25),
    )


def ready(address: str) -> None:
    print(f"READY {address}", flush=True)


async def until_stdin_closes() -> None:
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def serve_stage(width: int, variant: str = "", canned_bytes: int = 1 << 20) -> None:
    """``variant`` (for bench/call_breakdown.py): "inline" runs the identity forward on the event loop
    (no coalescer, no compute thread); "canned" answers every Stream with a reply prepared up front."""
    servicer = StageServicer(IdentityRuntime(stage_spec(width)), "bench-peer", PeerMetrics())
    servicer.lifecycle.change(PeerState.ONLINE)
    if variant == "inline":

        async def forward_inline(item, key=()):
            return item[1], None

        servicer.core.forwards.submit = forward_inline
    elif variant == "canned":
        canned = canned_reply(width, canned_bytes)

        async def stream_canned(request_iterator, context):
            async for _ in request_iterator:
                pass
            for frame in canned:
                yield frame

        servicer.Stream = stream_canned  # before start_server: the handlers are bound there
    server, port = await start_server(servicer, "127.0.0.1", 0)
    ready(f"127.0.0.1:{port}")
    try:
        await until_stdin_closes()
    finally:
        await server.stop(None)


def canned_reply(width: int, nbytes: int = 1 << 20) -> list[bytes]:
    """The frames of a ForwardResponse carrying ``nbytes`` of float32 activations, built once."""
    x = torch.randn(max(nbytes // 4 // width, 1), width)[None]
    header, payload = encode_parts(x, "none")
    return list(frames(swarm_pb2.ForwardResponse(output=header), ("output",), payloads=[payload]))


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True


def serve_tcp() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def echo(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(MAX_BYTES)
        header = bytearray(8)
        with conn:
            while recv_exact(conn, memoryview(header)):
                n = int.from_bytes(header, "little")
                if n == 0 or n > MAX_BYTES:
                    return
                view = memoryview(buf)[:n]
                if not recv_exact(conn, view):
                    return
                conn.sendall(view)

    def accept_loop() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=accept_loop, daemon=True).start()
    host, port = listener.getsockname()[:2]
    ready(f"{host}:{port}")
    sys.stdin.read()
    listener.close()


async def serve_hivemind() -> None:
    from hivemind.p2p import P2P

    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], persistent_conn_max_msg_size=MAX_BYTES + (16 << 20))

    async def handler(request: swarm_pb2.Tensor, _context) -> swarm_pb2.Tensor:
        return request

    await server.add_protobuf_handler("echo", handler, swarm_pb2.Tensor)
    ready(str((await server.get_visible_maddrs())[0]))
    try:
        await until_stdin_closes()
    finally:
        await server.shutdown()


def main() -> None:
    torch.set_num_threads(1)
    tune_allocator()
    kind = sys.argv[1] if len(sys.argv) > 1 else ""
    if kind in ("stage", "stage-inline", "stage-canned"):
        width = int(sys.argv[2]) if len(sys.argv) > 2 else WIDTH
        canned_bytes = int(sys.argv[3]) if len(sys.argv) > 3 else 1 << 20
        asyncio.run(serve_stage(width, kind.partition("-")[2], canned_bytes))
    elif kind == "tcp":
        serve_tcp()
    elif kind == "hivemind":
        asyncio.run(serve_hivemind())
    else:
        sys.exit("usage: echo_servers.py stage|stage-inline|stage-canned [width [reply bytes]]|tcp|hivemind")


if __name__ == "__main__":
    main()
