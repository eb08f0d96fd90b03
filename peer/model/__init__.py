"""Model families, one module each behind the same small interface.

A family module has ``build_stage(spec, stage, empty=False) -> nn.Module`` (a stage with ``is_first``,
``is_last`` and ``stage``; ``empty``: parameters on the meta device, to be loaded from a checkpoint)
and, when it reads Hugging Face checkpoints, ``checkpoint_name(param_name) -> str``. Adding a family
(e.g. a mixture of experts) is one new module and one line in ``FAMILIES``. The loss is the same for
every family: next-token cross-entropy on the last stage's logits.
"""

from __future__ import annotations

import importlib

from torch import nn

from swarmpipe.peer.model.bytegpt import PipelineStage, lm_loss
from swarmpipe.peer.model.lora import apply_lora
from swarmpipe.peer.spec import RunSpec

FAMILIES = {"bytegpt": "swarmpipe.peer.model.bytegpt", "llama": "swarmpipe.peer.model.llama"}


def family(spec: RunSpec):
    """The module of ``spec.model.family`` (imported on first use: bytegpt never loads transformers)."""
    return importlib.import_module(FAMILIES[spec.model.family])


def has_base_checkpoint(spec: RunSpec) -> bool:
    """Whether the stage's starting weights come from a checkpoint rather than the run's seed."""
    return bool(spec.model.checkpoint)


def build_stage(spec: RunSpec, stage: int, empty: bool = False) -> nn.Module:
    """Stage ``stage`` of the run's model, with LoRA adapters when the spec fine-tunes with LoRA.

    ``empty``: base parameters on the meta device (no memory) until a checkpoint's are assigned; the
    adapters are real from the start (they never come from the base checkpoint)."""
    module = family(spec).build_stage(spec, stage, empty=empty)
    if spec.finetune.method == "lora":
        apply_lora(module, spec.finetune, spec.seed, stage)
    return module


def checkpoint_name(spec: RunSpec, name: str) -> str:
    """The base checkpoint's tensor name for a stage parameter."""
    return family(spec).checkpoint_name(spec, name)


__all__ = ["FAMILIES", "PipelineStage", "build_stage", "checkpoint_name", "family", "has_base_checkpoint", "lm_loss"]
