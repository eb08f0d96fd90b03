"""A whole swarm on one machine as real processes: ``swarmpipe demo``, ``bench/`` and the tests.

:func:`spec_toml` is the one run-spec template (a model small enough that several peers share two
cores); :class:`LocalSwarm` starts a coordinator, peers and trainers on a :class:`ProcessGroup`,
waits for them, reads the coordinator's API and the shared event log, and stops everything.
"""

from __future__ import annotations

import json
import os
import textwrap
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmpipe.cli.launcher import Launched, ProcessGroup, coordinator_http_url, read_json, wait_for


# ------------------------------------------------------------------ the spec template
def spec_toml(
    run_id: str,
    num_stages: int = 2,
    *,
    n_layers: int | None = None,
    d_model: int = 64,
    n_heads: int = 4,
    seq_len: int = 32,
    microbatch_size: int = 8,
    lr: float = 3e-3,
    warmup_steps: int = 5,
    max_message_mb: int = 16,
    settings: Mapping[str, Any] | None = None,
    top: str = "",
    extra: str = "",
) -> str:
    """The run spec of a local swarm, as TOML.

    ``n_layers`` defaults to one block per stage. ``settings`` is merged over the template: top-level
    keys and whole tables as dicts (``{"update": {"max_staleness": 64}}``). ``top`` (top-level keys)
    and ``extra`` (whole tables) are raw TOML, for keys the template does not write itself.
    """
    data: dict[str, Any] = {
        "run_id": run_id,
        "num_stages": num_stages,
        "microbatch_size": microbatch_size,
        "seed": 0,
        "model": {"d_model": d_model, "n_layers": n_layers or num_stages, "n_heads": n_heads, "seq_len": seq_len},
        "optimizer": {"kind": "adamw", "lr": lr, "warmup_steps": warmup_steps},
        "limits": {"max_message_mb": max_message_mb},
    }
    data = _merged(data, settings or {})
    keys = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, Mapping)]
    if top.strip():
        keys.append(textwrap.dedent(top).strip())
    parts = ["\n".join(keys)] + [_toml_table(k, v) for k, v in data.items() if isinstance(v, Mapping)]
    return "\n\n".join(parts) + "\n" + ("\n" + textwrap.dedent(extra) if extra.strip() else "")


def write_spec(path: Path, run_id: str, num_stages: int = 2, **knobs: Any) -> Path:
    """Write :func:`spec_toml` to ``path``; ``knobs`` are its keyword arguments."""
    path = Path(path)
    path.write_text(spec_toml(run_id, num_stages, **knobs))
    return path


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = (
            _merged(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) else value
        )
    return out


def _toml_table(name: str, table: Mapping[str, Any]) -> str:
    lines = [f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, Mapping)]
    subtables = [_toml_table(f"{name}.{k}", v) for k, v in table.items() if isinstance(v, Mapping)]
    return "\n\n".join(["\n".join(lines), *subtables])


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # Python's int and float reprs are valid TOML (1e-05 and inf included)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


# ------------------------------------------------------------------ the swarm
@dataclass
class LocalSwarm:
    """Coordinator, peers and trainers as subprocesses sharing ``workdir`` (logs, ready files, reports,
    ``events.jsonl``). ``None`` for an announce period leaves the role's default; ``prefix`` runs every
    role under a command (``taskset -c 0``); ``start_peer`` can override host and prefix per peer."""

    workdir: Path
    run_id: str = "local"
    log_level: str = "INFO"
    host: str = "127.0.0.1"
    peer_announce_period: float | None = 1.0  # fast re-announcements: tests and benches see changes in seconds
    trainer_announce_period: float | None = 1.0
    peer_drain_timeout: float | None = None  # a peer's --drain-timeout (None: the role's default)
    checkpoints: bool = True  # the coordinator keeps checkpoints in workdir/checkpoints
    prefix: list[str] = field(default_factory=list)
    group: ProcessGroup = field(init=False)
    coordinator: Launched | None = field(default=None, init=False)
    maddr: str = field(default="", init=False)  # the coordinator's multiaddr: every other role's initial peer
    url: str = field(default="", init=False)  # the coordinator's HTTP API
    events: Path = field(init=False)
    _peer_count: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        # every role shares this machine's cores: one torch thread each unless the caller says otherwise
        env = {"SWARMPIPE_LOG_LEVEL": self.log_level, "SWARMPIPE_THREADS": os.environ.get("SWARMPIPE_THREADS", "1")}
        self.group = ProcessGroup(self.workdir, env=env)
        self.events = self.workdir / "events.jsonl"

    def write_spec(
        self, num_stages: int = 2, n_layers: int | None = None, *, name: str = "spec.toml", **knobs: Any
    ) -> Path:
        """This swarm's run spec from the one template; ``knobs``: :func:`spec_toml`'s keywords."""
        return write_spec(self.workdir / name, self.run_id, num_stages, n_layers=n_layers, **knobs)

    def start_role(self, name: str, role: str, *args: str, prefix: list[str] | None = None) -> Launched:
        return self.group.start(name, role, *args, prefix=self.prefix if prefix is None else prefix)

    # ------------------------------------------------------------ roles
    def start_coordinator(
        self, spec: Path | None = None, *args: str, wait: bool = True, http_port: int = 0, timeout: float = 120
    ) -> Launched:
        """``spec`` None: the coordinator's built-in spec (pass ``--run-id`` / ``--num-stages`` in ``args``).
        A restart reuses the identity and the saved port, so ``maddr`` stays the same."""
        peers_file = self.workdir / "initial_peers.txt"
        peers_file.unlink(missing_ok=True)  # its reappearance says this coordinator is up
        spec_args = ["--spec", str(spec)] if spec else []
        ckpt_args = ["--checkpoint-dir", str(self.workdir / "checkpoints")] if self.checkpoints else []
        self.coordinator = self.start_role(
            "coordinator",
            "coordinator",
            *spec_args,
            "--http-port",
            str(http_port),
            "--peers-file",
            str(peers_file),
            "--identity",
            str(self.workdir / "swarmpipe.coordinator.key"),
            *ckpt_args,
            "--event-log",
            str(self.events),
            "--host",
            self.host,
            *args,
        )
        if wait:
            wait_for(peers_file.exists, timeout, "coordinator initial peers", procs=[self.coordinator])
            self.maddr = peers_file.read_text().split()[0]
            # The dashboard line is printed before the peers file is written: the newest one is this process's.
            self.url = wait_for(
                lambda: coordinator_http_url(self.coordinator),
                15,
                "coordinator dashboard url",
                procs=[self.coordinator],
            )
        return self.coordinator

    def start_peer(
        self,
        stage: int | None = None,
        *args: str,
        wait: bool = True,
        name: str | None = None,
        host: str | None = None,
        prefix: list[str] | None = None,
        timeout: float = 90,
    ) -> Launched:
        """``stage`` None: the peer picks the stage that most needs it."""
        self._peer_count += 1
        name = name or f"peer{self._peer_count}-s{stage if stage is not None else 'auto'}"
        ready = self.workdir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        stage_args = ["--stage", str(stage)] if stage is not None else []
        launched = self.start_role(
            name,
            "peer",
            "--initial-peers",
            self.maddr,
            "--run-id",
            self.run_id,
            *stage_args,
            "--ready-file",
            str(ready),
            "--event-log",
            str(self.events),
            "--host",
            host or self.host,
            *_announce(self.peer_announce_period),
            *_drain(self.peer_drain_timeout),
            *args,
            prefix=prefix,
        )
        launched.ready_path = ready
        if wait:
            self.wait_ready(launched, timeout)
        return launched

    def wait_ready(self, launched: Launched, timeout: float = 90) -> dict:
        """The peer's ready file (address, stage, peer id, pid) once it serves."""
        return wait_for(lambda: read_json(launched.ready_path), timeout, f"{launched.name} to serve", procs=[launched])

    def start_trainer(
        self, steps: int, *args: str, name: str = "trainer", report: Path | None = None
    ) -> tuple[Launched, Path]:
        report = report or self.workdir / f"{name}-report.json"
        report.unlink(missing_ok=True)
        launched = self.start_role(
            name,
            "train",
            "--initial-peers",
            self.maddr,
            "--run-id",
            self.run_id,
            "--steps",
            str(steps),
            "--no-progress",
            "--report",
            str(report),
            "--event-log",
            str(self.events),
            "--host",
            self.host,
            *_announce(self.trainer_announce_period),
            *args,
        )
        return launched, report

    def wait_report(self, trainer: Launched, report: Path, timeout: float) -> dict:
        """Wait for the trainer to exit; its report (a trainer that wrote none is an error)."""
        wait_for(lambda: not trainer.alive(), timeout, f"{trainer.name} to finish", poll=0.5)
        data = read_json(report)
        if data is None:
            raise RuntimeError(
                f"{trainer.name} wrote no report (exit {trainer.proc.returncode}):\n{trainer.log_text()[-4000:]}"
            )
        return data

    # ------------------------------------------------------------ reading
    def api(self, path: str = "/api/swarm") -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return json.loads(response.read())

    def tail_events(self, offset: int = 0) -> tuple[list[dict], int]:
        """Whole event lines appended since byte ``offset``, and the offset to read on from."""
        try:
            with open(self.events, "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return [], offset
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        events = []
        for line in data[:end].splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
        return events, offset + end

    def read_events(self) -> list[dict]:
        return self.tail_events(0)[0]

    def events_of(self, kind: str) -> list[dict]:
        return [e for e in self.read_events() if e.get("kind") == kind]

    # ------------------------------------------------------------ stopping
    def stop(self, grace: float = 10.0) -> None:
        """Trainers and peers first, the coordinator last: draining peers hand their newest state to it,
        so the last checkpoint holds the final weights."""
        self.group.stop_all(grace, first=[p for p in self.group.procs if p is not self.coordinator])

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _announce(period: float | None) -> list[str]:
    return [] if period is None else ["--announce-period", f"{period:g}"]


def _drain(timeout: float | None) -> list[str]:
    return [] if timeout is None else ["--drain-timeout", f"{timeout:g}"]
