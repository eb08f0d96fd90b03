"""Who may hand a stage its state: the rule that peers and the coordinator's checkpoint server apply to a
pushed state before they take it (its signer announced on the stage, its version no further ahead than the
signer announced), and how long a push may take."""

from __future__ import annotations

import grpc

from swarmpipe.peer.state.format import StageState
from swarmpipe.peer.swarm.records import MAX_VERSION, StageRecord

PUSH_TIMEOUT_S = 120.0  # a push that never closes is cut off, and what it sent is dropped
VERSION_SLACK = 10_000  # steps a pusher may be ahead of its last announcement (records lag one period)


def pusher_problem(state: StageState, stage: int, members: dict[str, StageRecord]) -> tuple[grpc.StatusCode, str]:
    """Why a pushed state may not be taken ('' when it may): its signer must be announced on ``stage`` (the
    stage's signed records, ``members``) and its version no further ahead than that signer announced. Peers and
    the coordinator's checkpoint server apply the same rule."""
    sender = str(state.meta.get("signed_by", ""))
    record = members.get(sender)
    if record is None:
        return grpc.StatusCode.PERMISSION_DENIED, (
            f"peer {sender[-6:]} is not announced on stage {stage}: only its replicas hand over state"
        )
    if not 0 <= state.version <= min(MAX_VERSION, record.version + VERSION_SLACK):
        return grpc.StatusCode.INVALID_ARGUMENT, (
            f"pushed version {state.version} is beyond what peer {sender[-6:]} announced ({record.version})"
        )
    return grpc.StatusCode.OK, ""
