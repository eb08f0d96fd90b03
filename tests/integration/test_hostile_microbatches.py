"""Only the caller that opened a micro-batch reaches its forward: a backward without its ticket finds nothing,
and the owner's backward still applies afterwards. Real peer process, raw gRPC calls."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from swarmpipe.peer.transport.wire import decode, encode
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


async def test_a_backward_without_the_forwards_ticket_is_not_applied(swarm):
    spec = swarm.write_spec(num_stages=2, n_layers=2)
    swarm.start_coordinator(spec)
    address = (await asyncio.to_thread(swarm.wait_ready, swarm.start_peer(0, wait=False)))["address"]
    ticket = b"owner-secret-123"
    async with grpc.aio.insecure_channel(address) as channel:
        stub = swarm_pb2_grpc.StageStub(channel)
        forward = swarm_pb2.ForwardRequest(
            run_id="test", stage=0, microbatch_id="mb-1", input=encode(torch.randint(0, 256, (2, 8))), ticket=ticket
        )
        out = await stub.Forward(forward, timeout=30)
        shape = tuple(decode(out.output).shape)
        before = (await stub.Info(swarm_pb2.InfoRequest(run_id="test"), timeout=10)).version

        def backward(ticket_sent: bytes) -> swarm_pb2.BackwardRequest:
            grad = encode(torch.full(shape, 1e3))
            return swarm_pb2.BackwardRequest(
                run_id="test", stage=0, microbatch_id="mb-1", grad_output=grad, ticket=ticket_sent
            )

        for stolen in (b"", b"guessed-ticket-x", ticket[:8]):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Backward(backward(stolen), timeout=30)
            assert info.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), info.value
        # a forward under the same id from someone else does not replace the owner's
        forward.ticket = b"another-caller-1"
        await stub.Forward(forward, timeout=30)
        assert (await stub.Info(swarm_pb2.InfoRequest(run_id="test"), timeout=10)).version == before
        reply = await stub.Backward(backward(ticket), timeout=30)
        assert reply.applied and reply.version == before + 1
