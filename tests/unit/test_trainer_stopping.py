"""The trainer's way out (peer/trainer/trainer.py): in-flight work after a signal, stoppable waits, and the line
that names a stage with no reachable replica. No swarm: the trainer's helpers on plain asyncio tasks."""

from __future__ import annotations

import asyncio

import pytest

from swarmpipe.peer.config import TrainerConfig
from swarmpipe.peer.swarm.records import StageRecord
from swarmpipe.peer.trainer import trainer as trainer_module
from swarmpipe.peer.trainer.routing import Router
from swarmpipe.peer.trainer.trainer import Stopped, Trainer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


@pytest.fixture
def trainer(monkeypatch: pytest.MonkeyPatch) -> Trainer:
    monkeypatch.setattr(trainer_module, "STOP_GRACE_S", 0.2)
    t = Trainer(TrainerConfig())
    t.stop_requested = asyncio.Event()
    t.emitted = []  # type: ignore[attr-defined]
    monkeypatch.setattr(t.events, "emit", lambda kind, level=0, **fields: t.emitted.append((kind, fields)))
    return t


def _record(address: str) -> StageRecord:
    return StageRecord(address=address, state="online", throughput=1.0, queue=0, version=0, updated_at=0.0)


async def test_after_a_signal_in_flight_work_gets_the_grace_then_is_cancelled(trainer: Trainer) -> None:
    quick = asyncio.create_task(asyncio.sleep(0.05))
    stuck = asyncio.create_task(asyncio.sleep(60))
    trainer.stop_requested.set()
    loop = asyncio.get_running_loop()
    started = loop.time()
    await trainer._settle({quick, stuck})
    assert loop.time() - started < 1.0
    assert quick.done() and not quick.cancelled()
    assert stuck.cancelled()
    assert ("unfinished", {"microbatches": 1, "grace_s": 0.2}) in trainer.emitted


async def test_without_a_signal_every_micro_batch_in_flight_ends(trainer: Trainer) -> None:
    tasks = {asyncio.create_task(asyncio.sleep(d)) for d in (0.05, 0.3)}
    await trainer._settle(set(tasks))
    assert all(t.done() and not t.cancelled() for t in tasks)
    assert not trainer.emitted


async def test_a_signal_while_waiting_for_stragglers_cuts_the_wait_short(trainer: Trainer) -> None:
    stuck = asyncio.create_task(asyncio.sleep(60))
    loop = asyncio.get_running_loop()
    loop.call_later(0.1, trainer.stop_requested.set)
    started = loop.time()
    await trainer._settle({stuck})
    assert loop.time() - started < 2.5  # noticed at the next 1 s poll, then the grace
    assert stuck.cancelled()


async def test_a_stoppable_wait_returns_its_result_or_raises_stopped(trainer: Trainer) -> None:
    async def value() -> int:
        await asyncio.sleep(0.01)
        return 7

    assert await trainer._unless_stopped(value(), "a value") == 7

    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cancelled.set()

    asyncio.get_running_loop().call_later(0.05, trainer.stop_requested.set)
    with pytest.raises(Stopped):
        await trainer._unless_stopped(forever(), "the run spec")
    assert cancelled.is_set()  # the wait itself was cancelled, nothing left running
    assert trainer.emitted[-1][0] == "stopping" and trainer.emitted[-1][1]["waiting_for"] == "the run spec"


async def test_an_error_in_a_stoppable_wait_surfaces(trainer: Trainer) -> None:
    async def broken() -> None:
        raise ValueError("bad spec")

    with pytest.raises(ValueError, match="bad spec"):
        await trainer._unless_stopped(broken(), "the run spec")


async def test_the_stage_without_a_reachable_replica_is_named(trainer: Trainer, monkeypatch) -> None:
    monkeypatch.setattr(trainer_module, "UNREACHABLE_AFTER_S", 0.0)
    router = Router(3)
    router.update_stage(0, {"peer-a": _record("10.0.0.1:1000")})
    router.update_stage(2, {"peer-c": _record("192.0.2.1:3000")})
    router.peers["peer-c"].failures = 2  # announced, but its calls fail (an address nobody can dial)
    watcher = asyncio.create_task(trainer._watch_replicas(router))
    await asyncio.sleep(1.3)
    notices = {f["stage"]: f for kind, f in trainer.emitted if kind == "no_reachable_replica"}
    assert set(notices) == {1, 2}
    assert notices[1]["announced"] == 0 and notices[1]["addresses"] == "-"
    assert notices[2]["announced"] == 1 and notices[2]["failing"] == 1 and notices[2]["addresses"] == "192.0.2.1:3000"

    router.peers["peer-c"].failures = 0  # a call succeeded
    await asyncio.sleep(1.1)
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    assert [f["stage"] for kind, f in trainer.emitted if kind == "replica_reachable"] == [2]
