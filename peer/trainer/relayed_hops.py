"""Which hops of a chained micro-batch go through the trainer for now, and for how long: ``RelayedHops``.

When a chain breaks at stage b (the peer before it reached none of its candidates: ABORTED, ``chain broke at
stage b``), hop b alone goes through the trainer: chains end at stage b-1 and the trainer carries that hop
(peer/trainer/chain_segments.py); every other hop stays peer to peer. The hop stays relayed for a cooldown
(5 s, doubling while it keeps breaking, up to 60 s), then chains are tried through it again: a peer that cannot
dial the next stage (two peers behind one NAT without hairpinning, an egress firewall) costs one failed dial per
cooldown, not one per micro-batch. A chain that passes a hop again starts its next cooldown from the shortest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from swarmpipe.peer.events import EventLog
from swarmpipe.peer.transport.chain_protocol import ChainBroken

HUB_COOLDOWN_S = 5.0
HUB_COOLDOWN_MAX_S = 60.0


class RelayedHops:
    def __init__(self, num_stages: int, events: EventLog, clock: Callable[[], float] = time.monotonic):
        self.num_stages = num_stages
        self.events = events
        self.clock = clock
        self.hub_until: dict[int, float] = {}  # stage b -> until when the hop into b goes through the trainer
        self.cooldown: dict[int, float] = {}  # stage b -> the next cooldown's length
        self.breaks = 0

    def now(self) -> list[int]:
        """The hops (by the stage they lead into) that go through the trainer for now."""
        t = self.clock()
        return sorted(s for s, until in self.hub_until.items() if until > t)

    def segment_end(self, stage: int) -> int:
        """The last stage a chain from ``stage`` reaches: the one before the next hop the trainer relays."""
        return min((s for s in self.now() if s > stage), default=self.num_stages) - 1

    def broke(self, broken: ChainBroken, mb_id: str) -> None:
        """Relay hop ``broken.stage`` for a cooldown that doubles while it keeps breaking: once per chain tried
        after a cooldown, not once per micro-batch that was in flight when the hop broke (a relay's death broke
        four at once, and the hop went through the trainer for 75 s instead of 5)."""
        self.breaks += 1
        now = self.clock()
        if self.hub_until.get(broken.stage, 0.0) > now:  # the same break, seen by another micro-batch in flight
            self.events.emit(
                "chain_broken", level=logging.INFO, microbatch=mb_id, stage=broken.stage, relayed_s=0.0, again=True
            )
            return
        length = self.cooldown.get(broken.stage, HUB_COOLDOWN_S)
        self.hub_until[broken.stage] = now + length
        self.cooldown[broken.stage] = min(HUB_COOLDOWN_MAX_S, 2 * length)
        self.events.emit(
            "chain_broken",
            level=logging.WARNING,
            microbatch=mb_id,
            stage=broken.stage,
            unreachable=broken.unreachable,
            relayed_s=round(length, 1),
            reason=broken.reason[:120],
        )

    def passed(self, stage: int, end: int) -> None:
        """A chain passed every hop from ``stage`` to ``end``: their cooldowns start over from the shortest."""
        for s in range(stage + 1, end + 1):
            if self.hub_until.get(s, 0.0) <= self.clock():
                self.cooldown.pop(s, None)
