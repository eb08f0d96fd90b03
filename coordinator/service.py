"""The coordinator: first DHT node, publisher of the run spec, observer of the swarm.

It is not on the data path: peers re-publish the spec they hold, so the swarm
trains on while the coordinator is down. Its identity file and saved DHT port
give it the same multiaddr after a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import deque
from pathlib import Path
from typing import Any

import grpc

from swarmpipe.coordinator.base_weights import BaseWeights
from swarmpipe.coordinator.checkpoints import CheckpointServicer, CheckpointStore
from swarmpipe.coordinator.http import SwarmHttpServer
from swarmpipe.coordinator.metrics import CoordinatorMetrics
from swarmpipe.peer.config import CoordinatorConfig
from swarmpipe.peer.events import EventLog
from swarmpipe.peer.model.hf_checkpoint import resolve_spec
from swarmpipe.peer.spec import RunSpec, load_spec
from swarmpipe.peer.state.format import StateError
from swarmpipe.peer.state.transfer import download_state
from swarmpipe.peer.swarm.dht import SwarmDHT, start_dht, trust_coordinators, visible_maddrs
from swarmpipe.peer.swarm.records import CheckpointRecord, PeerState, RunIndexRecord, now
from swarmpipe.peer.swarm.relaying import relay_handlers, relay_record, relay_servicer
from swarmpipe.peer.transport.addresses import is_wildcard
from swarmpipe.peer.transport.channels import server_options
from swarmpipe.peer.transport.error_contract import Rejections, Unserved, guard_handlers, served_handlers
from swarmpipe.peer.transport.overload import bounded_server
from swarmpipe.peer.transport.unauthenticated import counted

log = logging.getLogger("swarmpipe.coordinator")
POLL_PERIOD_S = 2.0
HISTORY_POINTS = 2000
MAX_REPORTED_BANS = 10_000  # bans remembered for events: bounded however many trainers report
MAX_CONCURRENT_RPCS = 512  # as a peer's: beyond this the checkpoint server answers RESOURCE_EXHAUSTED


def _saved_port(identity: str) -> int:
    path = Path(identity + ".port")
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


class Coordinator:
    def __init__(self, cfg: CoordinatorConfig):
        self.cfg = cfg
        overrides: dict[str, Any] = {"run_id": cfg.run_id or None, "num_stages": cfg.num_stages or None}
        # A run on a Hugging Face checkpoint: the model fields come from its config.json, so peers without
        # the files build the same shapes (peer/model/hf_checkpoint.py).
        self.spec: RunSpec = resolve_spec(load_spec(cfg.spec or None, **overrides))
        self.base = BaseWeights(self.spec) if self.spec.model.checkpoint else None
        self.events = EventLog(cfg.event_log, "coordinator")
        self.stop_requested = asyncio.Event()
        self.dht = None
        self.swarm: SwarmDHT | None = None
        self.snapshot: dict[str, Any] = {
            "run_id": self.spec.run_id,
            "spec": self.spec.to_dict(),
            "stages": [],
            "trainers": [],
        }
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_POINTS)
        self.recent_events: deque[dict[str, Any]] = deque(maxlen=200)
        self._known_peers: dict[str, tuple[int, str]] = {}
        self._reported_bans: set[tuple[str, str]] = set()  # (trainer, peer) pairs already turned into events
        self.http: SwarmHttpServer | None = None
        self.metrics = CoordinatorMetrics(self)  # /metrics: the swarm as polled, and our server's refusals
        # every refused call of the checkpoint server: counted, one log line per caller per 10 s, no traceback
        self.rejections = Rejections(log, self.metrics.errors, lambda: f"coordinator {self.events.peer_id[-6:]}")
        self.initial_peers: list[str] = []
        self.store = (
            CheckpointStore(cfg.checkpoint_dir, self.spec.num_stages, spec=self.spec) if cfg.checkpoint_dir else None
        )
        self.grpc_server: grpc.aio.Server | None = None
        self.grpc_address = ""
        self.relay = None
        self.last_checkpoint: dict[str, Any] | None = self.store.manifest() if self.store else None

    async def run(self) -> int:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_requested.set)
        port = cfg.dht_port or (_saved_port(cfg.identity) if cfg.identity else 0)
        if cfg.identity:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.identity)), exist_ok=True)
        self.dht = await asyncio.to_thread(
            start_dht,
            cfg.initial_peers,
            cfg.host,
            port,
            cfg.identity or None,
            cfg.announce_host or None,
            coordinators=cfg.coordinator_id,
        )
        trust_coordinators(self.dht, [self.dht.peer_id.to_base58()])  # the run's spec is ours to sign
        try:
            return await self._serve()
        finally:
            if self.http is not None:
                self.http.stop()
            if self.grpc_server is not None:
                await self.grpc_server.stop(grace=1.0)
            self.dht.shutdown()

    async def _serve(self) -> int:
        cfg = self.cfg
        self.events.peer_id = self.dht.peer_id.to_base58()
        self.initial_peers = visible_maddrs(self.dht)
        if cfg.identity:
            bound = int(self.initial_peers[0].split("/tcp/")[1].split("/")[0])
            Path(cfg.identity + ".port").write_text(str(bound))
        self.swarm = SwarmDHT(self.dht, self.spec.run_id)
        self.swarm.protect()
        await self._start_grpc_server()
        await self._publish()
        self.http = SwarmHttpServer(self, cfg.host, cfg.http_port, metrics=self.metrics)
        http_port = self.http.start()
        print(f"initial peers: {' '.join(self.initial_peers)}", flush=True)
        print(f"dashboard: http://{cfg.announce_host or cfg.host}:{http_port}/", flush=True)
        if cfg.peers_file:
            tmp = cfg.peers_file + ".tmp"
            Path(tmp).write_text("\n".join(self.initial_peers) + "\n")
            os.replace(tmp, cfg.peers_file)
        self.events.emit(
            "started",
            run_id=self.spec.run_id,
            stages=self.spec.num_stages,
            http_port=http_port,
            initial_peers=self.initial_peers[0],
        )
        tasks = [asyncio.create_task(self._publish_loop()), asyncio.create_task(self._poll_loop())]
        if self.store is not None and cfg.checkpoint_every > 0:
            tasks.append(asyncio.create_task(self._checkpoint_loop()))
        await self.stop_requested.wait()
        for task in tasks:
            task.cancel()
        self.events.emit("stopped")
        return 0

    # ------------------------------------------------------------ publishing
    async def _publish(self) -> None:
        ttl = 6 * self.cfg.publish_period
        await self.swarm.publish_spec(self.spec)  # signed, and long-lived: the swarm outlives our downtime
        index = RunIndexRecord(
            run_id=self.spec.run_id,
            num_stages=self.spec.num_stages,
            coordinator=self.initial_peers[0] if self.initial_peers else "",
            updated_at=now(),
        )
        await self.swarm.list_in_index(index, ttl=max(ttl, 3600))

        if self.grpc_address and not is_wildcard(self.grpc_address.rsplit(":", 1)[0]):  # peers ask us to dial them
            record = relay_record(self.relay, self.grpc_address, role="coordinator")
            await self.swarm.announce_relay(record, ttl=max(ttl, 60))
        if self.grpc_address and (self.last_checkpoint is not None or self.base is not None or self.store is not None):
            # No checkpoint yet: every stage's version -1 (joiners take nothing from it), but the address is where a
            # leaving replica hands its state when no sibling can take it, from the first minute (it used to be
            # unpublished until the first checkpoint, and the only replica of a stage leaving before it lost its
            # state), and where the base weights are served when there are any.
            await self._publish_checkpoint(self.last_checkpoint or {"step": 0, "stages": {}})

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.publish_period)
            try:
                await self._publish()
            except Exception as e:
                log.warning("coordinator publish failed: %s", e)

    # ------------------------------------------------------------ checkpoints
    async def _start_grpc_server(self) -> None:
        """Reachability checks for joining peers, always; checkpoints, when we keep them or serve a base. Every
        other method (a peer's Forward, Chain, ...) is answered UNIMPLEMENTED, counted, without a traceback."""
        # a private swarm: credentials on every call, TLS with the certificate our checkpoint record names
        security = self.swarm.security
        self.grpc_server = bounded_server(
            server_options(self.spec.limits.max_message_mb),
            security.server_interceptors(counted(self.rejections)),
            MAX_CONCURRENT_RPCS,
            self.rejections,
        )
        if self.store is not None or self.base is not None:
            servicer = CheckpointServicer(
                self.store,
                self.spec,
                on_saved=self._checkpoint_saved,
                base=self.base,
                identity=self.swarm.identity,
                stage_members=self.swarm.stage_peers,
            )
            # only the methods it implements; garbage bytes to them: INVALID_ARGUMENT
            handlers = guard_handlers(served_handlers(servicer), self.rejections.malformed)
            self.grpc_server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler("swarmpipe.Stage", handlers),)
            )
        self.relay = relay_servicer(self.cfg, self.swarm.peer_id, role="coordinator")
        for name, relay in relay_handlers(self.relay).items():
            self.grpc_server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, relay),))
        self.grpc_server.add_generic_rpc_handlers((Unserved(self.rejections),))  # last: whatever nothing serves
        port = security.add_port(self.grpc_server, f"{self.cfg.host}:{self.cfg.grpc_port}")
        await self.grpc_server.start()
        self.grpc_address = f"{self.cfg.announce_host or self.cfg.host}:{port}"

    async def _publish_checkpoint(self, manifest: dict[str, Any]) -> None:
        stages = manifest.get("stages", {})
        record = CheckpointRecord(
            step=int(manifest["step"]),
            created_at=float(manifest.get("created_at", now())),
            url=self.grpc_address,
            tls_cert=self.swarm.security.cert_pem,  # clients pin it for url
            versions=[int(stages.get(str(s), {}).get("version", -1)) for s in range(self.spec.num_stages)],
            digests=[str(stages.get(str(s), {}).get("digest", "")) for s in range(self.spec.num_stages)],
        )
        await self.swarm.publish_checkpoint(record, ttl=3600)

    async def _checkpoint_saved(self, manifest: dict[str, Any], reason: str) -> None:
        self.last_checkpoint = manifest
        versions = {s: v["version"] for s, v in manifest["stages"].items()}
        self._event("checkpoint", step=manifest["step"], versions=versions, reason=reason)
        await self._publish_checkpoint(manifest)

    async def checkpoint_now(self) -> dict[str, Any] | None:
        """Pull every stage from its most advanced online replica and write one checkpoint."""
        states = {}
        for stage, peers in enumerate(await self.swarm.all_stages(self.spec.num_stages)):
            online = sorted(
                ((pid, r) for pid, r in peers.items() if r.state is PeerState.ONLINE), key=lambda item: -item[1].version
            )
            saved = ((self.last_checkpoint or {}).get("stages") or {}).get(str(stage), {}).get("version", -1)
            if online and online[0][1].version <= saved:
                continue  # nothing new to save for this stage
            for peer_id, record in online[:2]:
                try:
                    states[stage] = await download_state(
                        [record.address],
                        self.spec.run_id,
                        stage,
                        self.spec.limits.max_message_mb,
                        signers={record.address: frozenset({peer_id})},  # from the peer that announced it
                    )
                    break
                except StateError as e:
                    log.warning("coordinator could not pull stage %d from %s: %s", stage, record.address, e)
        if not states:
            return None
        manifest = await asyncio.to_thread(self.store.save, states)
        await self._checkpoint_saved(manifest, reason="periodic")
        return manifest

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.checkpoint_every)
            try:
                await self.checkpoint_now()
            except Exception as e:
                log.warning("coordinator checkpoint failed: %s", e)

    # ------------------------------------------------------------ observing
    async def _poll_loop(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception as e:
                log.warning("coordinator poll failed: %s", e)
            await asyncio.sleep(POLL_PERIOD_S)

    async def poll(self) -> None:
        stages = await self.swarm.all_stages(self.spec.num_stages)
        trainers = await self.swarm.trainers()
        seen: dict[str, tuple[int, str]] = {}
        stage_rows = []
        for index, peers in enumerate(stages):
            rows = []
            for peer_id, r in sorted(peers.items()):
                rows.append(
                    {
                        "peer_id": peer_id,
                        "address": r.address,
                        "state": r.state.value,
                        "throughput": r.throughput,
                        "queue": r.queue,
                        "version": r.version,
                        "updated_at": r.updated_at,
                        "metrics_address": r.metrics_address,
                        # "" and 0 from a peer that predates device reporting: shown as "-"
                        "device": r.device,
                        "device_memory_total": r.device_memory_total,
                        "device_memory_used": r.device_memory_used,
                        "relay": r.relay,  # '' when dialled directly; else the relay carrying its calls
                    }
                )
                seen[peer_id] = (index, r.state.value)
            live = [p for p in rows if p["state"] != PeerState.DRAINING.value]
            stage_rows.append(
                {
                    "index": index,
                    "peers": rows,
                    "throughput": sum(p["throughput"] for p in live),
                    "max_version": max((p["version"] for p in rows), default=0),
                }
            )
        self._diff_membership(seen)
        trainer_rows = [
            {
                "peer_id": pid,
                "step": t.step,
                "loss": t.loss,
                "val_loss": t.val_loss,
                "samples_per_s": t.samples_per_s,
                "microbatches_completed": t.microbatches_completed,
                "microbatches_retried": t.microbatches_retried,
                "microbatches_lost": t.microbatches_lost,
                "trainer_bytes_per_microbatch": t.bytes_per_microbatch,
                "updated_at": t.updated_at,
                "banned": list(t.banned),
            }
            for pid, t in sorted(trainers.items())
        ]
        self._report_bans(trainers)
        for stage in stage_rows:  # how many trainers caught each replica lying (a claim by each trainer, no more)
            for row in stage["peers"]:
                row["reported_by"] = sum(row["peer_id"] in t.banned for t in trainers.values())
        self.snapshot = {
            "run_id": self.spec.run_id,
            "spec": self.spec.to_dict(),
            "stages": stage_rows,
            "trainers": trainer_rows,
            "checkpoint": self.last_checkpoint,
            "coordinator": {
                "peer_id": self.events.peer_id,
                "initial_peers": self.initial_peers,
                "checkpoint_server": self.grpc_address,
            },
            "updated_at": time.time(),
        }
        losses = [t["loss"] for t in trainer_rows if t["loss"] is not None]
        val_losses = [t["val_loss"] for t in trainer_rows if t["val_loss"] is not None]
        self.history.append(
            {
                "time": time.time(),
                "loss": sum(losses) / len(losses) if losses else None,
                "val_loss": sum(val_losses) / len(val_losses) if val_losses else None,
                "samples_per_s": sum(t["samples_per_s"] for t in trainer_rows),
                "step": max((t["step"] for t in trainer_rows), default=0),
            }
        )

    def _report_bans(self, trainers: dict) -> None:
        """One event per replica a trainer banned for failing verification (its signed record names them)."""
        for trainer_id, record in trainers.items():
            for peer_id in record.banned:
                if (trainer_id, peer_id) not in self._reported_bans and len(self._reported_bans) < MAX_REPORTED_BANS:
                    self._reported_bans.add((trainer_id, peer_id))
                    self._event("replica_reported", peer=peer_id, trainer=trainer_id)

    def _diff_membership(self, seen: dict[str, tuple[int, str]]) -> None:
        for peer_id, (stage, state) in seen.items():
            before = self._known_peers.get(peer_id)
            if before is None:
                self._event("peer_joined", peer=peer_id, stage=stage, state=state)
            elif before != (stage, state):
                self._event("peer_changed", peer=peer_id, stage=stage, state=state)
        for peer_id, (stage, _) in self._known_peers.items():
            if peer_id not in seen:
                self._event("peer_gone", peer=peer_id, stage=stage)
        self._known_peers = seen

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.emit(kind, **fields)
        self.recent_events.append({"time": time.time(), "kind": kind, **fields})
