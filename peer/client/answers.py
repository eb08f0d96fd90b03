"""What a stage answers, checked before anything uses it or passes it on: ``AnswerChecks``.

A loss must be finite. A tensor is decoded as untrusted input (``wire.decode``: a float dtype, the element cap,
the byte count, every value finite) against the shape the caller expects, and its norm per sample must be no
wild outlier for what that stage returns as that kind (``NormGuard``): one broken or hostile replica cannot push
1e6-scaled values down the pipeline. The guards form one table per caller, keyed by (kind, stage) and learned
from accepted values only. A refused answer raises ``WireError``: the caller treats it as that replica's failure
and tries another, as for any failed call.
"""

from __future__ import annotations

import math

import torch

from swarmpipe.peer.norm_guard import NormGuard
from swarmpipe.peer.transport.wire import FLOAT_DTYPES, WireError, decode
from swarmpipe.protos import swarm_pb2

# Activations are layer outputs of a residual stream: they drift slowly, so a 100x jump is no honest spike.
# Gradients spike far more in an asynchronous swarm (norm_guard.py): NormGuard's own bound.
FACTORS = {"activations": 100.0, "gradients": NormGuard.factor}


class AnswerChecks:
    def __init__(self, max_elements: int):
        self.max_elements = max_elements
        self.guards: dict[tuple[str, int], NormGuard] = {}  # (kind, stage) -> norms of what its replicas returned

    def loss(self, stage: int, loss: float) -> float:
        if not math.isfinite(loss):
            raise WireError(f"stage {stage} returned a non-finite loss")
        return float(loss)

    def tensor(
        self,
        msg: swarm_pb2.Tensor,
        *,
        kind: str,
        stage: int,
        shape: tuple[int, ...],
        what: str,
        bounded: bool = True,
    ) -> torch.Tensor:
        """``msg`` decoded as float32, of ``shape``; with ``bounded``, its norm checked against what ``stage``
        returns as ``kind`` ("activations" or "gradients"). ``bounded=False``: a forward-only answer (logits
        on the last stage, verification probes) that nothing is passed on from."""
        t = decode(msg, max_elements=self.max_elements, allowed_dtypes=FLOAT_DTYPES, expect_shape=shape, what=what)
        t = t.float()
        return self.bounded(kind, stage, t) if bounded else t

    def bounded(self, kind: str, stage: int, t: torch.Tensor) -> torch.Tensor:
        """``t`` if finite and not an outlier for what ``stage`` returns as ``kind``; else ``WireError``."""
        guard = self.guards.get((kind, stage))
        if guard is None:
            guard = self.guards[(kind, stage)] = NormGuard(what=f"stage {stage} {kind}", factor=FACTORS[kind])
        problem = guard.check(float(t.norm()) / max(1, t.shape[0]))
        if problem:
            raise WireError(problem)
        return t
