"""The volunteer peer: join the DHT, pick a stage, serve it, announce it, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal

import torch

from swarmpipe.peer.config import PeerConfig, default_threads
from swarmpipe.peer.events import EventLog
from swarmpipe.peer.plan.memory import (
    MemoryEstimate,
    check_fits,
    estimate_for_peer,
    stages_that_fit_peer,
    stash_bound_bytes,
)
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.stage.averaging import ReplicaAverager
from swarmpipe.peer.stage.base_weights import load_base_weights
from swarmpipe.peer.stage.device import device_info, memory_in_use, resolve_device
from swarmpipe.peer.stage.handoff import hand_off_state, load_initial_state
from swarmpipe.peer.stage.lifecycle import Lifecycle
from swarmpipe.peer.stage.metrics import PeerMetrics
from swarmpipe.peer.stage.precision import resolve_precision
from swarmpipe.peer.stage.rebalancer import Rebalancer
from swarmpipe.peer.stage.runtime import StageRuntime
from swarmpipe.peer.stage.server import StageServicer, start_server
from swarmpipe.peer.stage.serving_address import NotReachable, ServingAddress
from swarmpipe.peer.state.format import StageState
from swarmpipe.peer.swarm.balance import choose_stage
from swarmpipe.peer.swarm.bootstrap import neediest_run, resolve_initial_peers
from swarmpipe.peer.swarm.dht import SwarmDHT, reconnect_bootstrap, restart_as_client, start_dht
from swarmpipe.peer.swarm.records import WIRE_PROTOCOL, PeerState, StageRecord, now
from swarmpipe.peer.swarm.relaying import check_settings, relay_handlers, relay_record, relay_servicer
from swarmpipe.peer.transport.addresses import hosts_of_multiaddrs

log = logging.getLogger("swarmpipe.peer")
MIN_RECORD_TTL_S = 10.0


class PeerDaemon:
    """The volunteer's process; implements :class:`~swarmpipe.peer.stage.lifecycle.StageHost` for the
    rebalancer and owns the peer's :class:`Lifecycle`."""

    def __init__(self, cfg: PeerConfig):
        self.cfg = cfg
        self.stop_requested = asyncio.Event()
        self.events = EventLog(cfg.event_log, "peer")  # without our id until the DHT gives it (_serve)
        self.lifecycle = Lifecycle()
        self.dht = None
        self.swarm: SwarmDHT | None = None
        self.servicer: StageServicer | None = None
        self.server = None
        self.address = ""
        self.metrics_address = ""
        self.initial_peers: list[str] = []
        self.averager: ReplicaAverager | None = None
        self.averaging_task: asyncio.Task | None = None
        self.serving: ServingAddress | None = None
        self.relay = None

    # ------------------------------------------------------------ lifecycle
    async def run(self) -> int:
        cfg = self.cfg
        torch.set_num_threads(cfg.threads or default_threads())
        self.device = resolve_device(cfg.device)  # before anything starts: a wrong --device ends here
        check_settings(cfg.relay, cfg.dht_client_mode, cfg.relay_capacity)
        self.device_info = device_info(self.device)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_requested.set)
        initial = self.initial_peers = resolve_initial_peers(cfg.initial_peers, cfg.swarm)
        # Start even if no initial peer answers (a restarting coordinator): wait_for_spec keeps pinging them.
        self.dht = await asyncio.to_thread(
            start_dht,
            initial,
            cfg.host,
            cfg.dht_port,
            None,
            cfg.announce_host or None,
            require_bootstrap=not cfg.run_id,
            coordinators=cfg.coordinator_id,
            client_mode=cfg.dht_client_mode == "on",
        )
        try:
            return await self._serve_or_leave()
        finally:
            if self.server is not None:
                await self.server.stop(grace=1.0)
            if self.servicer is not None:
                self.servicer.runtime.close()
            if self.serving is not None:
                await self.serving.close()
            self.dht.shutdown()

    async def _serve_or_leave(self) -> int:
        """Serve; a signal while still joining (spec wait, state download) ends the join at once: nothing to drain."""
        serve = asyncio.ensure_future(self._serve())
        stop = asyncio.ensure_future(self.stop_requested.wait())
        try:
            await asyncio.wait({serve, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not serve.done() and self.lifecycle.state is PeerState.JOINING:  # never online yet
                serve.cancel()
                await asyncio.gather(serve, return_exceptions=True)
                self.events.emit("stopped", joining=True)
                return 0
            return await serve
        finally:
            stop.cancel()
            serve.cancel()

    async def _serve(self) -> int:
        cfg = self.cfg
        peer_id = self.dht.peer_id.to_base58()
        self.events = EventLog(cfg.event_log, "peer", peer_id)  # our id is known from here on
        run_id = cfg.run_id or await self._pick_run()
        self.swarm = SwarmDHT(self.dht, run_id)
        spec = await self.swarm.wait_for_spec(cfg.spec_timeout, initial_peers=self.initial_peers)
        if cfg.stage >= spec.num_stages:
            raise ValueError(f"--stage {cfg.stage} does not exist: run {run_id!r} has {spec.num_stages} stages")
        budget = self.memory_budget()
        if cfg.stage >= 0:
            stage = cfg.stage
            check_fits(self.memory_estimate(spec, stage), budget, self.device_label)  # refuse before serving
        else:  # the neediest stage among those that fit here
            fitting = stages_that_fit_peer(spec, budget, self.autocast(spec))
            if not fitting:
                smallest = min(range(spec.num_stages), key=lambda s: self.memory_estimate(spec, s).total_bytes)
                check_fits(self.memory_estimate(spec, smallest), budget, self.device_label)
            stage = choose_stage(await self.swarm.all_stages(spec.num_stages), allowed=fitting)
        self.events.emit(
            "joining", run_id=run_id, stage=stage, device=self.device_info.describe(), threads=torch.get_num_threads()
        )
        runtime = StageRuntime(
            spec, stage, base_dir=cfg.checkpoint, device=self.device, stash_bound_bytes=self.stash_bound(spec)
        )
        metrics = PeerMetrics()
        # Shards we serve are signed by us; pushed state is taken only from our stage's announced replicas,
        # and a chained call dials only announced hops. Read through self.swarm when called: a peer that turns
        # into a DHT client (_through_a_relay) reads through its new node from then on.
        self.servicer = StageServicer(
            runtime,
            peer_id,
            metrics,
            self.lifecycle,
            identity=self.swarm.identity,
            stage_peers=lambda stage: self.swarm.stage_peers(stage),
            on_state_pushed=self._state_pushed,
        )
        self.relay = relay_servicer(cfg, peer_id)  # checks reachability for others; relays with --relay-capacity
        self.server, port = await start_server(self.servicer, cfg.host, cfg.port, services=relay_handlers(self.relay))
        self.serving = ServingAddress(
            cfg, self.swarm, peer_id, self.events, port, spec.num_stages, hosts_of_multiaddrs(self.initial_peers)
        )
        try:
            self.address = await self.serving.establish() or await self._through_a_relay(port)
        except NotReachable as e:
            self.events.emit("unreachable", level=logging.ERROR, advice=str(e))
            raise
        if not self.serving.relayed:  # relayed peers get our host for the ports we open for them
            self.relay.announce_at(self.address.rsplit(":", 1)[0].strip("[]"))
        if cfg.metrics_port >= 0:
            self.metrics_address = f"{self.address.rsplit(':', 1)[0]}:{metrics.serve(cfg.metrics_port, cfg.host)}"
        await self._announce()  # visible as "joining" while state arrives
        if cfg.state_download:
            await load_initial_state(self.swarm, runtime, self.events)
        elif runtime.weights.awaiting_base:
            await load_base_weights(self.swarm, runtime, self.events, cfg.checkpoint)
        self.lifecycle.change(PeerState.ONLINE)
        await self._announce()
        self.events.emit("online", stage=stage, address=self.address, metrics=self.metrics_address or "-")
        self._write_ready(run_id, stage, peer_id)
        background = [asyncio.create_task(self._announce_loop())]
        if self.serving.relayed:  # a lost relay is replaced and re-announced at once
            background.append(asyncio.create_task(self.serving.keep_relayed(self._moved, self.stop_requested)))
        self._start_averaging()
        if cfg.rebalance_period > 0:
            background.append(asyncio.create_task(Rebalancer(self, cfg.rebalance_period).run()))
        await self.stop_requested.wait()
        for task in background[1:] + ([self.averaging_task] if self.averaging_task else []):
            task.cancel()  # no move or averaging round may start while we leave
        await self._drain()
        background[0].cancel()
        runtime = self.servicer.runtime
        self.events.emit("stopped", stage=runtime.stage, version=runtime.version, steps=runtime.stats.steps)
        return 0

    def _state_pushed(self, state: StageState) -> None:
        """A draining sibling's state was blended into ours: the event log hears of it."""
        self.events.emit(
            "state_received",
            from_version=state.version,
            digest=state.digest(),
            version=self.servicer.runtime.version,
            clipped=state.meta.get("blend_scale", 1.0) < 1.0,  # its pull bounded like an averaging round's
            scale=float(f"{state.meta.get('blend_scale', 1.0):.4g}"),
            radius=float(f"{state.meta.get('blend_radius', 0.0):.4g}"),
        )

    async def _moved(self) -> None:
        """Another relay carries us now: its address, announced at once (and in the ready file)."""
        self.address = self.serving.address
        await self._announce()
        self._write_ready(self.swarm.run_id, self.servicer.runtime.stage, self.events.peer_id)

    async def _through_a_relay(self, port: int) -> str:
        """Nobody can dial us. Our DHT node becomes a client (``--dht-client-mode auto``); hivemind forks it,
        and a fork must not meet live gRPC objects, so our server stops for it and starts again on its port.
        Then a relay's tunnel: the address we announce."""
        self.relay.stop_relaying()  # a relayed peer relays nobody
        if self.cfg.dht_client_mode == "auto":
            await self.server.stop(None)
            self.server = None
            gc.collect()  # no grpc.aio object may be freed in the forked child
            self.dht = await asyncio.to_thread(restart_as_client, self.dht, self.initial_peers, self.cfg.host)
            self.swarm = SwarmDHT(self.dht, self.swarm.run_id)
            self.swarm.protect()
            self.serving.use_swarm(self.swarm)
            services = relay_handlers(self.relay)
            self.server, _ = await start_server(self.servicer, self.cfg.host, port, services=services)
        return await self.serving.relay()

    def _start_averaging(self) -> None:
        """Average with the current stage's replicas (again after a move: a fresh averager for the new runtime)."""
        if self.averaging_task is not None:
            self.averaging_task.cancel()
        runtime = self.servicer.runtime
        # our own movement, which bounds averaging rounds and pushed states, counts from here
        runtime.submit(runtime.weights.set_anchor)
        if runtime.spec.averaging_interval_s > 0:
            self.averager = ReplicaAverager(runtime, self.events)
            self.averaging_task = asyncio.create_task(self.averager.run(self.swarm))

    @property
    def runtime(self) -> StageRuntime:
        return self.servicer.runtime

    def switch_runtime(self, runtime: StageRuntime) -> None:
        """After a move: serve ``runtime`` (the old one is drained) and take new work again."""
        old = self.servicer.runtime
        self.servicer.swap_runtime(runtime)
        old.close()
        self._start_averaging()
        self.lifecycle.change(PeerState.ONLINE)

    async def _pick_run(self) -> str:
        probe = SwarmDHT(self.dht, "")
        runs = await probe.runs()
        stages_of = {}
        for run_id, record in runs.items():
            stages_of[run_id] = await SwarmDHT(self.dht, run_id).all_stages(record.num_stages)
        chosen = neediest_run(runs, stages_of)
        self.events.emit("run_chosen", run_id=chosen, candidates=len(runs))
        return chosen

    async def finish_in_flight(self) -> float:
        """Refuse new work and wait (bounded by --drain-timeout) for what we hold; returns the deadline."""
        servicer = self.servicer
        self.lifecycle.change(PeerState.DRAINING)
        self.events.emit(
            "draining",
            stage=servicer.runtime.stage,
            pending=len(servicer.runtime.pending),
            timeout=self.cfg.drain_timeout,
        )
        await self._announce()
        deadline = asyncio.get_running_loop().time() + self.cfg.drain_timeout
        while (servicer.runtime.pending or servicer.core.in_flight) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        self.events.emit("drained", unfinished=len(servicer.runtime.pending), version=servicer.runtime.version)
        return deadline

    async def _drain(self) -> None:
        """Refuse new work, finish what we hold, hand our state on, say goodbye."""
        servicer = self.servicer
        deadline = await self.finish_in_flight()
        if servicer.runtime.version > 0:
            remaining = max(1.0, deadline + 10.0 - asyncio.get_running_loop().time())
            try:
                await asyncio.wait_for(hand_off_state(self.swarm, servicer.runtime, self.events), remaining)
            except asyncio.TimeoutError:
                self.events.emit("handoff_failed", level=logging.WARNING, error="timed out")

    # ------------------------------------------------------------ announcing
    def record(self, state: PeerState | None = None, throughput: float | None = None) -> StageRecord:
        s = self.servicer
        return StageRecord(
            address=self.address,
            relay=self.serving.relay_peer,
            state=state or self.lifecycle.state,
            queue=s.core.queue,
            version=s.runtime.version,
            throughput=s.runtime.throughput() if throughput is None else throughput,
            updated_at=now(),
            metrics_address=self.metrics_address,
            protocol=WIRE_PROTOCOL,
            device=self.device_label,
            device_memory_total=self.device_info.total_bytes,
            device_memory_used=memory_in_use(self.device),
        )

    @property
    def device_label(self) -> str:
        return f"{self.device_info.name} ({self.device_info.label})"[:80]

    # ------------------------------------------------------------ memory
    def memory_budget(self) -> int:
        """Bytes this peer may use on its device: --max-memory-mb, else what the device has free."""
        free = self.device_info.free_bytes
        return min(free, self.cfg.max_memory_mb << 20) if self.cfg.max_memory_mb else free

    def autocast(self, spec: RunSpec) -> bool:
        """Whether this device computes ``spec`` under autocast (its activations are 2 bytes then)."""
        return resolve_precision(spec.precision, self.device).autocast

    def memory_estimate(self, spec: RunSpec, stage: int) -> MemoryEstimate:
        return estimate_for_peer(spec, stage, self.autocast(spec))

    def stash_bound(self, spec: RunSpec) -> int:
        """Bytes the stashed snapshots may take (peer/plan/memory.py): bounded by the memory budget on an
        accelerator or with --max-memory-mb."""
        bounded = bool(self.cfg.max_memory_mb) or self.device.type != "cpu"
        return stash_bound_bytes(spec, self.memory_budget(), bounded)

    @property
    def record_ttl(self) -> float:
        # Three missed announcements, but never so short that a busy event loop lets a live record lapse.
        return max(3 * self.cfg.announce_period, MIN_RECORD_TTL_S)

    async def _announce(self) -> None:
        await self.swarm.announce_stage(self.servicer.runtime.stage, self.record(), ttl=self.record_ttl)
        if not self.serving.relayed:  # we answer reachability checks (and relay, with --relay-capacity)
            await self.swarm.announce_relay(relay_record(self.relay, self.address), ttl=self.record_ttl)

    async def announce_as(self, stage: int, record: StageRecord) -> None:
        """Announce under a stage we are moving to or leaving (rebalancing)."""
        await self.swarm.announce_stage(stage, record, ttl=self.record_ttl)

    async def _announce_loop(self) -> None:
        rounds = 0
        while True:
            await asyncio.sleep(self.cfg.announce_period)
            rounds += 1
            try:
                await self._announce()
                if rounds % 3 == 0:  # find a restarted coordinator again
                    await reconnect_bootstrap(self.dht, self.initial_peers)
            except Exception as e:  # the DHT hiccups; the next period tries again
                log.warning("peer %s announce failed: %s", self.events.peer_id[-6:], e)

    def _write_ready(self, run_id: str, stage: int, peer_id: str) -> None:
        if not self.cfg.ready_file:
            return
        info = {
            "peer_id": peer_id,
            "address": self.address,
            "stage": stage,
            "run_id": run_id,
            "metrics_address": self.metrics_address,
            "pid": os.getpid(),
        }
        tmp = self.cfg.ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, self.cfg.ready_file)
