"""A process's gRPC security: credentials on every call it makes, checks on every call it serves, TLS.

:class:`Security` puts :mod:`auth` (call credentials) and :mod:`tls` (pinned certificates) on grpc.aio:

* clients: :meth:`Security.channel` dials an address over TLS when a signed record pinned a certificate for
  it (and refuses to dial at all when ``require_tls`` and none did), with interceptors that attach this
  process's credential to every call, unary and streamed;
* servers: :meth:`Security.server_interceptors` refuses a call without a valid credential with
  UNAUTHENTICATED before its handler runs (its request is not even parsed), and :meth:`Security.add_port`
  binds a TLS port when the process has a certificate.

One process has one identity and one swarm, so one :class:`Security`: the role's start installs it
(:func:`install`) and every channel and server of the process uses :func:`current` unless given another.
The default is an open swarm: plaintext, no credentials, no checks, no interceptors.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from swarmpipe.peer.transport.auth import METADATA_KEY, AuthError, Credentials, Verifier
from swarmpipe.peer.transport.error_contract import refusal
from swarmpipe.peer.transport.tls import Pin, ServerCert, TLSPins

# (context, method name, reason): answers the refused call (must end in ``context.abort``)
Reject = Callable[[grpc.aio.ServicerContext, str, str], Awaitable[Any]]
MAX_REASON = 200


class UntrustedAddress(grpc.aio.AioRpcError):
    """Raised instead of dialing an address no signed record pinned a certificate for (``--tls``): an
    UNAVAILABLE call error, so callers treat it as a peer they cannot use and go elsewhere."""

    def __init__(self, address: str):
        super().__init__(
            grpc.StatusCode.UNAVAILABLE,
            details=f"refusing to dial {address[:80]}: no certificate for it in a signed record (--tls)",
        )


def _with_credential(details: grpc.aio.ClientCallDetails, credential: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata[METADATA_KEY] = credential
    return details._replace(metadata=metadata)


class _Attach:
    """Puts this process's credential for the called method into the call's metadata."""

    def __init__(self, credentials: Credentials):
        self.credentials = credentials

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        return _with_credential(details, self.credentials.for_method(method))


# grpc.aio files an interceptor under the first call type it implements: one class per type
class _UnaryUnary(_Attach, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_Attach, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_Attach, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, requests):
        return await continuation(self._details(details), requests)


class _StreamStream(_Attach, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, requests):
        return await continuation(self._details(details), requests)


def _client_interceptors(credentials: Credentials) -> list:
    return [cls(credentials) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


async def abort_unauthenticated(context: grpc.aio.ServicerContext, method: str, reason: str) -> None:
    """The plain :data:`Reject` (no metrics, no log line)."""
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason[:MAX_REASON])


def _refusal(handler: grpc.RpcMethodHandler, method: str, reason: str, reject: Reject) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED without reading the request."""

    async def answer(context: grpc.aio.ServicerContext) -> None:
        await reject(context, method, reason)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason[:MAX_REASON])  # if ``reject`` did not

    return refusal(answer, (handler.request_streaming, handler.response_streaming))


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Every call needs a credential the ``verifier`` accepts; the rest get UNAUTHENTICATED via ``reject``."""

    def __init__(self, verifier: Verifier, reject: Reject = abort_unauthenticated):
        self.verifier = verifier
        self.reject = reject

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None  # an unknown method: grpc answers UNIMPLEMENTED
        credential = None
        for key, value in details.invocation_metadata or ():
            if key == METADATA_KEY:
                credential = value if isinstance(value, str) else None
                break
        try:
            self.verifier.verify(details.method, credential)
        except AuthError as e:
            return _refusal(handler, details.method.rsplit("/", 1)[-1], str(e), self.reject)
        return handler


class Security:
    """``credentials``: what this process attaches to its calls; ``verifier``: what its servers require;
    ``server_cert``: its servers speak TLS with it; ``require_tls``: dial only addresses with a pinned
    certificate; ``pins``: certificates learned from signed records (:class:`TLSPins`)."""

    def __init__(
        self,
        *,
        credentials: Credentials | None = None,
        verifier: Verifier | None = None,
        server_cert: ServerCert | None = None,
        require_tls: bool = False,
        pins: TLSPins | None = None,
        mode: str = "open",
    ):
        self.mode = mode  # "open", "token" or "allow-list": for logs
        self.credentials = credentials
        self.verifier = verifier
        self.server_cert = server_cert
        self.require_tls = require_tls
        self.pins = pins if pins is not None else TLSPins()
        self._interceptors = _client_interceptors(credentials) if credentials is not None else None

    @property
    def cert_pem(self) -> str:
        """What this process's signed records publish: its servers' certificate ('' without TLS)."""
        return self.server_cert.cert_pem if self.server_cert is not None else ""

    def describe(self) -> str:
        return f"auth={self.mode} tls={'on' if self.server_cert or self.require_tls else 'off'}"

    # ------------------------------------------------------------ client
    def pin(self, address: str) -> Pin | None:
        """The certificates a channel to ``address`` trusts; None: plaintext. :class:`UntrustedAddress` when
        TLS is required and no signed record pinned one."""
        pin = self.pins.pin(address)
        if pin is None and self.require_tls:
            raise UntrustedAddress(address)
        return pin

    def channel(
        self, address: str, options: Sequence[tuple[str, Any]] = (), pin: Pin | None = None
    ) -> grpc.aio.Channel:
        """A channel to ``address``: TLS to the pinned certificates if any, credentials on every call."""
        pin = pin or self.pin(address)
        if pin is None:
            return grpc.aio.insecure_channel(address, options=list(options), interceptors=self._interceptors)
        options = [*options, ("grpc.ssl_target_name_override", pin.name)]
        return grpc.aio.secure_channel(address, pin.channel_credentials(), options, interceptors=self._interceptors)

    # ------------------------------------------------------------ server
    def server_interceptors(self, reject: Reject = abort_unauthenticated) -> list[grpc.aio.ServerInterceptor]:
        return [AuthInterceptor(self.verifier, reject)] if self.verifier is not None else []

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind ``address`` (TLS with our certificate, if we have one); the bound port, 0 on failure."""
        if self.server_cert is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.server_cert.server_credentials())


_current = Security()


def install(security: Security) -> None:
    """This process's security from now on (a role's start, once it knows its identity)."""
    global _current
    _current = security


def current() -> Security:
    return _current
