"""The trainer's side of a hop it carries (peer/trainer/chain_segments.py), against fake stage calls: it takes the
output from whichever candidate parked it, gives the gradient back, follows a park that moved to another
candidate when the holder died, notices a chain that answered without parking, and abandons cleanly."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from swarmpipe.peer.client.answers import AnswerChecks
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.trainer.chain_segments import ChainResult, OpenSegment, SegmentHandovers
from swarmpipe.peer.trainer.routing import PeerView
from swarmpipe.peer.transport.wire import encode
from swarmpipe.protos import swarm_pb2

pytestmark = pytest.mark.timeout(30)
ROWS, SEQ = 2, 4


def _error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


class _Calls:
    """Stage calls as the candidates of one stage would answer them: ``parked_at`` holds the output."""

    def __init__(self, spec: RunSpec, segment: asyncio.Future):
        self.spec = spec
        self.segment = segment  # the chain call's answer: resolved when the parked chain gets its gradient
        self.parked_at: str | None = None
        self.dead: set[str] = set()
        self.resumed: list[tuple[str, bool]] = []
        self.answers = AnswerChecks(spec.limits.max_tensor_elements)
        self.output = torch.randn(ROWS, SEQ, spec.model.d_model)

    def ticket(self, mb_id: str) -> bytes:
        return b"t" * 16

    def codec(self, role, view, nbytes, exact=False):
        return "none"

    def encode_grad(self, stage, view, grad):
        return encode(grad)

    async def call(self, view: PeerView, method: str, request, timeout=None, expected_bytes=None):
        if view.peer_id in self.dead:
            raise _error(grpc.StatusCode.UNAVAILABLE)
        if method == "ChainHandover":
            if self.parked_at != view.peer_id:
                await asyncio.sleep(request.wait_s)
                raise _error(grpc.StatusCode.NOT_FOUND)
            return swarm_pb2.HandoverResponse(output=encode(self.output), version=3)
        assert method == "ChainResume"
        if self.parked_at != view.peer_id:
            raise _error(grpc.StatusCode.NOT_FOUND)
        self.resumed.append((view.peer_id, request.abandon))
        self.parked_at = None
        if request.abandon:
            self.segment.set_exception(_error(grpc.StatusCode.ABORTED))
        else:
            self.segment.set_result(ChainResult(None, torch.ones(ROWS, SEQ, 8), [], 0))
        return swarm_pb2.ResumeResponse(version=3)


class _Events:
    def __init__(self):
        self.emitted = []

    def emit(self, kind, level=None, **fields):
        self.emitted.append(kind)


def _setup() -> tuple[SegmentHandovers, _Calls, OpenSegment, _Events]:
    spec = RunSpec()
    spec.num_stages, spec.model.n_layers, spec.model.d_model = 3, 3, 8
    task = asyncio.get_running_loop().create_future()
    calls, events = _Calls(spec, task), _Events()
    holders = [PeerView("QmA", 1, "a:1"), PeerView("QmB", 1, "b:1")]
    seg = OpenSegment(0, 1, PeerView("Qm0", 0, "z:1"), torch.zeros(ROWS, SEQ, dtype=torch.int64), task, holders)
    return SegmentHandovers(spec, calls, router=None, events=events, hop_timeout=0.2), calls, seg, events


async def test_the_output_comes_from_whichever_candidate_parked_it_and_the_gradient_goes_back_there():
    handovers, calls, seg, _ = _setup()
    calls.parked_at = "QmB"
    await handovers.take(seg, "mb", wait=5)
    assert seg.holder.peer_id == "QmB" and torch.equal(seg.output, calls.output)
    result = await handovers.close(seg, "mb", torch.ones(ROWS, SEQ, 8))
    assert calls.resumed == [("QmB", False)] and result.grad.shape == (ROWS, SEQ, 8)


async def test_a_park_that_moved_to_another_candidate_gets_the_same_gradient():
    handovers, calls, seg, events = _setup()
    calls.parked_at = "QmA"
    await handovers.take(seg, "mb", wait=5)
    calls.dead.add("QmA")  # the holder dies before the gradient comes; stage 0 sends the micro-batch to B
    calls.parked_at = "QmB"
    result = await handovers.close(seg, "mb", torch.ones(ROWS, SEQ, 8))
    assert calls.resumed == [("QmB", False)] and result.grad is not None
    assert events.emitted.count("handover_moved") == 1 and "resume_failed" in events.emitted


async def test_a_chain_that_answers_without_parking_is_finished_and_nobody_waits_for_a_handover():
    handovers, calls, seg, _ = _setup()
    seg.task.set_result(ChainResult(None, torch.zeros(1), [1], 0))  # every stage of it had done its part
    await handovers.take(seg, "mb", wait=5)
    assert seg.finished is not None and seg.finished.stale == [1] and seg.output is None
    assert (await handovers.close(seg, "mb", torch.ones(1))) is seg.finished


async def test_no_candidate_hands_over_and_an_abandon_ends_the_parked_chain():
    handovers, calls, seg, _ = _setup()
    with pytest.raises(Exception, match="handed over"):
        await handovers.take(seg, "mb", wait=0.05)
    calls.parked_at = "QmA"
    await handovers.take(seg, "mb", wait=5)
    await handovers.abandon(seg, "mb")
    assert calls.resumed == [("QmA", True)] and seg.task.done()
