"""The one reading of a chain's answer (``ChainResponse``), for the trainer and for the peer that called the next
stage alike: the loss finite, one result per stage from the one called to the chain's end, in order, and the
gradient of the chain's input of the shape that input had, finite and no outlier for the stage that returned it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarmpipe.peer.client.answers import AnswerChecks
from swarmpipe.peer.transport.wire import WireError
from swarmpipe.protos import swarm_pb2


@dataclass
class ChainAnswer:
    loss: float  # the last stage's; meaningless for a chain that ends before it
    stages: list[swarm_pb2.ChainStageResult]  # what each stage from the one called to the chain's end did
    grad: torch.Tensor | None  # the gradient of the chain's input; None from stage 0 (its input is tokens)


def read_chain_answer(
    checks: AnswerChecks,
    response: swarm_pb2.ChainResponse,
    stage: int,
    end: int,
    input_shape: tuple[int, ...],
) -> ChainAnswer:
    """The answer of a chain called at ``stage`` that runs to ``end``; ``WireError`` when it breaks a rule."""
    loss = checks.loss(stage, response.loss)
    stages = list(response.stages)
    seen = [s.stage for s in stages]
    if seen != list(range(stage, end + 1)):
        raise WireError(f"stage {stage} answered for stages {seen[:8]}; {stage}..{end} were due")
    grad = None
    if stage > 0:
        grad = checks.tensor(response.grad_input, kind="gradients", stage=stage, shape=input_shape, what="grad_input")
    return ChainAnswer(loss, stages, grad)
