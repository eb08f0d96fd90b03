"""Drive the Compose deployment (deploy/docker-compose.yml) for the fault-injection suite.

One :class:`Stack` is one Compose project: coordinator, two replicas of each of the
two stages, a trainer started once every peer serves. Faults are Docker verbs
(kill, pause, network disconnect) and ``swarmpipe-netem`` run inside a peer
container. A :class:`Monitor` thread samples the coordinator's ``/api/swarm``
every second so recoveries can be timed and stalls measured.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "deploy" / "docker-compose.yml"
SETUP_SCRIPT = REPO / "deploy" / "setup-docker.sh"
PROJECT_PREFIX = "spt"
READY_FILE = "/tmp/swarmpipe-ready.json"
REPORT_PATH = "/reports/report.json"
ANNOUNCE_PERIOD_S = 5.0  # peers' default; their records expire after 3 periods
# A subnet apart from the default deployment's, so the suite runs next to a live stack.
SUBNET_PREFIX = os.environ.get("SWARMPIPE_TEST_SUBNET_PREFIX", "10.214.0")


class HarnessError(RuntimeError):
    pass


def sh(
    cmd: list[str],
    timeout: float = 120,
    check: bool = True,
    env: dict[str, str] | None = None,
    input_text: str | None = None,
) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, input=input_text)
    except subprocess.TimeoutExpired as e:
        raise HarnessError(f"timed out after {timeout:.0f}s: {shlex.join(cmd)}") from e
    if check and result.returncode != 0:
        raise HarnessError(f"exit {result.returncode}: {shlex.join(cmd)}\n{(result.stdout + result.stderr)[-3000:]}")
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise HarnessError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)


# ---------------------------------------------------------------- engine
@dataclass
class Engine:
    compose: list[str]
    setup_seconds: float
    setup_log: str


def prepare_engine(timeout: float = 2400) -> Engine:
    """Run deploy/setup-docker.sh (engine, base image, wheelhouse, image). Raises HarnessError."""
    started = time.monotonic()
    result = sh(["bash", str(SETUP_SCRIPT)], timeout=timeout, check=False)
    log = result.stdout + result.stderr
    if result.returncode != 0:
        lines = [line for line in log.splitlines() if "FAILED" in line] or log.strip().splitlines()[-1:]
        raise HarnessError(lines[-1] if lines else f"setup-docker.sh exited {result.returncode}")
    compose_line = [line for line in result.stdout.splitlines() if line.startswith("compose: ")][-1]
    return Engine(
        compose=compose_line.split(": ", 1)[1].split(), setup_seconds=time.monotonic() - started, setup_log=log
    )


def remove_leftovers(engine: Engine) -> None:
    """Bring down any suite project a crashed earlier session left behind."""
    out = sh(
        [
            "docker",
            "ps",
            "-a",
            "--filter",
            "label=com.docker.compose.project",
            "--format",
            '{{.Label "com.docker.compose.project"}}',
        ],
        check=False,
    ).stdout
    nets = sh(
        [
            "docker",
            "network",
            "ls",
            "--filter",
            "label=com.docker.compose.project",
            "--format",
            '{{.Label "com.docker.compose.project"}}',
        ],
        check=False,
    ).stdout
    for project in sorted(set((out + nets).split())):
        if project.startswith(PROJECT_PREFIX):
            sh(
                [*engine.compose, "-p", project, "-f", str(COMPOSE_FILE), "down", "-v", "-t", "1", "--remove-orphans"],
                check=False,
                timeout=120,
            )


# ---------------------------------------------------------------- monitor
@dataclass
class Sample:
    t: float
    step: int | None
    peers: dict[str, dict]  # peer_id -> {stage, state, updated_at, version, address}
    api_up: bool


class Monitor(threading.Thread):
    """Samples /api/swarm every second; keeps the whole timeline."""

    def __init__(self, stack: Stack, period: float = 1.0):
        super().__init__(daemon=True, name=f"monitor-{stack.project}")
        self.stack = stack
        self.period = period
        self.samples: list[Sample] = []
        self.stop_event = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self.stop_event.is_set():
            snap = self.stack.api(timeout=2.0)
            sample = Sample(time.monotonic(), None, {}, snap is not None)
            if snap is not None:
                steps = [t.get("step") or 0 for t in snap.get("trainers", [])]
                sample.step = max(steps) if steps else None
                for stage in snap.get("stages", []):
                    for p in stage.get("peers", []):
                        sample.peers[p["peer_id"]] = {
                            "stage": stage["index"],
                            "state": p["state"],
                            "updated_at": p["updated_at"],
                            "version": p["version"],
                            "address": p["address"],
                        }
            with self.lock:
                self.samples.append(sample)
            self.stop_event.wait(self.period)

    def stop(self) -> None:
        self.stop_event.set()

    def latest(self) -> Sample | None:
        with self.lock:
            return self.samples[-1] if self.samples else None

    def step(self) -> int:
        with self.lock:
            steps = [s.step for s in self.samples if s.step is not None]
        return max(steps) if steps else 0

    def longest_stall(self, since: float = 0.0, until: float | None = None) -> float:
        """Longest time the trainer's announced step did not move (coordinator downtime excluded)."""
        with self.lock:
            samples = [s for s in self.samples if s.t >= since and (until is None or s.t <= until)]
        worst, last_change, last_step = 0.0, None, None
        for s in samples:
            if s.step is None:  # coordinator down (or trainer not yet listed): no view, no verdict
                last_change = None
                continue
            if last_change is None:
                last_change, last_step = s.t, max(s.step, last_step or 0)
                continue
            if s.step > last_step:
                if last_change is not None:
                    worst = max(worst, s.t - last_change)
                last_change, last_step = s.t, s.step
        return worst


# ---------------------------------------------------------------- stack
@dataclass
class Stack:
    engine: Engine
    scenario: str
    logdir: Path
    replicas: tuple[int, int] = (2, 2)
    env_overrides: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.project = f"{PROJECT_PREFIX}{self.scenario.replace('-', '')}"
        self.http_port = free_port()
        self.dht_port = free_port()
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.monitor: Monitor | None = None
        self.trainer_started_at: float | None = None
        self.network = ""
        self._names: dict[str, str] = {}

    # -------------------------------------------------------- compose
    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMPIPE_")}
        env.update(
            {
                "SWARMPIPE_SPEC": "/opt/swarmpipe/specs/tiny.toml",
                "SWARMPIPE_RUN_ID": "compose",
                "SWARMPIPE_RESTART": "no",
                "SWARMPIPE_DASHBOARD_PORT": str(self.http_port),
                "SWARMPIPE_DHT_PUBLISH_PORT": str(self.dht_port),
                "SWARMPIPE_SUBNET": f"{SUBNET_PREFIX}.0/24",
                "SWARMPIPE_IP_RANGE": f"{SUBNET_PREFIX}.128/25",
                "SWARMPIPE_COORDINATOR_IP": f"{SUBNET_PREFIX}.2",
                "SWARMPIPE_CALL_TIMEOUT": "8",
                "SWARMPIPE_TRAINER_ANNOUNCE_PERIOD": "2",
                "SWARMPIPE_STEPS": "1",
            }
        )
        if os.environ.get("SWARMPIPE_IMAGE"):
            env["SWARMPIPE_IMAGE"] = os.environ["SWARMPIPE_IMAGE"]
        env.update(self.env_overrides)
        env.update(extra)
        return env

    def compose(self, *args: str, timeout: float = 180, check: bool = True, **env: str) -> subprocess.CompletedProcess:
        return sh(
            [*self.engine.compose, "-p", self.project, "-f", str(COMPOSE_FILE), *args],
            timeout=timeout,
            check=check,
            env=self.env(**env),
        )

    def up(self, timeout: float = 240) -> None:
        """Coordinator and peers (no trainer yet); wait until every peer serves and is listed."""
        self.down()
        r0, r1 = self.replicas
        self.compose(
            "up",
            "-d",
            "--no-build",
            "--scale",
            f"peer0={r0}",
            "--scale",
            f"peer1={r1}",
            "--scale",
            "trainer=0",
            timeout=timeout,
        )
        self.network = self.network_of(self.ids("coordinator")[0])
        self.monitor = Monitor(self)
        self.monitor.start()
        self.wait_serving(self.peer_ids(), timeout)

    def start_trainer(self, steps: int) -> str:
        self.compose("up", "-d", "--no-build", "--no-deps", "--no-recreate", "trainer", SWARMPIPE_STEPS=str(steps))
        self.trainer_started_at = time.monotonic()
        return self.ids("trainer")[0]

    def add_replica(self, service: str) -> str:
        """A new container for ``service`` (the dead ones removed first)."""
        before = set(self.ids(service))
        for cid in before:
            self.name(cid)
            if not self.running(cid):
                sh(["docker", "rm", "-f", cid], check=False)
        alive = [c for c in self.ids(service)]
        self.compose(
            "up",
            "-d",
            "--no-build",
            "--no-deps",
            "--no-recreate",
            "--scale",
            f"{service}={len(alive) + 1}",
            service,
            timeout=120,
        )
        new = [c for c in self.ids(service) if c not in before]
        if not new:
            raise HarnessError(f"no new {service} container appeared")
        return new[0]

    def add_byzantine(self, service: str, mode: str) -> str:
        """A replica of ``service`` that lies (tests/byzantine_peer.py mounted as sitecustomize: every Python
        process in it starts patched). A one-off container of the project: ``down`` removes it too."""
        script = Path(__file__).resolve().parents[1] / "byzantine_peer.py"
        r = self.compose(
            "run",
            "-d",
            "--no-deps",
            "-e",
            f"SWARMPIPE_TEST_BYZANTINE={mode}",
            "-e",
            "PYTHONPATH=/opt/byzantine",
            "-v",
            f"{script}:/opt/byzantine/sitecustomize.py:ro",
            service,
            timeout=120,
        )
        name = r.stdout.strip().splitlines()[-1]
        return sh(["docker", "inspect", "-f", "{{.Id}}", name]).stdout.strip()

    def down(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
        self.compose("down", "-v", "-t", "2", "--remove-orphans", timeout=180, check=False)

    # -------------------------------------------------------- containers
    def ids(self, service: str, all_states: bool = True) -> list[str]:
        cmd = [
            "docker",
            "ps",
            "--no-trunc",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
            "--filter",
            f"label=com.docker.compose.service={service}",
            "--format",
            "{{.ID}}",
        ]
        if all_states:
            cmd.insert(2, "-a")
        return sorted(sh(cmd).stdout.split())

    def peer_ids(self) -> list[str]:
        return self.ids("peer0") + self.ids("peer1")

    def name(self, cid: str) -> str:
        if cid not in self._names:  # cached: a removed container keeps its name in our notes
            self._names[cid] = sh(["docker", "inspect", "-f", "{{.Name}}", cid]).stdout.strip().lstrip("/")
        return self._names[cid]

    def short(self, cid: str) -> str:
        """peer0_2 / peer0-2 -> 'peer0#2' (v1 and v2 name containers differently)."""
        n = self.name(cid).removeprefix(self.project)
        return n.strip("_-").replace("_", "#").replace("-", "#")

    def running(self, cid: str) -> bool:
        r = sh(["docker", "inspect", "-f", "{{.State.Running}}", cid], check=False)
        return r.stdout.strip() == "true"

    def network_of(self, cid: str) -> str:
        out = sh(["docker", "inspect", "-f", "{{json .NetworkSettings.Networks}}", cid]).stdout
        return next(iter(json.loads(out)))

    def ip_of(self, cid: str) -> str:
        out = sh(["docker", "inspect", "-f", "{{json .NetworkSettings.Networks}}", cid]).stdout
        return json.loads(out)[self.network]["IPAddress"]

    def exec(self, cid: str, *cmd: str, root: bool = False, timeout: float = 60, check: bool = True) -> str:
        args = ["docker", "exec", *(["-u", "0"] if root else []), cid, *cmd]
        return sh(args, timeout=timeout, check=check).stdout

    def ready(self, cid: str) -> dict | None:
        r = sh(["docker", "exec", cid, "cat", READY_FILE], check=False, timeout=30)
        if r.returncode != 0:
            return None
        try:
            return json.loads(r.stdout)
        except ValueError:
            return None

    def peer_id(self, cid: str) -> str:
        info = self.ready(cid)
        if not info:
            raise HarnessError(f"{self.short(cid)} has no ready file")
        return info["peer_id"]

    # -------------------------------------------------------- faults
    def kill(self, cid: str) -> None:
        sh(["docker", "kill", cid])

    def pause(self, cid: str, attempts: int = 3) -> None:
        """``docker pause``, again when the kernel's cgroup freezer did not settle ("OCI runtime pause failed:
        unable to freeze", seen once on the CI-like machine while the container's processes were busy)."""
        for attempt in range(attempts):
            result = sh(["docker", "pause", cid], check=False)
            if result.returncode == 0:
                return
            if "unable to freeze" not in result.stderr or attempt == attempts - 1:
                raise HarnessError(f"exit {result.returncode}: docker pause {cid}\n{result.stderr[-2000:]}")
            time.sleep(1.0)

    def unpause(self, cid: str) -> None:
        sh(["docker", "unpause", cid])

    def disconnect(self, cid: str) -> str:
        ip = self.ip_of(cid)
        sh(["docker", "network", "disconnect", self.network, cid])
        return ip

    def connect(self, cid: str, ip: str, service: str) -> None:
        sh(["docker", "network", "connect", "--ip", ip, "--alias", service, self.network, cid])

    def netem(self, cid: str, *args: str) -> str:
        return self.exec(cid, "swarmpipe-netem", *args, root=True).strip()

    def stop(self, cid: str, grace: int = 10) -> None:
        sh(["docker", "stop", "-t", str(grace), cid], timeout=grace + 30)

    def start(self, cid: str) -> None:
        sh(["docker", "start", cid])

    # -------------------------------------------------------- observing
    def api(self, timeout: float = 3.0) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/api/swarm", timeout=timeout) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def listed(self, fresh_s: float = 3 * ANNOUNCE_PERIOD_S + 5) -> dict[str, dict]:
        """Peers the coordinator lists as online with a record younger than ``fresh_s``."""
        snap = self.api()
        if snap is None:
            return {}
        out = {}
        for stage in snap.get("stages", []):
            for p in stage.get("peers", []):
                if p["state"] == "online" and time.time() - p["updated_at"] <= fresh_s:
                    out[p["peer_id"]] = {"stage": stage["index"], **p}
        return out

    def wait_serving(self, cids: list[str], timeout: float) -> float:
        """Wait until each container wrote its ready file and the coordinator lists it online; seconds taken."""
        started = time.monotonic()

        def all_listed() -> bool:
            ids = []
            for cid in cids:
                if not self.running(cid):
                    raise HarnessError(f"{self.short(cid)} exited:\n{self.logs(cid)[-3000:]}")
                info = self.ready(cid)
                if not info:
                    return False
                ids.append(info["peer_id"])
            listed = self.listed()
            return all(i in listed for i in ids)

        wait_until(all_listed, timeout, f"{len(cids)} peer(s) to serve and be listed", poll=2.0)
        return time.monotonic() - started

    def trainer_step(self) -> int:
        return self.monitor.step() if self.monitor else 0

    def wait_step(self, at_least: int, timeout: float) -> int:
        trainer = self.ids("trainer")

        def reached() -> int | None:
            if trainer and not self.running(trainer[0]):
                raise HarnessError(f"the trainer exited before step {at_least}:\n{self.logs(trainer[0])[-3000:]}")
            step = self.trainer_step()
            return step if step >= at_least else None

        return wait_until(reached, timeout, f"trainer step {at_least}", poll=1.0)

    def wait_trainer(self, timeout: float) -> int:
        cid = self.ids("trainer")[0]
        r = sh(["docker", "wait", cid], timeout=timeout)
        return int(r.stdout.strip() or -1)

    def report(self) -> dict:
        cid = self.ids("trainer")[0]
        with tempfile.TemporaryDirectory() as tmp:
            sh(["docker", "cp", f"{cid}:{REPORT_PATH}", tmp + "/report.json"])
            text = Path(tmp, "report.json").read_text()
        (self.logdir / "report.json").write_text(text)
        return json.loads(text)

    def logs(self, cid: str) -> str:
        r = sh(["docker", "logs", cid], check=False, timeout=60)
        return r.stdout + r.stderr

    def save_logs(self) -> None:
        r = sh(
            [
                "docker",
                "ps",
                "-a",
                "--filter",
                f"label=com.docker.compose.project={self.project}",
                "--format",
                "{{.ID}} {{.Names}}",
            ],
            check=False,
        )
        for line in r.stdout.splitlines():
            cid, name = line.split(maxsplit=1)
            (self.logdir / f"{name}.log").write_text(self.logs(cid))
        snap = self.api()
        if snap is not None:
            (self.logdir / "api_swarm.json").write_text(json.dumps(snap, indent=2))
        if self.monitor is not None:
            timeline = [
                {
                    "t": round(s.t - self.monitor.samples[0].t, 1),
                    "step": s.step,
                    "api_up": s.api_up,
                    "peers": len(s.peers),
                }
                for s in self.monitor.samples
            ]
            (self.logdir / "timeline.json").write_text(json.dumps(timeline))
