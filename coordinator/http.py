"""The coordinator's HTTP side: JSON API, Prometheus metrics, the dashboard's static files.

A stdlib ThreadingHTTPServer on its own thread: it only reads snapshots the
coordinator's event loop publishes, so it never blocks the loop (or vice versa).
"""

from __future__ import annotations

import json
import logging
import mimetypes
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import urlparse

from swarmpipe.coordinator.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from swarmpipe.coordinator.metrics import CoordinatorMetrics

log = logging.getLogger("swarmpipe.http")


def _dashboard_file(name: str) -> bytes | None:
    if "/" in name or name.startswith("."):
        return None
    try:
        return resources.files("swarmpipe.coordinator").joinpath("dashboard", name).read_bytes()
    except (FileNotFoundError, OSError, IsADirectoryError):
        return None


class SwarmHttpServer:
    def __init__(self, coordinator: Any, host: str, port: int):
        self.coordinator = coordinator
        self.host = host
        self.port = port
        self.httpd: ThreadingHTTPServer | None = None
        self.metrics = CoordinatorMetrics(coordinator)

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

        self.httpd = ThreadingHTTPServer((self.host, self.port), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True).start()
        return int(self.httpd.server_address[1])

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
