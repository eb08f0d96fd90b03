"""swarmpipe.peer.transport.streaming: framed round trips for every method and codec; cut-off, overrun, lying and oversized streams fail cleanly."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmpipe.peer.transport.codecs import REGISTRY
from swarmpipe.peer.transport.streaming import METHODS, data_frame_bytes, frames, reassemble
from swarmpipe.peer.transport.wire import WireError, decode, encode, raw_view
from swarmpipe.protos import swarm_pb2

pytestmark = pytest.mark.unit
CODECS = tuple(REGISTRY)


async def _aiter(items):
    for item in items:
        yield item


def _parse(raw: list[bytes]) -> list[swarm_pb2.Frame]:
    return [swarm_pb2.Frame.FromString(b) for b in raw]


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("chunk", [1, 1000, 4096, 1 << 20])
def test_forward_request_round_trip(codec: str, chunk: int) -> None:
    x = torch.randn(2, 33, 64)
    msg = swarm_pb2.ForwardRequest(run_id="r", stage=1, microbatch_id="m", input=encode(x, codec), reply_codec="fp16")
    raw = list(frames(msg, METHODS["Forward"][2], method="Forward", chunk_bytes=chunk))
    assert all(len(f) <= chunk + 16 for f in raw[1:])
    method, got = run(reassemble(_aiter(_parse(raw)), max_total_bytes=1 << 30))
    assert method == "Forward" and got.run_id == "r" and got.microbatch_id == "m" and got.reply_codec == "fp16"
    assert torch.equal(decode(got.input), decode(msg.input))


def test_payloads_go_zero_copy_and_match_protobuf_path() -> None:
    x = torch.randn(3, 5, 7)
    header = encode(x[:0])
    del header.shape[:]
    header.shape.extend(x.shape)
    msg = swarm_pb2.ForwardRequest(run_id="r", stage=1, microbatch_id="m", input=header)
    raw = list(frames(msg, ("input",), method="Forward", chunk_bytes=17, payloads=[raw_view(x)]))
    _, got = run(reassemble(_aiter(_parse(raw)), max_total_bytes=1 << 20))
    assert torch.equal(decode(got.input), x)


def test_backward_with_two_tensors_and_an_empty_one() -> None:
    g = torch.randn(2, 4, 8)
    x = torch.randn(2, 4, 8)
    msg = swarm_pb2.BackwardRequest(
        run_id="r",
        stage=1,
        microbatch_id="m",
        grad_output=encode(g, "blockwise8"),
        input=encode(x, "bf16"),
        replay=True,
    )
    _, got = run(
        reassemble(
            _aiter(_parse(list(frames(msg, METHODS["Backward"][2], method="Backward", chunk_bytes=100)))),
            max_total_bytes=1 << 20,
        )
    )
    assert got.replay and torch.equal(decode(got.grad_output), decode(msg.grad_output))
    assert torch.equal(decode(got.input), decode(msg.input))
    plain = swarm_pb2.BackwardRequest(run_id="r", stage=1, microbatch_id="m", grad_output=encode(g))
    _, got = run(
        reassemble(
            _aiter(_parse(list(frames(plain, METHODS["Backward"][2], method="Backward")))), max_total_bytes=1 << 20
        )
    )
    assert not got.input.data and not got.input.dtype  # is_empty() holds


def test_response_frames_round_trip() -> None:
    y = torch.randn(4, 4, 4)
    resp = swarm_pb2.ForwardResponse(output=encode(y, "uint8"), version=7)
    msgs = _parse(list(frames(resp, ("output",), chunk_bytes=50)))  # what the server's Stream sends
    _, got = run(reassemble(_aiter(msgs), max_total_bytes=1 << 20, expect_method="Forward"))
    assert got.version == 7 and torch.equal(decode(got.output), decode(resp.output))


def _forward_frames(n: int = 4096, chunk: int = 1000) -> list[swarm_pb2.Frame]:
    msg = swarm_pb2.ForwardRequest(run_id="r", stage=1, microbatch_id="m", input=encode(torch.randn(n)))
    return _parse(list(frames(msg, ("input",), method="Forward", chunk_bytes=chunk)))


def test_cut_off_stream_fails_cleanly() -> None:
    fs = _forward_frames()
    for cut in (1, 2, len(fs) - 1):
        with pytest.raises(WireError, match=r"stream ended after \d+ of 16384 bytes"):
            run(reassemble(_aiter(fs[:cut]), max_total_bytes=1 << 20))


def test_empty_stream_fails_cleanly() -> None:
    with pytest.raises(WireError, match="before its first frame"):
        run(reassemble(_aiter([]), max_total_bytes=1 << 20))


def test_overrun_fails() -> None:
    fs = _forward_frames() + [swarm_pb2.Frame.FromString(data_frame_bytes(memoryview(b"x" * 10)))]
    with pytest.raises(WireError, match="more bytes than the 16384 announced"):
        run(reassemble(_aiter(fs), max_total_bytes=1 << 20))


def test_total_over_cap_rejected_before_allocating() -> None:
    first = swarm_pb2.Frame(method="Forward", header=b"", data_bytes=[1 << 40])
    with pytest.raises(WireError, match="exceed the stream cap"):
        run(reassemble(_aiter([first]), max_total_bytes=1 << 30))


@pytest.mark.parametrize(
    "first,match",
    [
        (swarm_pb2.Frame(method="Nope"), "unknown method 'Nope'"),
        (swarm_pb2.Frame(method="Forward", data_bytes=[1, 2]), "2 tensor sizes given, Forward has 1"),
        (swarm_pb2.Frame(method="Forward", data_bytes=[-1]), "negative tensor size"),
        (swarm_pb2.Frame(method="Forward", header=b"\xff\xff\xff", data_bytes=[0]), "malformed header"),
    ],
)
def test_lying_first_frame_rejected(first: swarm_pb2.Frame, match: str) -> None:
    with pytest.raises(WireError, match=match):
        run(reassemble(_aiter([first]), max_total_bytes=1 << 30))


def test_size_mismatch_with_shape_caught_by_decode() -> None:
    fs = _forward_frames()
    fs[0].data_bytes[0] = 16384 - 4  # consistent stream, but the bytes do not match the shape
    data = b"".join(f.data for f in fs[1:])[:-4]
    fs = [fs[0], swarm_pb2.Frame(data=data)]
    _, got = run(reassemble(_aiter(fs), max_total_bytes=1 << 20))
    with pytest.raises(WireError, match="bytes do not match shape"):
        decode(got.input)


@pytest.mark.parametrize("chunk", [7, 4096])
def test_raw_frames_round_trip_without_protobuf(chunk: int) -> None:
    """The server and client read serialized frames as raw bytes (no deserializer on the call)."""
    x = torch.randn(3, 17, 64)
    msg = swarm_pb2.ForwardRequest(run_id="r", stage=1, microbatch_id="m", input=encode(x, "none"))
    raw = list(frames(msg, METHODS["Forward"][2], method="Forward", chunk_bytes=chunk))
    method, got = run(reassemble(_aiter(raw), max_total_bytes=1 << 30))
    assert method == "Forward" and torch.equal(decode(got.input), x)


def test_raw_data_frame_with_other_fields_still_parses() -> None:
    """A data frame that is not the exact fast-path shape goes through protobuf and still counts."""
    x = torch.randn(2, 8)
    msg = swarm_pb2.ForwardRequest(run_id="r", stage=1, microbatch_id="m", input=encode(x, "none"))
    first, *data = list(frames(msg, METHODS["Forward"][2], method="Forward", chunk_bytes=32))  # 64 bytes: 2 chunks
    odd = swarm_pb2.Frame(method="x", data=swarm_pb2.Frame.FromString(data[0]).data).SerializeToString()
    _, got = run(reassemble(_aiter([first, odd]), max_total_bytes=1 << 30))
    assert torch.equal(decode(got.input), x)


@pytest.mark.parametrize("garbage", [b"\x22\xff", b"\x22\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\xff\xff\xff"])
def test_malformed_raw_frames_fail_cleanly(garbage: bytes) -> None:
    x = torch.randn(2, 8)
    msg = swarm_pb2.ForwardRequest(run_id="r", stage=1, microbatch_id="m", input=encode(x, "none"))
    first = next(iter(frames(msg, METHODS["Forward"][2], method="Forward")))
    with pytest.raises(WireError):
        run(reassemble(_aiter([first, garbage]), max_total_bytes=1 << 30))
    with pytest.raises(WireError):
        run(reassemble(_aiter([garbage]), max_total_bytes=1 << 30))


def test_a_tensor_within_one_chunk_travels_in_the_first_frame_and_is_not_copied() -> None:
    x = torch.randn(4, 16)
    msg = swarm_pb2.ForwardRequest(run_id="r", stage=1, microbatch_id="m", input=encode(x, "none"))
    raw = list(frames(msg, METHODS["Forward"][2], method="Forward", chunk_bytes=1 << 20))
    assert len(raw) == 1  # one gRPC message: one round through each event loop, not two
    parsed = swarm_pb2.Frame.FromString(raw[0])  # still a valid Frame to any protobuf reader
    assert (
        parsed.method == "Forward" and list(parsed.data_bytes) == [x.numel() * 4] and len(parsed.data) == x.numel() * 4
    )
    _, got = run(reassemble(_aiter(raw), max_total_bytes=1 << 30))
    assert isinstance(got.input.data, memoryview) and got.input.data.obj is raw[0]  # a view of the frame
    assert torch.equal(decode(got.input), x)


def test_a_first_frame_whose_field_runs_past_its_end_fails_cleanly() -> None:
    x = torch.randn(2, 8)
    msg = swarm_pb2.ForwardRequest(run_id="r", stage=1, microbatch_id="m", input=encode(x, "none"))
    first = next(iter(frames(msg, METHODS["Forward"][2], method="Forward")))
    with pytest.raises(WireError):
        run(reassemble(_aiter([first[:-10]]), max_total_bytes=1 << 30))


async def test_a_gigabyte_declared_and_a_few_bytes_sent_costs_a_few_bytes() -> None:
    """The buffer grows with what arrives, never to the declared size (an attacker declares 1 GiB, sends
    one byte per frame, and hangs up)."""
    import tracemalloc

    first = swarm_pb2.Frame(method="Forward", header=b"", data_bytes=[1 << 30], data=b"x")
    trickle = [swarm_pb2.Frame(data=b"y" * 1000) for _ in range(100)]
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match=r"stream ended after 100001 of 1073741824 bytes"):
            await reassemble(_aiter([first, *trickle]), max_total_bytes=2 << 30)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"reassembly held {peak} bytes for 100 kB received"
