"""The stage server's error contract against hostile bytes (issue 14, item 6), over a real grpc.aio
server: undecodable requests to every method answer INVALID_ARGUMENT with a short reason, no traceback
and one log line per caller; a caller's huge strings come back truncated; the peer keeps serving."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
import torch
from swarm_support import call_raw, service_methods

from swarmpipe.peer.spec import spec_from_dict
from swarmpipe.peer.stage.lifecycle import Lifecycle
from swarmpipe.peer.stage.metrics import PeerMetrics
from swarmpipe.peer.stage.runtime import StageRuntime
from swarmpipe.peer.stage.server import StageServicer, start_server
from swarmpipe.peer.swarm.records import PeerState
from swarmpipe.peer.transport.wire import encode
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MAX_DETAILS = 300
HUGE = "x" * 10_240
GARBAGE = {
    "corrupt wire format": b"\xff\xff\xff",
    "invalid UTF-8 in a string field": b"\x0a\x02\xc3\x28",  # field 1 is a string in every request
}
METHODS = service_methods()  # every Stage RPC, from swarm.proto


@pytest.fixture
async def peer() -> AsyncIterator[tuple[StageServicer, grpc.aio.Channel]]:
    """A first stage of a tiny model, online, on 127.0.0.1; and a channel to it."""
    spec = spec_from_dict(
        {
            "run_id": "t",
            "num_stages": 2,
            "averaging_interval_s": 0,
            "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
        }
    )
    runtime = StageRuntime(spec, 0)
    lifecycle = Lifecycle()
    lifecycle.change(PeerState.ONLINE)
    servicer = StageServicer(runtime, "peer-hostile", PeerMetrics(), lifecycle)
    server, port = await start_server(servicer, "127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield servicer, channel
    finally:
        await channel.close()
        await server.stop(None)
        runtime.close()
        # Free grpc.aio's objects now: one left in a reference cycle would be freed in the child of a later
        # in-process fork (hivemind's DHT), and freeing it there hangs (grpc's poller thread is not there).
        del channel, server
        gc.collect()


async def _send_raw(channel: grpc.aio.Channel, method: str, payload: bytes) -> grpc.aio.AioRpcError:
    """``payload`` as the request bytes of ``method`` (no serializer: the bytes go as they are)."""
    path = f"/swarmpipe.Stage/{method}"
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call_raw(channel, path, payload, METHODS[method])
    return failed.value


async def _still_serves(channel: grpc.aio.Channel) -> None:
    stub = swarm_pb2_grpc.StageStub(channel)
    tokens = torch.randint(0, 256, (1, 8))
    reply = await stub.Forward(
        swarm_pb2.ForwardRequest(run_id="t", stage=0, microbatch_id="ok", input=encode(tokens)), timeout=30
    )
    assert list(reply.output.shape) == [1, 8, 32]
    assert (await stub.Info(swarm_pb2.InfoRequest(run_id="t"), timeout=10)).peer_id == "peer-hostile"


async def test_undecodable_requests_to_every_method_get_invalid_argument_without_a_traceback(peer, caplog):
    servicer, channel = peer
    caplog.set_level(logging.INFO)
    for method in METHODS:
        for what, payload in GARBAGE.items():
            error = await _send_raw(channel, method, payload)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, what, error.code(), error.details())
            assert len(error.details()) < MAX_DETAILS, (method, what, error.details())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info], [
        r.getMessage()[:200] for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info
    ]
    # 14 rejections from one caller within the limiter's interval: one log line
    rejected = [r for r in caplog.records if r.name == "swarmpipe.server" and "rejected" in r.getMessage()]
    assert len(rejected) == 1, [r.getMessage() for r in rejected]
    assert "127.0.0.1" in rejected[0].getMessage()
    errors = servicer.metrics.errors
    assert errors.labels("forward", "malformed")._value.get() == len(GARBAGE)
    await _still_serves(channel)


async def test_huge_caller_strings_come_back_truncated(peer):
    _, channel = peer
    stub = swarm_pb2_grpc.StageStub(channel)
    tokens = encode(torch.randint(0, 256, (1, 8)))
    forged_dtype, forged_codec = swarm_pb2.Tensor(), swarm_pb2.Tensor()
    forged_dtype.CopyFrom(tokens)
    forged_dtype.dtype = HUGE
    forged_codec.CopyFrom(tokens)
    forged_codec.codec = HUGE
    inv = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        (dict(input=forged_dtype), inv, "is not allowed"),
        (dict(input=forged_codec), inv, "unknown codec"),
        (dict(input=tokens, reply_codec=HUGE), inv, "unknown codec"),
        (dict(input=tokens, run_id=HUGE), grpc.StatusCode.FAILED_PRECONDITION, "wrong run id"),
    ]
    for fields, code, words in cases:
        request = swarm_pb2.ForwardRequest(**{"run_id": "t", "stage": 0, "microbatch_id": "a", **fields})
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stub.Forward(request, timeout=10)
        details = failed.value.details()
        assert failed.value.code() == code and words in details, (failed.value.code(), details[:300])
        assert len(details) < MAX_DETAILS and f"{len(HUGE)} characters" in details, details[:300]
    # A streamed request names its method in its first frame: a huge name is cut as well.
    frame = swarm_pb2.Frame(method=HUGE).SerializeToString()
    error = await _send_raw(channel, "Stream", frame)
    assert error.code() == inv and "unknown method" in error.details() and len(error.details()) < MAX_DETAILS
    await _still_serves(channel)
