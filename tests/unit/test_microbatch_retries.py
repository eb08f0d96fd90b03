"""swarmpipe.peer.trainer.microbatch: what the runner does with each kind of failed call, and the outcome it
returns per micro-batch (no sockets: fake calls)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import torch

from swarmpipe.peer.events import EventLog
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.swarm.records import StageRecord
from swarmpipe.peer.trainer.microbatch import MicrobatchRunner
from swarmpipe.peer.trainer.outcome import Journey, MicrobatchOutcome, MicrobatchStatus, Rejected
from swarmpipe.peer.trainer.routing import PeerView, Router
from swarmpipe.peer.trainer.swarm_view import SwarmView

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def record(i: int) -> StageRecord:
    return StageRecord(address=f"127.0.0.1:{i + 1}", state="online", throughput=0.0, queue=0, version=0, updated_at=0.0)


class FakeStages:
    """The DHT as the swarm view reads it: fixed records per stage; counts the reads."""

    def __init__(self, stages: list[list[str]]):
        self.stages = stages
        self.reads = 0

    async def all_stages(self, num_stages: int) -> list[dict[str, StageRecord]]:
        self.reads += 1
        return [{p: record(10 * s + i) for i, p in enumerate(self.stages[s])} for s in range(num_stages)]


def make_runner(
    replicas: list[str], stage1: list[str] | None = None, wait_timeout: float = 2.0, events: EventLog | None = None
) -> MicrobatchRunner:
    """A two-stage runner; ``replicas`` serve stage 0, ``stage1`` stage 1. The DHT says the same thing."""
    stages = [replicas, stage1 or []]
    router = Router(2)
    for s, peers in enumerate(stages):
        router.update_stage(s, {p: record(10 * s + i) for i, p in enumerate(peers)})
    view = SwarmView(FakeStages(stages), router)
    return MicrobatchRunner(
        RunSpec(), view, events or EventLog("", "trainer", "test-trainer"), call_timeout=5.0, wait_timeout=wait_timeout
    )


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


# ------------------------------------------------------------ one call, with retries


async def test_a_replica_that_moved_is_dropped_and_the_call_goes_to_another() -> None:
    runner = make_runner(["mover", "stayer"])
    prefer(runner, "mover", "stayer")
    called: list[str] = []
    journey = Journey()
    call = failing_on("mover", grpc.StatusCode.FAILED_PRECONDITION, "wrong stage 0: this peer serves stage 1", called)
    result, view = await runner._with_retries(0, call, journey)
    assert (result, view.peer_id) == ("ok", "stayer")
    assert called == ["mover", "stayer"]
    assert "mover" not in runner.router.peers  # forgotten, not banned
    assert journey.retries == 1


async def test_one_replica_rejecting_a_request_does_not_fail_the_microbatch() -> None:
    runner = make_runner(["faulty", "good"])
    prefer(runner, "faulty", "good")
    called: list[str] = []
    call = failing_on("faulty", grpc.StatusCode.INVALID_ARGUMENT, "input: bad", called)
    _, view = await runner._with_retries(0, call, Journey())
    assert view.peer_id == "good" and called == ["faulty", "good"]
    assert runner.router.peers["faulty"].banned_until == 0.0  # a rejection is not a sign of ill health


async def test_a_request_every_replica_rejects_fails_that_microbatch_only() -> None:
    runner = make_runner(["a", "b"])
    calls: list[str] = []
    call = failing_on("*", grpc.StatusCode.INVALID_ARGUMENT, "input: token ids must lie in [0, 256)", calls)
    with pytest.raises(Rejected, match="every replica rejected"):
        await runner._with_retries(0, call, Journey())
    assert sorted(calls) == ["a", "b"]  # each replica asked once, no endless loop


async def test_unavailable_bans_the_replica_and_retries_elsewhere() -> None:
    runner = make_runner(["draining", "other"])
    prefer(runner, "draining", "other")
    called: list[str] = []
    journey = Journey()
    call = failing_on("draining", grpc.StatusCode.UNAVAILABLE, "draining", called)
    _, view = await runner._with_retries(0, call, journey)
    assert view.peer_id == "other"
    assert runner.router.peers["draining"].banned_until > 0
    assert journey.retries == 1


async def test_a_first_attempt_that_succeeds_is_no_retry() -> None:
    runner = make_runner(["only"])
    journey = Journey()
    await runner._with_retries(0, failing_on("nobody", grpc.StatusCode.UNAVAILABLE, "", []), journey)
    assert journey.retries == 0


# ------------------------------------------------------------ a whole micro-batch: its outcome


class FakeStageCalls:
    """Stands in for the runner's three calls. ``fail``: (method, peer id) -> error for a call that
    must fail; ``stale``: the stages whose update reports "not applied" (gradient too old)."""

    def __init__(
        self,
        runner: MicrobatchRunner,
        loss: float = 2.5,
        stale: tuple[int, ...] = (),
        fail: dict[tuple[str, str], Exception] | None = None,
    ):
        self.loss, self.stale, self.fail = loss, stale, fail or {}
        self.calls: list[tuple[str, str]] = []
        runner.calls.forward = self.forward
        runner.calls.forward_backward = self.forward_backward
        runner.calls.backward = self.backward

    def _enter(self, method: str, view: PeerView) -> None:
        self.calls.append((method, view.peer_id))
        error = self.fail.get((method, view.peer_id))
        if error is not None:
            raise error

    async def forward(self, view: PeerView, stage: int, mb_id: str, x: torch.Tensor) -> torch.Tensor:
        self._enter("Forward", view)
        return torch.zeros(1)

    async def forward_backward(self, view: PeerView, stage: int, mb_id: str, x: torch.Tensor, targets: torch.Tensor):
        self._enter("ForwardBackward", view)
        return self.loss, torch.zeros(1), stage in self.stale

    async def backward(
        self, view: PeerView, stage: int, mb_id: str, grad: torch.Tensor, replay_input: torch.Tensor | None
    ):
        self._enter("Replay" if replay_input is not None else "Backward", view)
        return (torch.zeros(1) if stage > 0 else None), stage in self.stale


TOKENS = torch.zeros(1, 4, dtype=torch.long)


async def test_a_microbatch_every_stage_applied_is_completed_with_its_loss() -> None:
    runner = make_runner(["s0"], stage1=["s1"])
    calls = FakeStageCalls(runner, loss=2.5)
    outcome = await runner.run("mb-1", TOKENS, TOKENS)
    assert outcome == MicrobatchOutcome("mb-1", MicrobatchStatus.COMPLETED, loss=2.5, retries=0, reason="")
    assert calls.calls == [("Forward", "s0"), ("ForwardBackward", "s1"), ("Backward", "s0")]


@pytest.mark.parametrize("stale", [(1,), (0,), (1, 0)])
async def test_a_gradient_refused_as_stale_drops_the_microbatch_but_keeps_its_loss(stale: tuple[int, ...]) -> None:
    runner = make_runner(["s0"], stage1=["s1"])
    FakeStageCalls(runner, loss=3.0, stale=stale)
    outcome = await runner.run("mb-2", TOKENS, TOKENS)
    assert outcome.status is MicrobatchStatus.DROPPED_STALE
    assert outcome.loss == 3.0 and outcome.retries == 0
    assert outcome.reason == "gradient dropped as stale by stage " + ", ".join(map(str, stale))


async def test_a_microbatch_every_replica_rejects_fails_with_the_reason_and_its_retries(tmp_path: Path) -> None:
    events = EventLog(str(tmp_path / "events.jsonl"), "trainer", "test-trainer")
    runner = make_runner(["s0"], stage1=["a", "b"], events=events)
    bad = rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "targets: bad shape")
    FakeStageCalls(runner, fail={("ForwardBackward", "a"): bad, ("ForwardBackward", "b"): bad})
    outcome = await runner.run("mb-3", TOKENS, TOKENS)
    assert outcome.status is MicrobatchStatus.FAILED and outcome.loss is None
    assert "stage 1: every replica rejected" in outcome.reason
    assert outcome.retries == 1  # the second replica was a retry, and it counts though the micro-batch failed
    logged = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    failed = [e for e in logged if e["kind"] == "microbatch_failed"]
    assert [(e["microbatch"], e["reason"]) for e in failed] == [("mb-3", outcome.reason)]


async def test_a_stage_without_replicas_fails_the_microbatch_after_asking_the_view_to_refresh() -> None:
    runner = make_runner(["s0"], stage1=[], wait_timeout=0.5)
    FakeStageCalls(runner)
    outcome = await runner.run("mb-4", TOKENS, TOKENS)
    assert outcome.status is MicrobatchStatus.FAILED
    assert "stage 1 has had no live replica" in outcome.reason
    assert runner.view.source.reads >= 1  # the runner asked its view, not the trainer, for a fresh read


async def test_retries_and_replays_both_count_in_the_outcome() -> None:
    runner = make_runner(["s0a", "s0b"], stage1=["s1a", "s1b"])
    prefer(runner, "s0a", "s0b")
    prefer(runner, "s1a", "s1b")
    gone = rpc_error(grpc.StatusCode.UNAVAILABLE, "peer gone")
    calls = FakeStageCalls(runner, fail={("ForwardBackward", "s1a"): gone, ("Backward", "s0a"): gone})
    outcome = await runner.run("mb-5", TOKENS, TOKENS)
    assert outcome.status is MicrobatchStatus.COMPLETED
    assert outcome.retries == 2  # one ForwardBackward retried on s1b, one Backward replayed on s0b
    assert calls.calls == [
        ("Forward", "s0a"),
        ("ForwardBackward", "s1a"),
        ("ForwardBackward", "s1b"),
        ("Backward", "s0a"),
        ("Replay", "s0b"),
    ]
