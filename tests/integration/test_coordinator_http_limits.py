"""The coordinator's HTTP server on an open port (issue 14): idle connections neither pile up threads
nor keep it from answering once they time out; over the connection cap a client is refused at once."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from swarmpipe.coordinator.http import MAX_CONNECTIONS, REQUEST_TIMEOUT_S, SwarmHttpServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

IDLE = 100
CAP = 16
TIMEOUT_S = 1.0


def _coordinator() -> SimpleNamespace:
    return SimpleNamespace(snapshot={}, history=[], recent_events=[])


def _healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as reply:
            return reply.status
    except (urllib.error.URLError, ConnectionError) as e:
        return getattr(e, "code", 0) or 0


def test_defaults_bound_time_and_connections():
    http = SwarmHttpServer(_coordinator(), "127.0.0.1", 0)
    assert (http.request_timeout_s, http.max_connections) == (REQUEST_TIMEOUT_S, MAX_CONNECTIONS) == (10.0, 64)


def test_idle_connections_are_bounded_and_the_server_still_answers():
    http = SwarmHttpServer(_coordinator(), "127.0.0.1", 0, request_timeout_s=TIMEOUT_S, max_connections=CAP)
    port = http.start()
    before = threading.active_count()
    idle: list[socket.socket] = []
    try:
        for _ in range(IDLE):  # connect and send nothing
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.3)  # the server accepts them all
        assert threading.active_count() <= before + CAP, threading.active_count() - before

        # Over the cap: refused at once with a 503, never left waiting.
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as late:
            late.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            try:
                answer = late.recv(1024)
            except ConnectionResetError:
                answer = b""
        assert time.monotonic() - started < 2.0
        assert answer == b"" or answer.startswith(b"HTTP/1.0 503"), answer

        # The idle ones time out and give their threads back; the server answers again.
        deadline = time.monotonic() + 10 * TIMEOUT_S
        while _healthz(port) != 200:
            assert time.monotonic() < deadline, "the server never answered again"
            time.sleep(0.2)
        assert threading.active_count() <= before + CAP
    finally:
        for s in idle:
            s.close()
        http.stop()
