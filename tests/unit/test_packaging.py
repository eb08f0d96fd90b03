"""Installed, swarmpipe is one import name: every package folder is mapped under ``swarmpipe`` and the
wheel holds no other top-level module (``peer``, ``protos`` ... would collide with other projects)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def _package_folders() -> dict[str, Path]:
    """Every folder with an __init__.py under a mapped root, by its installed dotted name."""
    found = {}
    for name, folder in SETUPTOOLS["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found[".".join([name, *rel.parts])] = init.parent
    return found


def test_every_package_folder_is_listed_under_swarmpipe():
    listed = set(SETUPTOOLS["packages"])
    folders = _package_folders()
    assert set(folders) == listed, f"pyproject lists {sorted(listed ^ set(folders))} wrongly"
    assert all(name == "swarmpipe" or name.startswith("swarmpipe.") for name in listed)


def test_the_console_script_lives_in_the_cli():
    assert PYPROJECT["project"]["scripts"]["swarmpipe"] == "swarmpipe.cli.main:main"


def test_the_wheel_has_one_top_level_module(tmp_path: Path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("swarmpipe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"swarmpipe"}, top
    for data in (
        "swarmpipe/peer/swarm/bootstrap/public.txt",
        "swarmpipe/coordinator/dashboard/index.html",
        "swarmpipe/protos/swarm.proto",
    ):
        assert data in names, f"{data} missing from the wheel"
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")] or [None]
    if top_level:
        assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["swarmpipe"]


def test_the_dashboard_is_found_outside_the_repository(tmp_path):
    """Installed, the dashboard's files are package data of swarmpipe.coordinator (a bare "coordinator" import
    only resolves from the repository root)."""
    import subprocess
    import sys

    probe = "from swarmpipe.coordinator.http import _dashboard_file; print(len(_dashboard_file('index.html') or b''))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and int(out.stdout) > 100, out.stderr[-2000:]
