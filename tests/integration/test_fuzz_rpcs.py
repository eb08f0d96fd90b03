"""A property-based fuzzer (hypothesis) drives every RPC of a real peer process with generated messages.

The contract: every answer is OK or one of the documented refusals (never UNKNOWN or INTERNAL, which would
mean an unhandled error), the peer keeps answering ``Info``, and its memory stays bounded. Generated messages
mix pure noise with near-valid ones (right run id and stage, real encoded tensors with one field off), so the
checks deep inside the handlers are reached, not only the first one.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmpipe.peer.transport.wire import encode
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
}
MAX_RSS_GROWTH_MB = 400

texts = st.one_of(st.sampled_from(["test", "", "float32", "int64", "none", "fp16"]), st.text(max_size=300))
small_ints = st.one_of(st.sampled_from([0, 1, -1, 2]), st.integers(-(2**31), 2**31 - 1))


@st.composite
def tensors(draw) -> swarm_pb2.Tensor:
    if draw(st.booleans()):  # near-valid: a real encoded tensor, maybe with one field changed
        rows, seq = draw(st.integers(1, 4)), draw(st.integers(1, 40))
        width = draw(st.sampled_from([None, 64, 63]))
        if width is None:
            t = encode(torch.randint(0, draw(st.sampled_from([256, 300])), (rows, seq)))  # 300: out of vocab
        else:
            scale = draw(st.sampled_from([1.0, 1.0, 1e30, float("nan")]))
            t = encode(torch.randn(rows, seq, width) * scale, draw(st.sampled_from(["none", "fp16", "blockwise8"])))
        field = draw(st.sampled_from(["none", "none", "none", "dtype", "codec", "shape", "data"]))
        if field == "dtype":
            t.dtype = draw(texts)
        elif field == "codec":
            t.codec = draw(texts)
        elif field == "shape":
            del t.shape[:]
            t.shape.extend(draw(st.lists(st.integers(-5, 2**40), max_size=5)))
        elif field == "data":
            t.data = draw(st.binary(max_size=64))
        return t
    return swarm_pb2.Tensor(
        shape=draw(st.lists(st.integers(-(2**62), 2**62), max_size=6)),
        dtype=draw(texts),
        codec=draw(texts),
        data=draw(st.binary(max_size=2048)),
    )


@st.composite
def headers(draw) -> dict:
    """Half the time a header the peer accepts (so the checks behind it are reached), else anything."""
    if draw(st.booleans()):
        mb = draw(st.sampled_from(["mb-1", "mb-2", "mb-3"]))
        return dict(run_id="test", stage=0, microbatch_id=mb, reply_codec="", ticket=b"t" * 16)
    return dict(
        run_id=draw(texts),
        stage=draw(small_ints),
        microbatch_id=draw(texts),
        reply_codec=draw(texts),
        ticket=draw(st.binary(max_size=80)),
    )


@st.composite
def requests(draw, method: str):
    head = draw(headers())
    if method == "Forward":
        return swarm_pb2.ForwardRequest(**head, input=draw(tensors()), evaluate=draw(st.booleans()))
    if method == "Backward":
        return swarm_pb2.BackwardRequest(
            **head, grad_output=draw(tensors()), input=draw(tensors()), replay=draw(st.booleans())
        )
    head.pop("ticket")
    if method == "ForwardBackward":
        return swarm_pb2.ForwardBackwardRequest(
            **head, input=draw(tensors()), targets=draw(tensors()), evaluate=draw(st.booleans())
        )
    if method == "DownloadState":
        return swarm_pb2.DownloadStateRequest(
            run_id=head["run_id"],
            stage=head["stage"],
            shard=draw(small_ints),
            num_shards=draw(small_ints),
            base=draw(st.booleans()),
        )
    if method == "PushState":
        chunk = st.builds(
            swarm_pb2.StateChunk,
            name=texts,
            tensor=tensors(),
            version=st.integers(-(2**63), 2**63 - 1),
            metadata_json=st.one_of(texts, st.just('{"run_id": "test", "stage": 0, "names": []}')),
            index=small_ints,
            total=small_ints,
        )
        return draw(st.lists(chunk, max_size=4))
    return swarm_pb2.InfoRequest(run_id=head["run_id"])


@st.composite
def calls(draw):
    method = draw(st.sampled_from(["Forward", "Backward", "ForwardBackward", "DownloadState", "PushState", "Info"]))
    return method, draw(requests(method))


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.fixture
def fuzz_target(swarm):
    """A real stage-0 peer (the run has 2 stages, so stage 0 takes Forward/Backward), with a sync channel."""
    swarm.start_coordinator(swarm.write_spec(num_stages=2, n_layers=2))
    launched = swarm.start_peer(0)
    info = swarm.wait_ready(launched)
    with grpc.insecure_channel(info["address"], options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        yield swarm_pb2_grpc.StageStub(channel), info["pid"], launched


def _call(stub, method: str, request) -> grpc.StatusCode:
    try:
        if method == "DownloadState":
            for _ in stub.DownloadState(request, timeout=20):
                pass
        elif method == "PushState":
            stub.PushState(iter(request), timeout=20)
        else:
            getattr(stub, method)(request, timeout=20)
    except grpc.RpcError as e:
        assert e.code() in ALLOWED, (method, e.code(), e.details())
        assert len(e.details() or "") < 400, (method, len(e.details()))
        return e.code()
    return grpc.StatusCode.OK


def test_every_rpc_keeps_its_contract_under_generated_messages(fuzz_target):
    stub, pid, launched = fuzz_target
    rss_before = _rss_mb(pid)
    seen: dict[str, set[grpc.StatusCode]] = {}

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(call=calls())
    def fuzz(call) -> None:
        method, request = call
        seen.setdefault(method, set()).add(_call(stub, method, request))

    fuzz()
    assert launched.alive(), launched.log_text()[-3000:]
    assert stub.Info(swarm_pb2.InfoRequest(run_id="test"), timeout=10).state == "online"
    growth = _rss_mb(pid) - rss_before
    assert growth < MAX_RSS_GROWTH_MB, f"peer memory grew {growth:.0f} MiB under the fuzzer"
    print("fuzz codes per method:", {m: sorted(c.name for c in codes) for m, codes in seen.items()})
    assert len(seen) == 6, seen  # every method was driven
    assert "Traceback" not in launched.log_text(), launched.log_text()[-3000:]
