"""A peer's memory holds its stage, not the model: loading one stage of four from a ~110 MB checkpoint
raises the process's peak resident memory by about that stage's size (run in a fresh subprocess so the
peak belongs to the load alone)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.hf_fixtures import make_tiny_llama

pytestmark = pytest.mark.timeout(240)

PROBE = textwrap.dedent(
    """
    import json, sys
    import torch
    torch.set_num_threads(1)
    from swarmpipe.peer.model.hf_checkpoint import resolve_spec
    from swarmpipe.peer.spec import spec_from_dict
    from swarmpipe.peer.stage.base_weights import read_local_base
    from swarmpipe.peer.stage.runtime import StageRuntime
    import transformers.models.llama.modeling_llama  # imported before the baseline: not the stage's cost

    folder, stage = sys.argv[1], int(sys.argv[2])
    spec = resolve_spec(spec_from_dict({"num_stages": 4, "model": {"family": "llama", "checkpoint": folder,
                                        "seq_len": 64}, "optimizer": {"kind": "adamw"}}))
    StageRuntime(spec, 0 if stage else 1)  # warm every import and allocator path on an empty stage
    def status_kb(field):  # not ru_maxrss: it keeps the forking parent's peak across exec
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    before = status_kb("VmRSS")
    runtime = StageRuntime(spec, stage)
    ckpt = read_local_base(folder, runtime)
    peak = status_kb("VmHWM")
    stage_bytes = sum(p.numel() * p.element_size() for p in runtime.weights.module.parameters())
    print(json.dumps({"before_kb": before, "peak_kb": peak, "stage_bytes": stage_bytes,
                      "tensors_read": ckpt.tensors_read}))
    """
)


def test_loading_a_stage_costs_its_own_size_not_the_models(tmp_path):
    make_tiny_llama(tmp_path, layers=8, hidden=512, heads=8, kv_heads=8, intermediate=1536, vocab=1000)
    model_bytes = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert model_bytes > 100e6
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path), "1"], capture_output=True, text=True, timeout=200, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    grown = (got["peak_kb"] - got["before_kb"]) * 1024
    assert got["stage_bytes"] < model_bytes / 3.5  # stage 1 of 4: two of eight layers
    # at most one copy of the stage (safetensors may even map the file instead of copying), never the model
    assert grown < got["stage_bytes"] * 1.2 + 8e6, got
    assert got["tensors_read"] == 2 * 9
