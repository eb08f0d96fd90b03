"""Helpers for tests that run a real swarm of subprocesses on 127.0.0.1 (imported as ``swarm_support``)."""
from __future__ import annotations

import json
import os
import signal
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

from swarmpipe.cli.launcher import Launched, ProcessGroup, coordinator_http_url, read_json, wait_for

# A model small enough that several peers share two cores comfortably.
SMALL_SPEC = """
run_id = "{run_id}"
num_stages = {num_stages}
microbatch_size = 8
seed = 0
{top}
[model]
d_model = 64
n_layers = {n_layers}
n_heads = 4
seq_len = 32

[optimizer]
kind = "adamw"
lr = 3e-3
warmup_steps = 5

[limits]
max_message_mb = {max_message_mb}
"""


class Swarm:
    """Start and inspect coordinator, peers and trainers as real processes."""

    def __init__(self, workdir: Path, run_id: str = "test"):
        self.workdir = workdir
        self.run_id = run_id
        self.group = ProcessGroup(workdir, env={"SWARMPIPE_LOG_LEVEL": "INFO"})
        self.coordinator: Launched | None = None
        self.maddr = ""
        self.url = ""
        self.events = workdir / "events.jsonl"
        self._peer_count = 0

    def write_spec(self, num_stages: int = 2, n_layers: int = 2, max_message_mb: int = 16, extra: str = "",
                   top: str = "") -> Path:
        """``top``: top-level keys; ``extra``: whole tables appended at the end."""
        path = self.workdir / "spec.toml"
        path.write_text(SMALL_SPEC.format(run_id=self.run_id, num_stages=num_stages, n_layers=n_layers,
                                          max_message_mb=max_message_mb, top=top) + textwrap.dedent(extra))
        return path

    def start_coordinator(self, spec: Path | None = None, *args: str, wait: bool = True) -> Launched:
        spec = spec or self.write_spec()
        peers_file = self.workdir / "initial_peers.txt"
        peers_file.unlink(missing_ok=True)
        self.coordinator = self.group.start(
            "coordinator", "coordinator", "--spec", str(spec), "--http-port", "0", "--peers-file", str(peers_file),
            "--identity", str(self.workdir / "swarmpipe.coordinator.key"), "--checkpoint-dir", str(self.workdir / "checkpoints"),
            "--event-log", str(self.events), *args)
        if wait:
            wait_for(peers_file.exists, 60, "coordinator initial peers", procs=[self.coordinator])
            self.maddr = peers_file.read_text().split()[0]
            self.url = wait_for(lambda: self._new_url(), 15, "coordinator dashboard url", procs=[self.coordinator])
        return self.coordinator

    def _new_url(self) -> str | None:
        lines = [line for line in self.coordinator.log_text().splitlines() if line.startswith("dashboard: ")]
        return lines[-1].split("dashboard: ", 1)[1].strip().rstrip("/") if lines else None

    def start_peer(self, stage: int | None = None, *args: str, wait: bool = True, name: str | None = None) -> Launched:
        self._peer_count += 1
        name = name or f"peer{self._peer_count}-s{stage if stage is not None else 'auto'}"
        ready = self.workdir / f"{name}.ready"
        stage_args = ["--stage", str(stage)] if stage is not None else []
        launched = self.group.start(name, "peer", "--initial-peers", self.maddr, "--run-id", self.run_id, *stage_args,
                                    "--ready-file", str(ready), "--event-log", str(self.events),
                                    "--announce-period", "1", *args)
        launched.ready_path = ready  # type: ignore[attr-defined]
        if wait:
            self.wait_ready(launched)
        return launched

    def wait_ready(self, launched: Launched, timeout: float = 90) -> dict:
        return wait_for(lambda: read_json(launched.ready_path), timeout, f"{launched.name} to serve", procs=[launched])

    def start_trainer(self, steps: int, *args: str, name: str = "trainer") -> tuple[Launched, Path]:
        report = self.workdir / f"{name}-report.json"
        launched = self.group.start(name, "train", "--initial-peers", self.maddr, "--run-id", self.run_id,
                                    "--steps", str(steps), "--no-progress", "--report", str(report),
                                    "--event-log", str(self.events), "--announce-period", "1", *args)
        return launched, report

    def wait_report(self, trainer: Launched, report: Path, timeout: float) -> dict:
        wait_for(lambda: not trainer.alive(), timeout, "the trainer to finish")
        data = read_json(report)
        assert data is not None, f"trainer wrote no report (exit {trainer.proc.returncode}):\n{trainer.log_text()[-4000:]}"
        return data

    def api(self, path: str = "/api/swarm") -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return json.loads(response.read())

    def read_events(self) -> list[dict]:
        if not self.events.exists():
            return []
        return [json.loads(line) for line in self.events.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        self.group.stop_all()


def kill_tree(launched: Launched) -> None:
    """SIGKILL a role and its children (its DHT process and p2pd), like a machine vanishing."""
    try:
        os.killpg(launched.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    launched.proc.wait(timeout=10)


def events_of(swarm: Swarm, kind: str) -> list[dict]:
    return [e for e in swarm.read_events() if e.get("kind") == kind]


def wait_step(swarm: Swarm, step: int, trainer: Launched, timeout: float = 180) -> int:
    """Wait until the trainer reports at least ``step`` completed micro-batches; returns the newest step."""
    def newest() -> int:
        steps = [e.get("step") or 0 for e in events_of(swarm, "progress")]
        return max(steps, default=0)
    wait_for(lambda: newest() >= step and newest() or (step == 0), timeout, f"trainer step {step}", procs=[trainer])
    return newest()


def assert_trained(report: dict, min_steps: int) -> None:
    """The invariants every fault scenario ends with."""
    report = {k: v for k, v in report.items() if k != "losses"}
    assert report["microbatches_lost"] == 0, report
    assert report["microbatches_completed"] + report["microbatches_dropped_stale"] == report["microbatches_started"], report
    assert report["microbatches_completed"] >= min_steps, report
    assert report["loss_last"] < report["loss_first"] - 0.3, (report["loss_first"], report["loss_last"])
