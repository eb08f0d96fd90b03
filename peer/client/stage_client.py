"""``StageClient``: every call to a stage replica, whoever makes it (the trainer's hub and chained calls, a peer's
call to the next stage of a chain).

One pooled channel per address (``ChannelPool``); the call's deadline, plus a guard of its own for a stream that
stalls past it; a request or reply above 1 MiB (or half the message cap) goes as a chunked stream
(``StreamingCaller``). Every call's bytes are counted (sent ones even when the call fails: they left all the
same) and, with its time, feed the per-address bandwidth estimate that ``auto`` codecs are chosen from
(``CodecPolicy``); the time a reply says its handler took (a chain's: its compute and every later hop) is not the
link's. Gradients sent in a codec that takes error feedback (``Codec.error_feedback``) carry what it lost into
the next one sent on the same key. A chained call that broke further down raises :class:`ChainBroken` instead of
the gRPC error (ABORTED, peer/transport/chain_protocol.py): that is not the called peer's fault. ``answers``
checks what stages answer (``AnswerChecks``: one norm table per client).
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

import grpc
import torch

from swarmpipe.peer.client.answers import AnswerChecks
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.transport import codecs
from swarmpipe.peer.transport.chain_protocol import BROKEN, ChainBroken
from swarmpipe.peer.transport.channels import ChannelPool
from swarmpipe.peer.transport.codec_policy import CodecPolicy, ErrorFeedback
from swarmpipe.peer.transport.streaming import StreamingCaller
from swarmpipe.peer.transport.wire import encode
from swarmpipe.protos import swarm_pb2

STALLED_STREAM_S = 1.0  # past the call's deadline: grpc's own deadline answers first; this only ends a stuck stream


class StageClient:
    def __init__(self, spec: RunSpec, pool: ChannelPool | None = None):
        self.num_stages = spec.num_stages
        self.compression = spec.compression
        self.pool = pool or ChannelPool(spec.limits.max_message_mb)
        cap = spec.limits.max_message_mb << 20
        self.caller = StreamingCaller(
            threshold_bytes=min(1 << 20, cap // 2),
            chunk_bytes=min(1 << 20, cap // 2),
            max_total_bytes=spec.limits.max_stream_mb << 20,
        )
        self.policy = CodecPolicy()  # per address: bandwidth measured on this client's own calls
        self.error_feedback = ErrorFeedback()
        self.answers = AnswerChecks(spec.limits.max_tensor_elements)
        self.bytes_sent = 0
        self.bytes_received = 0

    def codec(self, role: str, address: str, nbytes: int) -> str:
        """The codec for a ``role`` tensor of ``nbytes`` float32 bytes sent to (or asked back from) ``address``:
        the configured one, or for "auto" the cheapest on the bandwidth measured to it."""
        configured = self.compression.activations if role == "activations" else self.compression.gradients
        return self.policy.choose(role, configured, address, nbytes)

    def encode_gradient(self, key: Hashable, grad: torch.Tensor, codec: str) -> swarm_pb2.Tensor:
        """``grad`` in ``codec``; one that takes error feedback adds what it lost last time on ``key``."""
        if codecs.get(codec).error_feedback:
            return self.error_feedback.encode(key, grad, codec)
        return encode(grad, codec)

    async def call(
        self,
        address: str,
        method: str,
        request,
        *,
        timeout: float,
        payloads: list | None = None,
        expected_bytes: int | None = None,
    ):
        """``method`` at ``address``, unary when small, a chunked stream when large. ``payloads``: the request's
        tensor bytes as buffers, per tensor field (None: in the message); a streamed request frames them straight
        from tensor storage. ``expected_bytes``: the reply's size when it is larger than the request (a handover's
        output). Raises the gRPC error, ``asyncio.TimeoutError`` (a stalled stream), ``WireError`` (a malformed
        stream) or, for a chain that broke further down, ``ChainBroken``."""
        sent = request.ByteSize() + sum(memoryview(p).nbytes for p in payloads or () if p is not None)
        self.bytes_sent += sent
        with self.policy.timed(address) as timed:
            try:
                response = await asyncio.wait_for(
                    self.caller.call(
                        self.pool.channel(address),
                        self.pool.stub(address),
                        method,
                        request,
                        timeout=timeout,
                        payloads=payloads,
                        expected_bytes=expected_bytes,
                    ),
                    timeout + STALLED_STREAM_S,
                )
            except grpc.aio.AioRpcError as e:
                broken = self._broken_after(request.stage, e) if method == "Chain" else None
                if broken is None:
                    raise
                raise broken from None
            received = response.ByteSize()
            self.bytes_received += received
            timed.nbytes = sent + received
            timed.remote_seconds = getattr(response, "handler_seconds", 0.0)  # only a chain's reply says it
        return response

    def _broken_after(self, stage: int, error: grpc.aio.AioRpcError) -> ChainBroken | None:
        """The break a chain called at ``stage`` reports from a later stage; None when ``error`` is the called
        peer's own (another status, or a break it claims at its own stage or at none the run has)."""
        broken = ChainBroken.parse(error.details()) if error.code() == BROKEN else None
        if broken is None or not stage < broken.stage < self.num_stages:
            return None
        return broken

    async def close(self) -> None:
        await self.pool.close()
