"""Model families, one module each behind the same interface: build stage ``s`` from the run spec,
say whether it is the first or the last stage, and compute the loss on the last one."""

from swarmpipe.peer.model.bytegpt import PipelineStage, build_stage, lm_loss

__all__ = ["PipelineStage", "build_stage", "lm_loss"]
