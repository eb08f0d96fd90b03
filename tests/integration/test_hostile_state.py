"""State writes are authenticated: a peer (and the coordinator) takes a pushed state only from a replica announced
on that stage, signed by it, no larger than such a state can be, with a version that replica could have.

Real processes: a coordinator and one stage-0 peer; the attacker is this test with its own DHT node and key.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from swarmpipe.peer.state.format import StageState, to_chunks
from swarmpipe.peer.state.transfer import push_state
from swarmpipe.peer.swarm.dht import SwarmDHT, identity_of, start_dht
from swarmpipe.peer.swarm.records import WIRE_PROTOCOL, PeerState, StageRecord
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _state(version: int = 1, elements: int = 16) -> StageState:
    return StageState({"param.w": torch.ones(elements)}, {"run_id": "test", "stage": 0, "version": version})


async def _refused(address: str, state: StageState, signer, code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await push_state(address, state, timeout=30, signer=signer)
    assert info.value.code() == code, (info.value.code(), info.value.details())
    assert words in info.value.details(), info.value.details()
    assert len(info.value.details()) < 400


async def _info(address: str) -> swarm_pb2.InfoResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await swarm_pb2_grpc.StageStub(channel).Info(swarm_pb2.InfoRequest(run_id="test"), timeout=10)


async def test_state_pushes_from_strangers_liars_and_hogs_are_refused(swarm):
    spec = swarm.write_spec(num_stages=2, n_layers=2)
    swarm.start_coordinator(spec)
    peer = await asyncio.to_thread(swarm.wait_ready, swarm.start_peer(0, wait=False))
    address = peer["address"]
    attacker = await asyncio.to_thread(start_dht, [swarm.maddr])
    try:
        me = identity_of(attacker)
        swarm_dht = SwarmDHT(attacker, "test")
        checkpoint = None
        for _ in range(30):  # the coordinator's signed checkpoint record names its state server
            checkpoint = await swarm_dht.checkpoint()
            if checkpoint is not None and checkpoint.url:
                break
            await asyncio.sleep(1)
        assert checkpoint is not None and checkpoint.url
        before = await _info(address)

        # 1. unsigned, and signed by someone who is not a replica of the stage
        await _refused(address, _state(), None, grpc.StatusCode.INVALID_ARGUMENT, "not signed")
        await _refused(address, _state(), me, grpc.StatusCode.PERMISSION_DENIED, "not announced on stage 0")
        await _refused(checkpoint.url, _state(), me, grpc.StatusCode.PERMISSION_DENIED, "not announced on stage 0")

        # 2. announced on the stage (anyone may volunteer), but claiming a version it never announced
        record = StageRecord(
            address="127.0.0.1:9",
            state=PeerState.JOINING,  # never routed to
            throughput=0.0,
            queue=0,
            version=3,
            updated_at=time.time(),
            protocol=WIRE_PROTOCOL,
        )
        assert await swarm_dht.announce_stage(0, record, ttl=60)
        await asyncio.sleep(1.5)
        for target in (address, checkpoint.url):
            await _refused(target, _state(version=2**62), me, grpc.StatusCode.INVALID_ARGUMENT, "beyond what")

        # 3. a hog: far more bytes than a state of this stage can be, cut off while they stream
        huge = StageState(
            {f"param.w{i}": torch.ones(1 << 20) for i in range(16)},  # 64 MiB in 4 MiB chunks
            {"run_id": "test", "stage": 0, "version": 1},
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await push_state(address, huge, timeout=30, signer=me)
        # the server refuses mid-stream; a client still writing may see its send fail (INTERNAL) instead
        assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL), info.value
        assert "exceeds" in info.value.details() or info.value.code() == grpc.StatusCode.INTERNAL

        # 4. a push that never closes: the peer keeps serving everyone else meanwhile
        async with grpc.aio.insecure_channel(address) as channel:
            head = to_chunks(_state(), signer=me, purpose="push")[0]

            async def never_done():
                yield head
                await asyncio.sleep(3600)

            hanging = asyncio.ensure_future(swarm_pb2_grpc.StageStub(channel).PushState(never_done(), timeout=600))
            await asyncio.sleep(1.0)
            assert (await _info(address)).state == "online"
            hanging.cancel()

        after = await _info(address)
        assert after.version == before.version and after.state == "online"
        assert not list((swarm.workdir / "checkpoints").glob("*/stage-0.safetensors")) or all(
            "handoff" not in e.get("reason", "") for e in swarm.events_of("checkpoint")
        )
    finally:
        attacker.shutdown()
