"""Server-side batching on real peers: concurrent requests to one stage run as one compute call, give the
same answers as lone requests, and a bad request in the crowd fails alone."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from swarmpipe.peer.transport.wire import decode, encode
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CONCURRENT = 8
D_MODEL = 64


@pytest.fixture
def two_peers(swarm):
    # wait_ms: a lone request waits 300 ms for company, so the concurrent ones surely share a batch
    spec = swarm.write_spec(
        num_stages=2,
        n_layers=2,
        top="averaging_interval_s = 0",
        extra="[batching]\nmax_microbatches = 4\nwait_ms = 300\nbackward_wait_ms = 500\n",
    )
    swarm.start_coordinator(spec)
    first = swarm.start_peer(0, "--metrics-port", "0", wait=False)
    last = swarm.start_peer(1, "--metrics-port", "0", wait=False)
    return swarm.wait_ready(first), swarm.wait_ready(last)


def batch_histogram(metrics_address: str, method: str) -> tuple[float, float]:
    """(calls, micro-batches) of swarmpipe_batch_microbatches for one method."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.labels.get("method") == method and s.name.startswith("swarmpipe_batch_microbatches")
    }
    return values.get("swarmpipe_batch_microbatches_count", 0.0), values.get("swarmpipe_batch_microbatches_sum", 0.0)


async def _concurrently(address: str, method: str, requests: list) -> list:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = swarm_pb2_grpc.StageStub(channel)
        return await asyncio.gather(*(getattr(stub, method)(r, timeout=60) for r in requests), return_exceptions=True)


def test_concurrent_requests_share_compute_calls_and_match_lone_ones(two_peers):
    first, last = two_peers
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 256, (2, 16), generator=gen) for _ in range(CONCURRENT)]

    def forward(i: int, prefix: str) -> swarm_pb2.ForwardRequest:
        return swarm_pb2.ForwardRequest(
            run_id="test", stage=0, microbatch_id=f"{prefix}{i}", input=encode(tokens[i]), reply_codec="none"
        )

    # Lone forwards first (weights do not move without a backward), then the same inputs concurrently.
    lone = [asyncio.run(_concurrently(first["address"], "Forward", [forward(i, "lone")]))[0] for i in range(2)]
    crowd = asyncio.run(_concurrently(first["address"], "Forward", [forward(i, "mb") for i in range(CONCURRENT)]))
    assert all(isinstance(r, swarm_pb2.ForwardResponse) for r in crowd), crowd
    for i in range(2):
        torch.testing.assert_close(decode(crowd[i].output), decode(lone[i].output), rtol=1e-5, atol=1e-5)
    calls, microbatches = batch_histogram(first["metrics_address"], "forward")
    assert microbatches == CONCURRENT + 2 and calls < CONCURRENT, (calls, microbatches)

    # Their backwards, concurrently, plus one for a micro-batch nobody sent and one with a wrong shape.
    gen_grads = [torch.randn(2, 16, D_MODEL, generator=gen) for _ in range(CONCURRENT)]
    backwards = [
        swarm_pb2.BackwardRequest(run_id="test", stage=0, microbatch_id=f"mb{i}", grad_output=encode(g, "none"))
        for i, g in enumerate(gen_grads)
    ]
    backwards.append(
        swarm_pb2.BackwardRequest(
            run_id="test", stage=0, microbatch_id="never", grad_output=encode(gen_grads[0], "none")
        )
    )
    backwards.append(
        swarm_pb2.BackwardRequest(
            run_id="test", stage=0, microbatch_id="lone0", grad_output=encode(gen_grads[0][:, :8], "none")
        )
    )
    results = asyncio.run(_concurrently(first["address"], "Backward", backwards))
    assert all(isinstance(r, swarm_pb2.BackwardResponse) and r.applied for r in results[:CONCURRENT]), results
    assert isinstance(results[-2], grpc.aio.AioRpcError) and results[-2].code() == grpc.StatusCode.NOT_FOUND
    assert isinstance(results[-1], grpc.aio.AioRpcError) and results[-1].code() == grpc.StatusCode.INVALID_ARGUMENT
    steps = max(r.version for r in results[:CONCURRENT])
    assert 1 <= steps < CONCURRENT, "batched backwards take fewer, larger optimizer steps"
    calls, microbatches = batch_histogram(first["metrics_address"], "backward")
    assert calls < microbatches, (calls, microbatches)

    # The last stage: concurrent ForwardBackward calls, one with targets out of range.
    hidden = [torch.randn(2, 16, D_MODEL, generator=gen) for _ in range(CONCURRENT)]
    targets = [torch.randint(0, 256, (2, 16), generator=gen) for _ in range(CONCURRENT)]
    targets[3][0, 0] = 999
    requests = [
        swarm_pb2.ForwardBackwardRequest(
            run_id="test",
            stage=1,
            microbatch_id=f"fb{i}",
            input=encode(h, "none"),
            targets=encode(t),
            reply_codec="none",
        )
        for i, (h, t) in enumerate(zip(hidden, targets))
    ]
    results = asyncio.run(_concurrently(last["address"], "ForwardBackward", requests))
    assert isinstance(results[3], grpc.aio.AioRpcError) and results[3].code() == grpc.StatusCode.INVALID_ARGUMENT
    good = [r for i, r in enumerate(results) if i != 3]
    assert all(isinstance(r, swarm_pb2.ForwardBackwardResponse) and r.applied and r.loss > 0 for r in good), good
    assert all(decode(r.grad_input).shape == (2, 16, D_MODEL) for r in good)
    calls, microbatches = batch_histogram(last["metrics_address"], "forward_backward")
    assert calls < microbatches == CONCURRENT, (calls, microbatches)
