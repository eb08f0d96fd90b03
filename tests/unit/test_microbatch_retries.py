"""swarmpipe.peer.trainer.microbatch: what the trainer does with each kind of failed call (no sockets: fake calls)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from swarmpipe.peer.events import EventLog
from swarmpipe.peer.trainer.microbatch import MicrobatchRunner, Rejected
from swarmpipe.peer.swarm.records import StageRecord
from swarmpipe.peer.trainer.routing import Router
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.trainer.trainer import Progress

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


def failing_on(bad: str, code: grpc.StatusCode, details: str, called: list[str]):
    """A fake call: records each replica it goes to; ``bad`` fails with ``code``, the others answer "ok"."""
    async def call(view):
        called.append(view.peer_id)
        if bad in ("*", view.peer_id):
            raise rpc_error(code, details)
        return "ok"
    return call


def prefer(runner: MicrobatchRunner, first: str, then: str) -> None:
    """Make ``first`` look faster than ``then``, so it is tried first."""
    runner.router.peers[first].reported_throughput = 100.0
    runner.router.peers[then].reported_throughput = 1.0


def test_a_replica_that_moved_is_dropped_and_the_call_goes_to_another() -> None:
    runner = make_runner(["mover", "stayer"])
    prefer(runner, "mover", "stayer")
    called: list[str] = []
    call = failing_on("mover", grpc.StatusCode.FAILED_PRECONDITION, "wrong stage 0: this peer serves stage 1", called)
    result, view = run(runner._with_retries(0, call))
    assert (result, view.peer_id) == ("ok", "stayer")
    assert called == ["mover", "stayer"]
    assert "mover" not in runner.router.peers  # forgotten, not banned
    assert runner.progress.retried == 1


def test_one_replica_rejecting_a_request_does_not_fail_the_microbatch() -> None:
    runner = make_runner(["faulty", "good"])
    prefer(runner, "faulty", "good")
    called: list[str] = []
    result, view = run(runner._with_retries(0, failing_on("faulty", grpc.StatusCode.INVALID_ARGUMENT, "input: bad", called)))
    assert view.peer_id == "good" and called == ["faulty", "good"]
    assert runner.router.peers["faulty"].banned_until == 0.0  # a rejection is not a sign of ill health


def test_a_request_every_replica_rejects_fails_that_microbatch_only() -> None:
    runner = make_runner(["a", "b"])
    calls: list[str] = []
    call = failing_on("*", grpc.StatusCode.INVALID_ARGUMENT, "input: token ids must lie in [0, 256)", calls)
    with pytest.raises(Rejected, match="every replica rejected"):
        run(runner._with_retries(0, call))
    assert sorted(calls) == ["a", "b"]  # each replica asked once, no endless loop


def test_unavailable_bans_the_replica_and_retries_elsewhere() -> None:
    runner = make_runner(["draining", "other"])
    prefer(runner, "draining", "other")
    called: list[str] = []
    _, view = run(runner._with_retries(0, failing_on("draining", grpc.StatusCode.UNAVAILABLE, "draining", called)))
    assert view.peer_id == "other"
    assert runner.router.peers["draining"].banned_until > 0
