"""A peer's lifecycle: one enum (:class:`PeerState`), one owner that changes it, and the small typed
interface that the rebalancer and the drain use to act on the daemon.

    joining --ready--> online --drain--> draining --(a move finished)--> online
       \\______________stop_____________/

Every change goes through :meth:`Lifecycle.change`, which refuses a transition the diagram does not
have; the daemon owns the Lifecycle and logs its events, the server only reads the state
(``accepting``, ``serves_state``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from swarmpipe.peer.events import EventLog
from swarmpipe.peer.swarm.records import PeerState, StageRecord

if TYPE_CHECKING:
    from swarmpipe.peer.stage.runtime import StageRuntime
    from swarmpipe.peer.swarm.dht import SwarmDHT

TRANSITIONS: dict[PeerState, frozenset[PeerState]] = {
    PeerState.JOINING: frozenset({PeerState.ONLINE, PeerState.DRAINING}),
    PeerState.ONLINE: frozenset({PeerState.DRAINING}),
    PeerState.DRAINING: frozenset({PeerState.ONLINE}),  # a rebalancing move serves its new stage
}


class LifecycleError(RuntimeError):
    """A state change the lifecycle does not allow (a bug, never caller input)."""


class Lifecycle:
    """The one place a peer's :class:`PeerState` changes."""

    def __init__(self, on_change: Callable[[PeerState], None] | None = None):
        self._state = PeerState.JOINING
        self.on_change = on_change  # e.g. a metric

    @property
    def state(self) -> PeerState:
        return self._state

    @property
    def accepting(self) -> bool:
        """New work (forwards, replays) is taken only online."""
        return self._state is PeerState.ONLINE

    @property
    def serves_state(self) -> bool:
        """A joining peer has no state worth downloading yet."""
        return self._state is not PeerState.JOINING

    def change(self, new: PeerState) -> None:
        if new is self._state:
            return
        if new not in TRANSITIONS[self._state]:
            raise LifecycleError(f"a peer cannot go from {self._state.value} to {new.value}")
        self._state = new
        if self.on_change is not None:
            self.on_change(new)


class StageHost(Protocol):
    """What the rebalancer and the drain need from the peer daemon, and nothing more."""

    swarm: SwarmDHT
    events: EventLog
    lifecycle: Lifecycle

    @property
    def runtime(self) -> StageRuntime: ...

    def record(self, state: PeerState | None = None, throughput: float | None = None) -> StageRecord: ...

    async def announce_as(self, stage: int, record: StageRecord) -> None:
        """Announce ``record`` under ``stage`` (one we move to or leave)."""

    async def finish_in_flight(self) -> float:
        """Go draining and wait (bounded) for the work we hold; returns the drain deadline."""

    def switch_runtime(self, runtime: StageRuntime) -> None:
        """Serve ``runtime`` from now on (its stage's server, averaging and records)."""
