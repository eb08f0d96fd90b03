"""``swarmpipe monitor``: the swarm-wide health page, read-only, from the DHT.

Every ``refresh`` seconds it reads the swarm index (runs listed by a coordinator it trusts: ``--coordinator-id``,
else the peer ids of ``--initial-peers``), each run's spec, stage and trainer records and newest checkpoint, and
dials the announced peers once (reachability.py). The page (``/``) and its JSON (``/api/monitor``) show every run
with its stages, replicas, throughput, relayed peers, versions, trainers, checkpoint, reachability history, and
where a volunteer's GPU would help most. Its DHT node runs in client mode: it reads, never stores or routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections import Counter
from typing import Any

from swarmpipe.coordinator.http import SwarmHttpServer
from swarmpipe.coordinator.monitor.reachability import ReachabilityHistory, probe_all
from swarmpipe.coordinator.monitor.view import run_view
from swarmpipe.peer.config import MonitorConfig
from swarmpipe.peer.swarm.bootstrap import resolve_initial_peers
from swarmpipe.peer.swarm.dht import SwarmDHT, start_dht

log = logging.getLogger("swarmpipe.monitor")
MAX_RUNS = 64  # shown; the index is bounded by trust (only trusted coordinators' entries count)
MAX_PROBES = 512  # per round, whatever strangers announce
MAX_PROBES_PER_HOST = 8  # the page is no port scanner of one machine


class SwarmMonitor:
    def __init__(self, cfg: MonitorConfig) -> None:
        self.cfg = cfg
        self.history = ReachabilityHistory()
        self.snapshot: dict[str, Any] = {"updated_at": None, "runs": [], "errors": []}
        self.dht = None
        self.http: SwarmHttpServer | None = None

    def routes(self) -> dict[str, Any]:
        return {
            "/api/monitor": lambda: ("application/json", json.dumps(self.snapshot).encode()),
            "/healthz": lambda: ("text/plain", b"ok\n"),
        }

    async def read(self, swarm: SwarmDHT) -> dict[str, Any]:
        """One pass over the DHT: every trusted run (``--run-id``: that one only)."""
        index = await swarm.runs()
        run_ids = [self.cfg.run_id] if self.cfg.run_id else sorted(index)[:MAX_RUNS]
        runs, errors = [], []
        for run_id in run_ids:
            run = SwarmDHT(swarm.dht, run_id)
            try:
                spec = await run.fetch_spec()
                num_stages = spec.num_stages if spec else (index[run_id].num_stages if run_id in index else 0)
                stages = await run.all_stages(num_stages)
                view = run_view(run_id, index.get(run_id), spec, stages, await run.trainers(), await run.checkpoint())
            except Exception as e:  # one run's unusable records do not hide the others
                errors.append({"run_id": run_id, "error": str(e)[:300]})
                continue
            runs.append(view)
        return {"updated_at": time.time(), "runs": runs, "errors": errors}

    async def refresh(self, swarm: SwarmDHT) -> None:
        snapshot = await self.read(swarm)
        if self.cfg.probe:
            await probe_all(_probe_targets(snapshot), self.history, swarm.security.channel)
        for run in snapshot["runs"]:
            for stage in run["stages"]:
                for peer in stage["peers"]:
                    peer["reachability"] = self.history.summary(peer["peer_id"])
        self.snapshot = snapshot
        stages = sum(len(r["stages"]) for r in snapshot["runs"])
        peers = sum(len(s["peers"]) for r in snapshot["runs"] for s in r["stages"])
        names = ",".join(r["run_id"] for r in snapshot["runs"])[:200]
        log.info("monitor: %d runs (%s), %d stages, %d peers", len(snapshot["runs"]), names, stages, peers)
        for error in snapshot["errors"]:
            log.warning("monitor: run %s unreadable: %s", error["run_id"], error["error"])

    async def serve(self) -> None:
        cfg = self.cfg
        initial = resolve_initial_peers(cfg.initial_peers, cfg.swarm)
        self.dht = await asyncio.to_thread(
            start_dht, initial, cfg.host, 0, coordinators=cfg.coordinator_id, client_mode=True
        )
        swarm = SwarmDHT(self.dht, "")
        self.http = SwarmHttpServer(
            self, cfg.host, cfg.http_port, routes=self.routes, static_folder="monitor/page", metrics=None
        )
        port = self.http.start()
        print(f"health page: http://{cfg.host}:{port}/", flush=True)
        log.info("monitor %s serving the health page on port %d", swarm.peer_id[-6:], port)
        if cfg.ready_file:
            with open(cfg.ready_file, "w") as f:
                json.dump({"url": f"http://{cfg.host}:{port}/"}, f)
        stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stopping.set)
        try:
            while not stopping.is_set():
                try:
                    await self.refresh(swarm)
                except Exception as e:  # the DHT hiccups: the page keeps its last snapshot
                    log.warning("monitor: refresh failed: %s", str(e)[:300])
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stopping.wait(), cfg.refresh)
        finally:
            self.http.stop()
            self.dht.shutdown()
        log.info("monitor %s stopped", swarm.peer_id[-6:])


def _probe_targets(snapshot: dict[str, Any]) -> dict[str, str]:
    """peer id -> address of the listed peers, at most MAX_PROBES, at most MAX_PROBES_PER_HOST per host."""
    targets: dict[str, str] = {}
    per_host: Counter[str] = Counter()
    for run in snapshot["runs"]:
        for stage in run["stages"]:
            for peer in stage["peers"]:
                host = peer["address"].rsplit(":", 1)[0]
                if len(targets) >= MAX_PROBES or per_host[host] >= MAX_PROBES_PER_HOST:
                    continue
                if peer["peer_id"] not in targets:
                    per_host[host] += 1
                    targets[peer["peer_id"]] = peer["address"]
    return targets


def run_monitor(cfg: MonitorConfig) -> int:
    asyncio.run(SwarmMonitor(cfg).serve())
    return 0
