"""The trainer: owns the data and drives micro-batches through the swarm, many in flight.

No pipeline flush: up to ``in_flight`` micro-batches are anywhere in the
pipeline at once, and every stage updates after each backward. Each call has a
deadline; a failed forward is retried on another replica; a backward whose
forward peer is gone is replayed on another replica from the input we kept.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from swarmpipe.peer.swarm.bootstrap import resolve_initial_peers
from swarmpipe.peer.config import TrainerConfig
from swarmpipe.peer.trainer.data import BatchSampler, CorpusSplit, load_corpus
from swarmpipe.peer.events import EventLog
from swarmpipe.peer.trainer.microbatch import MicrobatchRunner
from swarmpipe.peer.swarm.records import TrainerRecord, now
from swarmpipe.peer.trainer.routing import Router
from swarmpipe.peer.swarm.dht import SwarmDHT, reconnect_bootstrap, start_dht

log = logging.getLogger("swarmpipe.trainer")
REFRESH_PERIOD_S = 2.0
LOSS_WINDOW = 10


@dataclass
class Progress:
    started: int = 0
    completed: int = 0
    retried: int = 0
    dropped_stale: int = 0
    failed: int = 0
    losses: list[float] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)
    marks: deque = field(default_factory=deque)

    def samples_per_s(self, microbatch_size: int) -> float:
        elapsed = time.monotonic() - self.t0
        return self.completed * microbatch_size / elapsed if elapsed > 0 else 0.0

    def recent_samples_per_s(self, microbatch_size: int, window_s: float = 10.0) -> float:
        """Rate over the last ``window_s`` seconds: what the swarm does now, not since the start."""
        t = time.monotonic()
        self.marks.append((t, self.completed))
        while len(self.marks) > 2 and self.marks[1][0] < t - window_s:
            self.marks.popleft()
        t0, c0 = self.marks[0]
        return (self.completed - c0) * microbatch_size / (t - t0) if t > t0 else 0.0

    def loss_ema(self) -> float | None:
        window = self.losses[-LOSS_WINDOW:]
        return sum(window) / len(window) if window else None


class Trainer:
    def __init__(self, cfg: TrainerConfig):
        self.cfg = cfg
        self.events = EventLog(cfg.event_log, "trainer")
        self.progress = Progress()
        self.dht = None
        self.initial_peers: list[str] = []

    async def run(self) -> dict:
        cfg = self.cfg
        torch.set_num_threads(max(1, cfg.threads))
        # SIGTERM / Ctrl-C: stop starting micro-batches, finish those in flight, write the report.
        self.stop_requested = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, self.stop_requested.set)
        initial = self.initial_peers = resolve_initial_peers(cfg.initial_peers, cfg.swarm)
        self.dht = await asyncio.to_thread(start_dht, initial, cfg.host, 0, require_bootstrap=not cfg.run_id)
        try:
            return await self._train()
        finally:
            self.dht.shutdown()

    async def _train(self) -> dict:
        cfg = self.cfg
        self.events.peer_id = self.dht.peer_id.to_base58()
        if not cfg.run_id:
            runs = await SwarmDHT(self.dht, "").runs()
            if len(runs) != 1:
                raise ValueError(f"pass --run-id: the swarm lists {len(runs)} runs ({', '.join(runs) or 'none'})")
            cfg.run_id = next(iter(runs))
        swarm = SwarmDHT(self.dht, cfg.run_id)
        spec = await swarm.wait_for_spec(cfg.spec_timeout, initial_peers=self.initial_peers)
        corpus = await asyncio.to_thread(load_corpus, cfg.data or None)
        sampler = BatchSampler(CorpusSplit.from_bytes(corpus).train, spec.microbatch_size, spec.model.seq_len, cfg.seed)
        router = Router(spec.num_stages)
        runner = MicrobatchRunner(spec, router, self.progress, self.events, cfg.call_timeout, cfg.wait_timeout,
                                  refresh=lambda: self._refresh(swarm, router, spec.num_stages))
        await self._refresh(swarm, router, spec.num_stages)
        self.events.emit("training", run_id=cfg.run_id, stages=spec.num_stages, steps=cfg.steps,
                         peers=len(router.peers), corpus_bytes=len(corpus))
        in_flight = cfg.in_flight or 2 * spec.num_stages
        background = [asyncio.create_task(self._refresh_loop(swarm, router, spec.num_stages)),
                      asyncio.create_task(self._announce_loop(swarm, spec.microbatch_size))]
        bar = self._progress_bar(spec.microbatch_size)
        try:
            await self._drive(runner, sampler, in_flight, bar)
        finally:
            for task in background:
                task.cancel()
            await runner.close()
            if bar is not None:
                bar.close()
        report = self._report(spec.microbatch_size)
        await swarm.announce_trainer(self._record(spec.microbatch_size), ttl=60)
        self.events.emit("finished", **{k: v for k, v in report.items() if k != "losses"})
        if cfg.report:
            tmp = cfg.report + ".tmp"
            with open(tmp, "w") as f:
                json.dump(report, f, indent=2)
            os.replace(tmp, cfg.report)
        return report

    async def _drive(self, runner: MicrobatchRunner, sampler: BatchSampler, in_flight: int, bar) -> None:
        """Keep ``in_flight`` micro-batches going until ``steps`` have ended."""
        p = self.progress
        target = self.cfg.steps
        tasks: set[asyncio.Task] = set()
        last_event = 0.0
        deadline = time.monotonic() + self.cfg.max_time if self.cfg.max_time > 0 else float("inf")
        while p.completed + p.dropped_stale + p.failed < target:
            if self.stop_requested.is_set() or time.monotonic() > deadline:
                self.events.emit("stopping", step=p.completed, in_flight=len(tasks),
                                 reason="signal" if self.stop_requested.is_set() else "max_time")
                break
            flush = self.cfg.flush_every
            while len(tasks) < in_flight and p.started < target and not (flush and p.started % flush == 0 and tasks):
                inputs, targets = sampler.next()
                p.started += 1
                tasks.add(asyncio.create_task(runner.run(f"{self.events.peer_id[-8:]}-{p.started}", inputs, targets)))
            done, tasks = await asyncio.wait(tasks, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a runner never raises except on a fatal error: let it surface
            if bar is not None:
                bar.n = min(target, p.completed + p.dropped_stale)
                bar.set_postfix(loss=f"{p.loss_ema() or 0:.3f}", sps=f"{p.samples_per_s(runner.spec.microbatch_size):.1f}",
                                retried=p.retried, refresh=False)
                bar.refresh()
            if time.monotonic() - last_event > 1.0:
                last_event = time.monotonic()
                self.events.emit("progress", level=logging.DEBUG, step=p.completed, loss=p.loss_ema(),
                                 samples_per_s=round(p.samples_per_s(runner.spec.microbatch_size), 2),
                                 recent_samples_per_s=round(p.recent_samples_per_s(runner.spec.microbatch_size), 2),
                                 retried=p.retried, target=target, call_ms=runner.router.latency_ms())
        if tasks:
            await asyncio.gather(*tasks)

    def _progress_bar(self, microbatch_size: int):
        if not self.cfg.progress:
            return None
        from tqdm import tqdm
        return tqdm(total=self.cfg.steps, desc="training", unit="mb", dynamic_ncols=True)

    async def _refresh(self, swarm: SwarmDHT, router: Router, num_stages: int) -> None:
        for stage, records in enumerate(await swarm.all_stages(num_stages)):
            router.update_stage(stage, records)

    async def _refresh_loop(self, swarm: SwarmDHT, router: Router, num_stages: int) -> None:
        while True:
            await asyncio.sleep(REFRESH_PERIOD_S)
            try:
                await self._refresh(swarm, router, num_stages)
            except Exception as e:  # keep training on the last known view
                log.warning("trainer refresh failed: %s", e)

    def _record(self, microbatch_size: int) -> TrainerRecord:
        p = self.progress
        return TrainerRecord(step=p.completed, loss=p.loss_ema(), samples_per_s=p.samples_per_s(microbatch_size),
                             microbatches_completed=p.completed, microbatches_retried=p.retried,
                             microbatches_lost=self._lost(), updated_at=now())

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

    def _lost(self) -> int:
        """Micro-batches that ended neither completed nor counted as dropped (the goal: always 0)."""
        p = self.progress
        return p.failed

    def _report(self, microbatch_size: int) -> dict:
        p = self.progress
        first = p.losses[:LOSS_WINDOW]
        last = p.losses[-LOSS_WINDOW:]
        return {
            "run_id": self.cfg.run_id,
            "steps": p.completed,
            "microbatches_started": p.started,
            "microbatches_completed": p.completed,
            "microbatches_retried": p.retried,
            "microbatches_dropped_stale": p.dropped_stale,
            "microbatches_lost": self._lost(),
            "microbatches_unfinished": p.started - p.completed - p.dropped_stale - p.failed,
            "loss_first": sum(first) / len(first) if first else None,
            "loss_last": sum(last) / len(last) if last else None,
            "samples_per_s": p.samples_per_s(microbatch_size),
            "elapsed_s": time.monotonic() - p.t0,
            "losses": p.losses,
        }
