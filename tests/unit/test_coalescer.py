"""swarmpipe.peer.stage.coalescer: requests queued behind a busy compute thread run as one batch; a lone one runs at once."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from swarmpipe.peer.stage.coalescer import Coalescer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list] = []

    def __call__(self, items: list) -> list:
        self.batches.append(list(items))
        return [
            ValueError(f"bad {x}") if isinstance(x, str) and x.startswith("bad") else (x, len(items)) for x in items
        ]


def block(executor: ThreadPoolExecutor) -> threading.Event:
    """Occupy the single compute thread until the returned event is set."""
    release = threading.Event()
    executor.submit(release.wait, 10)
    return release


def run(coro):
    return asyncio.run(coro)


def test_lone_request_runs_alone_and_at_once() -> None:
    async def main():
        with ThreadPoolExecutor(1) as ex:
            rec = Recorder()
            c = Coalescer(ex.submit, rec, max_items=4)
            started = time.monotonic()
            assert await c.submit(7) == (7, 1)
            return time.monotonic() - started, rec, c

    elapsed, rec, c = run(main())
    assert rec.batches == [[7]] and c.stats.sizes == {1: 1}
    assert elapsed < 1.0


def test_requests_queued_behind_a_busy_thread_form_one_batch() -> None:
    async def main():
        with ThreadPoolExecutor(1) as ex:
            rec = Recorder()
            c = Coalescer(ex.submit, rec, max_items=8)
            release = block(ex)
            tasks = [asyncio.create_task(c.submit(i)) for i in range(5)]
            await asyncio.sleep(0.05)
            assert c.pending() == 5
            release.set()
            return await asyncio.gather(*tasks), rec, c

    results, rec, c = run(main())
    assert results == [(i, 5) for i in range(5)]
    assert rec.batches == [[0, 1, 2, 3, 4]] and c.stats.mean_batch == 5


def test_batches_are_bounded_and_keyed() -> None:
    async def main():
        with ThreadPoolExecutor(1) as ex:
            rec = Recorder()
            c = Coalescer(ex.submit, rec, max_items=2)
            release = block(ex)
            tasks = [asyncio.create_task(c.submit(i, key=i % 2)) for i in range(6)]
            await asyncio.sleep(0.05)
            release.set()
            await asyncio.gather(*tasks)
            return rec

    rec = run(main())
    assert all(len(b) <= 2 for b in rec.batches)
    assert all(len({x % 2 for x in b}) == 1 for b in rec.batches)  # never mixes keys
    assert sorted(x for b in rec.batches for x in b) == list(range(6))
    assert rec.batches[0] == [0, 2]  # oldest first


def test_one_bad_request_fails_alone() -> None:
    async def main():
        with ThreadPoolExecutor(1) as ex:
            c = Coalescer(ex.submit, Recorder(), max_items=4)
            release = block(ex)
            tasks = [asyncio.create_task(c.submit(x)) for x in (1, "bad", 3)]
            await asyncio.sleep(0.05)
            release.set()
            return await asyncio.gather(*tasks, return_exceptions=True)

    ok1, bad, ok3 = run(main())
    assert ok1 == (1, 3) and ok3 == (3, 3)
    assert isinstance(bad, ValueError) and "bad" in str(bad)


def test_a_failing_batch_function_fails_every_request_in_it() -> None:
    def broken(items):
        raise RuntimeError("boom")

    async def main():
        with ThreadPoolExecutor(1) as ex:
            c = Coalescer(ex.submit, broken, max_items=4)
            return await asyncio.gather(c.submit(1), c.submit(2), return_exceptions=True)

    results = run(main())
    assert all(isinstance(r, RuntimeError) and "boom" in str(r) for r in results)


def test_wrong_number_of_results_is_an_error_not_a_hang() -> None:
    async def main():
        with ThreadPoolExecutor(1) as ex:
            c = Coalescer(ex.submit, lambda items: [], max_items=4)
            return await asyncio.gather(c.submit(1), return_exceptions=True)

    (result,) = run(main())
    assert isinstance(result, RuntimeError) and "0 results for 1" in str(result)


def test_a_cancelled_request_is_skipped() -> None:
    async def main():
        with ThreadPoolExecutor(1) as ex:
            rec = Recorder()
            c = Coalescer(ex.submit, rec, max_items=4)
            release = block(ex)
            doomed = asyncio.create_task(c.submit("gone"))
            kept = asyncio.create_task(c.submit(2))
            await asyncio.sleep(0.05)
            doomed.cancel()
            await asyncio.sleep(0.01)
            release.set()
            return await kept, rec

    result, rec = run(main())
    assert result == (2, 1) and rec.batches == [[2]]


def test_a_wait_gathers_requests_that_arrive_close_together() -> None:
    async def main():
        with ThreadPoolExecutor(1) as ex:
            rec = Recorder()
            c = Coalescer(ex.submit, rec, max_items=3, wait_s=0.2)
            first = asyncio.create_task(c.submit(1))
            await asyncio.sleep(0.05)
            second = asyncio.create_task(c.submit(2))
            await asyncio.gather(first, second)
            full = [asyncio.create_task(c.submit(i)) for i in (3, 4, 5)]  # a full batch does not wait
            started = time.monotonic()
            await asyncio.gather(*full)
            return rec, time.monotonic() - started

    rec, full_elapsed = run(main())
    assert rec.batches[0] == [1, 2]
    assert rec.batches[1] == [3, 4, 5] and full_elapsed < 0.2


def test_max_items_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Coalescer(ThreadPoolExecutor(1).submit, Recorder(), max_items=0)


def test_requests_fail_cleanly_once_the_compute_thread_is_shut_down() -> None:
    async def main():
        ex = ThreadPoolExecutor(1)
        ex.shutdown()
        c = Coalescer(ex.submit, Recorder(), max_items=4)
        with pytest.raises(RuntimeError, match="shutdown"):
            await asyncio.wait_for(c.submit(1), 5)
        assert c.pending() == 0

    run(main())


def test_a_failing_batch_hook_does_not_strand_the_callers() -> None:
    def hook(size: int) -> None:
        raise KeyError("metrics broke")

    async def main():
        with ThreadPoolExecutor(1) as ex:
            c = Coalescer(ex.submit, Recorder(), max_items=4, on_batch=hook)
            assert await asyncio.wait_for(c.submit(7), 5) == (7, 1)

    run(main())
