"""The committed generated code matches protos/swarm.proto (regenerate with `make protos`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_proto(tmp_path: Path):
    pytest.importorskip("grpc_tools")
    # Compiled under its installed path, as `make protos` does: the code imports swarmpipe.protos.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-Iswarmpipe/protos={ROOT / 'protos'}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            "swarmpipe/protos/swarm.proto",
        ],
        check=True,
    )
    for name in ("swarm_pb2.py", "swarm_pb2.pyi", "swarm_pb2_grpc.py"):
        fresh = (tmp_path / "swarmpipe" / "protos" / name).read_text()
        committed = (ROOT / "protos" / name).read_text()
        assert fresh == committed, f"protos/{name} is stale: run `make protos` and commit the result"


def test_no_pickle_on_the_wire():
    """The data plane never imports pickle: tensors travel as raw bytes with explicit dtype and shape."""
    for module in (
        "transport/wire.py",
        "transport/streaming.py",
        "stage/server.py",
        "trainer/microbatch.py",
        "transport/channels.py",
    ):
        source = (ROOT / "peer" / module).read_text()
        assert "pickle" not in source.replace("No pickle", "").replace("Nothing is pickled", ""), module
