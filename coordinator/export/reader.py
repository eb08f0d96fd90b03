"""Reading a checkpoint for export: its folder, its run spec, the base model folder, and its stage files,
checked against the names and shapes the spec implies before anything is written."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from swarmpipe.peer.spec import RunSpec, load_spec, spec_from_dict

SPEC_FILE = "spec.json"
PARAM_PREFIX = "param."  # stage files also hold ``optim.*`` state, which export ignores

Shapes = dict[str, tuple[int, ...]]


class ExportError(ValueError):
    """A checkpoint that cannot be exported: missing stage or tensor, wrong shape, wrong base, no spec."""


def some_names(names: list[str], limit: int = 5) -> str:
    """The first ``limit`` names and how many more: errors stay readable for a whole model's tensors."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def wrong_shapes(found: Shapes, expected: Shapes) -> list[str]:
    """``name [found] (expected [shape])`` for each expected tensor that is present with another shape."""
    return [
        f"{n} {list(found[n])} (expected {list(shape)})"
        for n, shape in expected.items()
        if n in found and found[n] != shape
    ]


class OpenFiles:
    """safetensors files opened on first use and closed together: a model's tensors are spread over
    shards, and each shard is opened once however many tensors are read from it."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def get(self, path: Path) -> Any:
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._handles[path]


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint root (follow ``latest``) or one ``ckpt-*`` folder -> the checkpoint folder."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"no checkpoint folder at {path}")
    latest = path / "latest"
    if latest.is_file():
        name = latest.read_text().strip()
        if not name or not (path / name).is_dir():
            raise ExportError(f"{latest} names {name!r}, which is not a folder in {path}")
        return path / name
    if (path / "manifest.json").is_file() or any(path.glob("stage-*.safetensors")):
        return path
    raise ExportError(f"{path} is neither a checkpoint root (no `latest`) nor a checkpoint folder (no stage files)")


def read_spec(folder: Path, spec: RunSpec | str | Path | None = None) -> RunSpec:
    """The explicit ``spec`` (object or file), else the checkpoint's ``spec.json``."""
    if isinstance(spec, RunSpec):
        try:
            return spec.validate()
        except ValueError as e:
            raise ExportError(f"cannot use the spec: {e}") from e
    path = Path(spec) if spec is not None else folder / SPEC_FILE
    if not path.is_file():
        if spec is not None:
            raise ExportError(f"no spec file at {path}")
        raise ExportError(f"{folder} has no {SPEC_FILE}: this checkpoint predates spec.json; pass --spec")
    try:
        if path.suffix == ".json":
            return spec_from_dict(json.loads(path.read_text()))
        return load_spec(path)
    except (ValueError, OSError) as e:
        raise ExportError(f"cannot use the spec in {path}: {e}") from e


def base_folder(run: RunSpec, base: str | Path | None) -> Path | None:
    """The base model folder: ``base`` when given, else the spec's ``model.checkpoint`` when it is a
    Hugging Face folder on this machine, else None."""
    if base is not None and str(base):
        path = Path(base)
        if not (path / "config.json").is_file():
            raise ExportError(f"--base {path} is not a Hugging Face model folder (no config.json)")
        return path
    if run.model.checkpoint and (Path(run.model.checkpoint) / "config.json").is_file():
        return Path(run.model.checkpoint)
    return None


class StageFiles:
    """The stage files of one checkpoint folder, opened lazily; only ``param.*`` tensors are read."""

    def __init__(self, folder: Path, spec: RunSpec):
        self.folder = folder
        self.spec = spec
        self.step: int | None = None
        manifest = folder / "manifest.json"
        if manifest.is_file():
            self.step = int(json.loads(manifest.read_text()).get("step", 0))
        self.paths: list[Path] = []
        for s in range(spec.num_stages):
            path = folder / f"stage-{s}.safetensors"
            if not path.is_file():
                raise ExportError(
                    f"stage {s} of {spec.num_stages} is missing from {folder} (no {path.name}): "
                    "no replica of it was ever checkpointed; export an older or a later checkpoint"
                )
            self._check_meta(s, folder / f"stage-{s}.json")
            self.paths.append(path)

    def _check_meta(self, stage: int, path: Path) -> None:
        if not path.is_file():
            return
        try:
            meta = json.loads(path.read_text())
        except ValueError as e:
            raise ExportError(f"{path} is not JSON: {e}") from e
        if "stage" in meta and int(meta["stage"]) != stage:
            raise ExportError(f"{path} holds stage {meta['stage']}, not stage {stage}")
        digest = meta.get("base_digest")
        if digest and digest != self.spec.model.base_digest:
            raise ExportError(
                f"stage {stage} was trained on base {digest!r}, but the spec names base "
                f"{self.spec.model.base_digest or '(none)'!r}: these adapters belong to another base model"
            )

    def shapes(self, stage: int) -> Shapes:
        with safe_open(str(self.paths[stage]), framework="pt") as f:
            return {
                k.removeprefix(PARAM_PREFIX): tuple(f.get_slice(k).get_shape())
                for k in f.keys()
                if k.startswith(PARAM_PREFIX)
            }

    def check(self, stage: int, required: Shapes, optional: Shapes) -> None:
        found = self.shapes(stage)
        where = f"stage {stage} ({self.paths[stage]})"
        missing = [n for n in required if n not in found]
        if missing:
            raise ExportError(f"{where} lacks {some_names(missing)}: the checkpoint does not match the spec")
        unexpected = [n for n in found if n not in required and n not in optional]
        if unexpected:
            raise ExportError(
                f"{where} holds unexpected tensor(s) {some_names(unexpected)}: the spec does not describe them"
            )
        wrong = wrong_shapes(found, {**required, **optional})
        if wrong:
            raise ExportError(f"{where} has tensor(s) of the wrong shape: {some_names(wrong)}")

    def stage_tensors(self, stage: int) -> Iterator[tuple[str, torch.Tensor]]:
        with safe_open(str(self.paths[stage]), framework="pt") as f:
            for key in f.keys():
                if key.startswith(PARAM_PREFIX):
                    yield key.removeprefix(PARAM_PREFIX), f.get_tensor(key)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every stage in order, one tensor at a time."""
        for s in range(self.spec.num_stages):
            yield from self.stage_tensors(s)
