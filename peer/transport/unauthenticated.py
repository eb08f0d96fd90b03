"""How a ``Stage`` service answers a call without valid credentials in a private swarm: UNAUTHENTICATED with a
short reason, before its handler runs, counted and logged like any rejection (at most one line per caller per
interval, no traceback: :mod:`swarmpipe.peer.transport.error_contract`). The check itself is
:class:`~swarmpipe.peer.transport.security.AuthInterceptor`; this is its answer, for a peer's server and for the
coordinator's checkpoint server (each counts in its own ``swarmpipe_errors_total``)."""

from __future__ import annotations

import grpc

from swarmpipe.peer.transport.error_contract import Rejections, method_label
from swarmpipe.peer.transport.security import Reject

KIND = "unauthenticated"  # the ``kind`` label of swarmpipe_errors_total


def counted(rejections: Rejections) -> Reject:
    """The answer: counted as ``swarmpipe_errors_total{method, kind="unauthenticated"}`` (a method swarm.proto
    does not declare as ``method="unknown"``: a caller's names never become series) and logged."""

    async def reject(context: grpc.aio.ServicerContext, method: str, reason: str) -> None:
        await rejections.reject(context, method_label(method), grpc.StatusCode.UNAUTHENTICATED, reason, KIND)

    return reject
