"""Chained micro-batches on a real swarm: activations pass peer to peer, the trainer sends tokens and gets the loss.

One swarm (3 stages; two replicas of the middle one) serves the whole module: a hub trainer and a chain trainer
run one after the other on it (nothing lost, the loss falls, the chain trainer moves far fewer bytes per
micro-batch, and /api/swarm shows it); then hostile chained requests: malformed routes are refused before any
work, and a route naming an address the DHT does not list for that stage is never dialled.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import grpc
import pytest
import torch
from swarm_support import Swarm

from swarmpipe.cli.launcher import wait_for
from swarmpipe.peer.transport.streaming import StreamingCaller
from swarmpipe.peer.transport.wire import decode, encode
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
TICKET = b"chain-test-ticket-0123"


@pytest.fixture(scope="module")
def chain_swarm(tmp_path_factory):
    swarm = Swarm(tmp_path_factory.mktemp("chain"))
    try:
        swarm.start_coordinator(swarm.write_spec(num_stages=3, n_layers=3))
        launched = [swarm.start_peer(stage, wait=False) for stage in (0, 1, 1, 2)]
        swarm.infos = [swarm.wait_ready(p) for p in launched]
        yield swarm
    finally:
        swarm.stop()
        leftovers = [p for p in swarm.group.procs if p.alive()]
        assert not leftovers, f"processes left behind: {[p.name for p in leftovers]}"


def _trained(report: dict, steps: int) -> None:
    assert report["microbatches_lost"] == 0, report
    assert report["microbatches_completed"] + report["microbatches_dropped_stale"] == report["microbatches_started"]
    assert report["microbatches_completed"] >= steps * 0.9, report


def test_chain_trainer_loses_nothing_and_moves_fewer_bytes(chain_swarm):
    swarm = chain_swarm
    hub, hub_path = swarm.start_trainer(40, "--route", "hub", name="hub")
    hub_report = swarm.wait_report(hub, hub_path, timeout=240)
    assert hub.proc.returncode == 0, hub.log_text()[-3000:]
    chain, chain_path = swarm.start_trainer(120, "--route", "chain", "--verify-fraction", "0", name="chain")
    report = swarm.wait_report(chain, chain_path, timeout=300)
    assert chain.proc.returncode == 0, chain.log_text()[-3000:]
    _trained(hub_report, 40)
    _trained(report, 120)
    assert report["route"] == "chain" and report["chain_breaks"] == 0, report
    assert report["microbatches_chained"] >= 0.8 * report["microbatches_completed"], report
    # the chain trainer goes on from where the hub trainer left the weights: the loss keeps falling
    assert report["loss_last"] < min(report["loss_first"] - 0.1, hub_report["loss_first"] - 1.0), (
        hub_report["loss_first"],
        report["loss_first"],
        report["loss_last"],
    )
    ratio = hub_report["trainer_bytes_per_microbatch"] / report["trainer_bytes_per_microbatch"]
    print(
        f"trainer bytes per micro-batch: hub {hub_report['trainer_bytes_per_microbatch']:.0f}, chain "
        f"{report['trainer_bytes_per_microbatch']:.0f} ({ratio:.1f}x fewer)"
    )
    assert ratio > 5, (hub_report["trainer_bytes_per_microbatch"], report["trainer_bytes_per_microbatch"])

    def shown() -> list | None:
        rows = swarm.api()["trainers"]
        return rows if len(rows) >= 2 and all(r.get("trainer_bytes_per_microbatch", 0) > 0 for r in rows) else None

    rows = wait_for(shown, 30, "/api/swarm to show both trainers' bytes per micro-batch")
    assert sorted(r["trainer_bytes_per_microbatch"] for r in rows)[0] < 0.2 * max(
        r["trainer_bytes_per_microbatch"] for r in rows
    )


class _Listener:
    """A TCP listener that counts connections: an address a hostile route names."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
                self.accepted += 1
                conn.close()
            except OSError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


def _request(route: list[list[tuple[str, str]]], **over) -> swarm_pb2.ChainRequest:
    fields = dict(
        run_id="test",
        stage=0,
        microbatch_id="hostile-1",
        input=encode(torch.randint(0, 256, (2, 8))),
        targets=encode(torch.randint(0, 256, (2, 8))),
        route=[
            swarm_pb2.ChainCandidates(hops=[swarm_pb2.ChainHop(peer_id=p, address=a) for p, a in hops])
            for hops in route
        ],
        ticket=TICKET,
        hop_timeout_s=10.0,
    )
    fields.update(over)
    return swarm_pb2.ChainRequest(**fields)


async def test_hostile_chained_requests_are_refused_and_dial_nobody(chain_swarm):
    swarm = chain_swarm
    first = swarm.infos[0]
    middle, last = swarm.infos[1], swarm.infos[3]
    stranger = _Listener()
    try:
        async with grpc.aio.insecure_channel(first["address"]) as channel:
            stub = swarm_pb2_grpc.StageStub(channel)
            good_rest = [(last["peer_id"], last["address"])]
            fake_id = "QmStrangerStrangerStrangerStrangerStrangerStra"
            refused = [
                ("route of the wrong length", _request([[(middle["peer_id"], middle["address"])]]), "route names"),
                (
                    "too many candidates",
                    _request([[(fake_id, f"127.0.0.1:{9000 + i}") for i in range(5)], good_rest]),
                    "candidates",
                ),
                ("no ticket", _request([[(middle["peer_id"], middle["address"])], good_rest], ticket=b""), "ticket"),
                ("non-base58 peer id", _request([[("0OIl", middle["address"])], good_rest]), "base58"),
                ("a candidate twice", _request([[(middle["peer_id"], middle["address"])] * 2, good_rest]), "twice"),
                (
                    "NaN hop timeout",
                    _request([[(middle["peer_id"], middle["address"])], good_rest], hop_timeout_s=float("nan")),
                    "hop_timeout",
                ),
                (
                    "targets out of vocabulary",
                    _request(
                        [[(middle["peer_id"], middle["address"])], good_rest], targets=encode(torch.full((2, 8), 10**6))
                    ),
                    "targets",
                ),
                (
                    "targets of another shape",
                    _request(
                        [[(middle["peer_id"], middle["address"])], good_rest],
                        targets=encode(torch.zeros(3, 8, dtype=torch.int64)),
                    ),
                    "targets",
                ),
            ]
            for what, request, words in refused:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Chain(request, timeout=30)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, info.value)
                assert words in info.value.details(), (what, info.value.details())
            # well-formed, but the next stage's candidates are not what the DHT lists: a real peer id at the
            # stranger's address, and a stranger's id. Nobody is dialled; the chain breaks at stage 1.
            for hop in ((middle["peer_id"], stranger.address), (fake_id, stranger.address)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Chain(_request([[hop], good_rest], microbatch_id=f"hostile-{hop[0][-4:]}"), timeout=30)
                assert info.value.code() == grpc.StatusCode.ABORTED, info.value
                assert info.value.details().startswith("chain broke at stage 1 (failed)"), info.value.details()
            # a later stage's hostile hop is refused by the peer that would dial it
            with pytest.raises(grpc.aio.AioRpcError) as info:
                request = _request([[(middle["peer_id"], middle["address"])], [(fake_id, stranger.address)]])
                await stub.Chain(request, timeout=30)
            assert info.value.details().startswith("chain broke at stage 2 (failed)"), info.value.details()
            await asyncio.sleep(0.5)
            assert stranger.accepted == 0
            # the peer keeps serving: a proper chained request goes through
            ok = await stub.Chain(
                _request([[(middle["peer_id"], middle["address"])], good_rest], microbatch_id="honest-1"), timeout=60
            )
            assert [s.stage for s in ok.stages] == [0, 1, 2] and ok.loss > 0
            assert ok.handler_seconds > 0  # what stage 0 held the call: its caller times the link without it
            again = await stub.Chain(
                _request([[(middle["peer_id"], middle["address"])], good_rest], microbatch_id="honest-1"), timeout=60
            )
            assert again.loss == ok.loss  # asked again: answered from what it kept, nothing stepped twice
            assert [s.version for s in again.stages] == [s.version for s in ok.stages]
    finally:
        stranger.close()


async def test_a_chain_ends_where_the_trainer_carries_the_hop_and_hostile_handovers_lose_nothing(chain_swarm):
    """Hop 2 relayed by the trainer: the chain 0 -> 1 parks stage 1's output; the trainer takes it (asking both
    stage-1 replicas, as it cannot know which one stage 0 reached), chains on from stage 2, and gives the gradient
    back. Lies, wrong tickets and wrong shapes on the way are refused and the park keeps waiting."""
    first, mids, last = chain_swarm.infos[0], chain_swarm.infos[1:3], chain_swarm.infos[3]
    channels = {i["peer_id"]: grpc.aio.insecure_channel(i["address"]) for i in chain_swarm.infos}
    stubs = {pid: swarm_pb2_grpc.StageStub(c) for pid, c in channels.items()}
    candidates = [(m["peer_id"], m["address"]) for m in mids]
    tokens = torch.randint(0, 256, (2, 8))

    def handover(mb: str, **over) -> swarm_pb2.HandoverRequest:
        fields = dict(run_id="test", stage=1, microbatch_id=mb, ticket=TICKET, wait_s=20.0)
        return swarm_pb2.HandoverRequest(**{**fields, **over})

    def resume(mb: str, **over) -> swarm_pb2.ResumeRequest:
        return swarm_pb2.ResumeRequest(**{**dict(run_id="test", stage=1, microbatch_id=mb, ticket=TICKET), **over})

    async def take(mb: str) -> tuple[str, swarm_pb2.HandoverResponse]:
        calls = {m["peer_id"]: stubs[m["peer_id"]].ChainHandover(handover(mb, wait_s=3.0), timeout=10) for m in mids}
        answers = await asyncio.gather(*calls.values(), return_exceptions=True)
        found = [(pid, a) for pid, a in zip(calls, answers) if not isinstance(a, Exception)]
        assert len(found) == 1, answers  # the replica stage 0 reached has it; the other: NOT_FOUND
        missing = [a for a in answers if isinstance(a, Exception)]
        assert missing[0].code() == grpc.StatusCode.NOT_FOUND, missing
        return found[0]

    try:
        stub0 = stubs[first["peer_id"]]
        request = _request([candidates], input=encode(tokens), microbatch_id="seg-1", segment_stages=2)
        chain = asyncio.ensure_future(stub0.Chain(request, timeout=90))
        holder, got = await take("seg-1")
        out = decode(got.output)
        assert out.shape == (2, 8, 64) and torch.isfinite(out).all()
        hostile = [
            (handover("seg-1", wait_s=0.0), "ChainHandover", grpc.StatusCode.INVALID_ARGUMENT),
            (handover("seg-1", wait_s=float("nan")), "ChainHandover", grpc.StatusCode.INVALID_ARGUMENT),
            (handover("seg-1", wait_s=1e9), "ChainHandover", grpc.StatusCode.INVALID_ARGUMENT),
            (handover("seg-1", ticket=b""), "ChainHandover", grpc.StatusCode.INVALID_ARGUMENT),
            (handover("seg-1", ticket=b"x" * 20, wait_s=0.3), "ChainHandover", grpc.StatusCode.NOT_FOUND),
            (handover("seg-1", stage=2), "ChainHandover", grpc.StatusCode.FAILED_PRECONDITION),  # not its stage
            (resume("seg-1", ticket=b"x" * 20, grad_output=encode(torch.ones(2, 8, 64))), "ChainResume", None),
            (resume("seg-1", grad_output=encode(torch.ones(2, 9, 64))), "ChainResume", None),  # wrong shape
            (resume("seg-1", grad_output=encode(torch.ones(2, 8, 64, dtype=torch.int64))), "ChainResume", None),
            (resume("seg-1", grad_output=encode(torch.ones(3))), "ChainResume", None),
        ]
        for message, method, code in hostile:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await getattr(stubs[holder], method)(message, timeout=10)
            expected = code or (
                grpc.StatusCode.NOT_FOUND if message.ticket != TICKET else grpc.StatusCode.INVALID_ARGUMENT
            )
            assert info.value.code() == expected, (message, info.value)
        assert not chain.done()  # the park keeps waiting through all of that
        # the trainer's part: the hop 1 -> 2 it carries, then the gradient back
        tail = _request([], stage=2, input=encode(out), microbatch_id="seg-1")
        answer = await stubs[last["peer_id"]].Chain(tail, timeout=60)
        assert [s.stage for s in answer.stages] == [2] and answer.loss > 0
        await stubs[holder].ChainResume(resume("seg-1", grad_output=answer.grad_input), timeout=10)
        done = await chain
        assert [s.stage for s in done.stages] == [0, 1] and done.stages[1].peer_id == holder
        assert all(s.applied for s in done.stages), done.stages
        with pytest.raises(grpc.aio.AioRpcError) as info:  # resumed: nothing waits any more
            await stubs[holder].ChainResume(resume("seg-1", grad_output=answer.grad_input), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND

        # abandoned (the rest of the micro-batch failed): the chain breaks at the carried hop, keeps nothing, and
        # the same micro-batch can go again
        request = _request([candidates], input=encode(tokens), microbatch_id="seg-2", segment_stages=2)
        chain = asyncio.ensure_future(stub0.Chain(request, timeout=90))
        holder, _ = await take("seg-2")
        await stubs[holder].ChainResume(resume("seg-2", abandon=True), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await chain
        assert info.value.code() == grpc.StatusCode.ABORTED
        assert info.value.details().startswith("chain broke at stage 2 (failed): the trainer abandoned")
        chain = asyncio.ensure_future(stub0.Chain(request, timeout=90))
        holder, _ = await take("seg-2")  # parked again: the abandoned run kept nothing
        await stubs[holder].ChainResume(resume("seg-2", abandon=True), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError):
            await chain

        # an output and a gradient too large for one message travel as frame streams, as activations do
        big = torch.randint(0, 256, (16, 32))
        request = _request(
            [candidates], input=encode(big), targets=encode(big), microbatch_id="seg-3", segment_stages=2
        )
        chain = asyncio.ensure_future(stub0.Chain(request, timeout=90))
        holder, _ = await take("seg-3")
        streamed = StreamingCaller(threshold_bytes=1024, chunk_bytes=4096)
        args = (channels[holder], stubs[holder])
        got = await streamed.call(
            *args, "ChainHandover", handover("seg-3"), timeout=10, expected_bytes=16 * 32 * 64 * 4
        )
        assert decode(got.output).shape == (16, 32, 64)
        grad = encode(torch.full((16, 32, 64), 1e-4))
        await streamed.call(*args, "ChainResume", resume("seg-3", grad_output=grad), timeout=10)
        assert [s.stage for s in (await chain).stages] == [0, 1]
    finally:
        for channel in channels.values():
            await channel.close()
