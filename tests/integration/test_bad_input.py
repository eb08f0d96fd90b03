"""A peer answering garbage, forged and oversized requests keeps serving valid ones."""

from __future__ import annotations

import grpc
import pytest
import torch

from swarmpipe.cli.launcher import wait_for
from swarmpipe.peer.swarm.records import WIRE_PROTOCOL
from swarmpipe.peer.transport.wire import encode
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

D_MODEL = 64


def _hidden(b: int = 2, t: int = 8) -> torch.Tensor:
    return torch.randn(b, t, D_MODEL)


@pytest.fixture
def two_peers(swarm):
    spec = swarm.write_spec(num_stages=2, n_layers=2, max_message_mb=1)
    swarm.start_coordinator(spec)
    first = swarm.start_peer(0, wait=False)
    last = swarm.start_peer(1, wait=False)
    return swarm, swarm.wait_ready(first)["address"], swarm.wait_ready(last)["address"]


def _call(channel, method: str, request):
    stub = swarm_pb2_grpc.StageStub(channel)
    return getattr(stub, method)(request, timeout=10)


def _expect(channel, method: str, request, code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _call(channel, method, request)
    assert info.value.code() == code, (info.value.code(), info.value.details())
    assert words.lower() in info.value.details().lower(), info.value.details()


def test_bad_requests_get_clear_errors_and_peer_keeps_serving(two_peers):
    swarm, first_addr, last_addr = two_peers
    options = [("grpc.max_send_message_length", 64 << 20)]
    tokens = torch.randint(0, 256, (2, 8))
    good_forward = swarm_pb2.ForwardRequest(run_id="test", stage=0, microbatch_id="ok-1", input=encode(tokens))
    with (
        grpc.insecure_channel(first_addr, options=options) as first,
        grpc.insecure_channel(last_addr, options=options) as last,
    ):
        inv = grpc.StatusCode.INVALID_ARGUMENT
        moved = grpc.StatusCode.FAILED_PRECONDITION  # the caller's view of this peer is stale
        _expect(
            first,
            "Forward",
            swarm_pb2.ForwardRequest(run_id="other", stage=0, microbatch_id="a", input=encode(tokens)),
            moved,
            "wrong run id",
        )
        _expect(
            first,
            "Forward",
            swarm_pb2.ForwardRequest(run_id="test", stage=1, microbatch_id="a", input=encode(tokens)),
            moved,
            "wrong stage",
        )
        _expect(
            first,
            "Forward",
            swarm_pb2.ForwardRequest(run_id="test", stage=0, microbatch_id="", input=encode(tokens)),
            inv,
            "microbatch_id",
        )
        # Shape that does not match the bytes.
        bad = encode(tokens)
        bad.shape[:] = [2, 9]
        _expect(
            first,
            "Forward",
            swarm_pb2.ForwardRequest(run_id="test", stage=0, microbatch_id="a", input=bad),
            inv,
            "bytes do not match",
        )
        # Disallowed dtypes: a forged dtype string, and floats where token ids belong.
        forged = encode(tokens)
        forged.dtype = "object"
        _expect(
            first,
            "Forward",
            swarm_pb2.ForwardRequest(run_id="test", stage=0, microbatch_id="a", input=forged),
            inv,
            "not allowed",
        )
        _expect(
            first,
            "Forward",
            swarm_pb2.ForwardRequest(run_id="test", stage=0, microbatch_id="a", input=encode(_hidden())),
            inv,
            "not accepted",
        )
        # Token ids outside the vocabulary, sequence too long.
        _expect(
            first,
            "Forward",
            swarm_pb2.ForwardRequest(run_id="test", stage=0, microbatch_id="a", input=encode(tokens + 1000)),
            inv,
            "token ids",
        )
        _expect(
            first,
            "Forward",
            swarm_pb2.ForwardRequest(
                run_id="test", stage=0, microbatch_id="a", input=encode(torch.zeros(1, 33, dtype=torch.int64))
            ),
            inv,
            "sequence length",
        )
        # Backward for a micro-batch this peer never saw.
        _expect(
            first,
            "Backward",
            swarm_pb2.BackwardRequest(run_id="test", stage=0, microbatch_id="never", grad_output=encode(_hidden())),
            grpc.StatusCode.NOT_FOUND,
            "no forward",
        )
        # NaN and Inf in activations and targets of the wrong shape, on the last stage.
        nan = _hidden()
        nan[0, 0, 0] = float("nan")
        targets = encode(torch.randint(0, 256, (2, 8)))
        _expect(
            last,
            "ForwardBackward",
            swarm_pb2.ForwardBackwardRequest(
                run_id="test", stage=1, microbatch_id="a", input=encode(nan), targets=targets
            ),
            inv,
            "nan",
        )
        inf = _hidden()
        inf[1, 2, 3] = float("inf")
        _expect(
            last,
            "ForwardBackward",
            swarm_pb2.ForwardBackwardRequest(
                run_id="test", stage=1, microbatch_id="a", input=encode(inf, "fp16"), targets=targets
            ),
            inv,
            "nan or inf",
        )
        _expect(
            last,
            "ForwardBackward",
            swarm_pb2.ForwardBackwardRequest(
                run_id="test",
                stage=1,
                microbatch_id="a",
                input=encode(_hidden()),
                targets=encode(torch.zeros(2, 7, dtype=torch.int64)),
            ),
            inv,
            "does not match",
        )
        _expect(
            last,
            "Forward",
            swarm_pb2.ForwardRequest(run_id="test", stage=1, microbatch_id="a", input=encode(_hidden())),
            inv,
            "ForwardBackward",
        )
        # Oversized: over the spec's 1 MiB message cap.
        huge = encode(torch.randn(2, 32, D_MODEL * 80))
        _expect(
            last,
            "ForwardBackward",
            swarm_pb2.ForwardBackwardRequest(run_id="test", stage=1, microbatch_id="a", input=huge, targets=targets),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "",
        )
        # Raw garbage that is not even a protobuf message.
        garbage = first.unary_unary("/swarmpipe.Stage/Forward", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            garbage(b"\xff\xff\xff\xff\x0f garbage", timeout=10)
        assert info.value.code() in (
            grpc.StatusCode.INTERNAL,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.UNKNOWN,
        )

        # After all that, both peers still serve valid requests.
        out = _call(first, "Forward", good_forward)
        assert list(out.output.shape) == [2, 8, D_MODEL]
        result = _call(
            last,
            "ForwardBackward",
            swarm_pb2.ForwardBackwardRequest(
                run_id="test", stage=1, microbatch_id="ok-1", input=out.output, targets=targets
            ),
        )
        assert result.loss > 0 and result.applied
        back = _call(
            first,
            "Backward",
            swarm_pb2.BackwardRequest(run_id="test", stage=0, microbatch_id="ok-1", grad_output=result.grad_input),
        )
        assert back.applied and back.version == 1
        info = _call(first, "Info", swarm_pb2.InfoRequest(run_id="test"))
        assert info.state == "online" and info.version == 1 and info.protocol == WIRE_PROTOCOL
        assert info.device == "cpu" and info.device_memory_total > 0 and info.device_memory_used > 0
    for peer in swarm.group.procs:
        assert peer.alive(), peer.log_text()[-2000:]
    # A peer whose device cannot hold a stage refuses to serve it, naming the numbers, and nothing starts.
    for stage_args in (["--stage", "1"], []):
        small = swarm.start_role(
            f"small{len(stage_args)}",
            "peer",
            "--initial-peers",
            swarm.maddr,
            "--run-id",
            "test",
            "--max-memory-mb",
            "1",
            "--host",
            "127.0.0.1",
            *stage_args,
        )
        wait_for(lambda small=small: not small.alive(), 60, "the small peer to give up", poll=0.5)
        assert small.proc.returncode == 2, small.log_text()[-2000:]
        assert "needs about" in small.log_text() and "MiB free" in small.log_text(), small.log_text()[-2000:]
