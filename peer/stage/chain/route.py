"""A chained request's route, checked before any work, and the only addresses a chain may dial.

A ``ChainRequest`` names, for every stage after the receiving one, a few candidate replicas (peer id and
address) in the trainer's order of preference. A stranger could fill it with any address, and every peer on
the way would dial it: a swarm of stage servers turned into a scanner or an amplifier. So:

* the route's shape is bounded before any work: exactly one entry per later stage of the chain (all stages
  left, or up to the end of a segment the trainer relays after: ``segment_stages``), 1..``MAX_CANDIDATES``
  candidates each, peer ids in base58, addresses of bounded length, no duplicates (INVALID_ARGUMENT);
* a peer dials a candidate only if the DHT's signed stage records list that peer id, online, at that very
  address, for that stage (:class:`AnnouncedHops`). The route cannot make a peer dial anything it would not
  dial as a trainer: whoever can announce a stage server could be routed to anyway. Addresses are compared as
  opaque strings (a relayed address is dialled through the channel pool like any other).

Signing the route by the trainer was the alternative; it would bind the route to a trainer but not bound what a
hostile trainer itself may name, and peers would need every trainer's key: the DHT check bounds both.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable

import grpc

from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.stage.request_checks import MAX_TICKET_BYTES, MIN_TICKET_BYTES, RequestError
from swarmpipe.peer.swarm.records import PeerState, StageRecord
from swarmpipe.peer.transport.chain_protocol import MAX_CANDIDATES, MAX_HOP_TIMEOUT_S
from swarmpipe.peer.transport.wire import decode, echo
from swarmpipe.protos import swarm_pb2

MAX_ADDRESS = 262  # characters, as a stage record's fields are bounded
_PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{1,64}$")
RECORDS_FRESH_S = 2.0  # the next stage's records are read from the DHT at most this often (more when one is missing)

Hop = tuple[str, str]  # (peer id, address)


def check_ticket(ticket: bytes) -> None:
    """Chained calls are bound to the trainer's secret for the micro-batch: required, and bounded."""
    if not MIN_TICKET_BYTES <= len(ticket) <= MAX_TICKET_BYTES:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"a chained request needs a ticket of {MIN_TICKET_BYTES}..{MAX_TICKET_BYTES} bytes, got {len(ticket)}",
        )


def check_route(spec: RunSpec, stage: int, request: swarm_pb2.ChainRequest) -> tuple[list[list[Hop]], int]:
    """(the route as ``[[(peer id, address), ...] per later stage of the segment]``, the segment's last stage);
    RequestError when either is malformed."""
    covers = request.segment_stages
    if not 0 <= covers <= spec.num_stages - stage:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"segment_stages must lie in [0, {spec.num_stages - stage}] from stage {stage}, got {covers}",
        )
    end = spec.num_stages - 1 if covers == 0 else stage + covers - 1
    left = end - stage
    if len(request.route) != left:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"route names {len(request.route)} stages; {left} follow stage {stage} in this chain (to stage {end} "
            f"of a {spec.num_stages}-stage run)",
        )
    check_ticket(request.ticket)
    if not 0 < request.hop_timeout_s <= MAX_HOP_TIMEOUT_S:  # also refuses NaN
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"hop_timeout_s must lie in (0, {MAX_HOP_TIMEOUT_S:g}]")
    route = []
    for offset, candidates in enumerate(request.route):
        hops = [(h.peer_id, h.address) for h in candidates.hops]
        where = f"route stage {stage + 1 + offset}"
        if not 1 <= len(hops) <= MAX_CANDIDATES:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {len(hops)} candidates; 1..{MAX_CANDIDATES} allowed"
            )
        for peer_id, address in hops:
            if not _PEER_ID.match(peer_id):
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: peer id {echo(peer_id)} is not base58")
            if not 0 < len(address) <= MAX_ADDRESS:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{where}: an address is 1..{MAX_ADDRESS} characters"
                )
        if len(set(hops)) != len(hops):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: a candidate is named twice")
        route.append(hops)
    return route, end


def decode_targets(spec: RunSpec, msg: swarm_pb2.Tensor, rows: int, seq: int):
    """The micro-batch's targets, carried to the last stage: int64 [rows, seq] of token ids in the vocabulary
    (checked at every stage, so a bad one fails at the first hop, not after every forward)."""
    targets = decode(
        msg,
        max_elements=spec.limits.max_tensor_elements,
        allowed_dtypes=("int64",),
        expect_shape=(rows, seq),
        what="targets",
    )
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= spec.model.vocab_size):
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT, f"targets: token ids must lie in [0, {spec.model.vocab_size})"
        )
    return targets


class AnnouncedHops:
    """Which route candidates this peer may dial: those the DHT lists for their stage, online, at that address.

    ``read(stage)`` returns the stage's signed records (``SwarmDHT.stage_peers``); reads are cached for
    ``RECORDS_FRESH_S`` and shared by concurrent callers; a candidate missing from a cached read triggers one
    fresh read (a replica that just joined), no more often than every ``RECORDS_FRESH_S / 4``.
    """

    def __init__(
        self,
        read: Callable[[int], Awaitable[dict[str, StageRecord]]] | None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.read = read  # None: nothing is announced to us (a servicer outside a daemon): dial nothing
        self.clock = clock
        self._cache: dict[int, tuple[float, dict[str, StageRecord]]] = {}
        self._reads: dict[int, asyncio.Task] = {}

    async def _records(self, stage: int, max_age: float) -> dict[str, StageRecord]:
        cached = self._cache.get(stage)
        if cached is not None and self.clock() - cached[0] <= max_age:
            return cached[1]
        task = self._reads.get(stage)
        if task is None or task.done():
            task = self._reads[stage] = asyncio.ensure_future(self.read(stage))
        try:
            records = await asyncio.shield(task)
        except Exception:  # noqa: BLE001 - a DHT hiccup: keep the last view
            return cached[1] if cached is not None else {}
        self._cache[stage] = (self.clock(), records)
        return records

    async def allowed(self, stage: int, hops: list[Hop]) -> tuple[list[Hop], list[Hop]]:
        """(candidates this peer may dial, in the route's order; those it may not)."""
        if self.read is None:
            return [], list(hops)
        records = await self._records(stage, RECORDS_FRESH_S)
        if any(not _listed(records, hop) for hop in hops):
            records = await self._records(stage, RECORDS_FRESH_S / 4)
        ok = [hop for hop in hops if _listed(records, hop)]
        return ok, [hop for hop in hops if hop not in ok]


def _listed(records: dict[str, StageRecord], hop: Hop) -> bool:
    record = records.get(hop[0])
    return record is not None and record.address == hop[1] and record.state == PeerState.ONLINE
