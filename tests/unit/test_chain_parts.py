"""Chained micro-batches, one module at a time (no sockets): the route's checks and the hops a peer may dial,
how a broken chain reads, each micro-batch's work running once per peer, and the trainer's relayed hops."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from swarmpipe.peer.client.answers import AnswerChecks
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.stage.chain.results import ChainDone, ChainResults, result_key
from swarmpipe.peer.stage.chain.route import AnnouncedHops, check_route, decode_targets
from swarmpipe.peer.stage.request_checks import RequestError
from swarmpipe.peer.swarm.records import PeerState, StageRecord
from swarmpipe.peer.trainer.chain import ChainCalls
from swarmpipe.peer.trainer.relayed_hops import HUB_COOLDOWN_MAX_S, HUB_COOLDOWN_S, RelayedHops
from swarmpipe.peer.trainer.routing import Router
from swarmpipe.peer.transport.chain_protocol import MAX_CANDIDATES, ChainBroken
from swarmpipe.peer.transport.wire import WireError, encode
from swarmpipe.protos import swarm_pb2

pytestmark = pytest.mark.unit
A, B, C = "QmAaaa", "QmBbbb", "QmCccc"


def _spec(stages: int = 3) -> RunSpec:
    spec = RunSpec()
    spec.num_stages = stages
    spec.model.n_layers = stages
    return spec


def _request(route, ticket=b"t" * 16, hop_timeout_s=10.0, stage=0, segment_stages=0) -> swarm_pb2.ChainRequest:
    return swarm_pb2.ChainRequest(
        run_id="r",
        stage=stage,
        microbatch_id="mb",
        route=[swarm_pb2.ChainCandidates(hops=[swarm_pb2.ChainHop(peer_id=p, address=a) for p, a in h]) for h in route],
        ticket=ticket,
        hop_timeout_s=hop_timeout_s,
        segment_stages=segment_stages,
    )


def _record(address: str, state: PeerState = PeerState.ONLINE) -> StageRecord:
    return StageRecord(address=address, state=state, throughput=1.0, queue=0, version=0, updated_at=0.0)


# ------------------------------------------------------------------ the route
def test_a_wellformed_route_reads_back_in_order():
    route = check_route(_spec(), 0, _request([[(A, "h:1"), (B, "h:2")], [(C, "h:3")]]))
    assert route == ([[(A, "h:1"), (B, "h:2")], [(C, "h:3")]], 2)
    assert check_route(_spec(), 2, _request([], stage=2)) == ([], 2)  # the last stage: nothing follows
    # a segment (the trainer relays the hop after its end): the route stops at the end
    assert check_route(_spec(), 0, _request([[(A, "h:1")]], segment_stages=2)) == ([[(A, "h:1")]], 1)
    assert check_route(_spec(), 1, _request([], stage=1, segment_stages=1)) == ([], 1)
    assert check_route(_spec(), 1, _request([[(C, "h:3")]], stage=1, segment_stages=2)) == ([[(C, "h:3")]], 2)


@pytest.mark.parametrize(
    "route, over, words",
    [
        ([[(A, "h:1")]], {}, "route names 1 stages"),  # one stage short
        ([[(A, "h:1")], [(C, "h:3")], [(B, "h:4")]], {}, "route names 3"),  # one too many
        ([[], [(C, "h:3")]], {}, "0 candidates"),
        ([[(f"Qm{i}abc", f"h:{i + 1}") for i in range(MAX_CANDIDATES + 1)], [(C, "h:3")]], {}, "candidates"),
        ([[("0OIl", "h:1")], [(C, "h:3")]], {}, "base58"),
        ([[(A, "")], [(C, "h:3")]], {}, "address"),
        ([[(A, "x" * 300)], [(C, "h:3")]], {}, "address"),
        ([[(A, "h:1"), (A, "h:1")], [(C, "h:3")]], {}, "twice"),
        ([[(A, "h:1")], [(C, "h:3")]], {"ticket": b""}, "ticket"),
        ([[(A, "h:1")], [(C, "h:3")]], {"ticket": b"x" * 65}, "ticket"),
        ([[(A, "h:1")], [(C, "h:3")]], {"hop_timeout_s": 0.0}, "hop_timeout"),
        ([[(A, "h:1")], [(C, "h:3")]], {"hop_timeout_s": float("nan")}, "hop_timeout"),
        ([[(A, "h:1")], [(C, "h:3")]], {"hop_timeout_s": 1e9}, "hop_timeout"),
        ([[(A, "h:1")], [(C, "h:3")]], {"segment_stages": 4}, "segment_stages"),  # past the last stage
        ([[(A, "h:1")], [(C, "h:3")]], {"segment_stages": -1}, "segment_stages"),
        ([[(A, "h:1")], [(C, "h:3")]], {"segment_stages": 2}, "route names 2"),  # a route past the segment's end
        ([], {"segment_stages": 2}, "route names 0"),  # one short of it
    ],
)
def test_hostile_routes_are_refused_before_any_work(route, over, words):
    with pytest.raises(RequestError) as info:
        check_route(_spec(), 0, _request(route, **over))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert words in str(info.value)


def test_targets_are_checked_at_every_stage():
    spec = _spec()
    good = decode_targets(spec, encode(torch.zeros(2, 8, dtype=torch.int64)), 2, 8)
    assert tuple(good.shape) == (2, 8)
    with pytest.raises(WireError):
        decode_targets(spec, encode(torch.zeros(2, 9, dtype=torch.int64)), 2, 8)  # another shape
    with pytest.raises(WireError):
        decode_targets(spec, encode(torch.zeros(2, 8)), 2, 8)  # floats
    with pytest.raises(RequestError):
        decode_targets(spec, encode(torch.full((2, 8), spec.model.vocab_size)), 2, 8)  # out of the vocabulary


async def test_only_hops_the_dht_lists_online_at_that_address_are_dialled():
    reads = []

    async def read(stage: int):
        reads.append(stage)
        return {A: _record("h:1"), B: _record("h:2", PeerState.DRAINING)}

    now = {"t": 0.0}
    hops = AnnouncedHops(read, clock=lambda: now["t"])
    ok, refused = await hops.allowed(1, [(A, "h:1"), (A, "evil:1"), (B, "h:2"), (C, "h:3")])
    assert ok == [(A, "h:1")] and refused == [(A, "evil:1"), (B, "h:2"), (C, "h:3")]
    assert reads == [1]  # read just now: a missing candidate does not make another read
    now["t"] = 1.0
    await hops.allowed(1, [(C, "h:3")])
    assert reads == [1, 1]  # a candidate missing from a half-second-old read: one fresh read
    await hops.allowed(1, [(A, "h:1")])
    assert reads == [1, 1]  # all listed: served from the cache
    ok, refused = await AnnouncedHops(None).allowed(1, [(A, "h:1")])  # no DHT: dial nobody
    assert ok == [] and refused == [(A, "h:1")]


async def test_a_dht_hiccup_keeps_the_last_view():
    calls = {"n": 0}
    now = {"t": 0.0}

    async def read(stage: int):
        calls["n"] += 1
        if calls["n"] > 1:
            raise TimeoutError("dht")
        return {A: _record("h:1")}

    hops = AnnouncedHops(read, clock=lambda: now["t"])
    assert (await hops.allowed(1, [(A, "h:1")]))[0] == [(A, "h:1")]
    now["t"] = 100.0
    assert (await hops.allowed(1, [(A, "h:1")]))[0] == [(A, "h:1")]


# ------------------------------------------------------------------ a broken chain
def test_a_broken_chain_reads_back_and_strangers_details_do_not():
    broken = ChainBroken(2, "QmAaaa: UNAVAILABLE connection refused", unreachable=True)
    again = ChainBroken.parse(broken.detail())
    assert (again.stage, again.unreachable, again.reason) == (2, True, broken.reason)
    assert ChainBroken.parse("chain broke at stage 1 (failed): x").unreachable is False
    for details in (None, "", "something else", "chain broke at stage -1 (failed): x", "chain broke at stage 1: x"):
        assert ChainBroken.parse(details) is None
    assert len(ChainBroken(1, "x" * 10_000, False).reason) <= 200


# ------------------------------------------------------------------ once per peer
def _done(nbytes: int = 16) -> ChainDone:
    return ChainDone(torch.zeros(nbytes // 4), 1.0, [])


async def test_a_micro_batch_runs_once_whoever_asks_again():
    results = ChainResults()
    runs = []
    gate = asyncio.Event()

    async def work():
        runs.append(1)
        await gate.wait()
        return _done()

    key = result_key(b"t" * 16, "mb")
    first = asyncio.create_task(results.once(key, "a", work))
    second = asyncio.create_task(results.once(key, "b", work))  # a retry through another peer, while it runs
    await asyncio.sleep(0)
    first.cancel()  # the first caller vanished: the work goes on
    gate.set()
    assert (await second).loss == 1.0
    assert (await results.once(key, "c", work)).loss == 1.0  # asked later: the kept result
    assert len(runs) == 1 and results.reused == 2


async def test_failed_work_is_not_kept_and_runs_again():
    results = ChainResults()
    attempts = []

    async def work():
        attempts.append(1)
        if len(attempts) == 1:
            raise ChainBroken(1, "down", True)
        return _done()

    with pytest.raises(ChainBroken):
        await results.once("k", "a", work)
    assert (await results.once("k", "a", work)).loss == 1.0 and len(attempts) == 2


async def test_kept_results_are_bounded_and_the_biggest_holder_goes_first():
    now = {"t": 0.0}
    results = ChainResults(max_results=4, max_bytes=1 << 20, ttl_s=10.0, clock=lambda: now["t"])

    async def work():
        return _done(1024)

    for i in range(3):
        await results.once(f"flood-{i}", "flooder", work)
    await results.once("honest", "honest", work)
    await results.once("flood-3", "flooder", work)
    assert "honest" in results.done and "flood-0" not in results.done and len(results.done) == 4
    assert results.nbytes == 4 * 1024
    now["t"] = 11.0
    await results.once("late", "honest", work)
    assert list(results.done) == ["late"]  # the rest expired


async def test_running_work_is_bounded_per_caller():
    results = ChainResults(max_running=3, max_running_per_caller=2)
    gate = asyncio.Event()

    async def work():
        await gate.wait()
        return _done()

    tasks = [asyncio.create_task(results.once(f"k{i}", "flooder", work)) for i in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(RequestError) as info:
        await results.once("k2", "flooder", work)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    tasks.append(asyncio.create_task(results.once("k3", "other", work)))
    await asyncio.sleep(0)
    with pytest.raises(RequestError):
        await results.once("k4", "third", work)  # the whole peer's bound
    gate.set()
    await asyncio.gather(*tasks)
    await results.close()


# ------------------------------------------------------------------ the trainer's relayed hops
class _Events:
    def __init__(self):
        self.emitted = []

    def emit(self, kind, level=None, **fields):
        self.emitted.append((kind, fields))


def test_the_trainer_relays_a_broken_hop_for_a_doubling_cooldown():
    now = {"t": 0.0}
    router = Router(3)
    events = _Events()
    chain = ChainCalls(_spec(), calls=None, router=router, events=events, hop_timeout=10.0, clock=lambda: now["t"])
    assert chain.deadline(0) == 40.0 and chain.deadline(2) == 20.0
    relays = chain.relays
    assert relays.segment_end(0) == 2
    relays.broke(ChainBroken(2, "down", True), "mb-1")
    assert events.emitted[-1][0] == "chain_broken"
    # hop 2 alone goes through the trainer: chains from 0 end at stage 1, the trainer chains on from 2
    assert relays.now() == [2] and relays.segment_end(0) == 1 and relays.segment_end(2) == 2
    relays.broke(ChainBroken(1, "down", True), "mb-2")
    assert relays.now() == [1, 2] and relays.segment_end(0) == 0 and relays.segment_end(1) == 1
    now["t"] = 2 * HUB_COOLDOWN_S + 0.1
    assert relays.now() == [] and relays.segment_end(0) == 2  # tried again after the cooldown
    lengths = []
    for _ in range(6):  # it breaks again at each try after a cooldown
        relays.broke(ChainBroken(2, "down", True), "mb")
        lengths.append(relays.hub_until[2] - now["t"])
        now["t"] = relays.hub_until[2] + 0.1
    assert lengths[:3] == pytest.approx([2 * HUB_COOLDOWN_S, 4 * HUB_COOLDOWN_S, 8 * HUB_COOLDOWN_S])
    assert max(lengths) == pytest.approx(HUB_COOLDOWN_MAX_S)


def test_micro_batches_in_flight_when_a_hop_breaks_are_one_break_not_a_doubling_each():
    now = {"t": 0.0}
    events = _Events()
    relays = RelayedHops(3, events, clock=lambda: now["t"])
    for i in range(4):  # a relay dies under four chained micro-batches
        relays.broke(ChainBroken(1, "relay gone", True), f"mb-{i}")
        now["t"] += 0.01
    assert relays.hub_until[1] == pytest.approx(HUB_COOLDOWN_S) and relays.breaks == 4
    assert [f.get("again", False) for _, f in events.emitted] == [False, True, True, True]
    now["t"] = HUB_COOLDOWN_S + 0.1
    assert relays.segment_end(0) == 2  # chains go peer to peer again after one cooldown


def test_the_route_names_the_best_replicas_of_every_later_stage():
    router = Router(3)
    router.update_stage(1, {f"Qm{i}x": _record(f"h:{i + 1}") for i in range(6)})
    router.update_stage(2, {C: _record("h:9")})
    router.peers["Qm0x"].in_flight = 5  # the busiest: last, and cut beyond MAX_CANDIDATES
    chain = ChainCalls(_spec(), calls=None, router=router, events=_Events(), hop_timeout=10.0)
    route = chain.route(0, 2)
    assert len(chain.route(0, 1)) == 1 and chain.route(1, 1) == []  # a segment's route ends at its end
    assert len(route) == 2 and len(route[0].hops) == MAX_CANDIDATES and "Qm0x" not in [h.peer_id for h in route[0].hops]
    assert [(h.peer_id, h.address) for h in route[1].hops] == [(C, "h:9")]
    router.update_stage(2, {})
    with pytest.raises(ChainBroken) as info:
        chain.route(0, 2)
    assert info.value.stage == 2 and not info.value.unreachable


class _ChainStageCalls:
    """The trainer's stage calls as a chain answers them: ``reply`` (raised when it is an exception), and the
    in-flight counts of the route's first candidates while the call ran."""

    def __init__(self, router: Router, reply):
        self.router, self.reply = router, reply
        self.answers = AnswerChecks(max_elements=1 << 20)
        self.seen_in_flight: dict[str, int] = {}

    def ticket(self, mb_id: str) -> bytes:
        return b"t" * 16

    async def call(self, view, method, request, payloads=None, timeout=None, expected_bytes=None):
        self.seen_in_flight = {p: v.in_flight for p, v in self.router.peers.items()}
        if isinstance(self.reply, BaseException):
            raise self.reply
        return self.reply


def _chain_router() -> Router:
    router = Router(3)
    for stage, peer in enumerate((A, B, C)):
        router.update_stage(stage, {peer: _record(f"h:{stage + 1}")})
    return router


@pytest.mark.parametrize("broken", [False, True])
async def test_a_chain_counts_its_first_candidates_in_flight_and_a_later_break_is_not_the_called_peers(broken):
    router = _chain_router()
    stages = [swarm_pb2.ChainStageResult(stage=s, applied=s != 1) for s in range(3)]
    reply = ChainBroken(2, "gone", unreachable=True) if broken else swarm_pb2.ChainResponse(loss=2.5, stages=stages)
    calls = _ChainStageCalls(router, reply)
    chain = ChainCalls(_spec(), calls=calls, router=router, events=_Events(), hop_timeout=10.0)
    first = router.peers[A]
    router.started(first)
    tokens = torch.zeros(2, 4, dtype=torch.int64)
    if broken:
        with pytest.raises(ChainBroken):
            await chain.call(first, 0, "mb", tokens, tokens)
        assert first.in_flight == 0 and first.failures == 0 and first.banned_until == 0.0
    else:
        result = await chain.call(first, 0, "mb", tokens, tokens)
        assert result.loss == 2.5 and result.grad is None and result.stale == [1] and first.in_flight == 1
    assert calls.seen_in_flight == {A: 1, B: 1, C: 1}  # the candidates a chain reaches count as ours meanwhile
    assert router.peers[B].in_flight == 0 and router.peers[C].in_flight == 0


# ------------------------------------------------------------------ the trainer record's new field
@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan"), 1e13, "12", True])
def test_a_hostile_trainer_bytes_figure_is_refused(value):
    from pydantic import ValidationError

    from swarmpipe.peer.swarm.records import TrainerRecord

    fields = dict(step=1, samples_per_s=1.0, updated_at=0.0)
    assert TrainerRecord(**fields, bytes_per_microbatch=4096.0).bytes_per_microbatch == 4096.0
    assert TrainerRecord(**fields).bytes_per_microbatch == 0.0  # a record from before the field
    with pytest.raises(ValidationError):
        TrainerRecord(**fields, bytes_per_microbatch=value)
