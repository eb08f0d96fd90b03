"""Which stage a peer should serve: the one with the least total throughput."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.swarm.records import PeerState, StageRecord

NEW_PEER_THROUGHPUT = 1.0  # a replica that has not measured yet still counts for something


def stage_throughputs(stages: list[dict[str, StageRecord]], exclude: str = "") -> list[float]:
    """Total throughput of each stage's live replicas; one that has not measured yet counts as
    the mean of its measured stage-mates (it will soon do about as much as they do)."""
    totals = []
    for peers in stages:
        live = [r for pid, r in peers.items() if r.state is not PeerState.DRAINING and pid != exclude]
        measured = [r.throughput for r in live if r.throughput > 0]
        prior = sum(measured) / len(measured) if measured else NEW_PEER_THROUGHPUT
        totals.append(sum(r.throughput if r.throughput > 0 else prior for r in live))
    return totals


def choose_stage(
    stages: list[dict[str, StageRecord]], rng: random.Random | None = None, allowed: list[int] | None = None
) -> int:
    """Empty stages first, then the least total throughput; ties broken at random so
    peers that join together spread out instead of piling onto stage 0. ``allowed``: the stages this
    peer can hold (those that fit in its memory); None: all."""
    rng = rng or random.Random()
    totals = stage_throughputs(stages)
    allowed = list(range(len(totals))) if allowed is None else [s for s in allowed if 0 <= s < len(totals)]
    if not allowed:
        raise ValueError("no stage fits on this peer")
    best = min(totals[s] for s in allowed)
    candidates = [s for s in allowed if totals[s] <= best * 1.05 + 1e-9]
    return rng.choice(candidates)


def stage_cost(spec: RunSpec, stage: int) -> float:
    """Relative compute of a stage: its blocks, plus embeddings on the first and norm+head+loss on the last."""
    cost = float(len(spec.block_range(stage)))
    if stage == 0:
        cost += 0.25
    if stage == spec.num_stages - 1:
        cost += 0.5 + spec.model.vocab_size / (4 * spec.model.d_model)
    return max(cost, 0.25)


def rebalance_target(
    stages: list[dict[str, StageRecord]],
    my_stage: int,
    my_peer_id: str,
    my_throughput: float,
    margin: float = 1.25,
    estimate: Callable[[int], float] | None = None,
    turn: int | None = None,
) -> int | None:
    """Stage to move to, or None. Moving must raise the slowest stage by ``margin`` (hysteresis)
    and must not make the stage we leave the new bottleneck, so peers do not flap.
    ``estimate(target)`` is our throughput there (default: the same as here). ``turn``: the rebalancing
    window (wall clock // period): only the replica :func:`mover` names for it may leave this stage, so replicas
    that all see the same imbalance at the same moment do not all move (None: any replica may)."""
    totals = stage_throughputs(stages)
    live_here = [pid for pid, r in stages[my_stage].items() if r.state is not PeerState.DRAINING]
    if len(live_here) < 2 or my_peer_id not in live_here:
        return None  # never leave a stage without a live replica
    if turn is not None and mover(live_here, turn) != my_peer_id:
        return None
    slowest = min(range(len(totals)), key=totals.__getitem__)
    if slowest == my_stage:
        return None
    after = list(totals)
    after[my_stage] -= my_throughput
    after[slowest] += estimate(slowest) if estimate is not None else my_throughput
    if min(after) >= margin * totals[slowest]:
        return slowest
    return None


def mover(peer_ids: list[str], turn: int) -> str:
    """The one replica of a stage that may leave it in ``turn``: a hash of the turn and the ids, so every peer that
    sees the same replicas names the same one, and the choice rotates from turn to turn."""
    return min(peer_ids, key=lambda pid: hashlib.sha256(f"{turn}:{pid}".encode()).digest())
