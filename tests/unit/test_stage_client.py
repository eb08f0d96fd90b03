"""One way to call a stage (peer/client/), without sockets: what a stage answers is checked by one set of rules
(shape, dtype, a finite loss, one norm table), a chain's answer is read in one place, a chained call that broke
further down surfaces as ``ChainBroken``, gradients take error feedback as the codec registry says, and a peer's
link tries the next stage's candidates in turn."""

from __future__ import annotations

import grpc
import pytest
import torch

from swarmpipe.peer.client.answers import AnswerChecks
from swarmpipe.peer.client.chain_answer import read_chain_answer
from swarmpipe.peer.client.stage_client import StageClient
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.stage.chain.link import ChainLink
from swarmpipe.peer.transport.chain_protocol import ChainBroken
from swarmpipe.peer.transport.wire import WireError, encode
from swarmpipe.protos import swarm_pb2

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]
ROWS, SEQ, WIDTH = 2, 4, 8


def _spec(stages: int = 3) -> RunSpec:
    spec = RunSpec()
    spec.num_stages, spec.model.n_layers, spec.model.d_model = stages, stages, WIDTH
    return spec


def _error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details or code.name)


def _answer(stage: int, end: int, grad: torch.Tensor | None = None, loss: float = 2.5) -> swarm_pb2.ChainResponse:
    response = swarm_pb2.ChainResponse(
        loss=loss, stages=[swarm_pb2.ChainStageResult(stage=s, applied=True) for s in range(stage, end + 1)]
    )
    if grad is not None:
        response.grad_input.CopyFrom(encode(grad))
    return response


class _Pool:
    def channel(self, address: str):
        return None

    def stub(self, address: str):
        return None

    async def close(self) -> None:
        pass


class _Caller:
    """Answers every call with ``reply``, or raises it when it is an exception."""

    def __init__(self, reply):
        self.reply = reply

    async def call(self, channel, stub, method, request, *, timeout, payloads=None, expected_bytes=None):
        if isinstance(self.reply, BaseException):
            raise self.reply
        return self.reply


# ------------------------------------------------------------------ what a stage answers
def test_a_tensor_of_the_wrong_shape_or_dtype_and_a_non_finite_loss_are_refused():
    checks = AnswerChecks(max_elements=1 << 20)
    ok = checks.tensor(
        encode(torch.ones(ROWS, SEQ, WIDTH)), kind="gradients", stage=1, shape=(ROWS, SEQ, WIDTH), what="g"
    )
    assert ok.dtype == torch.float32
    with pytest.raises(WireError, match="does not match the expected"):
        checks.tensor(encode(torch.ones(ROWS, SEQ, 9)), kind="gradients", stage=1, shape=(ROWS, SEQ, WIDTH), what="g")
    with pytest.raises(WireError, match="not accepted here"):
        tokens = torch.ones(ROWS, SEQ, WIDTH, dtype=torch.int64)
        checks.tensor(encode(tokens), kind="activations", stage=1, shape=(ROWS, SEQ, WIDTH), what="a")
    with pytest.raises(WireError, match="non-finite loss"):
        checks.loss(2, float("nan"))
    assert checks.loss(2, 2.5) == 2.5


def test_one_norm_table_refuses_activations_at_100x_and_gradients_at_1000x_of_what_a_stage_returned():
    checks = AnswerChecks(max_elements=1 << 20)
    shape = (ROWS, SEQ, WIDTH)
    for _ in range(40):
        for kind in ("activations", "gradients"):
            checks.bounded(kind, 1, torch.ones(shape))
    checks.bounded("gradients", 1, 200 * torch.ones(shape))  # a gradient spike of 200x passes
    with pytest.raises(WireError, match="outlier stage 1 activations"):
        checks.bounded("activations", 1, 200 * torch.ones(shape))
    with pytest.raises(WireError, match="outlier stage 1 gradients"):
        checks.bounded("gradients", 1, 5000 * torch.ones(shape))
    # another stage has its own norms; a forward-only answer is neither judged nor learned from
    checks.bounded("activations", 2, 200 * torch.ones(shape))
    probe = checks.tensor(
        encode(1e6 * torch.ones(shape)), kind="activations", stage=1, shape=shape, what="a", bounded=False
    )
    assert float(probe.max()) == 1e6 and checks.guards[("activations", 1)].seen == 40


def test_a_chain_answer_must_carry_every_stage_to_its_end_and_a_gradient_of_the_input_shape():
    checks = AnswerChecks(max_elements=1 << 20)
    grad = torch.randn(ROWS, SEQ, WIDTH)
    answer = read_chain_answer(checks, _answer(1, 2, grad), 1, 2, (ROWS, SEQ, WIDTH))
    assert answer.loss == 2.5 and [s.stage for s in answer.stages] == [1, 2] and torch.equal(answer.grad, grad)
    assert read_chain_answer(checks, _answer(0, 1), 0, 1, (ROWS, SEQ)).grad is None  # tokens have no gradient
    with pytest.raises(WireError, match="answered for stages"):
        read_chain_answer(checks, _answer(1, 1, grad), 1, 2, (ROWS, SEQ, WIDTH))
    with pytest.raises(WireError, match="does not match"):
        read_chain_answer(checks, _answer(1, 2, grad[:1]), 1, 2, (ROWS, SEQ, WIDTH))
    with pytest.raises(WireError, match="non-finite loss"):
        read_chain_answer(checks, _answer(1, 2, grad, loss=float("inf")), 1, 2, (ROWS, SEQ, WIDTH))


# ------------------------------------------------------------------ the call
@pytest.mark.parametrize(
    ("details", "broken"),
    [
        ("chain broke at stage 2 (unreachable): gone", 2),  # further down: not the called peer's fault
        ("chain broke at stage 1 (failed): mine", None),  # at the called stage itself: its own failure
        ("chain broke at stage 3 (failed): past the end", None),  # a stage the run does not have
        ("something else", None),
    ],
)
async def test_a_chained_call_that_broke_further_down_raises_chain_broken(details: str, broken: int | None):
    client = StageClient(_spec(), pool=_Pool())
    client.caller = _Caller(_error(grpc.StatusCode.ABORTED, details))
    request = swarm_pb2.ChainRequest(run_id="r", stage=1, microbatch_id="m")
    expected = ChainBroken if broken is not None else grpc.aio.AioRpcError
    with pytest.raises(expected) as info:
        await client.call("a:1", "Chain", request, timeout=1.0)
    if broken is not None:
        assert info.value.stage == broken and info.value.unreachable
    assert client.bytes_sent == request.ByteSize() and client.bytes_received == 0  # the bytes left all the same


async def test_a_reply_is_counted_and_a_stage_call_never_reads_as_a_broken_chain():
    client = StageClient(_spec(), pool=_Pool())
    reply = swarm_pb2.ForwardResponse(output=encode(torch.zeros(ROWS, SEQ, WIDTH)), version=4)
    client.caller = _Caller(reply)
    request = swarm_pb2.ForwardRequest(run_id="r", stage=1, microbatch_id="m")
    assert await client.call("a:1", "Forward", request, timeout=1.0, payloads=[b"x" * 10]) is reply
    assert client.bytes_sent == request.ByteSize() + 10 and client.bytes_received == reply.ByteSize()
    client.caller = _Caller(_error(grpc.StatusCode.ABORTED, "chain broke at stage 2 (failed): no"))
    with pytest.raises(grpc.aio.AioRpcError):
        await client.call("a:1", "Forward", request, timeout=1.0)


@pytest.mark.parametrize(
    ("codec", "residual"),
    [("blockwise8", True), ("blockwise4", True), ("blockwise2", True), ("uint8", True), ("fp16", False)],
)
def test_gradients_carry_error_feedback_where_the_codec_registry_says_so(codec: str, residual: bool):
    client = StageClient(_spec(), pool=_Pool())
    grad = torch.randn(ROWS, SEQ, WIDTH)
    msg = client.encode_gradient((1, tuple(grad.shape)), grad, codec)
    assert msg.codec == codec and ((1, tuple(grad.shape)) in client.error_feedback.residuals) == residual


# ------------------------------------------------------------------ a peer's link to the next stage
def _link(replies: dict[str, object]) -> tuple[ChainLink, list[str]]:
    """A link whose calls answer per address from ``replies`` (an exception is raised)."""
    link = ChainLink(_spec())
    called: list[str] = []

    async def call(address, method, request, *, timeout, payloads=None, expected_bytes=None):
        called.append(address)
        reply = replies[address]
        if isinstance(reply, BaseException):
            raise reply
        return reply

    link.client.call = call
    return link, called


def _build(act_codec: str, reply_codec: str) -> tuple[swarm_pb2.ChainRequest, list]:
    return swarm_pb2.ChainRequest(run_id="r", stage=1, microbatch_id="m", reply_codec=reply_codec), [None, None]


async def test_the_link_tries_candidates_in_turn_and_reads_the_answer_as_the_trainer_does():
    grad = torch.randn(ROWS, SEQ, WIDTH)
    bad = _answer(1, 1, grad)  # one stage result short
    link, called = _link({"a:1": _error(grpc.StatusCode.UNAVAILABLE), "b:1": bad, "c:1": _answer(1, 2, grad)})
    hops = [("QmA", "a:1"), ("QmB", "b:1"), ("QmC", "c:1")]
    answer = await link.call(1, hops, _build, (ROWS, SEQ, WIDTH), timeout=5.0)
    assert called == ["a:1", "b:1", "c:1"] and answer.peer_id == "QmC" and answer.failed == 2
    assert torch.equal(answer.grad, grad)


async def test_the_link_breaks_when_no_candidate_answers_and_passes_a_later_break_up_unchanged():
    link, _ = _link({"a:1": _error(grpc.StatusCode.UNAVAILABLE), "b:1": _error(grpc.StatusCode.DEADLINE_EXCEEDED)})
    with pytest.raises(ChainBroken) as info:
        await link.call(1, [("QmA", "a:1"), ("QmB", "b:1")], _build, (ROWS, SEQ, WIDTH), timeout=5.0)
    assert info.value.stage == 1 and info.value.unreachable
    link, called = _link({"a:1": ChainBroken(2, "below", unreachable=False), "b:1": _answer(1, 2)})
    with pytest.raises(ChainBroken) as info:
        await link.call(1, [("QmA", "a:1"), ("QmB", "b:1")], _build, (ROWS, SEQ, WIDTH), timeout=5.0)
    assert info.value.stage == 2 and called == ["a:1"]  # it already tried every candidate after it
