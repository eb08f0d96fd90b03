"""The trainer's calls to one stage replica: Forward, ForwardBackward, Backward, encoded and checked.

One pooled channel per peer; a tensor above 1 MiB (or half the message cap) goes as a chunked stream; the bytes
moved and the time taken feed the per-peer bandwidth estimate that ``auto`` codecs are chosen from; 8-bit
gradients carry what quantization lost into the next one (error feedback). Every tensor a peer returns is
decoded against the shape it must have and the element cap, and its norm against what this trainer has seen
from that stage (``NormGuard``): a stage's output or gradient is passed on to the next stage only when it is
finite and not a wild outlier, so one broken or hostile replica cannot push 1e6-scaled values down the pipeline.
A refused tensor raises ``WireError`` and the caller retries elsewhere, as for any failed call.

``exact=True`` sends and asks for float32 without compression: verification probes (``verification.py``)
measure small differences that a lossy codec would drown.
"""

from __future__ import annotations

import hashlib
import hmac
import os

import torch

from swarmpipe.peer.norm_guard import NormGuard
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.trainer.routing import PeerView
from swarmpipe.peer.transport.channels import ChannelPool
from swarmpipe.peer.transport.codec_policy import CodecPolicy, ErrorFeedback
from swarmpipe.peer.transport.streaming import StreamingCaller
from swarmpipe.peer.transport.wire import WireError, decode, encode, encode_parts
from swarmpipe.protos import swarm_pb2

# Activations are layer outputs of a residual stream: they drift slowly, so a 100x jump is no honest spike.
ACTIVATION_FACTOR = 100.0


class StageCalls:
    def __init__(self, spec: RunSpec, call_timeout: float):
        self.spec = spec
        self.call_timeout = call_timeout
        self.pool = ChannelPool(spec.limits.max_message_mb)
        cap = spec.limits.max_message_mb << 20
        self.caller = StreamingCaller(
            threshold_bytes=min(1 << 20, cap // 2),
            chunk_bytes=min(1 << 20, cap // 2),
            max_total_bytes=spec.limits.max_stream_mb << 20,
        )
        self.act_codec = spec.compression.activations  # "auto": chosen per hop from measured bandwidth
        self.grad_codec = spec.compression.gradients
        self.policy = CodecPolicy()
        self.error_feedback = ErrorFeedback()
        self._ticket_key = os.urandom(32)  # never leaves this process; tickets derive from it
        # per stage: the norms of what its replicas returned (per sample), learned from accepted values only
        self.guards: dict[tuple[str, int], NormGuard] = {}
        # peer id -> the newest weight version it answered with (verification judges only answers close in version)
        self.versions: dict[str, int] = {}
        # (peer id, micro-batch id) -> the version a training call was answered at (a check reads it at once)
        self.answered: dict[tuple[str, str], int] = {}
        self.bytes_sent = 0  # request bytes of every call (trainer_bytes_per_microbatch in the report)
        self.bytes_received = 0

    async def close(self) -> None:
        await self.pool.close()

    # ------------------------------------------------------------ plumbing
    async def call(
        self,
        view: PeerView,
        method: str,
        request,
        payloads: list | None = None,
        timeout: float | None = None,
        expected_bytes: int | None = None,
    ):
        """Unary when small, chunked stream when large. ``payloads``: the request's tensor bytes as buffers,
        per tensor field (None: in the message); a streamed request frames them straight from tensor storage.
        ``timeout``: the call's deadline (default ``call_timeout``; a chained call covers several stages).
        ``expected_bytes``: the reply's size when it is larger than the request (a handover's output)."""
        sent = request.ByteSize() + sum(memoryview(p).nbytes for p in payloads or () if p is not None)
        self.bytes_sent += sent  # counted even when the call fails: the bytes left all the same
        with self.policy.timed(view.address) as timed:
            response = await self.caller.call(
                self.pool.channel(view.address),
                self.pool.stub(view.address),
                method,
                request,
                timeout=timeout or self.call_timeout,
                payloads=payloads,
                expected_bytes=expected_bytes,
            )
            self.bytes_received += response.ByteSize()
            timed.nbytes = sent + response.ByteSize()
        if len(self.versions) < 100_000 or view.peer_id in self.versions:  # bounded however many peers lie
            self.versions[view.peer_id] = max(response.version, self.versions.get(view.peer_id, 0))
        self.answered[(view.peer_id, request.microbatch_id)] = response.version
        while len(self.answered) > 10_000:  # the oldest first: a check reads its entry right after the call
            self.answered.pop(next(iter(self.answered)))
        return response

    def ticket(self, mb_id: str) -> bytes:
        """This trainer's secret for a micro-batch: a peer lets only its holder send that micro-batch's backward."""
        return hmac.new(self._ticket_key, mb_id.encode(), hashlib.sha256).digest()[:16]

    def codec(self, role: str, view: PeerView, t: torch.Tensor, exact: bool = False) -> str:
        if exact:
            return "none"
        configured = self.act_codec if role == "activations" else self.grad_codec
        return self.policy.choose(role, configured, view.address, t.numel() * 4)

    def encode_grad(self, stage: int, view: PeerView, grad: torch.Tensor) -> swarm_pb2.Tensor:
        codec = self.codec("gradients", view, grad)
        if codec in ("uint8", "blockwise8"):  # 8-bit: carry what quantization lost into the next gradient
            return self.error_feedback.encode((stage, tuple(grad.shape)), grad, codec)
        return encode(grad, codec)

    def bounded(self, kind: str, stage: int, t: torch.Tensor) -> torch.Tensor:
        """``t`` if finite and not an outlier for what ``stage`` returns as ``kind``; else ``WireError``."""
        guard = self.guards.get((kind, stage))
        if guard is None:
            factor = ACTIVATION_FACTOR if kind == "activations" else NormGuard.factor
            guard = self.guards[(kind, stage)] = NormGuard(what=f"stage {stage} {kind}", factor=factor)
        problem = guard.check(float(t.norm()) / max(1, t.shape[0]))
        if problem:
            raise WireError(problem)
        return t

    # ------------------------------------------------------------ the three compute calls
    async def forward(
        self, view: PeerView, stage: int, mb_id: str, x: torch.Tensor, evaluate: bool = False, exact: bool = False
    ) -> torch.Tensor:
        codec = self.codec("activations", view, x, exact)
        header, payload = encode_parts(x, codec)
        request = swarm_pb2.ForwardRequest(
            run_id=self.spec.run_id,
            stage=stage,
            microbatch_id=mb_id,
            input=header,
            reply_codec=codec,
            evaluate=evaluate,
            ticket=b"" if evaluate else self.ticket(mb_id),
        )
        response = await self.call(view, "Forward", request, payloads=[payload])
        last = stage == self.spec.num_stages - 1  # an evaluate Forward there answers with logits
        out = decode(
            response.output,
            max_elements=self.spec.limits.max_tensor_elements,
            expect_shape=(x.shape[0], x.shape[1], self.spec.model.vocab_size if last else self.spec.model.d_model),
            what="forward output",
        ).float()
        return out if evaluate else self.bounded("activations", stage, out)

    async def forward_backward(
        self,
        view: PeerView,
        stage: int,
        mb_id: str,
        x: torch.Tensor,
        targets: torch.Tensor,
        evaluate: bool = False,
        exact: bool = False,
    ) -> tuple[float, torch.Tensor | None, bool]:
        """(loss, input gradient, dropped as stale); with ``evaluate``, the loss alone: (loss, None, False)."""
        header, payload = encode_parts(x, self.codec("activations", view, x, exact))
        request = swarm_pb2.ForwardBackwardRequest(
            run_id=self.spec.run_id,
            stage=stage,
            microbatch_id=mb_id,
            input=header,
            targets=encode(targets),
            reply_codec=self.codec("gradients", view, x, exact),
            evaluate=evaluate,
        )
        response = await self.call(view, "ForwardBackward", request, payloads=[payload, None])
        if not torch.isfinite(torch.tensor(response.loss)):
            raise WireError(f"stage {stage} returned a non-finite loss")
        if evaluate:
            return response.loss, None, False
        grad = None
        if stage > 0:
            grad = decode(
                response.grad_input,
                max_elements=self.spec.limits.max_tensor_elements,
                expect_shape=tuple(x.shape),
                what="grad_input",
            ).float()
            grad = self.bounded("gradients", stage, grad)
        return response.loss, grad, not response.applied

    async def backward(
        self, view: PeerView, stage: int, mb_id: str, grad: torch.Tensor, replay_input: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, bool]:
        """(input gradient, dropped as stale); ``replay_input``: recompute there from this input."""
        request = swarm_pb2.BackwardRequest(
            run_id=self.spec.run_id,
            stage=stage,
            microbatch_id=mb_id,
            grad_output=self.encode_grad(stage, view, grad),
            reply_codec=self.codec("gradients", view, grad),
            ticket=self.ticket(mb_id),
        )
        payloads: list = [None, None]  # grad_output (error-feedback encoded, in the message), input
        if replay_input is not None:
            header, payloads[1] = encode_parts(replay_input, self.codec("activations", view, replay_input))
            request.input.CopyFrom(header)
            request.replay = True
        response = await self.call(view, "Backward", request, payloads=payloads)
        grad_in = None
        if stage > 0:
            grad_in = decode(
                response.grad_input,
                max_elements=self.spec.limits.max_tensor_elements,
                expect_shape=(grad.shape[0], grad.shape[1], self.spec.model.d_model),
                what="grad_input",
            ).float()
            grad_in = self.bounded("gradients", stage, grad_in)
        return grad_in, not response.applied
