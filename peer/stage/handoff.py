"""Where a stage's state comes from when a peer starts serving it, and where it goes when it leaves."""

from __future__ import annotations

import asyncio
import logging
import os

from swarmpipe.peer.events import EventLog
from swarmpipe.peer.stage.base_weights import load_base_weights
from swarmpipe.peer.stage.runtime import StageRuntime
from swarmpipe.peer.state.format import StateError
from swarmpipe.peer.state.transfer import announced_signers, download_state, push_state
from swarmpipe.peer.swarm.dht import SwarmDHT
from swarmpipe.peer.swarm.records import PeerState

MAX_DONORS = 4


async def load_initial_state(swarm: SwarmDHT, runtime: StageRuntime, events: EventLog) -> str:
    """Newest state from live replicas (split across them), else the coordinator's checkpoint, else the
    run's start: the base checkpoint's weights, or the seed. Returns the source used.

    With LoRA the frozen base weights come first (the state is only the adapters); full fine-tuning
    takes a replica's whole state and needs no base download."""
    spec = runtime.spec
    loop = asyncio.get_running_loop()
    if runtime.weights.awaiting_base and spec.finetune.method == "lora":
        await load_base_weights(swarm, runtime, events, runtime.base_dir)
    peers = await swarm.stage_peers(runtime.stage)
    donors = [r.address for pid, r in peers.items() if pid != events.peer_id and r.state is PeerState.ONLINE]
    sources: list[tuple[str, list[str]]] = [("replicas", donors[:MAX_DONORS])] if donors else []
    signers = announced_signers(peers, swarm.coordinators)
    checkpoint = await swarm.checkpoint()
    if (
        checkpoint is not None
        and checkpoint.url
        and runtime.stage < len(checkpoint.versions)
        and checkpoint.versions[runtime.stage] >= 0
    ):
        sources.append(("checkpoint", [checkpoint.url]))
    for source, addresses in sources:
        started = loop.time()
        bar = DownloadProgress(source)
        try:
            state = await download_state(
                addresses,
                spec.run_id,
                runtime.stage,
                spec.limits.max_message_mb,
                on_progress=bar.update,
                signers=signers,
            )
            await runtime.run(runtime.weights.import_state, state)
        except (StateError, ValueError) as e:
            events.emit("state_download_failed", level=logging.WARNING, source=source, error=str(e)[:300])
            continue
        finally:
            bar.close()
        events.emit(
            "state_loaded",
            stage=runtime.stage,
            source=source,
            donors=len(addresses),
            version=runtime.version,
            digest=state.digest(),
            seconds=round(loop.time() - started, 2),
        )
        return source
    if runtime.weights.awaiting_base:
        return "base:" + await load_base_weights(swarm, runtime, events, runtime.base_dir)
    events.emit("state_from_seed", stage=runtime.stage, seed=spec.seed)
    return "seed"


async def hand_off_state(swarm: SwarmDHT, runtime: StageRuntime, events: EventLog) -> str | None:
    """Give our newest state to a live replica (it averages it in), else to the coordinator (it checkpoints it)."""
    state = await runtime.run(runtime.weights.export_state)
    peers = await swarm.stage_peers(runtime.stage)
    targets = [
        ("replica", r.address) for pid, r in peers.items() if pid != events.peer_id and r.state is PeerState.ONLINE
    ]
    checkpoint = await swarm.checkpoint()
    if checkpoint is not None and checkpoint.url:
        targets.append(("coordinator", checkpoint.url))
    for kind, address in targets:
        try:
            reply = await push_state(
                address, state, runtime.spec.limits.max_message_mb, timeout=30, signer=swarm.identity
            )
        except Exception as e:  # unreachable target: try the next one
            events.emit("handoff_failed", level=logging.WARNING, target=kind, address=address, error=str(e)[:200])
            continue
        events.emit(
            "handoff",
            stage=runtime.stage,
            target=kind,
            address=address,
            version=state.version,
            digest=state.digest(),
            detail=reply.detail,
        )
        return kind
    events.emit("handoff_skipped", level=logging.WARNING, reason="no live replica or coordinator")
    return None


class DownloadProgress:
    """A progress bar for a state download when stderr is a terminal (logs get the summary event)."""

    def __init__(self, source: str):
        self.source = source
        self.bar = None
        self.interactive = os.isatty(2)

    def update(self, received: int, total: int) -> None:
        if not self.interactive:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"state from {self.source}", unit="chunk", leave=False)
        self.bar.total = total
        self.bar.n = received
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
