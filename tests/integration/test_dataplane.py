"""Stage RPC over real gRPC: large tensors stream in chunks for every codec, a cut-off or cancelled
stream fails cleanly (INVALID_ARGUMENT / cancelled) and the peer keeps serving."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import pytest
import torch

from swarmpipe.peer.spec import LimitsSpec, ModelSpec, RunSpec
from swarmpipe.peer.stage.lifecycle import Lifecycle
from swarmpipe.peer.stage.metrics import PeerMetrics
from swarmpipe.peer.stage.server import StageServicer, start_server
from swarmpipe.peer.stage.stash import PendingForwards, RuntimeStats
from swarmpipe.peer.swarm.records import PeerState
from swarmpipe.peer.transport.channels import ChannelPool
from swarmpipe.peer.transport.streaming import StreamingCaller, data_frame_bytes, frames
from swarmpipe.peer.transport.wire import decode, encode
from swarmpipe.protos import swarm_pb2

pytestmark = pytest.mark.integration
WIDTH = 64


class IdentityRuntime:
    def __init__(self, spec: RunSpec):
        self.spec, self.stage, self.version = spec, 1, 0
        self.is_first = self.is_last = False
        self.stats = RuntimeStats()
        self.pending = PendingForwards(self.stats)  # the server's sibling waits and metrics read it
        self.device = torch.device("cpu")
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")

    def submit(self, fn) -> Future:
        return self._compute.submit(fn)

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    def forward(self, mb_id: str, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def forward_many(self, items: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        return [self.forward(mb, x) for mb, x in items]  # the server batches calls; identity needs no concat

    def throughput(self) -> float:
        return 0.0


async def _serve():
    spec = RunSpec(
        run_id="t",
        num_stages=3,
        model=ModelSpec(d_model=WIDTH, seq_len=4096),
        limits=LimitsSpec(max_message_mb=1, max_tensor_elements=1 << 24),
    )
    lifecycle = Lifecycle()
    lifecycle.change(PeerState.ONLINE)
    servicer = StageServicer(IdentityRuntime(spec), "peer-x", PeerMetrics(), lifecycle)
    server, port = await start_server(servicer, "127.0.0.1", 0)
    return server, f"127.0.0.1:{port}", ChannelPool(1)


def _request(x: torch.Tensor, codec: str) -> swarm_pb2.ForwardRequest:
    return swarm_pb2.ForwardRequest(run_id="t", stage=1, microbatch_id="m", input=encode(x, codec), reply_codec=codec)


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "uint8", "blockwise8"])
def test_large_forward_streams_past_the_message_cap(codec: str) -> None:
    async def main():
        server, address, pool = await _serve()
        try:
            x = torch.randn(4, 2048, WIDTH)  # 2 MiB of float32: over the 1 MiB message cap
            caller = StreamingCaller(threshold_bytes=256 * 1024, chunk_bytes=100_000)
            with pytest.raises(grpc.aio.AioRpcError) as unary:  # unary cannot carry it
                await pool.stub(address).Forward(_request(x, "none"), timeout=30)
            assert unary.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            r = await caller.call(pool.channel(address), pool.stub(address), "Forward", _request(x, codec), timeout=30)
            y = decode(r.output, max_elements=1 << 24)
            want = decode(encode(decode(_request(x, codec).input).float() * 2, codec))
            assert torch.equal(y, want)
            small = torch.randn(1, 3, WIDTH)  # below the threshold: unary, same answer
            r = await caller.call(
                pool.channel(address), pool.stub(address), "Forward", _request(small, "none"), timeout=30
            )
            assert torch.equal(decode(r.output), small * 2)
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(main())


def test_cut_off_and_cancelled_streams_fail_cleanly_and_peer_keeps_serving() -> None:
    async def main():
        server, address, pool = await _serve()
        channel = pool.channel(address)
        stream = channel.stream_stream(
            "/swarmpipe.Stage/Stream", request_serializer=lambda b: b, response_deserializer=swarm_pb2.Frame.FromString
        )
        try:
            x = torch.randn(2, 1024, WIDTH)
            raw = list(frames(_request(x, "none"), ("input",), method="Forward", chunk_bytes=64 * 1024))
            call = stream(iter(raw[: len(raw) // 2]), timeout=30)  # half the data, then end of stream
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                async for _ in call:
                    pass
            assert cut.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "stream ended after" in cut.value.details()

            extra = raw + [data_frame_bytes(memoryview(b"junk"))]
            with pytest.raises(grpc.aio.AioRpcError) as over:
                async for _ in stream(iter(extra), timeout=30):
                    pass
            assert over.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            async def slow():
                yield raw[0]
                yield raw[1]
                await asyncio.sleep(30)

            call = stream(slow(), timeout=30)
            await asyncio.sleep(0.3)
            call.cancel()  # the caller goes away midway
            with pytest.raises(asyncio.CancelledError):
                async for _ in call:
                    pass

            caller = StreamingCaller(threshold_bytes=1024)
            r = await caller.call(channel, pool.stub(address), "Forward", _request(x, "none"), timeout=30)
            assert torch.equal(decode(r.output, max_elements=1 << 24), x * 2)
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(main())
