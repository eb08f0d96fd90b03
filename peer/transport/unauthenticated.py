"""How a ``Stage`` service answers a call without valid credentials in a private swarm: UNAUTHENTICATED with a
short reason, before its handler runs, logged like any rejection (at most one line per caller per interval, no
traceback: :mod:`swarmpipe.peer.transport.error_contract`). The check itself is
:class:`~swarmpipe.peer.transport.security.AuthInterceptor`; this is its answer, for a peer's server (counted in
its metrics) and for the coordinator's checkpoint server (logged only)."""

from __future__ import annotations

import logging

import grpc

from swarmpipe.peer.transport.error_contract import RateLimit, Rejections, caller_key, metric_method, short
from swarmpipe.peer.transport.security import Reject

KIND = "unauthenticated"  # the ``kind`` label of swarmpipe_errors_total


def counted(rejections: Rejections) -> Reject:
    """A peer's answer: counted as ``swarmpipe_errors_total{method, kind="unauthenticated"}`` and logged."""

    async def reject(context: grpc.aio.ServicerContext, method: str, reason: str) -> None:
        await rejections.reject(context, metric_method(method), grpc.StatusCode.UNAUTHENTICATED, reason, KIND)

    return reject


def logged(log: logging.Logger, who: str, limit: RateLimit | None = None) -> Reject:
    """A server without peer metrics (the coordinator's): one rate-limited line per caller, then the answer."""
    limit = limit or RateLimit()

    async def reject(context: grpc.aio.ServicerContext, method: str, reason: str) -> None:
        peer = context.peer() or "unknown"
        suppressed = limit.admit(caller_key(peer))
        if suppressed is not None:
            more = f" ({suppressed} more from this caller not logged)" if suppressed else ""
            log.info("%s: refused %s from %s: %s%s", who, method, peer, short(reason), more)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, short(reason))

    return reject
