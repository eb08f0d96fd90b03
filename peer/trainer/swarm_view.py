"""The trainer's view of the swarm: a Router kept current from the DHT's stage records.

The view refreshes itself every ``period_s`` in a background task that it
starts and stops. Whoever needs a fresher picture sooner (a micro-batch
waiting for a replica of some stage) calls ``refresh_now()``: callers that
arrive while a read is under way share that read, so many micro-batches
waiting on the same stage cost one DHT lookup, not one each.

A failed periodic or on-demand read keeps the last known view: peers already
known stay routable and the next read tries again. Only the first read, in
``start()``, raises: without any view there is nothing to train on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from swarmpipe.peer.swarm.records import StageRecord
from swarmpipe.peer.trainer.routing import Router

log = logging.getLogger("swarmpipe.trainer")
REFRESH_PERIOD_S = 2.0


class StageSource(Protocol):
    """What the view reads: SwarmDHT in a trainer, a fake in tests."""

    async def all_stages(self, num_stages: int) -> list[dict[str, StageRecord]]: ...


class SwarmView:
    def __init__(self, source: StageSource, router: Router, period_s: float = REFRESH_PERIOD_S):
        self.source = source
        self.router = router
        self.period_s = period_s
        self.refreshes = 0  # completed reads, for tests and debugging
        self._read: asyncio.Task[bool] | None = None  # the read under way, shared by every caller
        self._loop: asyncio.Task[None] | None = None

    @property
    def num_stages(self) -> int:
        return self.router.num_stages

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """First read (its errors propagate), then refresh every ``period_s`` until ``stop()``."""
        await self._update()
        if self._loop is None:
            self._loop = asyncio.create_task(self._refresh_loop(), name="swarm-view-refresh")

    async def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
        read, self._read = self._read, None
        if read is not None and not read.done():
            read.cancel()
            await asyncio.gather(read, return_exceptions=True)

    async def __aenter__(self) -> SwarmView:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------ reads
    async def refresh_now(self) -> bool:
        """Re-read the DHT now, or join the read already under way. False: it failed (logged); the
        last known view stays."""
        if self._read is None or self._read.done():
            self._read = asyncio.create_task(self._guarded_update(), name="swarm-view-read")
        # shield: one caller being cancelled (its micro-batch ended) must not cancel the others' read
        return await asyncio.shield(self._read)

    async def _guarded_update(self) -> bool:
        try:
            await self._update()
        except Exception as e:  # keep training on the last known view
            log.warning("trainer refresh failed: %s", e)
            return False
        return True

    async def _update(self) -> None:
        for stage, records in enumerate(await self.source.all_stages(self.num_stages)):
            self.router.update_stage(stage, records)
        self.refreshes += 1

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            await self.refresh_now()
