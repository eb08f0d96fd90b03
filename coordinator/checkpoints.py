"""Checkpoints: atomic folders of safetensors + JSON, and a gRPC server that hands them out.

Layout under ``--checkpoint-dir``::

    ckpt-000012/stage-0.safetensors   weights and optimizer tensors of stage 0
    ckpt-000012/stage-0.json          version, optimizer scalars, digest
    ckpt-000012/manifest.json         step, per-stage versions and digests
    ckpt-000012/spec.json             the run spec (RunSpec.to_dict()): the folder describes itself
    latest                            "ckpt-000012" (replaced atomically)

A checkpoint is written into a temporary folder and renamed into place, so a
crash mid-write never leaves a half checkpoint behind ``latest``. A stage that
could not be pulled this round is carried over from the previous checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from safetensors.torch import load_file, save_file

from swarmpipe.coordinator.base_weights import BaseWeights
from swarmpipe.peer.model.hf_checkpoint import CheckpointError
from swarmpipe.peer.plan.memory import state_bytes_bound
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.state.format import StageState, to_chunks
from swarmpipe.peer.state.push import PUSH_TIMEOUT_S, pusher_problem
from swarmpipe.peer.state.transfer import receive_pushed
from swarmpipe.peer.swarm.identity import Identity
from swarmpipe.peer.swarm.records import StageRecord
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

log = logging.getLogger("swarmpipe.checkpoints")
KEEP = 3


class CheckpointStore:
    def __init__(self, root: str | Path, num_stages: int, spec: RunSpec | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.num_stages = num_stages
        self.spec = spec  # copied into every checkpoint as spec.json (what `swarmpipe export` reads)

    def latest_dir(self) -> Path | None:
        try:
            name = (self.root / "latest").read_text().strip()
        except OSError:
            return None
        path = self.root / name
        return path if path.is_dir() else None

    def manifest(self) -> dict[str, Any] | None:
        latest = self.latest_dir()
        if latest is None:
            return None
        return json.loads((latest / "manifest.json").read_text())

    def save(self, states: dict[int, StageState]) -> dict[str, Any]:
        """Write a new checkpoint with ``states``; other stages are carried over from the latest one."""
        previous = self.latest_dir()
        old = self.manifest() or {"step": 0, "stages": {}}
        step = int(old["step"]) + 1
        name = f"ckpt-{step:06d}"
        tmp = self.root / f".tmp-{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        stages: dict[str, Any] = {}
        for stage in range(self.num_stages):
            if stage in states:
                state = states[stage]
                save_file(
                    {k: v.contiguous() for k, v in state.tensors.items()}, str(tmp / f"stage-{stage}.safetensors")
                )
                meta = dict(state.meta, digest=state.digest())
                (tmp / f"stage-{stage}.json").write_text(json.dumps(meta))
                stages[str(stage)] = {"version": state.version, "digest": meta["digest"], "saved_at": time.time()}
            elif previous is not None and str(stage) in old["stages"]:
                for suffix in (".safetensors", ".json"):
                    shutil.copy2(previous / f"stage-{stage}{suffix}", tmp / f"stage-{stage}{suffix}")
                stages[str(stage)] = old["stages"][str(stage)]
        manifest = {"step": step, "created_at": time.time(), "stages": stages}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
        if self.spec is not None:
            (tmp / "spec.json").write_text(json.dumps(self.spec.to_dict(), indent=2))
        os.replace(tmp, self.root / name)
        pointer = self.root / ".latest.tmp"
        pointer.write_text(name)
        os.replace(pointer, self.root / "latest")
        self._prune(keep=name)
        return manifest

    def load(self, stage: int) -> StageState | None:
        latest = self.latest_dir()
        if latest is None or not (latest / f"stage-{stage}.safetensors").exists():
            return None
        tensors = load_file(str(latest / f"stage-{stage}.safetensors"))
        meta = json.loads((latest / f"stage-{stage}.json").read_text())
        return StageState(tensors, meta)

    def _prune(self, keep: str) -> None:
        folders = sorted(p for p in self.root.glob("ckpt-*") if p.is_dir())
        for path in folders[:-KEEP]:
            if path.name != keep:
                shutil.rmtree(path, ignore_errors=True)
        for stale in self.root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)


class CheckpointServicer(swarm_pb2_grpc.StageServicer):
    """The coordinator's side of state transfer: serves checkpoints (signed by the coordinator), accepts
    handed-over state only from a replica announced on that stage, signed by it, of a version it announced."""

    def __init__(
        self,
        store: CheckpointStore | None,
        spec: RunSpec,
        on_saved=None,
        base: BaseWeights | None = None,
        identity: Identity | None = None,
        stage_members: Callable[[int], Awaitable[dict[str, StageRecord]]] | None = None,
    ):
        self.store = store
        self.spec = spec
        self.run_id = spec.run_id
        self.on_saved = on_saved
        self.base = base  # serves each stage's base weights when the run starts from a HF checkpoint
        self.identity = identity
        self.stage_members = stage_members

    async def DownloadState(self, request: swarm_pb2.DownloadStateRequest, context: grpc.aio.ServicerContext):
        if request.run_id != self.run_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"wrong run id {request.run_id!r}")
        if request.base:
            if self.base is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, "this run has no base checkpoint")
            try:
                state = await asyncio.to_thread(self.base.stage_state, request.stage)
            except CheckpointError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        else:
            state = self.store.load(request.stage) if self.store is not None else None
        if state is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoint of stage {request.stage}")
        try:
            chunks = to_chunks(state, request.shard, request.num_shards or 1, signer=self.identity)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        for chunk in chunks:
            yield chunk

    async def PushState(self, request_iterator, context: grpc.aio.ServicerContext) -> swarm_pb2.PushStateResponse:
        if self.store is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this coordinator keeps no checkpoints (--checkpoint-dir)")
        signed = self.identity is not None
        cap = max(state_bytes_bound(self.spec, s) for s in range(self.spec.num_stages))
        try:
            state = await asyncio.wait_for(receive_pushed(request_iterator, cap, signed=signed), PUSH_TIMEOUT_S)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the pushed state took too long")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)[:300])
        stage = int(state.meta.get("stage", -1))
        if state.meta.get("run_id") != self.run_id or not 0 <= stage < self.store.num_stages:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"state for run {str(state.meta.get('run_id'))[:64]!r} stage {stage} does not belong here",
            )
        if signed:
            code, problem = await self._pusher_problem(state, stage)
            if problem:
                await context.abort(code, problem)
        manifest = self.store.save({stage: state})
        if self.on_saved is not None:
            await self.on_saved(manifest, reason=f"handoff of stage {stage}")
        return swarm_pb2.PushStateResponse(
            accepted=True, version=state.version, detail=f"checkpointed as step {manifest['step']}"
        )

    async def _pusher_problem(self, state: StageState, stage: int) -> tuple[grpc.StatusCode, str]:
        """Why a pushed state may not become the stage's checkpoint ('' when it may)."""
        members = await self.stage_members(stage) if self.stage_members is not None else {}
        return pusher_problem(state, stage, members)

    async def Info(self, request: swarm_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> swarm_pb2.InfoResponse:
        return swarm_pb2.InfoResponse(state="coordinator", stage=-1)
