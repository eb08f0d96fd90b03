"""Where a stage's base weights come from when the run starts from a Hugging Face checkpoint.

In order: the checkpoint folder on this machine (``--checkpoint DIR``, or the spec's path if it exists
here) when its digest is the run's; else over ``DownloadState(base=true)`` from a live replica (LoRA
runs: their base weights never change) or the coordinator, which reads just this stage's tensors
from its copy. A volunteer therefore needs no files and no hub access, and no peer ever reads more
than its own stage's tensors.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from swarmpipe.peer.events import EventLog
from swarmpipe.peer.model import checkpoint_name
from swarmpipe.peer.model.hf_checkpoint import CheckpointError, HFCheckpoint
from swarmpipe.peer.stage.runtime import StageRuntime
from swarmpipe.peer.state.format import StageState, StateError
from swarmpipe.peer.state.transfer import announced_signers, download_state
from swarmpipe.peer.swarm.dht import SwarmDHT
from swarmpipe.peer.swarm.records import PeerState

MAX_DONORS = 4
RETRY_S = 2.0


def read_local_base(folder: str, runtime: StageRuntime) -> HFCheckpoint:
    """Load the stage's base tensors from a local checkpoint folder whose digest is the run's."""
    spec = runtime.spec
    ckpt = HFCheckpoint.open(folder)
    if ckpt.digest() != spec.model.base_digest:
        raise CheckpointError(
            f"checkpoint {folder} is not this run's base (digest {ckpt.digest()[:16]}, run {spec.model.base_digest[:16]})"
        )
    names = runtime.weights.base_names()
    tensors = ckpt.read(sorted({checkpoint_name(spec, n) for n in names}))
    runtime.weights.load_base({n: tensors[checkpoint_name(spec, n)] for n in names})
    return ckpt


def base_from_state(state: StageState, runtime: StageRuntime) -> dict:
    """The parameter tensors of a downloaded base, checked to be this run's base."""
    digest = state.meta.get("base_digest", "")
    if digest != runtime.spec.model.base_digest:
        raise StateError(f"the donor's base is {str(digest)[:16]}, this run's is {runtime.spec.model.base_digest[:16]}")
    return {name[len("param.") :]: t for name, t in state.tensors.items() if name.startswith("param.")}


async def load_base_weights(
    swarm: SwarmDHT, runtime: StageRuntime, events: EventLog, local_dir: str = "", timeout: float = 120.0
) -> str:
    """Give ``runtime`` its base weights; returns the source ("local", "replicas", "coordinator").
    Keeps asking the swarm until ``timeout`` (a coordinator may be restarting), then raises StateError
    with what to do."""
    spec = runtime.spec
    loop = asyncio.get_running_loop()
    started = loop.time()
    for folder in dict.fromkeys(f for f in (local_dir, spec.model.checkpoint) if f):
        if not Path(folder).is_dir():
            continue
        try:
            ckpt = await runtime.run(read_local_base, folder, runtime)
        except (CheckpointError, StateError) as e:
            events.emit("base_local_skipped", level=logging.WARNING, folder=folder, error=str(e)[:300])
            continue
        events.emit(
            "base_loaded",
            stage=runtime.stage,
            source="local",
            tensors=ckpt.tensors_read,
            seconds=round(loop.time() - started, 2),
        )
        return "local"
    errors: list[str] = []
    while True:
        sources: list[tuple[str, list[str]]] = []
        peers = {}
        if spec.finetune.method == "lora":  # frozen bases: any online replica has exactly the checkpoint's
            peers = await swarm.stage_peers(runtime.stage)
            donors = [r.address for pid, r in peers.items() if pid != events.peer_id and r.state is PeerState.ONLINE]
            if donors:
                sources.append(("replicas", donors[:MAX_DONORS]))
        record = await swarm.checkpoint()
        if record is not None and record.url:
            sources.append(("coordinator", [record.url]))
        for source, addresses in sources:
            try:
                signers = announced_signers(peers, swarm.coordinators)
                state = await download_state(
                    addresses, spec.run_id, runtime.stage, spec.limits.max_message_mb, base=True, signers=signers
                )
                await runtime.run(runtime.weights.load_base, base_from_state(state, runtime))
            except (StateError, ValueError) as e:
                errors.append(f"{source}: {e}"[:300])
                events.emit("base_download_failed", level=logging.WARNING, source=source, error=str(e)[:300])
                continue
            events.emit(
                "base_loaded",
                stage=runtime.stage,
                source=source,
                donors=len(addresses),
                tensors=len(state.tensors),
                seconds=round(loop.time() - started, 2),
            )
            return source
        if loop.time() - started > timeout:
            raise StateError(
                f"no source for the base weights of stage {runtime.stage}: no local copy of {spec.model.checkpoint!r} "
                f"with digest {spec.model.base_digest[:16]} (pass --checkpoint DIR), and no replica or coordinator "
                f"served them ({'; '.join(errors[-3:]) or 'none listed in the DHT'})"
            )
        await asyncio.sleep(RETRY_S)
