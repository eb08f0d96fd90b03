"""What the health page shows of one run, from the records the DHT holds (no sockets here: the readers pass them in).

Every record was already checked on the way in (signed, bounded, parsed: ``SwarmDHT``); what is left is to bound
what a page shows when strangers announce thousands of replicas (the newest ``MAX_PEERS_SHOWN`` per stage) and to
say where a volunteer helps most: the stage ``--stage auto`` would pick on a GPU of each common memory size
(:func:`swarmpipe.peer.swarm.balance.choose_stage` over the stages that fit, by the peers' own memory estimate).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from swarmpipe.peer.plan.memory import stages_that_fit_peer
from swarmpipe.peer.spec import RunSpec, spec_from_dict
from swarmpipe.peer.swarm.balance import choose_stage, stage_throughputs
from swarmpipe.peer.swarm.records import CheckpointRecord, PeerState, RunIndexRecord, StageRecord, TrainerRecord

MAX_PEERS_SHOWN = 256  # per stage: the newest records; the rest are counted, not listed
MAX_TRAINERS_SHOWN = 64
GPU_MEMORY_GIB = (8, 12, 16, 24, 48, 80)  # the cards volunteers bring


class _NoChoice:
    """An rng for ``choose_stage`` that takes the first of equally needy stages: the page must not flicker."""

    @staticmethod
    def choice(candidates: list[int]) -> int:
        return candidates[0]


@functools.lru_cache(maxsize=64)
def _fitting(spec_json: str, gib: int) -> tuple[int, ...]:
    """The stages whose memory estimate fits a GPU of ``gib`` (computing under autocast unless the spec says fp32)."""
    spec = spec_from_dict(json.loads(spec_json))
    autocast = spec.precision.compute != "fp32"
    return tuple(stages_that_fit_peer(spec, gib << 30, autocast))


def where_to_help(spec: RunSpec, stages: list[dict[str, StageRecord]]) -> dict[str, Any]:
    """The neediest stage overall, and per GPU memory size the stage ``--stage auto`` would pick (None: no stage
    fits that card)."""
    spec_json = json.dumps(spec.to_dict(), sort_keys=True)
    by_memory: dict[str, int | None] = {}
    for gib in GPU_MEMORY_GIB:
        fitting = list(_fitting(spec_json, gib))
        by_memory[str(gib)] = choose_stage(stages, rng=_NoChoice(), allowed=fitting) if fitting else None
    return {"neediest_stage": choose_stage(stages, rng=_NoChoice()), "by_gpu_memory_gib": by_memory}


def _peer_row(peer_id: str, record: StageRecord) -> dict[str, Any]:
    row = record.model_dump(exclude={"tls_cert"})
    row["peer_id"] = peer_id
    row["relayed"] = bool(record.relay)
    return row


def run_view(
    run_id: str,
    index: RunIndexRecord | None,
    spec: RunSpec | None,
    stages: list[dict[str, StageRecord]],
    trainers: dict[str, TrainerRecord],
    checkpoint: CheckpointRecord | None,
) -> dict[str, Any]:
    """One run as the page and ``/api/monitor`` show it."""
    totals = stage_throughputs(stages)
    stage_rows = []
    for s, peers in enumerate(stages):
        newest = sorted(peers.items(), key=lambda item: -item[1].updated_at)
        live = [r for r in peers.values() if r.state is not PeerState.DRAINING]
        stage_rows.append(
            {
                "index": s,
                "replicas": len(live),
                "relayed": sum(bool(r.relay) for r in live),
                "throughput": round(totals[s], 3),
                "versions": sorted({r.version for r in live}),
                "peers": [_peer_row(pid, r) for pid, r in newest[:MAX_PEERS_SHOWN]],
                "peers_not_listed": max(0, len(newest) - MAX_PEERS_SHOWN),
            }
        )
    newest_trainers = sorted(trainers.items(), key=lambda item: -item[1].updated_at)[:MAX_TRAINERS_SHOWN]
    view: dict[str, Any] = {
        "run_id": run_id,
        "coordinator": index.coordinator if index else "",
        "num_stages": len(stages),
        "model": _model(spec),
        "stages": stage_rows,
        "empty_stages": [row["index"] for row in stage_rows if row["replicas"] == 0],
        "bottleneck_stage": min(range(len(totals)), key=totals.__getitem__) if totals else None,
        "trainers": [{"peer_id": pid, **t.model_dump()} for pid, t in newest_trainers],
        "checkpoint": checkpoint.model_dump(exclude={"tls_cert", "digests"}) if checkpoint else None,
    }
    view["help"] = where_to_help(spec, stages) if spec is not None and stages else None
    return view


def _model(spec: RunSpec | None) -> dict[str, Any] | None:
    if spec is None:
        return None
    m = spec.model
    return {
        "family": m.family,
        "d_model": m.d_model,
        "n_layers": m.n_layers,
        "vocab_size": m.vocab_size,
        "seq_len": m.seq_len,
        "finetune": spec.finetune.method,
    }
