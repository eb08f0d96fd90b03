"""The gRPC glue of private swarms (peer/transport/security.py) without sockets: the client interceptors put the
credential for the called method into the metadata of every call type, and the server interceptor passes a
valid call to its handler and answers any other with UNAUTHENTICATED through a handler of the same kind that
never parses the request."""

from __future__ import annotations

from collections import namedtuple

import grpc
import pytest

from swarmpipe.peer.swarm.access import token_credentials
from swarmpipe.peer.transport.auth import METADATA_KEY, TokenCheck, Verifier, derive_key
from swarmpipe.peer.transport.security import AuthInterceptor, Security

pytestmark = pytest.mark.unit

TOKEN = b"unit-test-token-0123456789"
Details = namedtuple("Details", "method invocation_metadata")


class Aborted(Exception):
    pass


class Context:
    def __init__(self):
        self.code = self.details = None

    def peer(self) -> str:
        return "ipv4:10.0.0.7:5555"

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted


async def echo(request, context):
    return request


async def stream(request, context):
    yield request


HANDLERS = {
    "Unary": grpc.unary_unary_rpc_method_handler(echo, request_deserializer=bytes),
    "ServerStream": grpc.unary_stream_rpc_method_handler(stream, request_deserializer=bytes),
    "ClientStream": grpc.stream_unary_rpc_method_handler(echo, request_deserializer=bytes),
    "Both": grpc.stream_stream_rpc_method_handler(stream, request_deserializer=bytes),
}


def _interceptor(reasons: list) -> AuthInterceptor:
    async def reject(context, method, reason):
        reasons.append((method, reason))
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    return AuthInterceptor(Verifier(TokenCheck(derive_key(TOKEN, "rpc"))), reject)


@pytest.mark.parametrize("name", list(HANDLERS))
async def test_a_valid_call_reaches_its_handler(name: str) -> None:
    method = f"/swarmpipe.Stage/{name}"
    credential = token_credentials(TOKEN).for_method(method)

    async def continuation(details):
        return HANDLERS[name]

    handler = await _interceptor([]).intercept_service(continuation, Details(method, ((METADATA_KEY, credential),)))
    assert handler is HANDLERS[name]


@pytest.mark.parametrize("name", list(HANDLERS))
@pytest.mark.parametrize("metadata", [(), ((METADATA_KEY, "t1.1.a.b"),), ((METADATA_KEY + "-bin", b"\x00"),)])
async def test_any_other_call_is_refused_by_a_handler_of_its_kind(name: str, metadata) -> None:
    reasons: list = []

    async def continuation(details):
        return HANDLERS[name]

    handler = await _interceptor(reasons).intercept_service(continuation, Details(f"/swarmpipe.Stage/{name}", metadata))
    original = HANDLERS[name]
    assert handler is not original and handler.request_deserializer is None  # the request is never parsed
    assert (handler.request_streaming, handler.response_streaming) == (
        original.request_streaming,
        original.response_streaming,
    )
    behaviour = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    context = Context()
    with pytest.raises(Aborted):
        result = behaviour(b"\xff garbage", context)
        if hasattr(result, "__anext__"):
            await result.__anext__()
        else:
            await result
    assert context.code == grpc.StatusCode.UNAUTHENTICATED and reasons and reasons[0][0] == name


async def test_unknown_methods_stay_unknown() -> None:
    async def continuation(details):
        return None

    assert await _interceptor([]).intercept_service(continuation, Details("/x/Y", ())) is None


async def test_client_interceptors_attach_the_credential_to_every_call_type() -> None:
    security = Security(credentials=token_credentials(TOKEN))
    interceptors = security._interceptors
    seen = []

    async def continuation(details, request):
        seen.append(details)
        return "called"

    details = grpc.aio.ClientCallDetails("/swarmpipe.Stage/Info", None, grpc.aio.Metadata(("other", "x")), None, None)
    calls = [
        interceptors[0].intercept_unary_unary(continuation, details, b""),
        interceptors[1].intercept_unary_stream(continuation, details, b""),
        interceptors[2].intercept_stream_unary(continuation, details, iter([b""])),
        interceptors[3].intercept_stream_stream(continuation, details, iter([b""])),
    ]
    for call in calls:
        assert await call == "called"
    verifier = Verifier(TokenCheck(derive_key(TOKEN, "rpc")))
    for attached in seen:
        assert attached.metadata["other"] == "x"  # the caller's own metadata stays
        assert verifier.verify("/swarmpipe.Stage/Info", attached.metadata[METADATA_KEY]) == "token"
    kinds = [type(i).__mro__[2] for i in interceptors]  # one grpc interceptor type each, as grpc.aio files them
    assert kinds == [
        grpc.aio.UnaryUnaryClientInterceptor,
        grpc.aio.UnaryStreamClientInterceptor,
        grpc.aio.StreamUnaryClientInterceptor,
        grpc.aio.StreamStreamClientInterceptor,
    ]
