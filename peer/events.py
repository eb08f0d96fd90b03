"""Logging and the JSON-lines event log: one line per event, with role and short peer id."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"


def setup_logging(level: str = "INFO") -> None:
    level = os.environ.get("SWARMPIPE_LOG_LEVEL", level).upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO), format=LOG_FORMAT, force=True)
    for noisy in ("hivemind", "asyncio", "grpc"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


def short_id(peer_id: str) -> str:
    return peer_id[-6:] if peer_id else "------"


class EventLog:
    """Writes ``{"time", "role", "peer_id", "kind", ...fields}`` per event and logs one line."""

    def __init__(self, path: str, role: str, peer_id: str = ""):
        self.path = path
        self.role = role
        self.peer_id = peer_id
        self.log = logging.getLogger(f"swarmpipe.{role}")
        self._lock = threading.Lock()
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def emit(self, kind: str, level: int = logging.INFO, **fields: Any) -> None:
        details = " ".join(f"{k}={v}" for k, v in fields.items())
        self.log.log(level, "%s %s %s %s", self.role, short_id(self.peer_id), kind, details)
        if not self.path:
            return
        record = {"time": time.time(), "role": self.role, "peer_id": self.peer_id, "kind": kind, **fields}
        line = json.dumps(record, default=str)
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
