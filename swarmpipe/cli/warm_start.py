"""Warm starts for the roles a test suite launches by the hundred.

A new interpreter spends about 5 of the 8 CPU-seconds a role takes to start importing torch (and the
``torch._dynamo`` its optimizers pull in), hivemind and the roles' own code (measured with py-spy; on two cores
the suite's ~200 role starts were most of its time). :class:`WarmStarter` keeps one server process per caller that
has imported all of that once and forks a fresh process per role instead.

Each role is still a real process: its own pid, session and log file, real signals, the exit code it chose. The
server is single-threaded and forks before the role has made any thread, event loop, gRPC object or DHT, so
nothing that does not survive fork exists yet; the role then runs ``swarmpipe.cli.main`` as its main program and
exits through the interpreter's normal shutdown. The forked process's parent is the server, not the caller, so
:class:`WarmProcess` answers ``poll``/``wait`` by asking the server, which reaps its children.

Two launch prefixes are done in the fork instead of by a new program (:func:`takes`): ``ip netns exec NS`` (the
fork enters the network namespace, as ``ip`` would; our roles use none of the ``/etc/netns`` or ``/sys`` views it
also sets up) and ``python SCRIPT ARGS...`` for a wrapper script that ends by running the role's entry point in its
own process (the tests' Byzantine peers): the fork runs the script as ``__main__`` with the argv it would have had.
Any other prefix (``taskset``) starts cold.

Opt-in (``SWARMPIPE_WARM_START=1``, set by the test suite's conftest): users start roles as ordinary commands.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ENV_FLAG = "SWARMPIPE_WARM_START"
ROLE_MODULE = "swarmpipe.cli.main"
NETNS_EXEC = ("ip", "netns", "exec")
CLONE_NEWNET = 0x40000000


def enabled() -> bool:
    return os.environ.get(ENV_FLAG, "") not in ("", "0")


def _split_netns(prefix: Sequence[str]) -> tuple[str | None, list[str]]:
    """``ip netns exec NS REST...`` -> (NS, REST); anything else -> (None, prefix)."""
    if tuple(prefix[:3]) == NETNS_EXEC and len(prefix) >= 4:
        return prefix[3], list(prefix[4:])
    return None, list(prefix)


def takes(prefix: Sequence[str]) -> bool:
    """Whether a warm start does what ``prefix`` would: nothing, entering a network namespace, running this
    interpreter's wrapper script, or the namespace and then the script."""
    _netns, rest = _split_netns(prefix)
    return not rest or (len(rest) >= 2 and rest[0] == sys.executable and rest[1].endswith(".py"))


# ------------------------------------------------------------------ the caller's side
class WarmProcess:
    """The slice of :class:`subprocess.Popen` that launchers and tests use, for a role the server forked."""

    def __init__(self, starter: WarmStarter, pid: int) -> None:
        self._starter = starter
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._starter.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"warm-started pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStarter:
    """A fork server (``python -m swarmpipe.cli.warm_start``) and the connection to it; one per process."""

    _shared: WarmStarter | None = None
    _shared_lock = threading.Lock()

    def __init__(self, log_path: Path) -> None:
        ours, theirs = socket.socketpair()
        with open(log_path, "ab") as log:
            self._server = subprocess.Popen(
                [sys.executable, "-m", "swarmpipe.cli.warm_start", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        theirs.close()
        self._sock = ours
        self._reader = ours.makefile("r", encoding="utf-8")
        self._lock = threading.Lock()

    @classmethod
    def shared(cls, log_dir: Path) -> WarmStarter:
        """This process's server, started on first use (its imports take a few seconds, once)."""
        with cls._shared_lock:
            if cls._shared is None or cls._shared._server.poll() is not None:
                cls._shared = cls(Path(log_dir) / "warm-start-server.log")
                atexit.register(cls._shared.close)
            return cls._shared

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._sock.sendall((json.dumps(request) + "\n").encode())
            line = self._reader.readline()
        if not line:
            raise RuntimeError(f"the warm-start server exited ({self._server.poll()}); see its log")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"warm start failed: {reply['error']}")
        return reply

    def start(self, args: list[str], env: dict[str, str], log_path: Path, prefix: Sequence[str] = ()) -> WarmProcess:
        """``[prefix...] python -m swarmpipe.cli.main *args`` with ``env``, this directory and its output in
        ``log_path``; ``prefix`` is one that :func:`takes`."""
        if not takes(prefix):
            raise ValueError(f"a warm start cannot run under {list(prefix)}; start it cold")
        request = {"op": "start", "args": args, "env": env, "log": str(log_path), "cwd": os.getcwd()}
        reply = self._ask({**request, "prefix": list(prefix)})
        return WarmProcess(self, int(reply["pid"]))

    def exit_code(self, pid: int) -> int | None:
        return self._ask({"op": "poll", "pid": pid})["code"]

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # the server exits at end of file (the reader holds the fd open)
            self._reader.close()
            self._sock.close()
            self._server.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self._server.kill()


# ------------------------------------------------------------------ the server's side
def _import_everything() -> None:
    """What every role imports, once, before the first fork."""
    import torch
    import torch._dynamo  # noqa: F401  (an optimizer's first param group imports it: 2 s)
    import uvloop  # noqa: F401

    import swarmpipe.cli.main  # noqa: F401
    import swarmpipe.coordinator.service  # noqa: F401
    import swarmpipe.peer.stage.daemon  # noqa: F401
    import swarmpipe.peer.trainer.trainer  # noqa: F401

    torch.set_num_threads(1)  # no pool is made before the fork; each role sets its own
    gc.freeze()  # the imported objects are never collected: a role's collector leaves their shared pages alone


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """Answer requests until the caller hangs up (returns None); in a forked role, returns its request."""
    exited: dict[int, int] = {}
    children: set[int] = set()
    buffer = b""
    while True:
        while children:  # reap every role that ended, and keep its code for the caller
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            children.discard(pid)
            exited[pid] = os.waitstatus_to_exitcode(status)
        ready, _, _ = select.select([sock], [], [], 0.05)
        if not ready:
            continue
        data = sock.recv(1 << 16)
        if not data:
            return None
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            request = json.loads(line)
            if request["op"] == "poll":  # a code is read once: the caller keeps it (WarmProcess.returncode)
                reply: dict[str, Any] = {"code": exited.pop(request["pid"], None)}
            else:
                try:
                    pid = os.fork()
                except OSError as e:  # out of processes or memory: the caller's start fails, the server goes on
                    reply = {"error": f"fork: {e}"}
                else:
                    if pid == 0:
                        sock.close()
                        return request
                    children.add(pid)
                    reply = {"pid": pid}
            sock.sendall((json.dumps(reply) + "\n").encode())


def _become_role(request: dict[str, Any]) -> None:
    """In the forked child: a session, output and environment of its own, then the role as main program."""
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # forked copies would otherwise share the server's random state
    try:
        import numpy

        numpy.random.seed()
    except ImportError:
        pass
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _enter_netns(name: str) -> None:
    """What ``ip netns exec NAME`` does for a network: join the namespace its bind mount names."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python 3.12+
            os.setns(fd, CLONE_NEWNET)
        else:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _run_role(request: dict[str, Any]) -> None:
    """The role as main program: its entry point, or the wrapper script that ends by calling it."""
    netns, wrapper = _split_netns(request.get("prefix", []))
    if netns is not None:
        _enter_netns(netns)
    role_command = [sys.executable, "-m", ROLE_MODULE, *request["args"]]
    if wrapper:
        import runpy

        sys.argv = [*wrapper[1:], *role_command]
        sys.path.insert(0, os.path.dirname(os.path.abspath(wrapper[1])))  # as `python SCRIPT` would
        runpy.run_path(wrapper[1], run_name="__main__")  # the script's own sys.exit ends the role
        sys.exit(0)
    from swarmpipe.cli.main import main as role_main

    sys.argv = [ROLE_MODULE, *request["args"]]
    sys.exit(role_main(request["args"]))


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    _import_everything()
    request = _serve(sock)
    if request is None:
        os._exit(0)  # nothing to flush or close; a full interpreter shutdown of all those modules takes seconds
    _become_role(request)
    _run_role(request)


if __name__ == "__main__":
    main()
