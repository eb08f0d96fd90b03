"""Reachability checks and the relay's reverse tunnel over real grpc.aio servers on 127.0.0.1 (issue 15):
the three outcomes of a check (reachable, unreachable, reachable at another address) against a peer that
announces a wrong address; a real stage's calls through a relay; a lost relay noticed by the relayed
side; and the Relay service against hostile callers (garbage, bad fields, floods, strangers' ids)."""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import AsyncIterator

import grpc
import pytest

from swarmpipe.peer.spec import spec_from_dict
from swarmpipe.peer.stage.lifecycle import Lifecycle
from swarmpipe.peer.stage.metrics import PeerMetrics
from swarmpipe.peer.stage.runtime import StageRuntime
from swarmpipe.peer.stage.server import StageServicer, start_server
from swarmpipe.peer.swarm.records import PeerState
from swarmpipe.peer.swarm.relaying import relay_handlers
from swarmpipe.peer.transport import relay_client
from swarmpipe.peer.transport.reachability import (
    ELSEWHERE,
    REACHABLE,
    UNREACHABLE,
    ReachabilityChecker,
    check_reachability,
)
from swarmpipe.peer.transport.relay_client import RelayTunnel
from swarmpipe.peer.transport.relay_server import RelayServicer
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
PEER_ID = "QmTarget1111111111111111111111111111111111111"


def _relay(capacity: int, **kw) -> RelayServicer:
    checker = ReachabilityChecker("QmChecker", min_interval_s=kw.pop("min_interval_s", 0.0))
    return RelayServicer(capacity, "127.0.0.1", "127.0.0.1", checker=checker, own_id="QmRelay", **kw)


class Node:
    """A real stage server (tiny model, online) with the Relay service, like a peer's."""

    def __init__(self, peer_id: str, relay: RelayServicer):
        spec = spec_from_dict(
            {
                "run_id": "t",
                "num_stages": 2,
                "averaging_interval_s": 0,
                "model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8},
            }
        )
        self.runtime = StageRuntime(spec, 0)
        lifecycle = Lifecycle()
        lifecycle.change(PeerState.ONLINE)
        self.servicer = StageServicer(self.runtime, peer_id, PeerMetrics(), lifecycle)
        self.relay = relay
        self.server = None
        self.port = 0

    async def start(self) -> Node:
        self.server, self.port = await start_server(self.servicer, "127.0.0.1", 0, services=relay_handlers(self.relay))
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(None)
        self.runtime.close()


@pytest.fixture
async def nodes() -> AsyncIterator[list[Node]]:
    made: list[Node] = []
    yield made
    for node in made:
        await node.stop()
    gc.collect()  # no grpc.aio object may be freed in a later fork's child


async def _node(nodes: list[Node], peer_id: str, relay: RelayServicer) -> Node:
    node = await Node(peer_id, relay).start()
    nodes.append(node)
    return node


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_the_three_outcomes_of_a_check(nodes):
    checker = await _node(nodes, "QmChecker", _relay(0))
    target = await _node(nodes, PEER_ID, _relay(0))
    reachable = await check_reachability(target.address, PEER_ID, [checker.address])
    assert reachable.outcome == REACHABLE and reachable.reachable_at == target.address
    assert reachable.observed_host == "127.0.0.1"
    closed = await check_reachability(f"127.0.0.1:{_closed_port()}", PEER_ID, [checker.address])
    assert closed.outcome == UNREACHABLE and "UNAVAILABLE" in closed.detail
    # announces a documentation address (nothing answers there); the checker saw us on 127.0.0.1: that works
    wrong_host = await check_reachability(f"192.0.2.1:{target.port}", PEER_ID, [checker.address])
    assert wrong_host.outcome == ELSEWHERE and wrong_host.reachable_at == target.address
    # the address answers, but as another peer: it is not ours
    impostor = await check_reachability(target.address, "QmSomebodyEmse", [checker.address])
    assert impostor.outcome == UNREACHABLE and "answered as peer" in impostor.detail
    # a wildcard is never dialled (it would mean the checker's own machine)
    wildcard = await check_reachability(f"0.0.0.0:{target.port}", PEER_ID, [checker.address])
    assert wildcard.outcome == ELSEWHERE  # only at the observed host
    nobody = await check_reachability(target.address, PEER_ID, [f"127.0.0.1:{_closed_port()}"])
    assert nobody.outcome == "unknown"


class LyingChecker(ReachabilityChecker):
    """A checker that answers without dialling: whatever ``answer`` says."""

    def __init__(self, answer: swarm_pb2.ReachabilityResponse):
        super().__init__("QmLiar", min_interval_s=0.0)
        self.answer = answer

    async def check(self, request, context) -> swarm_pb2.ReachabilityResponse:
        self.checks += 1
        return self.answer


async def _liar(nodes: list[Node], answer: swarm_pb2.ReachabilityResponse) -> tuple[Node, LyingChecker]:
    checker = LyingChecker(answer)
    relay = RelayServicer(0, "127.0.0.1", "127.0.0.1", checker=checker, own_id="QmLiar")
    return await _node(nodes, "QmLiar", relay), checker


async def test_a_lying_checker_cannot_make_a_peer_announce_an_address_that_is_not_its_own(nodes):
    honest = await _node(nodes, "QmChecker", _relay(0))
    target = await _node(nodes, PEER_ID, _relay(0))
    port = target.port
    # inconsistent: "elsewhere" at a port we did not ask about, or at a host it did not say it saw
    for lie in (
        swarm_pb2.ReachabilityResponse(outcome=ELSEWHERE, observed_host="127.0.0.1", reachable_at="127.0.0.1:1"),
        swarm_pb2.ReachabilityResponse(outcome=ELSEWHERE, observed_host="203.0.113.9", reachable_at=f"8.8.8.8:{port}"),
        swarm_pb2.ReachabilityResponse(outcome=ELSEWHERE, observed_host="not-an-ip", reachable_at=f"not-an-ip:{port}"),
        swarm_pb2.ReachabilityResponse(outcome="sure", observed_host="127.0.0.1"),
    ):
        liar, lying = await _liar(nodes, lie)
        alone = await check_reachability(target.address, PEER_ID, [liar.address])
        assert alone.outcome == "unknown" and not alone.reachable_at and lying.checks == 1, (lie, alone)
        for _ in range(3):  # whichever of the two is asked first
            verdict = await check_reachability(target.address, PEER_ID, [liar.address, honest.address])
            assert verdict.outcome == REACHABLE and verdict.reachable_at == target.address, (lie, verdict)
    # consistent but false: it "saw" us at 203.0.113.9; a second checker cannot dial us there, so it is not believed
    lie = swarm_pb2.ReachabilityResponse(
        outcome=ELSEWHERE, observed_host="203.0.113.9", reachable_at=f"203.0.113.9:{port}"
    )
    liar, lying = await _liar(nodes, lie)
    verdict = await check_reachability(target.address, PEER_ID, [liar.address, honest.address], ask=2)
    assert verdict.reachable_at != f"203.0.113.9:{port}" and lying.checks <= 1, verdict
    # a claimed REACHABLE is taken for the address we asked about, never for one the checker names
    lie = swarm_pb2.ReachabilityResponse(outcome=REACHABLE, observed_host="127.0.0.1", reachable_at="198.51.100.1:9")
    liar, _ = await _liar(nodes, lie)
    verdict = await check_reachability(target.address, PEER_ID, [liar.address])
    assert verdict.outcome == REACHABLE and verdict.reachable_at == target.address


class FloodingRelay(RelayServicer):
    """A hostile relay: gives an address, then announces a thousand callers and never serves their streams."""

    async def Tunnel(self, request_iterator, context):
        await request_iterator.__anext__()
        yield swarm_pb2.TunnelDown(address="127.0.0.1:1")
        for n in range(1, 1001):
            yield swarm_pb2.TunnelDown(connection=n, caller="ipv4:203.0.113.5:1")
        await asyncio.sleep(30)

    async def Connect(self, request_iterator, context):
        await asyncio.sleep(30)  # holds every stream open
        yield swarm_pb2.RelayChunk()


async def test_a_flooding_relay_gets_a_bounded_number_of_local_connections(nodes):
    relay = await _node(nodes, "QmRelay", FloodingRelay(4, "127.0.0.1", "127.0.0.1", own_id="QmRelay"))
    target = await _node(nodes, PEER_ID, _relay(0))
    tunnel = RelayTunnel(relay.address, PEER_ID, "127.0.0.1", target.port)
    assert await tunnel.open() == "127.0.0.1:1"
    serving = asyncio.ensure_future(tunnel.run())
    for _ in range(100):
        await asyncio.sleep(0.05)
        if tunnel.refused:
            break
    assert len(tunnel._tasks) <= relay_client.MAX_CONNECTIONS and tunnel.connections <= relay_client.MAX_CONNECTIONS
    assert tunnel.refused > 0
    serving.cancel()
    await tunnel.close()


async def test_a_real_stage_served_through_a_relay_and_the_relay_lost(nodes):
    relay = await _node(nodes, "QmRelay", _relay(2))
    target = await _node(nodes, PEER_ID, _relay(0))
    tunnel = RelayTunnel(relay.address, PEER_ID, "127.0.0.1", target.port)
    address = await tunnel.open()
    assert address != target.address and address.startswith("127.0.0.1:")
    serving = asyncio.ensure_future(tunnel.run())
    channel = grpc.aio.insecure_channel(address)
    try:
        info = await swarm_pb2_grpc.StageStub(channel).Info(swarm_pb2.InfoRequest(), timeout=10)
        assert info.peer_id == PEER_ID and info.state == "online"
        # the check itself passes through the relay: the relayed address is reachable as this peer
        verdict = await check_reachability(address, PEER_ID, [relay.address])
        assert verdict.outcome == REACHABLE
        assert relay.relay.in_use == 1
        await relay.server.stop(None)  # the relay dies
        reason = await asyncio.wait_for(serving, 45)
        assert reason  # the relayed side knows, and says why
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await swarm_pb2_grpc.StageStub(channel).Info(swarm_pb2.InfoRequest(), timeout=5)
        assert gone.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        serving.cancel()
        await channel.close()
        await tunnel.close()


async def _raw(address: str, method: str, payload: bytes, streaming: bool) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as channel:
        path = f"/swarmpipe.Relay/{method}"
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            if streaming:
                async for _ in channel.stream_stream(path)(iter([payload]), timeout=10):
                    pass
            else:
                await channel.unary_unary(path)(payload, timeout=10)
        return failed.value


async def test_hostile_callers_get_clear_errors_and_the_relay_keeps_serving(nodes):
    relay = await _node(nodes, "QmRelay", _relay(1, min_interval_s=30.0))
    for method, streaming in (("CheckReachability", False), ("Tunnel", True), ("Connect", True)):
        error = await _raw(relay.address, method, b"\xff\xff\xff", streaming)
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (method, error)
    stub = swarm_pb2_grpc.RelayStub(grpc.aio.insecure_channel(relay.address))
    bad = [
        swarm_pb2.ReachabilityRequest(address="no-port", peer_id=PEER_ID),
        swarm_pb2.ReachabilityRequest(address="127.0.0.1:70000", peer_id=PEER_ID),
        swarm_pb2.ReachabilityRequest(address="127.0.0.1:5", peer_id="not base58 0OIl"),
        swarm_pb2.ReachabilityRequest(address="127.0.0.1:5", peer_id=PEER_ID, tls_cert="x" * 100_000),
    ]
    for request in bad:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CheckReachability(request, timeout=10)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, request
    # one check per host per interval: a flood of checks (a port scan through us) is refused
    first = await stub.CheckReachability(
        swarm_pb2.ReachabilityRequest(address=f"127.0.0.1:{_closed_port()}", peer_id=PEER_ID), timeout=10
    )
    assert first.outcome == UNREACHABLE
    with pytest.raises(grpc.aio.AioRpcError) as flood:
        await stub.CheckReachability(swarm_pb2.ReachabilityRequest(address="127.0.0.1:22", peer_id=PEER_ID), timeout=10)
    assert flood.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    # a tunnel without a proper peer id; a Connect for a connection nobody announced
    for first_message in (swarm_pb2.TunnelUp(peer_id=""), swarm_pb2.TunnelUp(peer_id="x" * 100)):
        with pytest.raises(grpc.aio.AioRpcError) as no_id:
            async for _ in stub.Tunnel(iter([first_message]), timeout=10):
                pass
        assert no_id.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as hijack:
        async for _ in stub.Connect(iter([swarm_pb2.RelayChunk(connection=12345, data=b"GET /")]), timeout=10):
            pass
    assert hijack.value.code() is grpc.StatusCode.NOT_FOUND
    # capacity: the second relayed peer is refused while the first holds the only place
    target = await _node(nodes, PEER_ID, _relay(0))
    tunnel = RelayTunnel(relay.address, PEER_ID, "127.0.0.1", target.port)
    await tunnel.open()
    other = RelayTunnel(relay.address, "QmAnother", "127.0.0.1", target.port)
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        await other.open()
    # a node that does not relay says so
    plain = await _node(nodes, "QmPlain", _relay(0))
    with pytest.raises(Exception, match="FAILED_PRECONDITION"):
        await RelayTunnel(plain.address, "QmAnother", "127.0.0.1", target.port).open()
    info = await swarm_pb2_grpc.StageStub(grpc.aio.insecure_channel(relay.address)).Info(
        swarm_pb2.InfoRequest(), timeout=10
    )
    assert info.peer_id == "QmRelay"  # still serving
    await tunnel.close()


async def test_a_stranger_naming_a_relayed_peer_cannot_take_its_tunnel_and_one_host_cannot_take_them_all(nodes):
    relay = await _node(nodes, "QmRelay", _relay(10, max_per_host=2))
    target = await _node(nodes, PEER_ID, _relay(0))
    real = RelayTunnel(relay.address, PEER_ID, "127.0.0.1", target.port)
    address = await real.open()
    serving = asyncio.ensure_future(real.run())
    impostor = RelayTunnel(relay.address, PEER_ID, "127.0.0.1", _closed_port())  # claims the same peer id
    try:
        other = await impostor.open()
        assert other != address
        channel = grpc.aio.insecure_channel(address)
        info = await swarm_pb2_grpc.StageStub(channel).Info(swarm_pb2.InfoRequest(), timeout=10)
        assert info.peer_id == PEER_ID and not serving.done()  # the real tunnel still carries the real peer
        await channel.close()
        third = RelayTunnel(relay.address, "QmThird", "127.0.0.1", target.port)
        with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
            await third.open()  # two tunnels from 127.0.0.1 already
    finally:
        serving.cancel()
        await impostor.close()
        await real.close()
