"""A peer's calls to the next stage of a chained micro-batch: candidates in turn, codecs per link, answers checked.

The peer that sends activations owns the link: it chooses their codec (and the codec it wants the gradient
back in) from the bandwidth it measured to that very address (``CodecPolicy``, as the trainer does per hop in
hub mode), and it checks what comes back as the trainer checks a stage's answer: the gradient's shape, that it
is finite and not a wild outlier for that stage (``NormGuard``), the loss finite, one result per later stage.

A candidate that fails (unreachable, draining, moved, refusing, too slow, a bad answer) makes way for the next
one in the route; when none is left, :class:`ChainBroken` says where the chain broke and why. A downstream peer's
own :class:`ChainBroken` (status ABORTED, peer/transport/chain_protocol.py) travels up unchanged: it already tried every candidate after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from swarmpipe.peer.norm_guard import NormGuard
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.transport.chain_protocol import BROKEN, UNREACHABLE, ChainBroken
from swarmpipe.peer.transport.channels import ChannelPool
from swarmpipe.peer.transport.codec_policy import CodecPolicy
from swarmpipe.peer.transport.streaming import StreamingCaller
from swarmpipe.peer.transport.wire import WireError, decode
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
        self.spec = spec
        self.pool = pool or ChannelPool(spec.limits.max_message_mb)
        cap = spec.limits.max_message_mb << 20
        self.caller = StreamingCaller(
            threshold_bytes=min(1 << 20, cap // 2),
            chunk_bytes=min(1 << 20, cap // 2),
            max_total_bytes=spec.limits.max_stream_mb << 20,
        )
        self.policy = CodecPolicy()  # per next-hop address: bandwidth measured on our own calls
        self.guards: dict[int, NormGuard] = {}  # stage -> norms of the gradients its replicas returned
        self.bytes_sent = 0
        self.bytes_received = 0

    def codecs(self, address: str, nbytes: int) -> tuple[str, str]:
        """(activation codec, reply gradient codec) for a tensor of ``nbytes`` float32 bytes to ``address``."""
        c = self.spec.compression
        return (
            self.policy.choose("activations", c.activations, address, nbytes),
            self.policy.choose("gradients", c.gradients, address, nbytes),
        )

    async def call(
        self,
        stage: int,
        hops: list[tuple[str, str]],
        build: Build,
        out_shape: tuple[int, ...],
        timeout: float,
        end: int | None = None,
    ) -> LinkAnswer:
        """Send the micro-batch to the first candidate of ``stage`` that takes it; ChainBroken when none does.
        ``end``: the chain's last stage (default: the run's), whose results the answer must carry."""
        failures: list[str] = []
        unreachable = True
        nbytes = 4 * int(torch.Size(out_shape).numel())
        for peer_id, address in hops:
            act_codec, reply = self.codecs(address, nbytes)
            request, payloads = build(act_codec, reply)
            try:
                response = await self._send(address, request, payloads, timeout)
                grad = self._check(stage, response, out_shape, end)
                return LinkAnswer(response, grad, peer_id, len(failures))
            except grpc.aio.AioRpcError as e:
                if e.code() == BROKEN:
                    below = ChainBroken.parse(e.details())
                    if below is not None and below.stage > stage:
                        raise below from None
                unreachable = unreachable and e.code() in UNREACHABLE
                failures.append(f"{peer_id[-6:]}: {e.code().name} {(e.details() or '')[:60]}")
            except asyncio.TimeoutError:
                failures.append(f"{peer_id[-6:]}: no answer in {timeout:.0f}s")
            except WireError as e:
                unreachable = False
                failures.append(f"{peer_id[-6:]}: bad answer: {str(e)[:60]}")
        raise ChainBroken(stage, "; ".join(failures) or "no candidate", unreachable and bool(failures))

    async def _send(self, address: str, request, payloads: list, timeout: float) -> swarm_pb2.ChainResponse:
        with self.policy.timed(address) as timed:
            response = await asyncio.wait_for(
                self.caller.call(
                    self.pool.channel(address),
                    self.pool.stub(address),
                    "Chain",
                    request,
                    timeout=timeout,
                    payloads=payloads,
                ),
                timeout + 1.0,  # grpc's own deadline answers first; this one only guards a stuck stream
            )
            sent = request.ByteSize() + sum(memoryview(p).nbytes for p in payloads if p is not None)
            received = response.ByteSize()
            timed.nbytes = sent + received
            timed.remote_seconds = response.handler_seconds  # its compute and every later hop are not this link
        self.bytes_sent += sent
        self.bytes_received += received
        return response

    def _check(self, stage: int, response, out_shape: tuple[int, ...], end: int | None = None) -> torch.Tensor:
        """The next stage's answer, as the trainer would check it: its gradient, loss and per-stage results."""
        if not torch.isfinite(torch.tensor(float(response.loss))):
            raise WireError(f"stage {stage} returned a non-finite loss")
        end = self.spec.num_stages - 1 if end is None else end
        left = end + 1 - stage
        stages = list(response.stages)
        if len(stages) != left or [s.stage for s in stages] != list(range(stage, end + 1)):
            raise WireError(f"stage {stage} reported {len(stages)} stage results; {left} were due")
        grad = decode(
            response.grad_input,
            max_elements=self.spec.limits.max_tensor_elements,
            allowed_dtypes=("float32", "float16", "bfloat16"),
            expect_shape=tuple(out_shape),
            what="grad_input",
        ).float()
        guard = self.guards.get(stage)
        if guard is None:
            guard = self.guards[stage] = NormGuard(what=f"stage {stage} gradients")
        problem = guard.check(float(grad.norm()) / max(1, grad.shape[0]))
        if problem:
            raise WireError(problem)
        return grad

    async def close(self) -> None:
        await self.pool.close()
