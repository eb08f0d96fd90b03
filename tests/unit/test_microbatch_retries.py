"""peer.microbatch: what the trainer does with each kind of failed call (no sockets: fake calls)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from peer.events import EventLog
from peer.microbatch import MicrobatchRunner, Rejected
from peer.records import StageRecord
from peer.routing import Router
from peer.spec import RunSpec
from peer.trainer import Progress

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def make_runner(replicas: list[str]) -> MicrobatchRunner:
    router = Router(2)
    router.update_stage(0, {p: StageRecord(address=f"127.0.0.1:{i + 1}", state="online", throughput=0.0, queue=0,
                                           version=0, updated_at=0.0) for i, p in enumerate(replicas)})

    async def refresh() -> None:
        return None

    return MicrobatchRunner(RunSpec(), router, Progress(), EventLog("", "trainer", "test-trainer"),
                            call_timeout=5.0, wait_timeout=2.0, refresh=refresh)


def run(coro):
    return asyncio.run(coro)


def test_a_replica_that_moved_is_dropped_and_the_call_goes_to_another() -> None:
    runner = make_runner(["mover", "stayer"])
    called: list[str] = []

    async def call(view):
        called.append(view.peer_id)
        if view.peer_id == "mover":
            raise rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "wrong stage 0: this peer serves stage 1")
        return "ok"

    runner.router.peers["stayer"].reported_throughput = 1.0  # make the mover look faster: it is tried first
    runner.router.peers["mover"].reported_throughput = 100.0
    result, view = run(runner._with_retries(0, call))
    assert (result, view.peer_id) == ("ok", "stayer")
    assert called == ["mover", "stayer"]
    assert "mover" not in runner.router.peers  # forgotten, not banned
    assert runner.progress.retried == 1


def test_one_replica_rejecting_a_request_does_not_fail_the_microbatch() -> None:
    runner = make_runner(["faulty", "good"])
    runner.router.peers["faulty"].reported_throughput = 100.0
    runner.router.peers["good"].reported_throughput = 1.0

    called: list[str] = []

    async def call(view):
        called.append(view.peer_id)
        if view.peer_id == "faulty":
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "input: bad")
        return "ok"

    result, view = run(runner._with_retries(0, call))
    assert view.peer_id == "good" and called == ["faulty", "good"]
    assert runner.router.peers["faulty"].banned_until == 0.0  # a rejection is not a sign of ill health


def test_a_request_every_replica_rejects_fails_that_microbatch_only() -> None:
    runner = make_runner(["a", "b"])
    calls: list[str] = []

    async def call(view):
        calls.append(view.peer_id)
        raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "input: token ids must lie in [0, 256)")

    with pytest.raises(Rejected, match="every replica rejected"):
        run(runner._with_retries(0, call))
    assert sorted(calls) == ["a", "b"]  # each replica asked once, no endless loop


def test_unavailable_bans_the_replica_and_retries_elsewhere() -> None:
    runner = make_runner(["draining", "other"])
    runner.router.peers["draining"].reported_throughput = 100.0
    runner.router.peers["other"].reported_throughput = 1.0

    async def call(view):
        if view.peer_id == "draining":
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "draining")
        return "ok"

    _, view = run(runner._with_retries(0, call))
    assert view.peer_id == "other"
    assert runner.router.peers["draining"].banned_until > 0
