"""Validation through a real swarm: evaluate calls keep nothing and step nothing, give the loss a training
call would, refuse bad targets; a trainer with --eval-every reports its validation losses everywhere.

One swarm (coordinator, one peer per stage) serves every test in this module: the direct calls compare
versions and outputs before and after, so they need no other traffic, and the trainer runs to its end.
"""

from __future__ import annotations

import math
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from swarm_support import Swarm

from swarmpipe.cli.launcher import wait_for
from swarmpipe.peer.transport.channels import ChannelPool
from swarmpipe.peer.transport.streaming import StreamingCaller
from swarmpipe.peer.transport.wire import decode, encode
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RUN = "test"
VOCAB, SEQ, D_MODEL = 256, 32, 64


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    """(swarm, stage-0 ready info, stage-1 ready info); torn down after the module."""
    swarm = Swarm(tmp_path_factory.mktemp("evaluation"))
    try:
        swarm.start_coordinator(swarm.write_spec(num_stages=2, n_layers=2))
        launched = [swarm.start_peer(stage, "--metrics-port", "0", wait=False) for stage in (0, 1)]
        first, last = (swarm.wait_ready(p) for p in launched)
        yield swarm, first, last
    finally:
        swarm.stop()
        leftovers = [p for p in swarm.group.procs if p.alive()]
        assert not leftovers, f"processes left behind: {[p.name for p in leftovers]}"


def stub(channel: grpc.Channel) -> swarm_pb2_grpc.StageStub:
    return swarm_pb2_grpc.StageStub(channel)


def info(channel: grpc.Channel) -> swarm_pb2.InfoResponse:
    return stub(channel).Info(swarm_pb2.InfoRequest(), timeout=10)


def forward(channel, mb: str, x: torch.Tensor, evaluate: bool) -> torch.Tensor:
    request = swarm_pb2.ForwardRequest(
        run_id=RUN, stage=0, microbatch_id=mb, input=encode(x), reply_codec="none", evaluate=evaluate
    )
    return decode(stub(channel).Forward(request, timeout=30).output)


def forward_backward(channel, mb: str, h: torch.Tensor, targets: torch.Tensor, evaluate: bool):
    request = swarm_pb2.ForwardBackwardRequest(
        run_id=RUN, stage=1, microbatch_id=mb, input=encode(h), targets=encode(targets), evaluate=evaluate
    )
    return stub(channel).ForwardBackward(request, timeout=30)


def scrape(metrics_address: str) -> dict[tuple[str, str], float]:
    """{(sample name, method label): value} of a peer's /metrics."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, s.labels.get("method", "")): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def test_an_evaluate_forward_keeps_nothing_and_changes_nothing(peers) -> None:
    _, first, _ = peers
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    before_metrics = scrape(first["metrics_address"])
    with grpc.insecure_channel(first["address"]) as channel:
        before = info(channel)
        out = forward(channel, "ev-a", tokens, evaluate=True)
        assert out.shape == (2, SEQ, D_MODEL) and torch.isfinite(out).all()
        # Nothing was kept: a backward for the id is a backward for an unknown micro-batch.
        with pytest.raises(grpc.RpcError) as unknown:
            stub(channel).Backward(
                swarm_pb2.BackwardRequest(
                    run_id=RUN, stage=0, microbatch_id="ev-a", grad_output=encode(torch.ones(2, SEQ, D_MODEL))
                ),
                timeout=30,
            )
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND, unknown.value.details()
        # The weights did not move: the same answer again, and a training forward (on a snapshot of the same
        # version) agrees with it.
        assert torch.equal(forward(channel, "ev-b", tokens, evaluate=True), out)
        assert torch.allclose(forward(channel, "train-a", tokens, evaluate=False), out, atol=1e-5)
        after = info(channel)
    assert after.version == before.version and after.samples_processed == before.samples_processed
    after_metrics = scrape(first["metrics_address"])
    assert (
        after_metrics[("swarmpipe_requests_total", "evaluate")]
        == before_metrics[("swarmpipe_requests_total", "evaluate")] + 2
    )
    assert after_metrics[("swarmpipe_compute_seconds_count", "evaluate")] >= 2
    assert (
        after_metrics[("swarmpipe_requests_total", "forward")]
        == before_metrics[("swarmpipe_requests_total", "forward")] + 1
    )


def test_an_evaluate_forward_backward_gives_the_training_loss_without_a_step(peers) -> None:
    _, first, last = peers
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    with grpc.insecure_channel(first["address"]) as f, grpc.insecure_channel(last["address"]) as channel:
        h = forward(f, "ev-h", tokens, evaluate=True)
        v0 = info(channel).version
        evaluated = forward_backward(channel, "ev-c", h, targets, evaluate=True)
        assert evaluated.applied is False and evaluated.dropped_reason == ""
        assert not evaluated.HasField("grad_input") and evaluated.version == v0
        assert info(channel).version == v0
        assert math.isfinite(evaluated.loss) and 0 < evaluated.loss < 10
        again = forward_backward(channel, "ev-d", h, targets, evaluate=True)
        assert again.loss == evaluated.loss  # nothing moved in between
        trained = forward_backward(channel, "train-c", h, targets, evaluate=False)
        assert trained.applied and trained.HasField("grad_input")
        assert trained.loss == pytest.approx(evaluated.loss, rel=1e-5)  # the same weights, the same loss
        assert info(channel).version == v0 + 1  # the training call stepped; the evaluations did not


def test_bad_evaluate_requests_are_invalid_and_change_nothing(peers) -> None:
    _, first, last = peers
    h = torch.randn(2, SEQ, D_MODEL)
    good = torch.randint(0, VOCAB, (2, SEQ))
    cases = {
        "targets out of the vocabulary": good + VOCAB,
        "negative targets": good - VOCAB,
        "targets of the wrong shape": torch.randint(0, VOCAB, (2, SEQ - 1)),
        "targets of a float dtype": good.float(),
    }
    with grpc.insecure_channel(first["address"]) as f, grpc.insecure_channel(last["address"]) as channel:
        v_last, v_first = info(channel).version, info(f).version
        reference = forward_backward(channel, "ev-ref", h, good, evaluate=True).loss
        for what, targets in cases.items():
            with pytest.raises(grpc.RpcError) as bad:
                forward_backward(channel, "ev-bad", h, targets, evaluate=True)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, bad.value.details())
        with pytest.raises(grpc.RpcError) as bad:
            forward(f, "ev-bad", torch.full((2, SEQ), VOCAB), evaluate=True)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad.value.details()
        # The peers serve on, unchanged.
        assert forward_backward(channel, "ev-ref2", h, good, evaluate=True).loss == reference
        assert (info(channel).version, info(f).version) == (v_last, v_first)


async def test_streamed_evaluate_calls_carry_the_flag(peers) -> None:
    """Chunked streams (rpc Stream) send the whole request header: the evaluate flag arrives with it."""
    _, first, last = peers
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (8, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (8, SEQ), generator=gen)

    async def main():
        pool = ChannelPool(16)
        caller = StreamingCaller(threshold_bytes=512, chunk_bytes=700)  # every request here is over the threshold
        try:

            async def call(address: str, method: str, request):
                return await caller.call(pool.channel(address), pool.stub(address), method, request, timeout=30)

            fwd = swarm_pb2.ForwardRequest(
                run_id=RUN, stage=0, microbatch_id="ev-s", input=encode(tokens), reply_codec="none", evaluate=True
            )
            h = decode((await call(first["address"], "Forward", fwd)).output)
            bwd = swarm_pb2.BackwardRequest(
                run_id=RUN, stage=0, microbatch_id="ev-s", grad_output=encode(torch.ones(8, SEQ, D_MODEL))
            )
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await call(first["address"], "Backward", bwd)
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND  # a training forward would have kept it
            version = (await pool.stub(last["address"]).Info(swarm_pb2.InfoRequest(), timeout=10)).version
            fb = swarm_pb2.ForwardBackwardRequest(
                run_id=RUN, stage=1, microbatch_id="ev-s", input=encode(h), targets=encode(targets), evaluate=True
            )
            streamed = await call(last["address"], "ForwardBackward", fb)
            unary = await pool.stub(last["address"]).ForwardBackward(fb, timeout=30)
            assert streamed.loss == unary.loss and not streamed.applied
            assert (await pool.stub(last["address"]).Info(swarm_pb2.InfoRequest(), timeout=10)).version == version
        finally:
            await pool.close()

    await main()


def test_a_trainer_reports_validation_losses_everywhere(peers) -> None:
    swarm, _, _ = peers
    steps, every = 30, 10
    trainer, report_path = swarm.start_trainer(steps, "--eval-every", str(every), "--eval-batches", "3")
    report = swarm.wait_report(trainer, report_path, timeout=200)
    assert trainer.proc.returncode == 0, trainer.log_text()[-3000:]
    assert report["microbatches_completed"] == steps
    series = report["val_losses"]
    assert series and all(math.isfinite(v) and 0 < v < 10 for _, v in series), series
    assert [s for s, _ in series] == sorted(s for s, _ in series) and series[-1][0] == steps  # the final one
    assert series[0][0] == 0 and all(s >= every for s, _ in series[1:])  # the starting weights' loss first
    assert report["val_loss"] == series[-1][1]
    evaluated = [e for e in swarm.events_of("evaluated") if e.get("role") == "trainer"]
    assert len(evaluated) == len(series) and all(e["batches"] == 3 for e in evaluated), evaluated
    # The coordinator shows it: the trainer's row, the history, the Prometheus gauge.
    # the row may first show a record announced before the final evaluation (4.03 there, 3.47 in the report, once)
    final = pytest.approx(report["val_loss"], rel=1e-6)
    wait_for(
        lambda: next((t for t in swarm.api()["trainers"] if t.get("val_loss") == final), None),
        30,
        "the trainer's row with its final val_loss",
    )
    wait_for(
        lambda: any(h.get("val_loss") is not None for h in swarm.api("/api/history")), 30, "val_loss in the history"
    )
    with urllib.request.urlopen(swarm.url + "/metrics", timeout=10) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    assert families["swarmpipe_val_loss"].type == "gauge"
    assert families["swarmpipe_val_loss"].samples[0].value == pytest.approx(report["val_loss"], rel=1e-6)
