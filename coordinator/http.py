"""The coordinator's HTTP side: JSON API, Prometheus metrics, the dashboard's static files.

A stdlib ThreadingHTTPServer on its own thread: it only reads snapshots the
coordinator's event loop publishes, so it never blocks the loop (or vice versa).
Anyone can connect, so a connection holds its thread only for a bounded time (a
socket timeout on every read and write) and at most ``max_connections`` are served
at once: beyond that a new connection gets a 503 and is closed, no thread started.
"""

from __future__ import annotations

import json
import logging
import mimetypes
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import urlparse

from swarmpipe.coordinator.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from swarmpipe.coordinator.metrics import CoordinatorMetrics

log = logging.getLogger("swarmpipe.http")

REQUEST_TIMEOUT_S = 10.0  # an idle or stalled connection gives its thread back after this long
MAX_CONNECTIONS = 64
BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def _dashboard_file(name: str) -> bytes | None:
    if "/" in name or name.startswith("."):
        return None
    try:
        return resources.files("swarmpipe.coordinator").joinpath("dashboard", name).read_bytes()
    except (FileNotFoundError, OSError, IsADirectoryError):
        return None


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them at once."""

    daemon_threads = True
    block_on_close = False  # stop() does not wait for open connections: they time out on their own
    request_queue_size = 128  # a burst of connections waits in the listen backlog, not in threads

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int):
        super().__init__(address, handler)
        self.max_connections = max_connections
        self.slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self._refuse(request, client_address)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self.slots.release()  # no thread started: nothing else would give the slot back
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

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
    def __init__(
        self,
        coordinator: Any,
        host: str,
        port: int,
        *,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        metrics: CoordinatorMetrics | None = None,
    ):
        self.coordinator = coordinator
        self.host = host
        self.port = port
        self.request_timeout_s = request_timeout_s
        self.max_connections = max_connections
        self.httpd: BoundedHTTPServer | None = None
        self.metrics = metrics or CoordinatorMetrics(coordinator)

    def routes(self) -> dict[str, Any]:
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
            timeout = self.request_timeout_s  # per read and write: an idle connection is closed after it

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                path = urlparse(self.path).path
                route = server.routes().get(path)
                if route is not None:
                    content_type, body = route()
                    return self._send(200, content_type, body)
                extra = getattr(server.coordinator, "http_extra", None)
                if extra is not None:
                    found = extra(path)
                    if found is not None:
                        return self._send(200, *found)
                name = "index.html" if path in ("/", "") else path.lstrip("/").removeprefix("dashboard/")
                body = _dashboard_file(name)
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

        self.httpd = BoundedHTTPServer((self.host, self.port), Handler, self.max_connections)
        threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True).start()
        return int(self.httpd.server_address[1])

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
