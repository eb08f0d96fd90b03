"""The stage server's error contract in pieces (peer/transport/error_contract.py and the checks that echo a
caller's strings): the rejection log's rate limit, undecodable requests caught before the servicer,
caller strings truncated. No sockets."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter

from swarmpipe.peer.spec import spec_from_dict
from swarmpipe.peer.stage.request_checks import RequestError, check_header, reply_codec
from swarmpipe.peer.transport.codecs import MAX_ECHOED, echo
from swarmpipe.peer.transport.error_contract import (
    MAX_DETAILS,
    Malformed,
    RateLimit,
    Rejections,
    Unserved,
    caller_key,
    guard_handlers,
    method_kind,
    method_label,
    metric_method,
    served_handlers,
    short,
)
from swarmpipe.peer.transport.streaming import reassemble
from swarmpipe.peer.transport.wire import WireError, decode
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

HUGE = "x" * 10_240


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------ rate limit


def test_one_line_per_caller_per_interval_with_the_count_of_the_rest():
    clock = Clock()
    limit = RateLimit(interval_s=10.0, clock=clock)
    assert limit.admit("ipv4:10.0.0.1") == 0  # first rejection: logged, nothing suppressed before it
    for _ in range(5):
        clock.now += 1.0
        assert limit.admit("ipv4:10.0.0.1") is None
    assert limit.admit("ipv4:10.0.0.2") == 0  # another caller has its own allowance
    clock.now += 5.0  # 10 s after the first line
    assert limit.admit("ipv4:10.0.0.1") == 5
    assert limit.admit("ipv4:10.0.0.1") is None


def test_memory_is_bounded_forgetting_the_least_recently_seen_caller():
    clock = Clock()
    limit = RateLimit(interval_s=10.0, max_callers=3, max_lines=1000, clock=clock)
    for caller in ("a", "b", "c"):
        assert limit.admit(caller) == 0
    assert limit.admit("a") is None  # "a" is now the most recently seen
    assert limit.admit("d") == 0
    assert len(limit) == 3
    assert limit.admit("b") == 0  # "b" was forgotten: a new caller again
    assert limit.admit("a") is None  # "a" was kept


def test_lines_over_all_callers_are_bounded_per_interval():
    clock = Clock()
    limit = RateLimit(interval_s=10.0, max_lines=4, clock=clock)
    logged = [limit.admit(f"ipv6:[2001:db8::{i:x}]") for i in range(50)]
    assert sum(x is not None for x in logged) == 4
    clock.now += 10.0
    assert limit.admit("ipv6:[2001:db8::4]") == 1  # refused by the total, counted: reported on its next line


def test_a_caller_is_its_address_without_the_port():
    assert caller_key("ipv4:10.0.0.7:51234") == "ipv4:10.0.0.7"
    assert caller_key("ipv6:[::1]:40000") == "ipv6:[::1]"
    assert caller_key("unix:/tmp/sock") == "unix:/tmp/sock"


def test_metric_method_names():
    assert [metric_method(m) for m in ("Forward", "ForwardBackward", "PushState", "Info")] == [
        "forward",
        "forward_backward",
        "push_state",
        "info",
    ]


def test_method_labels_and_kinds_come_from_the_proto_and_nothing_else():
    assert method_label("/swarmpipe.Stage/ForwardBackward") == "forward_backward"
    assert method_label("/swarmpipe.Relay/CheckReachability") == "check_reachability"
    assert method_label("ChainResume") == "chain_resume"  # by name, as the credential check names a call
    assert method_label("/swarmpipe.Stage/" + HUGE) == method_label("/made.Up/X") == "unknown"  # one series
    assert method_label(HUGE) == method_label("Forward/") == "unknown"
    assert method_kind("/swarmpipe.Stage/PushState") == (True, False)
    assert method_kind("/swarmpipe.Stage/DownloadState") == (False, True)
    assert method_kind("/swarmpipe.Stage/Chain") == (False, False)
    assert method_kind("/made.Up/X") == (True, True)  # answers a call of any kind


# ------------------------------------------------------------------ methods a server does not serve


class PartialServicer(swarm_pb2_grpc.StageServicer):
    async def Info(self, request, context):
        return swarm_pb2.InfoResponse(state="coordinator")


class AbortingContext:
    def __init__(self) -> None:
        self.aborted: tuple | None = None

    def peer(self) -> str:
        return "ipv4:10.0.0.9:1234"

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise Aborted(details)


def test_only_the_methods_a_servicer_implements_are_served():
    assert set(served_handlers(PartialServicer())) == {"Info"}


async def test_an_unserved_method_is_unimplemented_counted_and_logged_once(caplog):
    errors = Counter("swarmpipe_errors_total", "refused", ["method", "kind"], registry=CollectorRegistry())
    caplog.set_level(logging.INFO)
    unserved = Unserved(Rejections(logging.getLogger("swarmpipe.test_unserved"), errors, lambda: "coordinator x"))
    for path, kind in [("/swarmpipe.Stage/Chain", (False, False)), ("/made.Up/" + HUGE, (True, True))]:
        handler = unserved.service(SimpleNamespace(method=path, invocation_metadata=()))
        assert (handler.request_streaming, handler.response_streaming) == kind
        assert handler.request_deserializer is None  # the request is never parsed
        context = AbortingContext()
        with pytest.raises(Aborted):
            if kind == (False, False):
                await handler.unary_unary(b"\xff", context)
            else:
                async for _ in handler.stream_stream(_stream(b"\xff"), context):
                    pass
        code, details = context.aborted
        assert code == grpc.StatusCode.UNIMPLEMENTED and "not served here" in details and len(details) < 100
    assert errors.labels("chain", "unimplemented")._value.get() == 1
    assert errors.labels("unknown", "unimplemented")._value.get() == 1
    lines = [r for r in caplog.records if r.name == "swarmpipe.test_unserved"]
    assert len(lines) == 1 and not lines[0].exc_info and len(lines[0].getMessage()) < 300


# ------------------------------------------------------------------ undecodable requests


class Aborted(Exception):
    pass


class FakeContext:
    def peer(self) -> str:
        return "ipv4:10.0.0.9:1234"


def _handlers(calls: list) -> dict:
    async def forward(request, context):
        calls.append(("forward", request))
        return swarm_pb2.ForwardResponse(version=1)

    async def push(requests, context):
        calls.append(("push", [r async for r in requests]))
        return swarm_pb2.PushStateResponse(accepted=True)

    async def download(request, context):
        calls.append(("download", request))
        yield swarm_pb2.StateChunk(name="w")

    return {
        "Forward": grpc.unary_unary_rpc_method_handler(
            forward, swarm_pb2.ForwardRequest.FromString, swarm_pb2.ForwardResponse.SerializeToString
        ),
        "PushState": grpc.stream_unary_rpc_method_handler(
            push, swarm_pb2.StateChunk.FromString, swarm_pb2.PushStateResponse.SerializeToString
        ),
        "DownloadState": grpc.unary_stream_rpc_method_handler(
            download, swarm_pb2.DownloadStateRequest.FromString, swarm_pb2.StateChunk.SerializeToString
        ),
        "Stream": grpc.stream_stream_rpc_method_handler(forward),  # raw bytes: left as it is
    }


async def _stream(*items):
    for item in items:
        yield item


async def test_undecodable_bytes_are_rejected_before_the_servicer_runs():
    calls: list = []
    rejected: list = []

    async def reject(method, context, reason):
        rejected.append((method, reason))
        raise Aborted(reason)

    raw = _handlers(calls)
    guarded = guard_handlers(raw, reject)
    assert guarded["Stream"] is raw["Stream"]
    forward, push, download = guarded["Forward"], guarded["PushState"], guarded["DownloadState"]

    bad = forward.request_deserializer(b"\xff\xff\xff")
    assert isinstance(bad, Malformed) and "ForwardRequest" in bad.reason
    with pytest.raises(Aborted):
        await forward.unary_unary(bad, FakeContext())
    good = forward.request_deserializer(swarm_pb2.ForwardRequest(run_id="t").SerializeToString())
    assert (await forward.unary_unary(good, FakeContext())).version == 1

    chunk = push.request_deserializer(swarm_pb2.StateChunk(name="w").SerializeToString())
    with pytest.raises(Aborted):  # a bad chunk after a good one: refused as the servicer reaches it
        await push.stream_unary(_stream(chunk, push.request_deserializer(b"\x0a\x02\xc3\x28")), FakeContext())
    assert (await push.stream_unary(_stream(chunk), FakeContext())).accepted

    with pytest.raises(Aborted):
        async for _ in download.unary_stream(download.request_deserializer(b"\xff"), FakeContext()):
            pass
    assert [c.name async for c in download.unary_stream(swarm_pb2.DownloadStateRequest(), FakeContext())] == ["w"]

    assert [m for m, _ in rejected] == ["Forward", "PushState", "DownloadState"]
    assert all(len(reason) < 100 for _, reason in rejected)
    assert [name for name, _ in calls] == ["forward", "push", "download"]  # only the good calls got through
    assert [c.name for c in calls[1][1]] == ["w"]


# ------------------------------------------------------------------ caller strings truncated


def test_echo_bounds_a_callers_string():
    assert echo("zstd") == "'zstd'"
    assert len(echo(HUGE)) < MAX_ECHOED + 30 and "10240 characters" in echo(HUGE)
    assert len(echo("\U000e0000" * 40)) < MAX_ECHOED + 30  # escapes cannot blow it up either
    assert len(short(HUGE)) == MAX_DETAILS


async def test_huge_strings_from_a_caller_come_back_short():
    spec = spec_from_dict({"run_id": "t"})
    messages = []
    with pytest.raises(WireError) as dtype:
        decode(swarm_pb2.Tensor(shape=[1], dtype=HUGE, data=b"\x00" * 4))
    messages.append(str(dtype.value))
    with pytest.raises(WireError) as codec:
        decode(swarm_pb2.Tensor(shape=[1], dtype="float32", codec=HUGE, data=b"\x00" * 4))
    messages.append(str(codec.value))
    with pytest.raises(RequestError) as run:
        check_header(spec, 0, HUGE, 0, "mb")
    messages.append(str(run.value))
    with pytest.raises(RequestError) as reply:
        reply_codec(HUGE, "fp16")
    messages.append(str(reply.value))
    with pytest.raises(WireError) as method:
        await reassemble(_stream(swarm_pb2.Frame(method=HUGE).SerializeToString()), max_total_bytes=1 << 20)
    messages.append(str(method.value))
    assert all(len(m) < 200 for m in messages), [len(m) for m in messages]
    assert all("10240 characters" in m for m in messages), messages
