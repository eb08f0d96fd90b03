"""The trainer's calls to one stage replica: Forward, ForwardBackward, Backward, and what every call it makes keeps.

The calls go through the trainer's one ``StageClient`` (peer/client/: pooled channels, streaming, per-link codecs,
error feedback for gradients, byte counts), and what a replica returns is checked there (``AnswerChecks``): each
tensor decoded against the shape it must have and the element cap, and its norm against what this trainer has
seen from that stage, so a stage's output or gradient is passed on to the next stage only when it is finite and
not a wild outlier. A refused tensor raises ``WireError`` and the caller retries elsewhere, as for any failed call.
Here: the request of each call, the trainer's tickets for its micro-batches, and the weight version each replica
answered at (verification judges only answers close in version).

``exact=True`` sends and asks for float32 without compression: verification probes (``verification.py``)
measure small differences that a lossy codec would drown.
"""

from __future__ import annotations

import hashlib
import hmac
import os

import torch

from swarmpipe.peer.client.answers import AnswerChecks
from swarmpipe.peer.client.stage_client import StageClient
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.trainer.routing import PeerView
from swarmpipe.peer.transport.wire import encode, encode_parts
from swarmpipe.protos import swarm_pb2


class StageCalls:
    def __init__(self, spec: RunSpec, client: StageClient, call_timeout: float):
        self.spec = spec
        self.client = client
        self.answers: AnswerChecks = client.answers
        self.call_timeout = call_timeout
        self._ticket_key = os.urandom(32)  # never leaves this process; tickets derive from it
        # peer id -> the newest weight version it answered with (verification judges only answers close in version)
        self.versions: dict[str, int] = {}
        # (peer id, micro-batch id) -> the version a training call was answered at (a check reads it at once)
        self.answered: dict[tuple[str, str], int] = {}

    async def close(self) -> None:
        await self.client.close()

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
        """``StageClient.call`` to ``view``, noting the version it answered at. ``timeout``: the call's deadline
        (default ``call_timeout``; a chained call covers several stages)."""
        response = await self.client.call(
            view.address,
            method,
            request,
            timeout=timeout or self.call_timeout,
            payloads=payloads,
            expected_bytes=expected_bytes,
        )
        if len(self.versions) < 100_000 or view.peer_id in self.versions:  # bounded however many peers lie
            self.versions[view.peer_id] = max(response.version, self.versions.get(view.peer_id, 0))
        self.answered[(view.peer_id, request.microbatch_id)] = response.version
        while len(self.answered) > 10_000:  # the oldest first: a check reads its entry right after the call
            self.answered.pop(next(iter(self.answered)))
        return response

    def ticket(self, mb_id: str) -> bytes:
        """This trainer's secret for a micro-batch: a peer lets only its holder send that micro-batch's backward."""
        return hmac.new(self._ticket_key, mb_id.encode(), hashlib.sha256).digest()[:16]

    def codec(self, role: str, view: PeerView, nbytes: int, exact: bool = False) -> str:
        """The codec for a ``role`` tensor of ``nbytes`` float32 bytes to or from ``view``."""
        return "none" if exact else self.client.codec(role, view.address, nbytes)

    def encode_grad(self, stage: int, view: PeerView, grad: torch.Tensor) -> swarm_pb2.Tensor:
        codec = self.codec("gradients", view, _nbytes(grad))
        return self.client.encode_gradient((stage, tuple(grad.shape)), grad, codec)

    # ------------------------------------------------------------ the three compute calls
    async def forward(
        self, view: PeerView, stage: int, mb_id: str, x: torch.Tensor, evaluate: bool = False, exact: bool = False
    ) -> torch.Tensor:
        codec = self.codec("activations", view, _nbytes(x), exact)
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
        width = self.spec.model.vocab_size if last else self.spec.model.d_model
        return self.answers.tensor(
            response.output,
            kind="activations",
            stage=stage,
            shape=(x.shape[0], x.shape[1], width),
            what="forward output",
            bounded=not evaluate,
        )

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
        header, payload = encode_parts(x, self.codec("activations", view, _nbytes(x), exact))
        request = swarm_pb2.ForwardBackwardRequest(
            run_id=self.spec.run_id,
            stage=stage,
            microbatch_id=mb_id,
            input=header,
            targets=encode(targets),
            reply_codec=self.codec("gradients", view, _nbytes(x), exact),
            evaluate=evaluate,
        )
        response = await self.call(view, "ForwardBackward", request, payloads=[payload, None])
        loss = self.answers.loss(stage, response.loss)
        if evaluate:
            return loss, None, False
        return loss, self._grad_input(response, stage, tuple(x.shape)), not response.applied

    async def backward(
        self, view: PeerView, stage: int, mb_id: str, grad: torch.Tensor, replay_input: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, bool]:
        """(input gradient, dropped as stale); ``replay_input``: recompute there from this input."""
        request = swarm_pb2.BackwardRequest(
            run_id=self.spec.run_id,
            stage=stage,
            microbatch_id=mb_id,
            grad_output=self.encode_grad(stage, view, grad),
            reply_codec=self.codec("gradients", view, _nbytes(grad)),
            ticket=self.ticket(mb_id),
        )
        payloads: list = [None, None]  # grad_output (error-feedback encoded, in the message), input
        if replay_input is not None:
            codec = self.codec("activations", view, _nbytes(replay_input))
            header, payloads[1] = encode_parts(replay_input, codec)
            request.input.CopyFrom(header)
            request.replay = True
        response = await self.call(view, "Backward", request, payloads=payloads)
        shape = (grad.shape[0], grad.shape[1], self.spec.model.d_model)
        return self._grad_input(response, stage, shape), not response.applied

    def _grad_input(self, response, stage: int, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The gradient of the stage's input, checked; None on stage 0 (its input is tokens)."""
        if stage == 0:
            return None
        return self.answers.tensor(response.grad_input, kind="gradients", stage=stage, shape=shape, what="grad_input")


def _nbytes(t: torch.Tensor) -> int:
    """``t``'s size as float32, what codecs are chosen by."""
    return 4 * t.numel()
