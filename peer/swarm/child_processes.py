"""Processes a role starts die with it, however it ends: done, signalled, or SIGKILLed (preemption).

Every role runs hivemind's DHT, a forked ``multiprocessing`` child that runs ``p2pd`` (a Go binary); hivemind's
averagers fork the same way. Two things kept such children alive after their role was gone:

* a fork inherits the role's asyncio signal handlers, which only poke a loop the child never runs, so the
  child swallowed SIGTERM (and the role's interpreter then waited on it forever at exit, in multiprocessing's
  ``atexit`` join);
* nothing told a child that its parent had been SIGKILLed.

:func:`guard_forks` fixes both for every process forked afterwards: the child gets a SIGTERM handler that takes
its own descendants (p2pd) down and exits, and a watchdog thread that does the same within
``WATCH_PERIOD_S`` of its parent vanishing. ``PR_SET_PDEATHSIG`` is not used: it fires when the forking
*thread* exits, and the DHT is forked from a worker thread (``asyncio.to_thread``). p2pd is hivemind's to
spawn, so its parent (the DHT child) kills it; p2pd also exits by itself once the control connection of a
SIGKILLed DHT child closes. :class:`DHTProcess` is hivemind's DHT with a shutdown that is bounded and leaves
nothing behind. Descendants are found through ``/proc`` (Linux; elsewhere only the child itself is stopped).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable

import hivemind

WATCH_PERIOD_S = 0.25  # how often a forked child checks that its parent still lives
KILL_GRACE_S = 1.0  # SIGTERM -> SIGKILL, for a child's descendants and for the DHT process itself

_installed = False
_fork_parent = 0  # the pid of the process that forks: the parent a child must outlive by no more than a moment


# ------------------------------------------------------------------ /proc
def _ppid_and_state(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # the command name in parentheses may hold spaces
    return int(fields[1]), fields[0]


def alive(pid: int) -> bool:
    """Running (a zombie is not: it only waits to be reaped)."""
    found = _ppid_and_state(pid)
    if found is not None:
        return found[1] not in ("Z", "X")
    if os.path.isdir("/proc"):
        return False
    try:  # no /proc (macOS): all we can ask is whether the pid exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (children first); empty without ``/proc``."""
    children: dict[int, list[int]] = {}
    try:
        entries = [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return []
    for p in entries:
        found = _ppid_and_state(p)
        if found is not None and found[1] not in ("Z", "X"):
            children.setdefault(found[0], []).append(p)
    out: list[int] = []
    frontier = [pid]
    while frontier:
        below = [c for p in frontier for c in children.get(p, [])]
        out.extend(below)
        frontier = below
    return out


def end_processes(pids: Iterable[int], grace: float = KILL_GRACE_S) -> list[int]:
    """SIGTERM ``pids``, SIGKILL whichever still runs after ``grace``; returns those that outlived even that."""
    pids = list(pids)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 1.0)):
        pending = [p for p in pids if alive(p)]
        for p in pending:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while pending and time.monotonic() < deadline:
            time.sleep(0.02)
            pending = [p for p in pending if alive(p)]
        if not pending:
            return []
    return [p for p in pids if alive(p)]


# ------------------------------------------------------------------ forked children
def guard_forks() -> None:
    """Once per process (idempotent): every process forked from here on dies with this one and obeys SIGTERM."""
    global _installed
    if _installed or not hasattr(os, "register_at_fork"):
        return
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _installed = True


def _before_fork() -> None:
    global _fork_parent
    _fork_parent = os.getpid()  # the same value from any forking thread: no race


def _after_fork_in_child() -> None:
    """Runs in the child right after ``os.fork`` (in its new main thread)."""
    parent = _fork_parent or os.getppid()
    try:
        # The inherited wakeup fd is the parent's event loop's: a signal here would be delivered to the parent.
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, _on_sigterm)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the role decides, then stops us
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    except (ValueError, OSError):  # not the main thread: cannot happen after a fork in CPython
        pass
    threading.Thread(target=_watch_parent, args=(parent,), name="swarmpipe-parent-watch", daemon=True).start()


def _on_sigterm(signum: int, frame: object) -> None:
    _leave(128 + signum)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_PERIOD_S)
    _leave(1)  # the parent is gone (SIGKILLed, OOM-killed, preempted): nobody will ever stop us


def _leave(code: int) -> None:
    """Take our own descendants (p2pd) down, then exit at once: no cleanup that could hang."""
    end_processes(descendants(os.getpid()))
    os._exit(code)


# ------------------------------------------------------------------ the DHT process
class DHTProcess(hivemind.DHT):
    """hivemind's DHT whose ``shutdown`` returns within ``shutdown_timeout + 2 * KILL_GRACE_S`` and leaves no
    process: a graceful request (hivemind stops p2pd), then SIGTERM, then SIGKILL for the child and p2pd."""

    def shutdown(self) -> None:
        if self._parent_pid != os.getpid() or self.pid is None:
            return  # not started, or not ours to stop (a copy inherited by a fork)
        family = descendants(self.pid)  # p2pd, read while the DHT process still holds it
        try:
            super().shutdown()  # joins up to shutdown_timeout, then SIGTERMs a DHT that did not stop
        except (OSError, ValueError, BrokenPipeError):  # the pipe to a dead child: nothing graceful left to do
            pass
        self.join(KILL_GRACE_S)
        if self.is_alive():
            self.kill()
            self.join(KILL_GRACE_S)
        end_processes(family, grace=0.2)
