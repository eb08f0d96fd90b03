"""A peer's calls to the next stage of a chained micro-batch: candidates in turn, codecs per link, answers checked.

The call itself is the one every stage call makes (``StageClient``, peer/client/): pooled channels, streaming,
the deadline. The peer that sends activations owns the link: it chooses their codec (and the codec it wants the
gradient back in) from the bandwidth it measured to that very address, as the trainer does per hop in hub mode,
and it reads the answer as the trainer reads a chain's (``read_chain_answer``: the loss finite, one result per
later stage, the gradient of the shape sent, finite and not a wild outlier for that stage).

A candidate that fails (unreachable, draining, moved, refusing, too slow, a bad answer) makes way for the next
one in the route; when none is left, :class:`ChainBroken` says where the chain broke and why. A downstream peer's
own :class:`ChainBroken` (status ABORTED, peer/transport/chain_protocol.py) travels up unchanged: it already tried
every candidate after it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from swarmpipe.peer.client.chain_answer import read_chain_answer
from swarmpipe.peer.client.stage_client import StageClient
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.transport.chain_protocol import UNREACHABLE, ChainBroken
from swarmpipe.peer.transport.channels import ChannelPool
from swarmpipe.peer.transport.wire import WireError
from swarmpipe.protos import swarm_pb2


@dataclass
class LinkAnswer:
    response: swarm_pb2.ChainResponse
    grad: torch.Tensor  # the gradient of our output, decoded and checked
    peer_id: str  # the candidate that answered
    failed: int  # candidates that failed before it


# builds (request, payloads) for one candidate from (activation codec, reply codec)
Build = Callable[[str, str], tuple[swarm_pb2.ChainRequest, list]]


class ChainLink:
    def __init__(self, spec: RunSpec, pool: ChannelPool | None = None):
        self.last_stage = spec.num_stages - 1
        self.client = StageClient(spec, pool)

    async def call(
        self,
        stage: int,
        hops: list[tuple[str, str]],
        build: Build,
        out_shape: tuple[int, ...],
        timeout: float,
        end: int | None = None,
    ) -> LinkAnswer:
        """Send the micro-batch to the first candidate of ``stage`` that takes it; ChainBroken when none does
        (or when a candidate reports that the chain broke further down). ``end``: the chain's last stage
        (default: the run's), whose results the answer must carry."""
        end = self.last_stage if end is None else end
        failures: list[str] = []
        unreachable = True
        nbytes = 4 * math.prod(out_shape)
        for peer_id, address in hops:
            codecs = self.client.codec("activations", address, nbytes), self.client.codec("gradients", address, nbytes)
            request, payloads = build(*codecs)
            try:
                response = await self.client.call(address, "Chain", request, payloads=payloads, timeout=timeout)
                answer = read_chain_answer(self.client.answers, response, stage, end, tuple(out_shape))
                return LinkAnswer(response, answer.grad, peer_id, len(failures))
            except grpc.aio.AioRpcError as e:
                unreachable = unreachable and e.code() in UNREACHABLE
                failures.append(f"{peer_id[-6:]}: {e.code().name} {(e.details() or '')[:60]}")
            except asyncio.TimeoutError:
                failures.append(f"{peer_id[-6:]}: no answer in {timeout:.0f}s")
            except WireError as e:
                unreachable = False
                failures.append(f"{peer_id[-6:]}: bad answer: {str(e)[:60]}")
        raise ChainBroken(stage, "; ".join(failures) or "no candidate", unreachable and bool(failures))

    async def close(self) -> None:
        await self.client.close()
