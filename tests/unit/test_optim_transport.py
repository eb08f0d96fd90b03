"""Optimizer state survives the trip to a new replica: tensors apart, everything else through JSON."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from swarmpipe.peer.model.bytegpt import PipelineStage, lm_loss
from swarmpipe.peer.optim import build_optimizer, set_learning_rate
from swarmpipe.peer.spec import ModelSpec, OptimizerSpec, RunSpec

pytestmark = pytest.mark.unit
torch.set_num_threads(1)


def _split(state: dict) -> tuple[dict[str, torch.Tensor], str]:
    """Tensors by name, and a JSON document with param groups and plain scalars."""
    tensors, scalars = {}, {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = value.clone()
            else:
                assert isinstance(value, (int, float, bool)), (key, type(value))
                scalars.setdefault(str(index), {})[key] = value
    return tensors, json.dumps({"param_groups": state["param_groups"], "scalars": scalars})


def _join(tensors: dict[str, torch.Tensor], doc: str) -> dict:
    meta = json.loads(doc)
    entries: dict[int, dict] = {}
    for name, value in tensors.items():
        index, key = name.split(".", 1)
        entries.setdefault(int(index), {})[key] = value
    for index, scalars in meta["scalars"].items():
        entries.setdefault(int(index), {}).update(scalars)
    return {"state": entries, "param_groups": meta["param_groups"]}


@pytest.mark.parametrize(
    "kind,stash", [("adamw", True), ("nesterov", True), ("nesterov", False), ("basis_rotation", True)]
)
def test_state_through_json_continues_identically(kind: str, stash: bool) -> None:
    opt_spec = OptimizerSpec(kind=kind, stash=stash, rotation_every=2, warmup_steps=2, total_steps=20)
    gen = torch.Generator().manual_seed(5)
    batches = [
        (torch.randint(0, 256, (2, 8), generator=gen), torch.randint(0, 256, (2, 8), generator=gen)) for _ in range(7)
    ]

    def train(stage: PipelineStage, opt: torch.optim.Optimizer, part: list, start: int) -> None:
        for i, (x, y) in enumerate(part):
            set_learning_rate(opt, opt_spec, start + i, 0, 3)
            lm_loss(stage(x), y).backward()
            torch.nn.utils.clip_grad_norm_(stage.parameters(), opt_spec.clip_norm)
            opt.step()
            opt.zero_grad()

    # A whole model in one module (token ids in, logits out), but its optimizer built as stage 0
    # of 3, so the no-stash momentum and lr corrections are active.
    one = RunSpec(num_stages=1, model=ModelSpec(d_model=16, n_layers=3, n_heads=2, seq_len=8))
    stage = PipelineStage(one, 0)
    opt = build_optimizer(stage.named_parameters(), opt_spec, 0, 3)
    train(stage, opt, batches[:4], 0)
    weights = copy.deepcopy(stage.state_dict())
    tensors, doc = _split(opt.state_dict())
    train(stage, opt, batches[4:], 4)

    replica = PipelineStage(one, 0)
    replica.load_state_dict(weights)
    replica_opt = build_optimizer(replica.named_parameters(), opt_spec, 0, 3)
    replica_opt.load_state_dict(_join(tensors, doc))
    train(replica, replica_opt, batches[4:], 4)
    for a, b in zip(stage.parameters(), replica.parameters()):
        assert torch.equal(a, b)
