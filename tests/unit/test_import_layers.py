"""Imports point down (docs/ARCHITECTURE.md): cli -> coordinator -> peer roles -> model/optim/swarm ->
transport -> protos. A module that imports upwards, or one role that imports another, fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
SHARED = {"spec", "config", "events", "norm_guard"}

# layer -> the layers it may import (itself always allowed)
ALLOWED: dict[str, set[str]] = {
    "cli": {"coordinator", "stage", "trainer", "client", "state", "plan", "data", "model", "optim", "swarm"}
    | {"transport", "shared", "protos"},
    # the coordinator keeps checkpoints: it takes the state layer, never a volunteer's stage code
    "coordinator": {"state", "plan", "model", "optim", "swarm", "transport", "shared", "protos"},
    "stage": {"client", "state", "plan", "model", "optim", "swarm", "transport", "shared", "protos"},
    "trainer": {"client", "data", "swarm", "transport", "shared", "protos"},
    # one way to call a stage, for trainers and for peers' chains alike (connections, codecs, answer checks)
    "client": {"swarm", "transport", "shared", "protos"},
    # the state format, signing, transfer and robust aggregation that stages and checkpoints share
    "state": {"plan", "swarm", "transport", "shared", "protos"},
    "plan": {"model", "optim", "shared"},  # what a stage costs (memory), before anyone starts it
    "data": {"shared"},
    "optim": {"model", "shared"},
    "model": {"shared"},
    "swarm": {"transport", "shared", "protos"},
    "transport": {"protos"},
    "shared": {"transport"},  # the spec validates codec names against the registry
    "protos": set(),
}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "swarmpipe" or len(parts) < 2:
        return None
    if parts[1] in ("cli", "coordinator", "protos"):
        return parts[1]
    if parts[1] == "peer" and len(parts) > 2:
        return "shared" if parts[2] in SHARED else parts[2]
    return None


def modules() -> dict[str, Path]:
    found = {}
    for folder, name in (
        ("swarmpipe", "swarmpipe"),
        ("peer", "swarmpipe.peer"),
        ("coordinator", "swarmpipe.coordinator"),
        ("protos", "swarmpipe.protos"),
    ):
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([name, *parts])] = path
    return found


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_imports_point_down():
    wrong = []
    for module, path in modules().items():
        mine = layer_of(module)
        if mine is None:
            continue
        for imported in imports_of(path):
            theirs = layer_of(imported)
            if theirs is not None and theirs != mine and theirs not in ALLOWED[mine]:
                wrong.append(f"{module} ({mine}) imports {imported} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_nothing_imports_the_old_top_level_names():
    wrong = [
        f"{module} imports {name}"
        for module, path in modules().items()
        for name in imports_of(path)
        if name.split(".")[0] in ("peer", "coordinator", "protos")
    ]
    assert not wrong, "\n".join(wrong)


def test_the_coordinator_imports_nothing_of_a_volunteers_stage():
    wrong = [
        f"{module} imports {name}"
        for module, path in modules().items()
        if module.startswith("swarmpipe.coordinator")
        for name in imports_of(path)
        if name.startswith("swarmpipe.peer.stage")
    ]
    assert not wrong, "\n".join(wrong)
