"""Moving a stage's state between participants over gRPC.

* :func:`download_state`: a joining peer pulls its stage from live replicas, one
  shard per donor in parallel (a failed donor's shard is retried on another), or
  from the coordinator's checkpoint server. Replicas train on between requests and
  differ from each other, so every shard says which snapshot it belongs to (version
  and digest) and a set mixed from several is never loaded: the joiner then takes
  every shard from one donor, whose :class:`DonorSnapshot` serves them all from the
  same export.
* :func:`push_state`: a draining peer hands its newest state to a replica or the
  coordinator.
Every shard is signed by its sender (:mod:`state_signing`); with ``signers`` a joiner loads only
shards signed by the peer that announced the address it fetched them from.
Both stream :class:`StateChunk` messages; a stream cut off midway fails cleanly
with :class:`StateError` and nothing half-loaded is ever used.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable

import grpc

from swarmpipe.peer.state.format import MixedState, StageState, StateError, assemble, from_chunks, to_chunks
from swarmpipe.peer.swarm.identity import Identity
from swarmpipe.peer.swarm.records import StageRecord
from swarmpipe.peer.transport import security as process_security  # TLS pins, credentials (private swarms)
from swarmpipe.peer.transport.channels import channel_options
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

log = logging.getLogger("swarmpipe.state")
TRANSFER_TIMEOUT_S = 120.0
SNAPSHOT_TTL_S = 30.0  # a joiner's parallel and retried shard requests arrive well within this
PARAMS_TTL_S = 2.0  # siblings pull at the same clock-aligned slot: one export serves them all, still fresh
Shard = tuple[dict, dict]  # (metadata, tensors) of one shard


class ParamsExport:
    """The donor's side of a params-only download (a sibling's averaging round): one export of the trainable
    weights, encoded and signed once, is shared by every request within ``ttl`` seconds, so the siblings that
    pull at the same slot cost one copy, however many ask. Re-exported when the runtime changed (a move)."""

    def __init__(self, ttl: float = PARAMS_TTL_S):
        self.ttl = ttl
        self._chunks: list[swarm_pb2.StateChunk] | None = None
        self._owner: object = None
        self._taken_at = 0.0
        self._lock = asyncio.Lock()

    async def get(self, owner: object, make: Callable[[], Awaitable[list[swarm_pb2.StateChunk]]]):
        async with self._lock:
            fresh = self._chunks is not None and self._owner is owner
            if not fresh or time.monotonic() - self._taken_at > self.ttl:
                self._chunks, self._owner = None, None  # the old copy goes before the new one is made
                self._chunks = await make()
                self._owner, self._taken_at = owner, time.monotonic()
                asyncio.get_running_loop().call_later(self.ttl + 1.0, self._expire)
            return self._chunks

    def _expire(self) -> None:
        if self._chunks is not None and time.monotonic() - self._taken_at > self.ttl:
            self._chunks, self._owner = None, None


class DonorSnapshot:
    """The donor's side: one exported state serves every shard request for ``ttl`` seconds, so the
    shards one joiner fetches in parallel (or retries) agree in version and digest. Holds at most
    one copy of the state, dropped when it expires."""

    def __init__(self, ttl: float = SNAPSHOT_TTL_S):
        self.ttl = ttl
        self._state: StageState | None = None
        self._taken_at = 0.0
        self._lock = asyncio.Lock()

    async def get(self, export: Callable[[], Awaitable[StageState]]) -> StageState:
        async with self._lock:
            if self._state is None or time.monotonic() - self._taken_at > self.ttl:
                self._state = await export()
                self._taken_at = time.monotonic()
                asyncio.get_running_loop().call_later(self.ttl + 1.0, self._expire)
            return self._state

    def _expire(self) -> None:
        if self._state is not None and time.monotonic() - self._taken_at > self.ttl:
            self._state = None

    def clear(self) -> None:
        self._state = None


async def _download_shard(
    address: str,
    run_id: str,
    stage: int,
    shard: int,
    num_shards: int,
    max_message_mb: int,
    on_chunk: Callable[[int, int], None] | None,
    base: bool = False,
    signers: frozenset[str] | None = None,
    params_only: bool = False,
    max_bytes: int | None = None,
):
    async with process_security.current().channel(address, channel_options(max_message_mb)) as channel:
        stub = swarm_pb2_grpc.StageStub(channel)
        request = swarm_pb2.DownloadStateRequest(
            run_id=run_id, stage=stage, shard=shard, num_shards=num_shards, base=base, params_only=params_only
        )
        chunks = []
        received = 0
        async for chunk in stub.DownloadState(request, timeout=TRANSFER_TIMEOUT_S):
            received += chunk.ByteSize()
            if max_bytes is not None and received > max_bytes:  # a donor streaming without end
                raise StateError(f"{address} sent more than {max_bytes >> 20} MiB, more than this stage's state")
            chunks.append(chunk)
            if on_chunk is not None:
                on_chunk(chunk.index + 1, chunk.total)
    if signers is None:
        return from_chunks(chunks)
    meta, tensors = from_chunks(chunks, purpose="download")
    if meta["signed_by"] not in signers:
        raise StateError(
            f"{address} served a shard signed by {meta['signed_by'][-6:]}, not by the peer announced there"
        )
    return meta, tensors


def announced_signers(peers: dict[str, StageRecord], coordinators: frozenset[str]) -> dict[str, frozenset[str]]:
    """Who must have signed a state shard fetched from each address: the peer whose signed record announced
    it; for any other address (the checkpoint server the coordinator's record names) a trusted coordinator."""
    signers: dict[str, frozenset[str]] = defaultdict(lambda: coordinators)
    for pid, record in peers.items():
        signers[record.address] = frozenset({pid})
    return signers


def _signers_of(signers: dict[str, frozenset[str]], address: str) -> frozenset[str]:
    try:
        return signers[address]  # a defaultdict may name a default (the trusted coordinators)
    except KeyError:
        return frozenset()


async def download_state(
    donors: list[str],
    run_id: str,
    stage: int,
    max_message_mb: int = 64,
    on_progress: Callable[[int, int], None] | None = None,
    base: bool = False,
    signers: dict[str, frozenset[str]] | None = None,
    params_only: bool = False,
    max_bytes: int | None = None,
) -> StageState:
    """Pull the stage's state split across ``donors`` (addresses); retries a failed shard elsewhere.
    ``base``: the stage's frozen base weights from the run's base checkpoint instead of its state.
    ``params_only``: the trainable weights alone, in one stream per donor (pass one donor).
    ``max_bytes``: the most one shard's stream may carry (counted as it arrives).
    Shards from different snapshots are never joined: the whole state is then taken from one donor
    (the newest first), and a donor whose shards still disagree is skipped.
    ``signers``: address -> the peer ids whose signature a shard from there must carry (the DHT's
    signed records say who announced each address); None only for tests and local tools."""
    if not donors:
        raise StateError("no donors to download from")
    if params_only and len(donors) != 1:
        raise ValueError("a params-only download comes whole from one donor")
    num_shards = len(donors)
    done_chunks = [0] * num_shards
    totals = [1] * num_shards

    def progress(shard: int) -> Callable[[int, int], None]:
        def update(received: int, total: int) -> None:
            done_chunks[shard], totals[shard] = received, total
            if on_progress is not None:
                on_progress(sum(done_chunks), sum(totals))

        return update

    async def fetch(shard: int, candidates: list[str]) -> tuple[Shard, str]:
        errors = []
        for attempt in range(len(candidates)):
            address = candidates[(shard + attempt) % len(candidates)]
            try:
                allowed = None if signers is None else _signers_of(signers, address)
                got = await _download_shard(
                    address,
                    run_id,
                    stage,
                    shard,
                    num_shards,
                    max_message_mb,
                    progress(shard),
                    base,
                    allowed,
                    params_only,
                    max_bytes,
                )
                return got, address
            except (grpc.aio.AioRpcError, StateError, ValueError, asyncio.TimeoutError) as e:
                detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                errors.append(f"{address}: {detail}")
                log.warning("state shard %d/%d from %s failed: %s", shard, num_shards, address, detail)
        raise StateError(f"shard {shard} could not be downloaded: {'; '.join(errors)}")

    fetched = await asyncio.gather(*(fetch(s, donors) for s in range(num_shards)))
    try:
        return assemble([shard for shard, _ in fetched])
    except MixedState as e:
        log.info("state shards of stage %d disagree (%s): taking the whole state from one donor", stage, e)
    version_of: dict[str, int] = {}  # donor -> the newest version it showed us
    for (meta, _), address in fetched:
        version_of[address] = max(version_of.get(address, 0), int(meta.get("version", 0)))
    newest_first = sorted(version_of, key=version_of.get, reverse=True)
    errors = []
    for donor in newest_first:
        try:
            shards = await asyncio.gather(*(fetch(s, [donor]) for s in range(num_shards)))
            return assemble([shard for shard, _ in shards])
        except StateError as e:
            errors.append(f"{donor}: {e}")
    raise StateError(f"no donor gave a consistent state: {'; '.join(errors)}")


async def push_state(
    address: str,
    state: StageState,
    max_message_mb: int = 64,
    timeout: float = 60.0,
    signer: Identity | None = None,
) -> swarm_pb2.PushStateResponse:
    chunks = to_chunks(state, signer=signer, purpose="push")
    async with process_security.current().channel(address, channel_options(max_message_mb)) as channel:
        stub = swarm_pb2_grpc.StageStub(channel)
        return await stub.PushState(iter(chunks), timeout=timeout)


async def receive_pushed(request_iterator, max_bytes: int, signed: bool = True) -> StageState:
    """Server side of PushState: collect (at most ``max_bytes``, counted as they arrive) and validate the
    whole stream before anything is used. ``signed``: refuse it unless its sender signed it for a push;
    the sender's peer id is then ``state.meta["signed_by"]`` for the caller to judge."""
    chunks = []
    received = 0
    async for chunk in request_iterator:
        received += chunk.ByteSize()
        if received > max_bytes:
            raise StateError(f"pushed state exceeds {max_bytes >> 20} MiB, more than this stage's state can be")
        chunks.append(chunk)
    meta, tensors = from_chunks(chunks, purpose="push" if signed else None)
    return assemble([(meta, tensors)])
