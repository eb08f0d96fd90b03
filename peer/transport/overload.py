"""A server's answer to more calls than it takes at once: RESOURCE_EXHAUSTED, counted and logged like any
rejection (:mod:`~swarmpipe.peer.transport.error_contract`), never CANCELLED.

Under a flood two places used to refuse calls, neither as documented:

* grpc-core keeps the calls that grpc.aio has not picked up yet (its loop takes them one at a time) in a
  queue per method; past ``grpc.server.max_pending_requests`` (default 1000) it drops calls at random, all of
  them past the hard limit (3000), and a dropped call ends CANCELLED, no detail, no count. A burst of 2,000
  ``Info`` calls beside 1,000 ``Forward`` ends ~10 % of them so. :data:`PENDING_OPTIONS` (in every server's
  :func:`~swarmpipe.peer.transport.channels.server_options`) raises both limits: a queued call costs its
  headers and a small arena, and the loop takes thousands per second.
* grpc.aio's own ``maximum_concurrent_rpcs`` answers RESOURCE_EXHAUSTED, but before any of our code: no
  metric counts it and no log names the caller. :class:`ConcurrencyLimit` refuses first (an interceptor,
  before the handler runs and before the request is parsed), counted as ``swarmpipe_errors_total{kind=
  "overloaded"}``; grpc's own limit stays as a backstop far above it (:func:`bounded_server`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from swarmpipe.peer.transport.error_contract import Rejections, method_kind, method_label, refusal

KIND = "overloaded"  # the ``kind`` label of swarmpipe_errors_total
MAX_PENDING_CALLS = 8192  # calls grpc-core queues per method before it starts dropping them (CANCELLED)
PENDING_OPTIONS = [
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
]
BACKSTOP = 4  # grpc's own limit, in multiples of ours: refusals in flight count there too


class ConcurrencyLimit(grpc.aio.ServerInterceptor):
    """At most ``limit`` calls run at once; the next gets RESOURCE_EXHAUSTED from ``rejections`` (counted, one
    log line per caller per interval) before its handler runs or its request is parsed. A call holds its
    place until grpc.aio's task for it ends (answered, aborted or cancelled), as grpc's own limiter counts."""

    def __init__(self, limit: int, rejections: Rejections):
        if limit < 1:
            raise ValueError(f"a concurrency limit must be positive, got {limit}")
        self.limit = limit
        self.rejections = rejections
        self.active = 0

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails) -> Any:
        if self.active >= self.limit:  # before the next interceptors: an overloaded server spends nothing more
            path = str(details.method)
            return refusal(self._answer(path), method_kind(path))
        task = asyncio.current_task()  # grpc.aio runs the whole call, interceptors first, in one task
        if task is not None:
            self.active += 1
            task.add_done_callback(self._release)
        return await continuation(details)

    def _release(self, _task: asyncio.Task) -> None:
        self.active -= 1

    def _answer(self, path: str):
        reason = f"this server is at its limit of {self.limit} concurrent calls: retry later or elsewhere"

        async def answer(context: grpc.aio.ServicerContext) -> None:
            await self.rejections.reject(context, method_label(path), grpc.StatusCode.RESOURCE_EXHAUSTED, reason, KIND)

        return answer


def bounded_server(
    options: Sequence[tuple[str, Any]],
    interceptors: Sequence[grpc.aio.ServerInterceptor],
    limit: int,
    rejections: Rejections,
) -> grpc.aio.Server:
    """A grpc.aio server running at most ``limit`` calls at once: beyond them RESOURCE_EXHAUSTED, counted by
    ``rejections``. The limit is checked before ``interceptors`` (credentials): an overloaded server spends
    nothing more on a call. ``options``: :func:`~swarmpipe.peer.transport.channels.server_options`."""
    return grpc.aio.server(
        options=list(options),
        interceptors=[ConcurrencyLimit(limit, rejections), *interceptors],
        maximum_concurrent_rpcs=BACKSTOP * limit,
    )
