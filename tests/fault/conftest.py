"""The fault tier's longest scenarios start first."""

from __future__ import annotations

from pathlib import Path

import pytest
from netns_nat import NamespaceNat

# Run first (in this order), so the two workers of `-n 2` end together instead of one running a minute-long
# scenario alone at the end. A stale list costs only time.
SLOWEST_FIRST = (
    "test_relayed_hop.py",
    "test_relayed_peer.py",
    "test_rebalance.py",
    "test_home_peers.py",
    "test_peer_faults.py",
    "test_join_while_coordinator_down.py",
    "test_averaging_member_vanishes.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if item.path.parent == here]
    rank = {name: n for n, name in enumerate(SLOWEST_FIRST)}
    ordered = sorted((items[i] for i in slots), key=lambda item: rank.get(item.path.name, len(rank)))
    for i, item in zip(slots, ordered, strict=True):
        items[i] = item


@pytest.fixture
def nat():
    """A home network behind a NAT gateway (tests/netns_nat.py), deleted after the test; tests that take it skip
    themselves where namespaces cannot be made (``netns_nat.unavailable_reason``)."""
    nat = NamespaceNat()
    try:
        nat.create()
        yield nat
    finally:
        nat.delete()
