"""Start swarmpipe roles as real subprocesses and stop them for sure.

Each role runs as ``[prefix...] python -m swarmpipe.cli.main <role> ...`` in its own process group
with its output in a log file; :class:`ProcessGroup` kills everything it started, also when the
caller is interrupted. :class:`swarmpipe.cli.local_swarm.LocalSwarm` builds a whole swarm on it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from swarmpipe.cli import warm_start
from swarmpipe.cli.warm_start import WarmProcess, WarmStarter


@dataclass
class Launched:
    name: str
    proc: subprocess.Popen | WarmProcess  # warm-started roles (tests) answer the same calls
    log_path: Path
    ready_path: Path | None = None  # a peer's --ready-file, where there is one

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def kill_tree(self) -> None:
        """SIGKILL the role and its children (its DHT process and p2pd), like a machine vanishing."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class ProcessGroup:
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    procs: list[Launched] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)

    def start(
        self, name: str, role: str, *args: str, extra_env: dict[str, str] | None = None, prefix: Sequence[str] = ()
    ) -> Launched:
        """``prefix``: a command that runs the role (``ip netns exec NS``, ``taskset -c 1``); it must
        exec the role in place, so that the pid and the process group stay the role's."""
        log_path = self.workdir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **self.env, **(extra_env or {})}
        proc: subprocess.Popen | WarmProcess
        if warm_start.enabled() and warm_start.takes(prefix):
            proc = WarmStarter.shared(self.workdir).start([role, *args], env, log_path, prefix)
        else:
            command = [*prefix, sys.executable, "-m", "swarmpipe.cli.main", role, *args]
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
        launched = Launched(name, proc, log_path)
        self.procs.append(launched)
        return launched

    def stop_all(self, grace: float = 10.0, first: Sequence[Launched] = ()) -> None:
        """SIGTERM everything, wait up to ``grace``, then SIGKILL the whole process groups. ``first`` are
        stopped (and waited for, within ``grace``) before the rest get their SIGTERM."""
        deadline = time.monotonic() + grace
        for wave in (list(first), [p for p in self.procs if p not in first]):
            for p in wave:
                p.signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
                p.signal(signal.SIGTERM)
            for p in wave:
                try:
                    p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for p in self.procs:
            try:
                os.killpg(p.proc.pid, signal.SIGKILL)  # children too (hivemind's DHT process, p2pd)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def wait_for(
    predicate: Callable[[], object], timeout: float, what: str, poll: float = 0.2, procs: Sequence[Launched] = ()
) -> object:
    """Poll until ``predicate()`` is truthy; fail early (with the log tail) if a process died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs:
            if not p.alive():
                raise RuntimeError(
                    f"{p.name} exited with {p.proc.returncode} while waiting for {what}:\n{p.log_text()[-3000:]}"
                )
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def read_json(path: Path | None) -> dict | None:
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def coordinator_http_url(launched: Launched) -> str | None:
    """The newest ``dashboard:`` line: a restarted coordinator appends to the same log."""
    lines = [line for line in launched.log_text().splitlines() if line.startswith("dashboard: ")]
    return lines[-1].split("dashboard: ", 1)[1].strip().rstrip("/") if lines else None
