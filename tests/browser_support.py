"""A real browser for the page tests (the coordinator's dashboard, the monitor's health page): headless Chromium
loads a URL in a fresh profile and dumps the DOM after its scripts ran; :class:`Elements` reads the tags back."""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def chromium_path() -> str:
    """The browser binary, installed with apt-get where missing; skips the test where neither works."""
    path = _find_browser()
    if path is None and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        try:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=300, check=True)
            subprocess.run(
                ["apt-get", "install", "-y", "chromium"], env=env, capture_output=True, timeout=600, check=True
            )
        except (OSError, subprocess.SubprocessError):
            pass
        path = _find_browser()
    if path is None:
        pytest.skip("no chromium and `apt-get install -y chromium` failed (not root or offline?)")
    return path


class Browser:
    def __init__(self, binary: str, workdir: Path):
        self.binary = binary
        self.workdir = workdir
        self.runs = 0

    def _run(self, url: str, *args: str, budget_ms: int = 6000) -> subprocess.CompletedProcess:
        self.runs += 1
        profile = self.workdir / f"chromium-profile-{self.runs}"  # fresh: nothing cached between loads
        cmd = [
            self.binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            f"--virtual-time-budget={budget_ms}",
            *args,
            url,
        ]
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        finally:
            shutil.rmtree(profile, ignore_errors=True)

    def dom(self, url: str) -> str:
        result = self._run(url, "--dump-dom")
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    def screenshot(self, url: str, path: Path) -> None:
        result = self._run(url, f"--screenshot={path}", "--window-size=1400,900", "--hide-scrollbars")
        assert result.returncode == 0 and path.exists(), result.stderr[-3000:]


class Elements(HTMLParser):
    """Every start tag with its attributes, in document order."""

    def __init__(self, html: str):
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def by_class(self, name: str) -> list[dict[str, str]]:
        return [a for _, a in self.tags if name in a.get("class", "").split()]

    def by_id(self, ident: str) -> dict[str, str] | None:
        return next((a for _, a in self.tags if a.get("id") == ident), None)
