"""The ``Stage`` service's answer to hostile input: bytes that are not a valid request get
INVALID_ARGUMENT before any work, a status detail is short, and rejections are logged at most once per
caller per interval, never with a traceback.

grpc.aio deserializes a unary request before the servicer runs; when the deserializer raises, grpc logs
the traceback at ERROR and answers UNKNOWN itself, out of the servicer's reach (a streamed request is
deserialized while the servicer iterates, with the same result). So :func:`guard_handlers` wraps each
handler's deserializer to return a :class:`Malformed` marker instead of raising, and each behaviour to
answer the marker with INVALID_ARGUMENT: a unary request before the servicer is called, a streamed one
as soon as the servicer reaches it.
"""

from __future__ import annotations

import inspect
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
from prometheus_client import Counter

from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

MAX_DETAILS = 256  # characters of a status detail or a logged reason
MAX_METHOD = 64  # characters of a caller's method path echoed in a detail

# (method, context, reason): answers INVALID_ARGUMENT, i.e. ends in ``context.abort``
Reject = Callable[[str, grpc.aio.ServicerContext, str], Awaitable[NoReturn]]
# (context): answers a refused call, i.e. ends in ``context.abort``
Answer = Callable[[grpc.aio.ServicerContext], Awaitable[Any]]


def short(message: str, limit: int = MAX_DETAILS) -> str:
    """A status detail of at most ``limit`` characters, whatever a caller's strings made it."""
    return message if len(message) <= limit else message[: limit - 3] + "..."


def metric_method(method: str) -> str:
    """The peer metrics' ``method`` label of a gRPC method: "ForwardBackward" -> "forward_backward"."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", method).lower()


# every method of swarm.proto's services by full path: its metric label (a caller's made-up method names never
# become label values, one series each) and its kind (request streaming, response streaming)
_METHODS = {
    f"/{service.full_name}/{method.name}": (
        metric_method(method.name),
        method.client_streaming,
        method.server_streaming,
    )
    for service in swarm_pb2.DESCRIPTOR.services_by_name.values()
    for method in service.methods
}


_NAME_LABELS = {path.rsplit("/", 1)[1]: label for path, (label, _, _) in _METHODS.items()}


def method_label(method: str) -> str:
    """The ``method`` label of a call by its full path or its name: "/swarmpipe.Stage/ForwardBackward" or
    "ForwardBackward" -> "forward_backward"; "unknown" for any method swarm.proto does not declare."""
    return _METHODS[method][0] if method in _METHODS else _NAME_LABELS.get(method, "unknown")


def method_kind(path: str) -> tuple[bool, bool]:
    """(request streaming, response streaming) of a method by its full path; streaming both ways, which answers
    a call of any kind, for a method swarm.proto does not declare."""
    return _METHODS[path][1:] if path in _METHODS else (True, True)


def caller_key(peer: str) -> str:
    """The caller a rejection is counted against: its address without the port, so a caller that opens
    a new connection for each request is still one caller ("ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7")."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer


# ------------------------------------------------------------------ undecodable requests


class Malformed:
    """What a guarded deserializer returns for bytes that are not a valid message."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


def _tolerant(deserializer: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    message_type = getattr(getattr(deserializer, "__self__", None), "__name__", "message")

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception:  # noqa: BLE001 - DecodeError, or whatever else a parser raises on hostile bytes
            return Malformed(f"{method}: {len(raw)} request bytes are not a valid {message_type}")

    return deserialize


async def _checked(
    requests: AsyncIterator[Any], method: str, context: grpc.aio.ServicerContext, reject: Reject
) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Malformed):
            await reject(method, context, request.reason)
        yield request


def _guard_behavior(behavior: Callable, method: str, request_streaming: bool, reject: Reject) -> Callable:
    """``behavior`` (an ``async def`` servicer method) behind a check for :class:`Malformed` requests.
    The wrapper is of the same kind (coroutine or async generator function): grpc.aio inspects a
    handler to choose how to run it."""

    async def precheck(request: Any, context: grpc.aio.ServicerContext) -> Any:
        """The request the servicer gets: a stream checked as it is read, a unary one checked now."""
        if request_streaming:
            return _checked(request, method, context, reject)
        if isinstance(request, Malformed):
            await reject(method, context, request.reason)
        return request

    if inspect.isasyncgenfunction(behavior):

        async def guarded_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in behavior(await precheck(request, context), context):
                yield response

        return guarded_stream

    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(await precheck(request, context), context)

    return guarded


# (request streaming, response streaming) -> the handler's behaviour attribute, and how to build one
_KINDS: dict[tuple[bool, bool], tuple[str, Callable[..., grpc.RpcMethodHandler]]] = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class _HandlerCapture:
    """Stands in for a server to catch the generated code's method handlers."""

    handlers: dict[str, grpc.RpcMethodHandler]

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.handlers = dict(handlers)


def generated_handlers(
    servicer: Any, add: Callable[[Any, Any], None] = swarm_pb2_grpc.add_StageServicer_to_server
) -> dict[str, grpc.RpcMethodHandler]:
    """The method handlers the generated ``add`` (default: ``swarmpipe.Stage``'s) builds for ``servicer``."""
    capture = _HandlerCapture()
    add(servicer, capture)
    return capture.handlers


async def abort_malformed(method: str, context: grpc.aio.ServicerContext, reason: str) -> NoReturn:
    """A :data:`Reject` for servers without a :class:`Rejections` (the coordinator's state server)."""
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, short(reason))


def guard_handlers(handlers: dict[str, grpc.RpcMethodHandler], reject: Reject) -> dict[str, grpc.RpcMethodHandler]:
    """The generated ``handlers`` with undecodable requests answered by ``reject``. A handler without a
    deserializer (raw bytes, e.g. ``Stream``) checks its input itself and is kept as it is."""
    guarded = {}
    for method, handler in handlers.items():
        if handler.request_deserializer is None:
            guarded[method] = handler
            continue
        attribute, build = _KINDS[(handler.request_streaming, handler.response_streaming)]
        guarded[method] = build(
            _guard_behavior(getattr(handler, attribute), method, handler.request_streaming, reject),
            request_deserializer=_tolerant(handler.request_deserializer, method),
            response_serializer=handler.response_serializer,
        )
    return guarded


# ------------------------------------------------------------------ logging rejections


class RateLimit:
    """Which rejections get a log line: one per caller per ``interval_s`` (the rest are counted and the
    count rides on that caller's next line), at most ``max_lines`` per interval over all callers (many
    addresses), and memory for ``max_callers`` callers, the least recently seen forgotten first."""

    def __init__(
        self,
        interval_s: float = 10.0,
        max_callers: int = 1024,
        max_lines: int = 100,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.interval_s = interval_s
        self.max_callers = max_callers
        self.max_lines = max_lines
        self.clock = clock
        self._callers: OrderedDict[str, list] = OrderedDict()  # caller -> [time of its last line, suppressed]
        self._window = (float("-inf"), 0)  # (start of the current interval, lines logged in it)

    def __len__(self) -> int:
        return len(self._callers)

    def admit(self, caller: str) -> int | None:
        """None: do not log this one. Else log it, with the number of this caller's rejections suppressed
        since its last line."""
        now = self.clock()
        entry = self._callers.get(caller)
        if entry is None:
            entry = self._callers[caller] = [float("-inf"), 0]
            if len(self._callers) > self.max_callers:
                self._callers.popitem(last=False)
        else:
            self._callers.move_to_end(caller)
        start, lines = self._window
        if now - start >= self.interval_s:
            start, lines = now, 0
        if now - entry[0] < self.interval_s or lines >= self.max_lines:
            entry[1] += 1
            self._window = (start, lines)
            return None
        suppressed = entry[1]
        entry[0], entry[1] = now, 0
        self._window = (start, lines + 1)
        return suppressed


class Rejections:
    """Answers a refused request: its error counted, one rate-limited log line, the call aborted with a
    short detail."""

    def __init__(self, log: logging.Logger, errors: Counter, who: Callable[[], str], limit: RateLimit | None = None):
        self.log = log
        self.errors = errors
        self.who = who  # "peer abc123 stage 1": read per line, a rebalancing move changes the stage
        self.limit = limit or RateLimit()

    async def reject(
        self, context: grpc.aio.ServicerContext, method: str, code: grpc.StatusCode, message: str, kind: str
    ) -> NoReturn:
        detail = short(message)
        self.errors.labels(method, kind).inc()
        peer = context.peer() or "unknown"
        suppressed = self.limit.admit(caller_key(peer))
        if suppressed is not None:
            more = f" ({suppressed} more from this caller not logged)" if suppressed else ""
            self.log.info("%s: rejected %s from %s: %s%s", self.who(), method, peer, detail, more)
        await context.abort(code, detail)

    async def malformed(self, method: str, context: grpc.aio.ServicerContext, reason: str) -> NoReturn:
        """The :data:`Reject` of :func:`guard_handlers`."""
        await self.reject(context, metric_method(method), grpc.StatusCode.INVALID_ARGUMENT, reason, "malformed")


# ------------------------------------------------------------------ refusals before the servicer


def refusal(answer: Answer, kind: tuple[bool, bool] = (True, True)) -> grpc.RpcMethodHandler:
    """A handler that answers a call with ``answer`` (an abort) without parsing its request, of ``kind``
    (request streaming, response streaming: the method's own, e.g. :func:`method_kind`)."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await answer(context)

    async def refuse_streaming(_request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await answer(context)
        yield  # pragma: no cover - an async generator: grpc.aio runs it as a streaming handler

    _, build = _KINDS[kind]
    return build(refuse_streaming if kind[1] else refuse)  # no deserializer: the bytes stay unread


def served_handlers(
    servicer: Any,
    base: type = swarm_pb2_grpc.StageServicer,
    add: Callable[[Any, Any], None] = swarm_pb2_grpc.add_StageServicer_to_server,
) -> dict[str, grpc.RpcMethodHandler]:
    """The generated handlers of the methods ``servicer`` implements itself, not those it inherits from the
    generated ``base`` (which answer UNIMPLEMENTED by raising: grpc logs each call with a traceback)."""
    handlers = generated_handlers(servicer, add)
    return {name: h for name, h in handlers.items() if getattr(type(servicer), name) is not getattr(base, name)}


class Unserved(grpc.GenericRpcHandler):
    """The last generic handler of a server: every method nothing else serves (a ``Stage`` method the
    coordinator does not implement, a made-up path) is answered UNIMPLEMENTED without reading its request,
    counted as ``kind="unimplemented"`` and logged at most once per caller per interval, no traceback."""

    KIND = "unimplemented"

    def __init__(self, rejections: Rejections):
        self.rejections = rejections

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        path = str(handler_call_details.method)
        reason = f"{short(path, MAX_METHOD)} is not served here"

        async def answer(context: grpc.aio.ServicerContext) -> None:
            await self.rejections.reject(context, method_label(path), grpc.StatusCode.UNIMPLEMENTED, reason, self.KIND)

        return refusal(answer, method_kind(path))
