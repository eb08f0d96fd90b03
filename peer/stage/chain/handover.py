"""Where a chain that ends before the last stage waits for the trainer: its output parked, its gradient awaited.

When the hop into stage e+1 goes through the trainer (stage e cannot dial it: two peers behind one NAT without
hairpinning, an egress firewall), the trainer's chain covers stages s..e only (``segment_stages``). Stage e runs
its forward, parks the output here and waits: the trainer takes it (``ChainHandover``), sends it on from stage
e+1, and gives back its gradient (``ChainResume``); stage e then runs its backward and answers its caller as in a
whole chain. So every peer of the segment keeps what it sent downstream until its backward, and only the hop
the trainer relays crosses the trainer's link.

A park is keyed by the micro-batch's ticket digest and id (``chain_results.result_key``): only holders of the
ticket (the trainer, and the peers the micro-batch passed) can take the output or resume it. A park lives inside
the chain's work, so ``ChainResults`` bounds how many run; it ends when resumed, abandoned, or after ``timeout``
(the trainer vanished), and the forward it kept is then dropped by the caller. A ``ChainHandover`` may come
before the chain reaches this peer (the trainer asks every candidate of stage e at once: it cannot know which one
stage e-1 reached), so it waits up to ``wait_s``; waiting calls are bounded in all and per caller.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

import grpc
import torch

from swarmpipe.peer.stage.request_checks import RequestError


class Abandoned(Exception):
    """The trainer gave no gradient for a parked output: it abandoned the micro-batch, or never came back."""


@dataclass
class Parked:
    output: torch.Tensor
    version: int
    grad: asyncio.Future  # the gradient of ``output``; None: abandoned


class Handovers:
    def __init__(self, max_waiting: int = 512, max_waiting_per_caller: int = 128):
        self.max_waiting = max_waiting
        self.max_waiting_per_caller = max_waiting_per_caller
        self.parked: dict[str, Parked] = {}
        self._arrivals: dict[str, asyncio.Event] = {}  # key -> set when it parks (only while someone waits)
        self._waiting_on: Counter[str] = Counter()  # key -> handover calls waiting for it
        self._waiting_by: Counter[str] = Counter()  # caller -> handover calls waiting
        self.handed_over = 0
        self.abandoned = 0

    # ------------------------------------------------------------ the parked chain's side
    async def park(self, key: str, output: torch.Tensor, version: int, timeout: float) -> torch.Tensor:
        """Park ``output`` under ``key`` and wait for its gradient; Abandoned when none comes."""
        if key in self.parked:  # ChainResults runs a key's work once: a second park is a bug, not an input
            raise RuntimeError(f"micro-batch {key} is parked already")
        parked = Parked(output, version, asyncio.get_running_loop().create_future())
        self.parked[key] = parked
        arrival = self._arrivals.get(key)
        if arrival is not None:
            arrival.set()
        try:
            grad = await asyncio.wait_for(asyncio.shield(parked.grad), timeout)
        except TimeoutError:
            self.abandoned += 1
            raise Abandoned(f"the trainer gave no gradient for the handed-over output within {timeout:.0f}s") from None
        finally:
            self.parked.pop(key, None)
        if grad is None:
            self.abandoned += 1
            raise Abandoned("the trainer abandoned the micro-batch after the handover")
        return grad

    # ------------------------------------------------------------ the trainer's side
    async def handover(self, key: str, caller: str, wait_s: float) -> Parked:
        """The output parked under ``key``, waiting up to ``wait_s`` for it to park; NOT_FOUND when it does not."""
        parked = self.parked.get(key)
        if parked is None:
            self._admit(caller)
            arrival = self._arrivals.setdefault(key, asyncio.Event())
            self._waiting_on[key] += 1
            self._waiting_by[caller] += 1
            try:
                await asyncio.wait_for(arrival.wait(), wait_s)
            except TimeoutError:
                pass
            finally:
                self._leave(key, caller)
            parked = self.parked.get(key)
            if parked is None:
                raise RequestError(
                    grpc.StatusCode.NOT_FOUND, f"no chain parked this micro-batch here within {wait_s:.0f}s"
                )
        self.handed_over += 1
        return parked

    def waiting_for(self, key: str) -> Parked:
        """The park a resume is for; NOT_FOUND when there is none (never parked here, or ended)."""
        parked = self.parked.get(key)
        if parked is None or parked.grad.done():
            raise RequestError(grpc.StatusCode.NOT_FOUND, "no chain waits here for this micro-batch's gradient")
        return parked

    def resume(self, key: str, grad: torch.Tensor | None) -> None:
        """Give the parked chain its gradient (None: abandon it)."""
        self.waiting_for(key).grad.set_result(grad)

    @property
    def waiting(self) -> int:
        return sum(self._waiting_by.values())

    def _admit(self, caller: str) -> None:
        if self.waiting >= self.max_waiting:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many handovers are waiting here")
        if self._waiting_by[caller] >= self.max_waiting_per_caller:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.max_waiting_per_caller} handovers from this caller are waiting already",
            )

    def _leave(self, key: str, caller: str) -> None:
        self._waiting_by[caller] -= 1
        if self._waiting_by[caller] <= 0:
            del self._waiting_by[caller]
        self._waiting_on[key] -= 1
        if self._waiting_on[key] <= 0:  # nobody waits for it any more: nothing to wake
            del self._waiting_on[key]
            self._arrivals.pop(key, None)

    def close(self) -> None:
        """The peer is leaving: every parked chain ends (its caller sees the chain abandoned)."""
        for parked in list(self.parked.values()):
            if not parked.grad.done():
                parked.grad.set_result(None)
