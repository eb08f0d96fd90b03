"""The coordinator serves each stage's base weights from its copy of the run's Hugging Face checkpoint.

A volunteer without the files downloads its stage's tensors with ``DownloadState(base=true)``; the
coordinator reads exactly those tensors (never the whole model) and keeps the last stage it read for a
short while, so the shards of one sharded download come from one read. Memory: one stage at a time.
"""

from __future__ import annotations

import threading
import time

from swarmpipe.peer.model import build_stage, checkpoint_name
from swarmpipe.peer.model.hf_checkpoint import CheckpointError, HFCheckpoint
from swarmpipe.peer.model.lora import is_adapter
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.state.format import StageState

KEEP_S = 30.0


class BaseWeights:
    def __init__(self, spec: RunSpec):
        if not spec.model.checkpoint:
            raise CheckpointError("the run has no base checkpoint")
        self.spec = spec
        self.checkpoint = HFCheckpoint.open(spec.model.checkpoint)
        if self.checkpoint.digest() != spec.model.base_digest:
            raise CheckpointError(f"{spec.model.checkpoint} changed since the spec was resolved (digest differs)")
        self._lock = threading.Lock()
        self._kept: tuple[int, float, StageState] | None = None

    def stage_state(self, stage: int) -> StageState:
        """The stage's base parameters as a state (version 0, no optimizer); call off the event loop."""
        if not 0 <= stage < self.spec.num_stages:
            raise CheckpointError(f"stage {stage} does not exist (the run has {self.spec.num_stages})")
        with self._lock:
            if self._kept is not None and self._kept[0] == stage and time.monotonic() - self._kept[1] < KEEP_S:
                return self._kept[2]
            shapes = {n: p.shape for n, p in build_stage(self.spec, stage, empty=True).named_parameters()}
            names = [n for n in shapes if not is_adapter(n)]
            wanted = {n: checkpoint_name(self.spec, n) for n in names}
            tensors = self.checkpoint.read(sorted(set(wanted.values())))
            for name, source in wanted.items():
                if tensors[source].shape != shapes[name]:
                    raise CheckpointError(
                        f"checkpoint tensor {source} has shape {list(tensors[source].shape)}, "
                        f"stage {stage} needs {list(shapes[name])}"
                    )
            meta = {
                "run_id": self.spec.run_id,
                "stage": stage,
                "version": 0,
                "base": True,
                "base_digest": self.spec.model.base_digest,
            }
            state = StageState({f"param.{n}": tensors[source] for n, source in wanted.items()}, meta)
            self._kept = (stage, time.monotonic(), state)
            return state
