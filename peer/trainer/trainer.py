"""The trainer: owns the data and drives micro-batches through the swarm, many in flight.

No pipeline flush: up to ``in_flight`` micro-batches are anywhere in the
pipeline at once, and every stage updates after each backward. Each call has a
deadline; a failed forward is retried on another replica; a backward whose
forward peer is gone is replayed on another replica from the input we kept.

The parts talk one way. The trainer launches each micro-batch on the
``MicrobatchRunner`` and folds the ``MicrobatchOutcome`` it returns into its
``Progress``; the runner never sees the progress. The ``SwarmView`` keeps the
router current from the DHT on its own; the runner holds it and asks for an
early read only while it waits for a replica. With ``eval_every`` set, an
``Evaluator`` runs the validation set through the swarm as a task beside
training (one at a time) and once more at the end; its losses go to the progress.

SIGTERM / Ctrl-C: no new micro-batch starts, those in flight get ``STOP_GRACE_S``, the rest are cancelled and
reported as ``microbatches_unfinished`` (not lost); a wait for the spec or an evaluation ends at once. While a
stage has no reachable replica, one warning line every ``UNREACHABLE_NOTICE_S`` names it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import torch

from swarmpipe.peer.config import TrainerConfig, default_threads
from swarmpipe.peer.data import MicrobatchStream, open_dataset
from swarmpipe.peer.events import EventLog
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.swarm.bootstrap import resolve_initial_peers
from swarmpipe.peer.swarm.dht import SwarmDHT, reconnect_bootstrap, start_dht
from swarmpipe.peer.swarm.records import TrainerRecord
from swarmpipe.peer.trainer.chain import ROUTES, ChainCalls
from swarmpipe.peer.trainer.evaluation import Evaluator
from swarmpipe.peer.trainer.microbatch import MicrobatchRunner
from swarmpipe.peer.trainer.progress import Progress
from swarmpipe.peer.trainer.resume import StateFile
from swarmpipe.peer.trainer.routing import Router
from swarmpipe.peer.trainer.swarm_view import SwarmView

log = logging.getLogger("swarmpipe.trainer")
STOP_GRACE_S = 3.0  # after a signal, in-flight micro-batches get this long before they are reported unfinished
STOP_ANNOUNCE_S = 3.0  # after a signal, the last DHT announcement gets this long
UNREACHABLE_AFTER_S = 5.0  # a stage with no routable replica this long is named (a short ban is normal)
UNREACHABLE_NOTICE_S = 10.0
T = TypeVar("T")


class Stopped(Exception):
    """A signal came while the trainer waited for something other than its micro-batches."""


class Trainer:
    def __init__(self, cfg: TrainerConfig):
        self.cfg = cfg
        self.events = EventLog(cfg.event_log, "trainer")
        self.progress = Progress()
        self.dht = None
        self.initial_peers: list[str] = []
        self.evaluator: Evaluator | None = None
        self._evaluation: asyncio.Task[None] | None = None  # at most one validation run at a time

    async def run(self) -> dict[str, Any]:
        cfg = self.cfg
        torch.set_num_threads(cfg.threads or default_threads())
        # SIGTERM / Ctrl-C: stop starting micro-batches, give those in flight STOP_GRACE_S, write the report.
        self.stop_requested = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, self.stop_requested.set)
        initial = self.initial_peers = resolve_initial_peers(cfg.initial_peers, cfg.swarm)
        self.dht = await asyncio.to_thread(
            start_dht, initial, cfg.host, 0, require_bootstrap=not cfg.run_id, coordinators=cfg.coordinator_id
        )
        try:
            return await self._train()
        finally:
            await asyncio.to_thread(self.dht.shutdown)  # bounded; kills the DHT process and p2pd if they hang

    async def _train(self) -> dict[str, Any]:
        cfg = self.cfg
        self.events.peer_id = self.dht.peer_id.to_base58()
        if not cfg.run_id:
            runs = await SwarmDHT(self.dht, "").runs()
            if len(runs) != 1:
                raise ValueError(
                    f"pass --run-id: the swarm lists {len(runs)} runs its trusted coordinators signed "
                    f"({', '.join(runs) or 'none'})"
                )
            cfg.run_id = next(iter(runs))
        swarm = SwarmDHT(self.dht, cfg.run_id)
        try:
            spec = await self._unless_stopped(
                swarm.wait_for_spec(cfg.spec_timeout, initial_peers=self.initial_peers), "the run spec"
            )
        except Stopped:
            return self._write_report(self.progress.report(cfg.run_id, 0))
        dataset = await asyncio.to_thread(
            open_dataset, cfg.data or None, spec.model.seq_len, spec.model.vocab_size, self._tokenizer(spec), cfg.seed
        )
        data = dataset.describe()
        identity = f"{data['source']}:{data['path']}:seq_len={spec.model.seq_len}:seed={cfg.seed}"
        self.state_file = StateFile(cfg.state_file, cfg.run_id, cfg.shard, cfg.num_shards, identity)
        saved = self.state_file.load()
        self.state_file.restore(self.progress)
        stream = dataset.batches(spec.microbatch_size, cfg.shard, cfg.num_shards, saved.cursor)
        view = SwarmView(swarm, Router(spec.num_stages))
        if not 0.0 <= cfg.verify_fraction <= 1.0 or cfg.verify_ban_after < 1:
            raise ValueError("--verify-fraction must lie in [0, 1] and --verify-ban-after be at least 1")
        if cfg.route not in ROUTES:
            raise ValueError(f"--route must be one of {', '.join(ROUTES)}, not {cfg.route!r}")
        runner = self.runner = MicrobatchRunner(
            spec,
            view,
            self.events,
            cfg.call_timeout,
            cfg.wait_timeout,
            cfg.verify_fraction,
            cfg.verify_ban_after,
            route=cfg.route,
        )
        if cfg.eval_every > 0:
            valid = (await asyncio.to_thread(dataset.validation, spec.microbatch_size))[: cfg.eval_batches]
            self.evaluator = Evaluator(runner, valid, cfg.eval_every, self.events)
            if not valid:
                log.warning("no validation loss: the data holds no held-out sequence")
        background: list[asyncio.Task[None]] = []
        bar = None
        try:
            # the first read: its failure ends the run, as there is nothing to route to
            await self._unless_stopped(view.start(), "the first read of the swarm")
            self.events.emit(
                "training",
                run_id=cfg.run_id,
                stages=spec.num_stages,
                steps=cfg.steps,
                peers=len(view.router.peers),
                data=data["source"],
                path=data["path"],
                shard=f"{cfg.shard}/{cfg.num_shards}",
                resumed_at=saved.cursor.to_dict() if self.state_file.resumed else None,
                completed_before=self.progress.completed,
            )
            in_flight = cfg.in_flight or 2 * spec.num_stages
            background.append(asyncio.create_task(self._announce_loop(swarm, spec.microbatch_size)))
            background.append(asyncio.create_task(self._watch_replicas(view.router)))
            bar = self._progress_bar(spec.microbatch_size)
            if self.evaluator is not None and not self.progress.val_losses:
                # the baseline: the starting weights' loss
                await self._unless_stopped(self._evaluate(self.evaluator.run), "the first validation")
            await self._drive(runner, stream, in_flight, bar)
            if not self.stop_requested.is_set():  # after a signal the process is asked to leave: no final validation
                await self._unless_stopped(self._final_evaluation(), "the final validation")
        except Stopped:
            pass  # the report below says what ended and what did not
        finally:
            if self._evaluation is not None:
                self._evaluation.cancel()
            for task in background:
                task.cancel()
            await view.stop()
            await runner.close()
            if bar is not None:
                bar.close()
        self.state_file.save(stream.cursor, self.progress)  # the final counters
        report = self.progress.report(cfg.run_id, spec.microbatch_size)
        report["verification"] = {**vars(runner.verifier.stats), "banned": dict(runner.verifier.banned)}
        report.update(self._traffic(), route=cfg.route, **ChainCalls.counters(runner.chain))
        last = swarm.announce_trainer(self._record(spec.microbatch_size), ttl=60)
        try:  # after a signal the process is asked to leave: a slow DHT must not keep it
            await asyncio.wait_for(last, STOP_ANNOUNCE_S if self.stop_requested.is_set() else None)
        except asyncio.TimeoutError:
            log.warning("the last trainer announcement timed out; leaving anyway")
        return self._write_report(report)

    def _write_report(self, report: dict[str, Any]) -> dict[str, Any]:
        self.events.emit("finished", **{k: v for k, v in report.items() if k not in ("losses", "val_losses")})
        if self.cfg.report:
            tmp = self.cfg.report + ".tmp"
            with open(tmp, "w") as f:
                json.dump(report, f, indent=2)
            os.replace(tmp, self.cfg.report)
        return report

    async def _unless_stopped(self, awaitable: Awaitable[T], what: str) -> T:
        """Await ``awaitable``, or cancel it and raise :class:`Stopped` as soon as a signal comes."""
        task = asyncio.ensure_future(awaitable)
        stop = asyncio.ensure_future(self.stop_requested.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled() and self.stop_requested.is_set():
            self.events.emit("stopping", step=self.progress.completed, reason="signal", waiting_for=what)
            raise Stopped(what)
        return task.result()

    def _tokenizer(self, spec: RunSpec) -> str | None:
        """--tokenizer, else the tokenizer of the run's checkpoint when this machine has that folder."""
        if self.cfg.tokenizer:
            return self.cfg.tokenizer
        folder = Path(spec.model.checkpoint) if spec.model.checkpoint else None
        if folder is not None and (folder / "tokenizer_config.json").is_file():
            return str(folder)
        return None

    async def _drive(self, runner: MicrobatchRunner, stream: MicrobatchStream, in_flight: int, bar) -> None:
        """Keep ``in_flight`` micro-batches going until ``steps`` have ended."""
        p = self.progress
        target = self.cfg.steps
        tasks: set[asyncio.Task] = set()
        last_event = 0.0
        deadline = time.monotonic() + self.cfg.max_time if self.cfg.max_time > 0 else float("inf")
        while p.ended < target:
            if self.stop_requested.is_set() or time.monotonic() > deadline:
                self.events.emit(
                    "stopping",
                    step=p.completed,
                    in_flight=len(tasks),
                    reason="signal" if self.stop_requested.is_set() else "max_time",
                )
                break
            flush = self.cfg.flush_every
            while len(tasks) < in_flight and p.started < target and not (flush and p.started % flush == 0 and tasks):
                inputs, targets, sequences = await asyncio.to_thread(stream.next)
                # saved before the micro-batch runs: a restart never trains these sequences again
                self.state_file.save(stream.cursor, p)
                mb_id = f"{self.events.peer_id[-8:]}-{p.start()}"
                self.events.emit("data", level=logging.DEBUG, microbatch=mb_id, sequences=sequences)
                tasks.add(asyncio.create_task(self._run_and_count(runner, mb_id, inputs, targets)))
            done, tasks = await asyncio.wait(tasks, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a runner never raises except on a fatal error: let it surface
            self._maybe_evaluate()
            if bar is not None:
                bar.n = min(target, p.completed + p.dropped_stale)
                bar.set_postfix(
                    loss=f"{p.loss_ema() or 0:.3f}",
                    sps=f"{p.samples_per_s(runner.spec.microbatch_size):.1f}",
                    retried=p.retried,
                    refresh=False,
                )
                bar.refresh()
            if time.monotonic() - last_event > 1.0:
                last_event = time.monotonic()
                self.events.emit(
                    "progress",
                    level=logging.DEBUG,
                    step=p.completed,
                    loss=p.loss_ema(),
                    val_loss=p.val_loss,
                    samples_per_s=round(p.samples_per_s(runner.spec.microbatch_size), 2),
                    recent_samples_per_s=round(p.recent_samples_per_s(runner.spec.microbatch_size), 2),
                    retried=p.retried,
                    target=target,
                    call_ms=runner.router.latency_ms(),
                )
        await self._settle(tasks)

    async def _settle(self, tasks: set[asyncio.Task]) -> None:
        """Let the micro-batches in flight end: all of them after the last step or ``max_time``; after a signal
        only for ``STOP_GRACE_S``, then the rest are cancelled (counted unfinished, not lost)."""
        while tasks and not self.stop_requested.is_set():
            done, tasks = await asyncio.wait(tasks, timeout=1.0)
            for task in done:
                task.result()
        if not tasks:
            return
        done, tasks = await asyncio.wait(tasks, timeout=STOP_GRACE_S)
        for task in done:
            task.result()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if tasks:
            self.events.emit("unfinished", level=logging.WARNING, microbatches=len(tasks), grace_s=STOP_GRACE_S)

    async def _watch_replicas(self, router: Router) -> None:
        """Name, every ``UNREACHABLE_NOTICE_S``, each stage that has had no reachable replica for a while (its
        micro-batches wait, up to --wait-timeout): none announced, none online, or every one's last call failed
        (a peer that announces an address nobody can dial keeps failing between short bans)."""
        since: dict[int, float] = {}
        noticed: dict[int, float] = {}
        while True:
            await asyncio.sleep(1.0)
            t = time.monotonic()
            for stage in range(router.num_stages):
                if any(v.failures == 0 for v in router.available(stage)):
                    if stage in noticed:
                        self.events.emit("replica_reachable", stage=stage, after_s=round(t - since[stage]))
                    since.pop(stage, None)
                    noticed.pop(stage, None)
                    continue
                start = since.setdefault(stage, t)
                if t - start < UNREACHABLE_AFTER_S or (stage in noticed and t - noticed[stage] < UNREACHABLE_NOTICE_S):
                    continue
                noticed[stage] = t
                replicas = router.replicas(stage)
                self.events.emit(
                    "no_reachable_replica",
                    level=logging.WARNING,
                    stage=stage,
                    announced=len(replicas),
                    not_online=sum(v.state != "online" for v in replicas),
                    failing=sum(v.failures > 0 for v in replicas),
                    addresses=",".join(v.address for v in replicas[:3]) or "-",
                    waited_s=round(t - start),
                    gives_up_after_s=round(self.cfg.wait_timeout),
                )

    def _maybe_evaluate(self) -> None:
        """Start a validation run beside training when one is due and none is running."""
        if self._evaluation is not None:
            if not self._evaluation.done():
                return
            task, self._evaluation = self._evaluation, None
            task.result()  # an evaluation never raises except on a fatal error: let it surface
        if self.evaluator is not None and self.evaluator.due(self.progress.completed):
            self._evaluation = asyncio.create_task(self._evaluate(self.evaluator.maybe_run))

    async def _evaluate(self, run) -> None:
        step = self.progress.completed
        val_loss = await run(step)
        if val_loss is not None:
            self.progress.validated(step, val_loss)

    async def _final_evaluation(self) -> None:
        """Wait for a running evaluation, then measure the final weights once. Not after a signal: the
        process is asked to leave (a running evaluation is cancelled on the way out)."""
        evaluator = self.evaluator
        if evaluator is None or not evaluator.enabled or self.stop_requested.is_set():
            return
        if self._evaluation is not None:
            task, self._evaluation = self._evaluation, None
            await task
        if evaluator.history and evaluator.history[-1][0] == self.progress.completed:
            return  # the last periodic evaluation already saw these weights' step
        await self._evaluate(evaluator.run)

    async def _run_and_count(
        self, runner: MicrobatchRunner, mb_id: str, inputs: torch.Tensor, targets: torch.Tensor
    ) -> None:
        # Folded the moment it ends, so losses keep the order micro-batches finished in.
        self.progress.apply(await runner.run(mb_id, inputs, targets))

    def _progress_bar(self, microbatch_size: int):
        if not self.cfg.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=self.cfg.steps, desc="training", unit="mb", dynamic_ncols=True)

    def _traffic(self) -> dict[str, float]:
        """The trainer's own bytes on the wire (every call, verification included), per micro-batch ended."""
        client = self.runner.calls.client
        total = client.bytes_sent + client.bytes_received
        return {
            "trainer_bytes_sent": client.bytes_sent,
            "trainer_bytes_received": client.bytes_received,
            "trainer_bytes_per_microbatch": round(total / max(1, self.progress.ended), 1),
        }

    def _record(self, microbatch_size: int) -> TrainerRecord:
        """Progress, its traffic, and the replicas this trainer banned for failing verification (the coordinator
        reports them)."""
        record = self.progress.record(microbatch_size)
        update = {"banned": list(self.runner.verifier.banned)}
        return record.model_copy(
            update={**update, "bytes_per_microbatch": self._traffic()["trainer_bytes_per_microbatch"]}
        )

    async def _announce_loop(self, swarm: SwarmDHT, microbatch_size: int) -> None:
        rounds = 0
        while True:
            rounds += 1
            try:
                if rounds % 3 == 0:  # find a restarted coordinator again
                    await reconnect_bootstrap(self.dht, self.initial_peers)
                await swarm.announce_trainer(self._record(microbatch_size), ttl=3 * self.cfg.announce_period)
            except Exception as e:
                log.warning("trainer announce failed: %s", e)
            await asyncio.sleep(self.cfg.announce_period)
