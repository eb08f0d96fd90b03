"""The data-plane benchmarks still run end to end (tiny sizes, a fraction of a second per point).

They are not timed here (speed is for the benchmarks themselves); this only keeps them from rotting:
every callee process starts and stops, every column is filled, the JSON is written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
REPO = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, tmp_path: Path) -> tuple[str, dict]:
    out = tmp_path / f"{Path(script).stem}.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout, json.loads(out.read_text())


def test_dataplane_bench_fills_every_column(tmp_path: Path) -> None:
    stdout, data = run_bench(
        "dataplane.py", "--sizes-kib", "64", "1024", "--rounds", "2", "--seconds", "0.05", tmp_path=tmp_path
    )
    assert [r["bytes"] for r in data["rows"]] == [64 * 1024, 1024 * 1024]
    for row in data["rows"]:
        for key in ("tcp_gbps", "swarmpipe_gbps", "swarmpipe_x4_gbps", "hivemind_gbps", "hivemind_x4_gbps"):
            assert row[key] > 0, (key, row)
        for key in ("vs_tcp", "x4_vs_tcp", "vs_hivemind", "x4_vs_hivemind_x4"):
            low, high = row[key + "_range"]
            assert 0 < low <= row[key] <= high, (key, row)
    assert data["empty_calls"]["info_rtt_ms"] > 0
    assert "ratio ranges over rounds" in stdout


def test_call_breakdown_bench_measures_three_callees(tmp_path: Path) -> None:
    stdout, data = run_bench("call_breakdown.py", "--kib", "256", "--seconds", "0.5", tmp_path=tmp_path)
    assert set(data["rows"]) == {"stage", "inline", "canned"}
    for row in data["rows"].values():
        assert row["calls"] >= 25 and row["latency_ms"] > 0 and row["callee_cpu_ms"] >= 0
    assert "compute-thread hop" in stdout
