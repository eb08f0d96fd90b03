"""The coordinator's HTTP side: JSON API, Prometheus metrics, the dashboard's static files.

A stdlib HTTP server on its own thread, a thread per connection: it only reads snapshots the
coordinator's event loop publishes, so it never blocks the loop (or vice versa).
Anyone can connect, so a connection holds its thread only for a bounded time (its whole
request within ``request_timeout_s``, however slowly it trickles in; each write of the reply
within it too) and at most ``max_connections`` are served at once. The health checks must
answer while strangers hold all of them (a slowloris): beyond the cap a new connection gets
one of ``PROBE_CONNECTIONS`` reserved threads that serve only ``/healthz`` and ``/metrics``
and give a request ``PROBE_DEADLINE_S`` to arrive; beyond those it gets a 503 and is closed,
no thread started.
"""

from __future__ import annotations

import io
import json
import logging
import mimetypes
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from importlib import resources
from typing import Any
from urllib.parse import urlparse

from swarmpipe.coordinator.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from swarmpipe.coordinator.metrics import CoordinatorMetrics

log = logging.getLogger("swarmpipe.http")

REQUEST_TIMEOUT_S = 10.0  # an idle or stalled connection gives its thread back after this long
MAX_CONNECTIONS = 64
PROBE_CONNECTIONS = 8  # reserved for health checks and scrapes once strangers hold every connection
PROBE_DEADLINE_S = 1.0  # a probe's request is a line or two: whoever trickles it is cut off at once
PROBE_PATHS = frozenset({"/healthz", "/metrics"})
BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def _dashboard_file(name: str, folder: str = "dashboard") -> bytes | None:
    if "/" in name or name.startswith("."):
        return None
    try:
        return resources.files("swarmpipe.coordinator").joinpath(*folder.split("/"), name).read_bytes()
    except (FileNotFoundError, OSError, IsADirectoryError):
        return None


class _DeadlineReader(io.RawIOBase):
    """A socket's bytes, all due by ``deadline`` (monotonic): a client that sends a byte every few seconds
    is cut off then, where a per-read timeout would wait on it as long as it keeps trickling."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class BoundedHTTPServer(HTTPServer):
    """A thread per connection: at most ``max_connections`` of them with ``handler``, then at most
    ``probe_connections`` more with ``probe_handler`` (health checks), then none: a 503 at once."""

    request_queue_size = 128  # a burst of connections waits in the listen backlog, not in threads

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        max_connections: int,
        probe_handler: type[BaseHTTPRequestHandler],
        probe_connections: int = PROBE_CONNECTIONS,
    ):
        super().__init__(address, handler)
        self.max_connections = max_connections
        self.slots = threading.BoundedSemaphore(max_connections)
        self.probe_handler = probe_handler
        self.probe_slots = threading.BoundedSemaphore(probe_connections)

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        if self.slots.acquire(blocking=False):
            handler, slots = self.RequestHandlerClass, self.slots
        elif self.probe_slots.acquire(blocking=False):
            handler, slots = self.probe_handler, self.probe_slots
        else:
            self._refuse(request, client_address)
            return
        thread = threading.Thread(target=self._serve, args=(request, client_address, handler, slots), daemon=True)
        try:
            thread.start()
        except BaseException:
            slots.release()  # no thread started: nothing else would give the slot back
            raise

    def _serve(
        self,
        request: socket.socket,
        client_address: Any,
        handler: type[BaseHTTPRequestHandler],
        slots: threading.BoundedSemaphore,
    ) -> None:
        try:
            handler(request, client_address, self)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            slots.release()

    def _refuse(self, request: socket.socket, client_address: Any) -> None:
        log.debug("http: all %d connections busy; refused %s", self.max_connections, client_address)
        try:
            request.setblocking(False)  # a 503 if the socket takes it at once; never wait on a stranger
            request.send(BUSY)
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that resets or stalls mid-response is routine on an open port: a line, not a traceback.
        log.debug("http: connection from %s failed: %s", client_address, sys.exc_info()[1])


class SwarmHttpServer:
    """``coordinator``'s JSON API, metrics and dashboard; or, given ``routes`` (path -> () -> (content type,
    body)) and ``static_folder`` (under swarmpipe.coordinator), another read-only page such as the health monitor's,
    with the same connection bounds."""

    def __init__(
        self,
        coordinator: Any,
        host: str,
        port: int,
        *,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        metrics: CoordinatorMetrics | None = None,
        routes: Callable[[], dict[str, Any]] | None = None,
        static_folder: str = "dashboard",
    ):
        self.coordinator = coordinator
        self.host = host
        self.port = port
        self.request_timeout_s = request_timeout_s
        self.max_connections = max_connections
        self.httpd: BoundedHTTPServer | None = None
        self.static_folder = static_folder
        self._routes = routes
        self.metrics = metrics or (CoordinatorMetrics(coordinator) if routes is None else None)

    def routes(self) -> dict[str, Any]:
        if self._routes is not None:
            return self._routes()
        c = self.coordinator
        return {
            "/api/swarm": lambda: ("application/json", json.dumps(c.snapshot).encode()),
            "/api/history": lambda: ("application/json", json.dumps(list(c.history)).encode()),
            "/api/events": lambda: ("application/json", json.dumps(list(c.recent_events)).encode()),
            "/metrics": lambda: (METRICS_CONTENT_TYPE, self.metrics.render()),
            "/healthz": lambda: ("text/plain", b"ok\n"),
        }

    def start(self) -> int:
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = self.request_timeout_s  # per write of the reply
            request_deadline_s = self.request_timeout_s  # for the whole request, however it trickles in
            probe_only = False

            def setup(self) -> None:
                super().setup()
                self.rfile.close()  # read through a deadline instead
                deadline = time.monotonic() + self.request_deadline_s
                self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline))

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                self.connection.settimeout(self.timeout)  # the request is in: the reply's writes get their own
                path = urlparse(self.path).path
                if self.probe_only and path not in PROBE_PATHS:
                    return self._send(503, "text/plain", b"busy: only /healthz and /metrics now\n")
                route = server.routes().get(path)
                if route is not None:
                    content_type, body = route()
                    return self._send(200, content_type, body)
                name = "index.html" if path in ("/", "") else path.lstrip("/").removeprefix("dashboard/")
                body = _dashboard_file(name, server.static_folder)
                if body is None:
                    return self._send(404, "application/json", json.dumps({"error": f"no such path {path}"}).encode())
                self._send(200, mimetypes.guess_type(name)[0] or "application/octet-stream", body)

            def _send(self, code: int, content_type: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("http %s", fmt % args)

        class Probe(Handler):
            """A reserved connection (every other one is taken): health checks and scrapes only, quickly."""

            request_deadline_s = min(PROBE_DEADLINE_S, self.request_timeout_s)
            probe_only = True

        self.httpd = BoundedHTTPServer((self.host, self.port), Handler, self.max_connections, Probe)
        threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True).start()
        return int(self.httpd.server_address[1])

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
