"""swarmpipe.peer.trainer.swarm_view: a Router that keeps itself current from the DHT (fake DHT reads)."""

from __future__ import annotations

import asyncio

import pytest

from swarmpipe.peer.swarm.records import StageRecord
from swarmpipe.peer.trainer.routing import Router
from swarmpipe.peer.trainer.swarm_view import SwarmView

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def record(port: int) -> StageRecord:
    return StageRecord(address=f"127.0.0.1:{port}", state="online", throughput=0.0, queue=0, version=0, updated_at=0.0)


class FakeStages:
    """What the DHT says per stage; a read can be held open (``gate``) or made to fail (``error``)."""

    def __init__(self, stages: list[dict[str, StageRecord]]):
        self.stages = stages
        self.reads = 0
        self.gate: asyncio.Event | None = None
        self.error: Exception | None = None

    async def all_stages(self, num_stages: int) -> list[dict[str, StageRecord]]:
        self.reads += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        return [dict(self.stages[s]) for s in range(num_stages)]


def make_view(period_s: float = 60.0) -> tuple[SwarmView, FakeStages]:
    source = FakeStages([{"a": record(1)}, {"b": record(2)}])
    return SwarmView(source, Router(2), period_s=period_s), source


async def test_start_reads_the_dht_once_and_stop_ends_the_loop() -> None:
    view, source = make_view()
    await view.start()
    assert source.reads == 1 and set(view.router.peers) == {"a", "b"}
    assert view._loop is not None and not view._loop.done()
    loop = view._loop
    await view.stop()
    assert loop.done() and view._loop is None


async def test_a_failed_first_read_raises() -> None:
    view, source = make_view()
    source.error = RuntimeError("dht down")
    with pytest.raises(RuntimeError, match="dht down"):
        await view.start()
    assert view._loop is None  # nothing left running


async def test_the_view_refreshes_itself_periodically() -> None:
    view, source = make_view(period_s=0.05)
    async with view:
        source.stages[1] = {"b": record(2), "c": record(3)}
        for _ in range(100):
            if "c" in view.router.peers:
                break
            await asyncio.sleep(0.02)
    assert "c" in view.router.peers and source.reads >= 2


async def test_refresh_now_sees_a_new_replica_and_forgets_a_gone_one() -> None:
    view, source = make_view()
    await view.start()
    source.stages[0] = {"a2": record(4)}
    assert await view.refresh_now() is True
    assert set(view.router.peers) == {"a2", "b"}
    await view.stop()


async def test_concurrent_refreshes_share_one_read() -> None:
    view, source = make_view()
    source.gate = asyncio.Event()
    waiters = [asyncio.create_task(view.refresh_now()) for _ in range(5)]
    await asyncio.sleep(0.01)
    source.gate.set()
    assert await asyncio.gather(*waiters) == [True] * 5
    assert source.reads == 1
    assert await view.refresh_now() is True and source.reads == 2  # a later call reads again


async def test_a_failed_refresh_keeps_the_last_view() -> None:
    view, source = make_view()
    await view.start()
    source.error = RuntimeError("dht hiccup")
    assert await view.refresh_now() is False
    assert set(view.router.peers) == {"a", "b"}
    await view.stop()


async def test_a_cancelled_waiter_does_not_cancel_the_read_others_wait_for() -> None:
    view, source = make_view()
    source.gate = asyncio.Event()
    first = asyncio.create_task(view.refresh_now())
    second = asyncio.create_task(view.refresh_now())
    await asyncio.sleep(0.01)
    first.cancel()
    source.gate.set()
    assert await second is True
    with pytest.raises(asyncio.CancelledError):
        await first
