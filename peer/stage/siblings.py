"""Backwards of one batched forward meet again: micro-batches that shared a server-side forward batch
are best differentiated together (one backward through the shared graph), so a backward waits
briefly (``batching.backward_wait_ms``) for its siblings. A sibling that is slow or went elsewhere
is not waited for longer: the runtime recomputes the late ones on the stashed weights, still exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container
from dataclasses import dataclass, field

MAX_REMEMBERED = 1024  # sibling records whose backward never came (the trainer retried elsewhere)


@dataclass
class Siblings:
    """Micro-batches that shared one batched forward: their backwards are best run together too."""

    members: frozenset[str]
    arrived: set[str] = field(default_factory=set)
    complete: asyncio.Event = field(default_factory=asyncio.Event)


class SiblingWaits:
    """Micro-batch id -> its forward batch's :class:`Siblings`, until its backward arrives."""

    def __init__(self, pending: Callable[[], Container[str]], wait_ms: Callable[[], float]):
        self._pending = pending  # the runtime's forwards still owed a backward
        self._wait_ms = wait_ms
        self._by_microbatch: dict[str, Siblings] = {}

    def remember(self, microbatch_id: str, siblings: Siblings | None) -> None:
        if siblings is None:
            return
        self._by_microbatch[microbatch_id] = siblings
        if len(self._by_microbatch) > MAX_REMEMBERED:
            pending = self._pending()
            for stale in [mb for mb in self._by_microbatch if mb not in pending]:
                del self._by_microbatch[stale]

    async def wait(self, microbatch_id: str) -> None:
        """Hold a backward briefly so the members of one forward batch share one backward pass."""
        siblings = self._by_microbatch.pop(microbatch_id, None)
        if siblings is None:
            return
        siblings.arrived.add(microbatch_id)
        pending = self._pending()
        owed = {mb for mb in siblings.members if mb in pending}
        if owed <= siblings.arrived:
            siblings.complete.set()  # the waiting siblings wake in this loop iteration and join one batch
            return
        try:
            async with asyncio.timeout(self._wait_ms() / 1000):
                await siblings.complete.wait()
        except TimeoutError:
            pass  # a sibling is slow or went elsewhere: ours runs without it (recomputed, still exact)
