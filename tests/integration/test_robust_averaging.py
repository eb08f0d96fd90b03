"""Robust replica averaging with a Byzantine replica: real processes on 127.0.0.1.

Stage 1 has two honest replicas and a Byzantine one (tests/byzantine_weights_peer.py: an honest peer whose served
weights are its own times 1e6, correctly signed). Every averaging round the honest replicas pull both siblings,
clip the Byzantine pull (CenteredClip around their own weights) and keep training; their weights stay where
training takes them. Strangers announced on the stage pushing scaled weights move a replica no further than its
trust radius (1e6-scaled ones not at all), and only once each. ``DownloadState(params_only)``'s hostile inputs are refused, and a donor
that streams without end is cut off by the puller.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from swarm_support import assert_trained, events_of, stop_trainer, wait_step

from swarmpipe.cli.launcher import wait_for
from swarmpipe.peer.state.format import StageState, StateError, from_chunks
from swarmpipe.peer.state.robust_aggregate import flatten
from swarmpipe.peer.state.transfer import PARAMS_TTL_S, download_state, push_state
from swarmpipe.peer.swarm.dht import SwarmDHT, identity_of, start_dht
from swarmpipe.peer.swarm.records import WIRE_PROTOCOL, PeerState, StageRecord
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

INTERVAL_S = 6.0
BYZANTINE = [sys.executable, str(Path(__file__).resolve().parents[1] / "byzantine_weights_peer.py"), "1e6", "--"]


async def _params(address: str, stage: int = 1) -> StageState:
    return await download_state([address], "test", stage, params_only=True)


def _vector(state: StageState) -> torch.Tensor:
    return flatten([state.tensors[k] for k in sorted(state.tensors)])


async def test_a_byzantine_replica_is_clipped_and_honest_weights_stay_where_training_takes_them(swarm):
    spec = swarm.write_spec(top=f"averaging_period = 5\naveraging_interval_s = {INTERVAL_S}")
    swarm.start_coordinator(spec)
    launched = [
        swarm.start_peer(0, wait=False),
        swarm.start_peer(1, wait=False, name="honest-a"),
        swarm.start_peer(1, wait=False, name="honest-b"),
        swarm.start_peer(1, wait=False, name="byzantine", prefix=BYZANTINE),
    ]
    infos = [await asyncio.to_thread(swarm.wait_ready, p) for p in launched]
    honest = {i["peer_id"]: i["address"] for i in infos[1:3]}
    byzantine_id = infos[3]["peer_id"]
    before = {pid: _vector(await _params(address)) for pid, address in honest.items()}
    served = _vector(await _params(infos[3]["address"]))
    assert float(served.norm()) > 1e5 * float(before[infos[1]["peer_id"]].norm())  # the liar's patch is live

    # verification of compute is another test's subject: this one is about weights (the liar computes honestly)
    # trains until both honest replicas averaged twice and 100 micro-batches are done, then stops (SIGTERM)
    trainer, report_path = swarm.start_trainer(1_000_000, "--max-time", "120", "--verify-fraction", "0")

    def honest_rounds() -> list[dict]:
        rounds = [e for e in events_of(swarm, "averaged") if e["peer_id"] in honest]
        return rounds if {e["peer_id"] for e in rounds} == set(honest) and len(rounds) >= 4 else []

    await asyncio.to_thread(wait_for, honest_rounds, 150, "both honest replicas to average twice", 1.0, [trainer])
    await asyncio.to_thread(wait_step, swarm, 110, trainer)
    report = await asyncio.to_thread(stop_trainer, swarm, trainer, report_path)
    assert_trained(report, min_steps=100, stopped=True)

    rounds = [e for e in events_of(swarm, "averaged") if e["peer_id"] in honest]
    skipped = [e for e in events_of(swarm, "averaging_donor_skipped") if e["peer_id"] in honest]
    assert not skipped, skipped  # the liar's weights are well-formed and signed: pulled, then clipped
    for e in rounds:  # with two siblings (k = 4) every round pulls the liar too
        assert e["group_size"] == 3 and e["clipped"] >= 1 and e["outliers"] >= 1 and e["farthest"] > 1e3, e
        assert e["moved"] <= 3 * e["tau"], e  # at most tau per CenteredClip iteration
        assert e["moved"] < e["norm"], e  # a round moves the weights by less than their norm (the liar's: 1e6 x)
    # Where training alone takes the weights: the liar trains and averages honestly (only what it serves is
    # scaled), so its true weights (served / 1e6) are a third replica's. Training moves these tiny test weights
    # by more than their initial norm, so "stay where they were" is measured against that, not the start.
    after = {pid: _vector(await _params(address)) for pid, address in honest.items()}
    liar_true = _vector(await _params(infos[3]["address"])) / 1e6
    for pid in honest:
        ratio = float(after[pid].norm()) / float(liar_true.norm())
        apart = float((after[pid] - liar_true).norm()) / float(liar_true.norm())
        grown = float(after[pid].norm()) / float(before[pid].norm())
        print(
            f"honest {pid[-6:]}: ||w|| x{grown:.2f} since the start, {ratio:.3f} x the liar's true ||w||, {apart:.3f} apart"
        )
        assert abs(ratio - 1) < 0.2 and apart < 0.5, (ratio, apart)  # a plain mean: ratio ~3e5
        assert bool(torch.isfinite(after[pid]).all())
    byzantine_rounds = [e for e in events_of(swarm, "averaged") if e["peer_id"] == byzantine_id]
    print(f"{len(rounds)} honest rounds, the liar averaged {len(byzantine_rounds)} times itself")

    # Strangers announced on stage 1 push to an honest replica once its rounds are over (nothing trains, so its
    # trust radius is the floor, 1e-3 ||w||): 1e6-scaled weights have no pull, 1.05x-scaled ones (50 radii off)
    # are clipped to the radius, and a second push from the same sibling within 30 s is refused.
    target_id, target = next(iter(honest.items()))
    await asyncio.sleep(INTERVAL_S + PARAMS_TTL_S + 1.0)  # the last round is done, the shared export expired
    w0 = await _params(target)
    attackers = [await asyncio.to_thread(start_dht, [swarm.maddr]) for _ in range(2)]
    try:
        for node in attackers:
            assert await SwarmDHT(node, "test").announce_stage(1, _joining_record(w0.version), ttl=60)
        await asyncio.sleep(1.5)
        gross, careful = (identity_of(node) for node in attackers)
        reply = await push_state(target, _scaled(w0, 1e6), timeout=30, signer=gross)
        assert reply.accepted and "no pull" in reply.detail, reply.detail
        await asyncio.sleep(PARAMS_TTL_S + 0.5)
        w1 = _vector(await _params(target))
        assert w1.equal(_vector(w0))

        reply = await push_state(target, _scaled(w0, 1.05), timeout=30, signer=careful)
        assert reply.accepted and "clipped" in reply.detail, reply.detail
        await asyncio.sleep(PARAMS_TTL_S + 0.5)
        pulled = float((_vector(await _params(target)) - w1).norm())
        received = [e for e in events_of(swarm, "state_received") if e["peer_id"] == target_id]
        assert [e["clipped"] for e in received] == [True, True] and received[0]["scale"] == 0.0, received
        radius = received[-1]["radius"]
        print(f"a 1.05x push moved the replica by {pulled:.5f}: radius {radius}, ||w|| {float(w1.norm()):.3f}")
        assert radius == pytest.approx(1e-3 * float(w1.norm()), rel=0.01)
        assert 0.45 * radius <= pulled <= 0.5 * radius * 1.01  # half way (a blend) along the clipped pull

        with pytest.raises(grpc.aio.AioRpcError) as again:
            await push_state(target, _scaled(w0, 1e6), timeout=30, signer=gross)
        assert again.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, again.value.details()
    finally:
        for node in attackers:
            node.shutdown()


def _joining_record(version: int) -> StageRecord:
    """A stranger's record on the stage: anyone may volunteer; joining, so never routed to and never pulled."""
    return StageRecord(
        address="127.0.0.1:9",
        state=PeerState.JOINING,
        throughput=0.0,
        queue=0,
        version=version,
        updated_at=time.time(),
        protocol=WIRE_PROTOCOL,
    )


def _scaled(state: StageState, factor: float) -> StageState:
    return StageState({k: v * factor for k, v in state.tensors.items()}, {**state.meta, "params_only": False})


async def _download(address: str, **fields) -> list[swarm_pb2.StateChunk]:
    request = swarm_pb2.DownloadStateRequest(**{"run_id": "test", "stage": 0, **fields})
    async with grpc.aio.insecure_channel(address) as channel:
        return [c async for c in swarm_pb2_grpc.StageStub(channel).DownloadState(request, timeout=30)]


async def _refused(address: str, code: grpc.StatusCode, words: str, **fields) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _download(address, **fields)
    assert info.value.code() == code and words in info.value.details(), (info.value.code(), info.value.details())
    assert len(info.value.details()) < 400


async def test_params_only_downloads_are_validated_and_share_one_export(swarm):
    swarm.start_coordinator(swarm.write_spec(top="averaging_interval_s = 0"))
    info = await asyncio.to_thread(swarm.wait_ready, swarm.start_peer(0, wait=False))
    address, peer_id = info["address"], info["peer_id"]
    bad = grpc.StatusCode.INVALID_ARGUMENT
    await _refused(address, bad, "not with base", params_only=True, base=True)
    await _refused(address, bad, "not with base or shards", params_only=True, num_shards=2)
    await _refused(address, bad, "not with base or shards", params_only=True, shard=3)
    await _refused(address, bad, "not with base or shards", params_only=True, shard=-1, num_shards=-5)
    await _refused(address, grpc.StatusCode.FAILED_PRECONDITION, "wrong stage", params_only=True, stage=1)

    # 32 siblings pulling at once: one export, encoded and signed once, serves them all
    answers = await asyncio.gather(*(_download(address, params_only=True) for _ in range(32)))
    stamps = set()
    for chunks in answers:
        meta, tensors = from_chunks(chunks, purpose="download")
        assert meta["signed_by"] == peer_id and meta["params_only"] is True
        assert tensors and all(name.startswith("param.") for name in tensors)
        stamps.add((meta["digest"], chunks[0].metadata_json))
    assert len(stamps) == 1  # the same signed stream, byte for byte
    full = await _download(address)
    assert {c.name for c in full[1:]} >= {c.name for c in answers[0][1:]}


class _EndlessDonor(swarm_pb2_grpc.StageServicer):
    """A donor that answers a download with chunks that never end."""

    async def DownloadState(self, request, context):
        payload = swarm_pb2.Tensor(dtype="float32", shape=[1 << 18], data=bytes(1 << 20))
        for i in range(10_000):
            yield swarm_pb2.StateChunk(name=f"param.w{i}", tensor=payload, index=i + 1, total=10_001)


async def test_a_donor_streaming_without_end_is_cut_off():
    server = grpc.aio.server()
    swarm_pb2_grpc.add_StageServicer_to_server(_EndlessDonor(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        with pytest.raises(StateError, match="more than 4 MiB"):
            await download_state([f"127.0.0.1:{port}"], "test", 0, params_only=True, max_bytes=4 << 20)
    finally:
        await server.stop(grace=None)
