"""The fault tier's trainers read a small corpus, and its longest scenarios start first."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

CORPUS_BYTES = 1 << 20
# Run first (in this order), so the two workers of `-n 2` end together instead of one running a minute-long
# scenario alone at the end. A stale list costs only time.
SLOWEST_FIRST = (
    "test_relayed_hop.py",
    "test_relayed_peer.py",
    "test_rebalance.py",
    "test_peer_faults.py",
    "test_join_while_coordinator_down.py",
    "test_averaging_member_vanishes.py",
)


@pytest.fixture(scope="session")
def fault_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1 MiB of the stdlib's top-level modules. A trainer's default corpus is the whole stdlib, found by walking
    every folder under it (site-packages too): 3 CPU-seconds of each trainer's start, for scenarios that train a
    few hundred micro-batches of 8 x 32 bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = b"\n".join(p.read_bytes() for p in sorted(stdlib.glob("*.py")))[:CORPUS_BYTES]
    path = tmp_path_factory.mktemp("corpus") / "stdlib.txt"
    path.write_bytes(text)
    return path


@pytest.fixture(autouse=True)
def _trainers_read_the_small_corpus(fault_corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # every role inherits the environment; SWARMPIPE_DATA is the trainer's --data (no other role has it)
    monkeypatch.setenv("SWARMPIPE_DATA", str(fault_corpus))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if item.path.parent == here]
    rank = {name: n for n, name in enumerate(SLOWEST_FIRST)}
    ordered = sorted((items[i] for i in slots), key=lambda item: rank.get(item.path.name, len(rank)))
    for i, item in zip(slots, ordered, strict=True):
        items[i] = item
