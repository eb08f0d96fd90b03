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

# generous: the suite runs files two at a time on two shared cores, and a bench killed by its timeout leaves
# its swarm's processes behind (they run in sessions of their own)
pytestmark = [pytest.mark.integration, pytest.mark.timeout(330)]
REPO = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, tmp_path: Path) -> tuple[str, dict]:
    out = tmp_path / f"{Path(script).stem}.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
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


def test_gpu_bench_runs_its_code_paths_on_the_cpu(tmp_path: Path) -> None:
    """``--allow-cpu --tiny``: bare loop, a 1-peer swarm and a 2-peer swarm at a tiny size, every column."""
    stdout, data = run_bench("gpu.py", "--allow-cpu", "--tiny", tmp_path=tmp_path)
    assert data["figure"] is False  # tiny: a check, never a figure
    assert data["bare_tokens_per_s"] > 0 and len(data["bare"]) == 2
    assert [s["stages"] for s in data["swarms"]] == [1, 2]
    for s in data["swarms"]:
        assert s["tokens_per_s"] > 0 and s["ratio"] > 0 and s["lost"] == 0 and s["goal_met"] is None, s
        assert len(s["peer_memory_bytes"]) == len(s["memory_estimate_bytes"]) == s["stages"]
    for key in ("device", "peak_flops", "params", "params_without_embedding", "bare_peak_memory_bytes", "bare_mfu"):
        assert key in data, key
    assert "| run | stages | tokens/s | vs bare loop | MFU |" in stdout


def test_gpu_bench_without_cuda_says_so_and_exits_0(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: bench/gpu.py would run the real benchmark")
    out = tmp_path / "gpu.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu.py"), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no CUDA device: bench/gpu.py measures GPU stages; nothing to do" in result.stdout
    assert not out.exists()


def test_swarm_convergence_quick_trains_a_real_swarm_and_the_sync_reference(tmp_path: Path) -> None:
    """``--quick``: one optimizer through a real 2-stage swarm (processes, gRPC, DHT) and the one-process
    synchronous reference, every column filled (issue 16, item 5)."""
    stdout, data = run_bench("swarm_convergence.py", "--quick", tmp_path=tmp_path)
    sync, swarm = data["runs"]
    assert sync["name"].startswith("sync") and swarm["name"] == "basis_rotation_dc"
    assert swarm["completed"] == data["sizes"]["steps"] and swarm["lost"] == 0
    for run in (sync, swarm):
        assert run["eval_micro"][0] == 0 and run["eval_micro"][-1] == data["sizes"]["steps"], run
        assert len(run["eval_losses"]) == len(run["eval_micro"]) == len(run["eval_wall_s"])
        assert all(0 < loss < 10 for loss in run["eval_losses"])
    assert len(swarm["optimizer_steps"]) == 2 and all(s > 0 for s in swarm["optimizer_steps"])
    assert len(swarm["mean_delays"]) == 2 and swarm["mean_delays"][1] == 0  # the last stage's loss is fresh
    assert "| run | val loss | vs sync | micro-batches to sync@half" in stdout


def test_optimizer_cost_bench_measures_both_optimizers_and_the_bounds(tmp_path: Path) -> None:
    stdout, data = run_bench("optimizer_cost.py", "--widths", "16,32", "--repeats", "1", tmp_path=tmp_path)
    rows = [(r["width"], tuple(r["shape"]), r["max_dim"], r["factor_dtype"]) for r in data["rows"]]
    expected = []
    for d in (16, 32):
        for shape in ((d, d), (4 * d, d)):
            expected += [(d, shape, 0, "float32"), (d, shape, 0, "bfloat16")]
            expected += [(d, shape, d, "float32")] if shape[0] != shape[1] else []
    assert rows == expected
    square, square_bf16, wide, wide_bf16, bounded = data["rows"][:5]
    assert abs(square["memory_ratio"] - 3.0) < 0.05 and abs(square_bf16["memory_ratio"] - 2.0) < 0.05
    assert wide["memory_ratio"] > wide_bf16["memory_ratio"] > bounded["memory_ratio"]
    for row in data["rows"]:
        assert row["adamw_step_s"] > 0 and row["rotation_amortised_s"] > 0 and row["first_eigh_s"] > 0, row
    assert "| d | shape | bound |" in stdout


def test_relay_bench_measures_the_tunnel_direct_relayed_and_capped(tmp_path: Path) -> None:
    """``--cases tunnel --quick``: a relay, a target and a tunnel in one process; every cell measured."""
    stdout, data = run_bench("relay.py", "--cases", "tunnel", "--quick", tmp_path=tmp_path)
    tunnel = data["tunnel"]
    assert all(tunnel["rtt_ms"][k] > 0 for k in ("direct", "relayed", "relayed_capped"))
    for size, row in tunnel["mb_s"].items():
        assert int(size) > 0 and all(row[k] > 0 for k in ("direct", "relayed", "relayed_capped")), row
        assert all(r > 0 for r in row["ratio_relayed_direct"])
    assert "relayed" in stdout


def test_link_budget_table_matches_the_8b_arithmetic(tmp_path: Path) -> None:
    """bench/link_budget.py: 2048 x 4096 values a hop; 8-bit at 100 Mbit/s is ~3,000 tokens/s, ~17x the link."""
    stdout, data = run_bench("link_budget.py", tmp_path=tmp_path)
    rows = {r["codec"]: r for r in data["rows"]}
    assert rows["bf16"]["bytes_per_hop"] == 2 * 2048 * 4096 and rows["bf16"]["vs_bf16"] == 1.0
    eight = rows["blockwise8"]["links"][1]
    assert eight["mbits"] == 100 and 2900 < eight["tokens_per_s"] < 3100 and 15 < eight["link_over_compute"] < 18
    assert rows["blockwise4"]["vs_bf16"] > 3.7 and rows["blockwise2"]["vs_bf16"] > 7.0
    assert "| codec | MiB a hop, each way | vs bf16 |" in stdout
