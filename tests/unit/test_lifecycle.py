"""The peer lifecycle: one enum, one owner, only the transitions the diagram has."""

from __future__ import annotations

import pytest

from swarmpipe.peer.stage.lifecycle import Lifecycle, LifecycleError
from swarmpipe.peer.swarm.records import PeerState, StageRecord

pytestmark = pytest.mark.unit


def test_a_peer_joins_serves_drains_and_may_serve_again_after_a_move():
    seen: list[PeerState] = []
    life = Lifecycle(on_change=seen.append)
    assert life.state is PeerState.JOINING and not life.accepting and not life.serves_state
    life.change(PeerState.ONLINE)
    assert life.accepting and life.serves_state
    life.change(PeerState.DRAINING)
    assert not life.accepting and life.serves_state
    life.change(PeerState.ONLINE)  # a rebalancing move switched to its new stage
    life.change(PeerState.ONLINE)  # no change, no callback
    assert seen == [PeerState.ONLINE, PeerState.DRAINING, PeerState.ONLINE]


def test_a_stop_while_joining_drains_directly():
    life = Lifecycle()
    life.change(PeerState.DRAINING)
    assert life.state is PeerState.DRAINING


def test_transitions_outside_the_diagram_are_refused():
    life = Lifecycle()
    life.change(PeerState.ONLINE)
    with pytest.raises(LifecycleError, match="from online to joining"):
        life.change(PeerState.JOINING)
    assert life.state is PeerState.ONLINE


def test_record_state_is_the_enum_and_travels_as_its_string():
    record = StageRecord(
        address="10.0.0.1:7000", state=PeerState.DRAINING, throughput=1.0, queue=0, version=3, updated_at=0.0
    )
    assert record.model_dump()["state"] == "draining" and type(record.model_dump()["state"]) is str
    assert StageRecord.model_validate(record.model_dump()).state is PeerState.DRAINING
