"""swarmpipe.peer.trainer.evaluation and MicrobatchRunner.evaluate: when the validation set runs, how its
losses are averaged, what the runner sends and how it retries (no sockets: fake runners and calls)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
import torch

from swarmpipe.cli import main as cli
from swarmpipe.cli.args import resolve
from swarmpipe.peer.config import TrainerConfig
from swarmpipe.peer.events import EventLog
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.swarm.records import StageRecord
from swarmpipe.peer.trainer.evaluation import Evaluator
from swarmpipe.peer.trainer.microbatch import MicrobatchRunner
from swarmpipe.peer.trainer.routing import Router
from swarmpipe.peer.trainer.swarm_view import SwarmView
from swarmpipe.peer.transport.streaming import frames, reassemble
from swarmpipe.peer.transport.wire import encode
from swarmpipe.protos import swarm_pb2

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def batch(rows: int, value: int = 0, t: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((rows, t), value, dtype=torch.long), torch.full((rows, t), value, dtype=torch.long)


class FakeRunner:
    """Answers each batch with the loss ``losses[value]`` (the batch's fill value), counting concurrency."""

    def __init__(self, losses: dict[int, float | None], delay: float = 0.0):
        self.losses = losses
        self.delay = delay
        self.calls = 0
        self.running = 0
        self.most_at_once = 0

    async def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        self.calls += 1
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            await asyncio.sleep(self.delay)
            return self.losses[int(inputs[0, 0])]
        finally:
            self.running -= 1


# ------------------------------------------------------------ the evaluator


async def test_due_after_every_n_completed_and_not_before() -> None:
    runner = FakeRunner({0: 2.0})
    ev = Evaluator(runner, [batch(2)], every=10)
    assert [ev.due(c) for c in (0, 9, 10)] == [False, False, True]
    assert await ev.maybe_run(9) is None and runner.calls == 0
    assert await ev.maybe_run(10) == 2.0 and runner.calls == 1
    assert not ev.due(10) and not ev.due(19) and await ev.maybe_run(15) is None
    # A jump past several multiples runs once; the next is the multiple after it.
    assert await ev.maybe_run(35) == 2.0
    assert not ev.due(39) and ev.due(40)
    assert ev.history == [(10, 2.0), (35, 2.0)] and ev.last == 2.0


async def test_every_zero_or_no_batches_disables() -> None:
    runner = FakeRunner({0: 2.0})
    for ev in (Evaluator(runner, [batch(2)], every=0), Evaluator(runner, [], every=5)):
        assert not ev.enabled and not ev.due(100)
        assert await ev.maybe_run(100) is None
    assert runner.calls == 0
    with pytest.raises(ValueError):
        Evaluator(runner, [], every=-1)


async def test_mean_is_weighted_by_each_batch_target_count() -> None:
    runner = FakeRunner({1: 1.0, 4: 4.0})
    ev = Evaluator(runner, [batch(2, 1), batch(4, 4)], every=1)  # 16 and 32 targets
    assert await ev.run(7) == pytest.approx((1.0 * 16 + 4.0 * 32) / 48)
    assert ev.history == [(7, pytest.approx(3.0))]


async def test_failed_batches_are_left_out_and_all_failed_is_none(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    events = EventLog(str(path), "trainer", "test-trainer")
    ev = Evaluator(FakeRunner({1: 1.0, 2: None, 3: float("nan")}), [batch(2, 1), batch(2, 2), batch(2, 3)], 5, events)
    assert await ev.run(5) == 1.0
    nothing = Evaluator(FakeRunner({2: None}), [batch(2, 2)], 5, events)
    assert await nothing.run(5) is None and nothing.history == []
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    evaluated = [e for e in lines if e["kind"] == "evaluated"]
    assert len(evaluated) == 1
    assert evaluated[0]["step"] == 5 and evaluated[0]["val_loss"] == 1.0
    assert evaluated[0]["batches"] == 1 and evaluated[0]["failed"] == 2 and evaluated[0]["seconds"] >= 0
    assert [e["kind"] for e in lines].count("evaluation_failed") == 1


async def test_a_few_batches_at_a_time() -> None:
    runner = FakeRunner({0: 1.0}, delay=0.01)
    ev = Evaluator(runner, [batch(1)] * 10, every=1, concurrency=3)
    assert await ev.run(1) == 1.0
    assert runner.calls == 10 and runner.most_at_once == 3


def record(i: int) -> StageRecord:
    return StageRecord(address=f"127.0.0.1:{i + 1}", state="online", throughput=0.0, queue=0, version=0, updated_at=0.0)


class FakeStages:
    def __init__(self, stages: list[list[str]]):
        self.stages = stages

    async def all_stages(self, num_stages: int) -> list[dict[str, StageRecord]]:
        return [{p: record(10 * s + i) for i, p in enumerate(self.stages[s])} for s in range(num_stages)]


def make_runner(stage0: list[str], stage1: list[str], wait_timeout: float = 2.0) -> MicrobatchRunner:
    stages = [stage0, stage1]
    router = Router(2)
    for s, peers in enumerate(stages):
        router.update_stage(s, {p: record(10 * s + i) for i, p in enumerate(peers)})
    view = SwarmView(FakeStages(stages), router)
    return MicrobatchRunner(RunSpec(), view, EventLog("", "trainer", "t"), call_timeout=5.0, wait_timeout=wait_timeout)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


async def test_runner_evaluate_sends_evaluate_calls_and_retries_on_another_replica() -> None:
    runner = make_runner(["a", "b"], ["z"])
    runner.router.peers["a"].reported_throughput = 100.0  # tried first
    runner.router.peers["b"].reported_throughput = 1.0
    sent: list[tuple[str, str, object]] = []

    async def call(view, method: str, request, payloads=None):
        sent.append((view.peer_id, method, request))
        if view.peer_id == "a":
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "peer is draining")
        if method == "Forward":
            return swarm_pb2.ForwardResponse(output=encode(torch.zeros(2, 8, runner.spec.model.d_model)))
        return swarm_pb2.ForwardBackwardResponse(loss=2.5, applied=False)

    runner.calls.call = call
    tokens, targets = batch(2)
    assert await runner.evaluate(tokens, targets) == 2.5
    assert [(p, m) for p, m, _ in sent] == [("a", "Forward"), ("b", "Forward"), ("z", "ForwardBackward")]
    assert all(r.evaluate for _, _, r in sent)
    assert len({r.microbatch_id for _, _, r in sent}) == 1 and sent[0][2].microbatch_id.startswith("eval-")
    # Counted as calls, never as latency: the routing estimates stay those of training calls.
    for peer in ("b", "z"):
        view = runner.router.peers[peer]
        assert view.calls == 1 and view.in_flight == 0 and view.latency_ema is None
    assert runner.router.peers["a"].banned_until > 0


async def test_runner_evaluate_is_none_when_every_replica_rejects_it() -> None:
    runner = make_runner(["a"], ["z"])

    async def call(view, method: str, request, payloads=None):
        raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "targets must lie in [0, 256)")

    runner.calls.call = call
    assert await runner.evaluate(*batch(2)) is None


async def test_runner_evaluate_is_none_when_a_stage_has_no_replica() -> None:
    runner = make_runner(["a"], [], wait_timeout=0.0)

    async def call(view, method: str, request, payloads=None):
        return swarm_pb2.ForwardResponse(output=encode(torch.zeros(2, 8, runner.spec.model.d_model)))

    runner.calls.call = call
    assert await runner.evaluate(*batch(2)) is None


# ------------------------------------------------------------ the wire and the flags


@pytest.mark.parametrize("method", ["Forward", "ForwardBackward"])
async def test_a_streamed_request_keeps_its_evaluate_flag(method: str) -> None:
    x = torch.randn(2, 64, 64)
    if method == "Forward":
        request = swarm_pb2.ForwardRequest(run_id="r", stage=1, microbatch_id="e", input=encode(x), evaluate=True)
        fields = ("input",)
    else:
        request = swarm_pb2.ForwardBackwardRequest(
            run_id="r", stage=1, microbatch_id="e", input=encode(x), targets=encode(batch(2)[1]), evaluate=True
        )
        fields = ("input", "targets")

    async def stream():
        for frame in frames(request, fields, method=method, chunk_bytes=4096):
            yield frame

    got_method, got = await reassemble(stream(), max_total_bytes=1 << 24)
    assert got_method == method and got.evaluate is True and got.microbatch_id == "e"
    assert bytes(got.input.data) == request.input.data


def test_eval_flags_reach_the_trainer_config() -> None:
    args = cli.build_parser().parse_args(["train", "--eval-every", "25", "--eval-batches", "2"])
    cfg = resolve(TrainerConfig, args, env={})
    assert (cfg.eval_every, cfg.eval_batches) == (25, 2)
    assert (TrainerConfig().eval_every, TrainerConfig().eval_batches) == (0, 4)  # off unless asked for
