"""The coordinator's HTTP server on an open port (issues 14 and 36): idle connections neither pile up threads
nor keep it from answering once they time out; over the connection cap a client is refused at once; a request
trickled in a byte at a time is cut off at the deadline; and while slow clients hold every connection, the
health check and the metrics scrape still answer within a second (reserved connections)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from swarmpipe.coordinator.http import (
    MAX_CONNECTIONS,
    PROBE_CONNECTIONS,
    PROBE_DEADLINE_S,
    REQUEST_TIMEOUT_S,
    SwarmHttpServer,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

IDLE = 100
CAP = 16
TIMEOUT_S = 1.0
SLOW_CLIENTS = 64  # as many as the default cap: every dashboard connection held
SLOW_FOR_S = 6.0  # each slow client gives up by itself after this long


def _coordinator() -> SimpleNamespace:
    return SimpleNamespace(snapshot={}, history=[], recent_events=[])


def _get(port: int, path: str = "/healthz", timeout: float = 5) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as reply:
            reply.read()
            return reply.status
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return getattr(e, "code", 0) or 0


def _healthz(port: int) -> int:
    return _get(port)


def _slowloris(port: int, stop: threading.Event, held: list[socket.socket]) -> None:
    """One slow client on loopback: a request header sent a byte every 0.3 s, never finished; it ends when
    ``stop`` is set, the server closes it, or after ``SLOW_FOR_S``."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError:
        return
    held.append(sock)
    deadline = time.monotonic() + SLOW_FOR_S
    try:
        sock.sendall(b"GET /api/swarm HTTP/1.1\r\nHost: x\r\n")
        while not stop.is_set() and time.monotonic() < deadline:
            sock.sendall(b"X")
            stop.wait(0.3)
    except OSError:
        pass  # cut off by the server
    finally:
        sock.close()


def test_defaults_bound_time_and_connections():
    http = SwarmHttpServer(_coordinator(), "127.0.0.1", 0)
    assert (http.request_timeout_s, http.max_connections) == (REQUEST_TIMEOUT_S, MAX_CONNECTIONS) == (10.0, 64)
    assert (PROBE_CONNECTIONS, PROBE_DEADLINE_S) == (8, 1.0)


def test_idle_connections_are_bounded_and_the_server_still_answers():
    http = SwarmHttpServer(_coordinator(), "127.0.0.1", 0, request_timeout_s=TIMEOUT_S, max_connections=CAP)
    port = http.start()
    before = threading.active_count()
    idle: list[socket.socket] = []
    try:
        for _ in range(IDLE):  # connect and send nothing
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.3)  # the server accepts them all
        # the cap, and the reserved health-check connections (each held at most PROBE_DEADLINE_S)
        assert threading.active_count() <= before + CAP + PROBE_CONNECTIONS, threading.active_count() - before

        # Over the cap, a request other than a health check is refused at once with a 503, never left waiting.
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as late:
            late.sendall(b"GET /api/swarm HTTP/1.0\r\n\r\n")
            try:
                answer = late.recv(1024)
            except ConnectionResetError:
                answer = b""
        assert time.monotonic() - started < 2.0
        assert answer == b"" or answer.startswith(b"HTTP/1.0 503"), answer

        # The idle ones time out and give their threads back; the server answers again.
        deadline = time.monotonic() + 10 * TIMEOUT_S
        while _get(port, "/api/swarm") != 200:
            assert time.monotonic() < deadline, "the server never answered again"
            time.sleep(0.2)
        assert threading.active_count() <= before + CAP + PROBE_CONNECTIONS
    finally:
        for s in idle:
            s.close()
        http.stop()


def test_a_trickled_request_is_cut_off_at_the_deadline():
    """One byte every 0.3 s kept a per-read timeout of 1 s waiting for ever; the whole request has 1 s."""
    http = SwarmHttpServer(_coordinator(), "127.0.0.1", 0, request_timeout_s=TIMEOUT_S, max_connections=CAP)
    port = http.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET /healthz HTTP/1.0\r\n")
            started = time.monotonic()
            closed = None
            while time.monotonic() - started < 5 * TIMEOUT_S:
                try:
                    sock.sendall(b"X")
                    sock.settimeout(0.3)
                    if sock.recv(1024) == b"":  # the server closed it
                        closed = time.monotonic() - started
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed = time.monotonic() - started
                    break
        assert closed is not None and closed < 3 * TIMEOUT_S, closed
    finally:
        http.stop()


def test_health_and_metrics_answer_while_slow_clients_hold_every_connection():
    http = SwarmHttpServer(_coordinator(), "127.0.0.1", 0)  # the defaults: 64 connections, 10 s
    port = http.start()
    stop = threading.Event()
    held: list[socket.socket] = []
    slow = [threading.Thread(target=_slowloris, args=(port, stop, held), daemon=True) for _ in range(SLOW_CLIENTS)]
    try:
        for thread in slow:
            thread.start()
        deadline = time.monotonic() + 5
        while len(held) < SLOW_CLIENTS:  # every one connected and started its header
            assert time.monotonic() < deadline, f"only {len(held)} slow clients connected"
            time.sleep(0.05)
        time.sleep(0.5)  # the server gave each its connection thread
        assert http.httpd.slots._value == 0, "the slow clients do not hold every connection"
        assert _get(port, "/api/swarm", timeout=2) != 200  # the dashboard itself is busy: the flood is bounded
        for path in ("/healthz", "/metrics", "/healthz"):
            started = time.monotonic()
            assert _get(port, path, timeout=2) == 200, path
            assert time.monotonic() - started < 1.0, (path, time.monotonic() - started)
    finally:
        stop.set()
        for thread in slow:
            thread.join(timeout=10)
        http.stop()
    assert not any(thread.is_alive() for thread in slow)
