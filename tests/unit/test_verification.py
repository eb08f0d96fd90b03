"""ReplicaVerifier: honest replicas pass, a replica that scales, flips or adds noise is struck and banned.

Replicas here are real stage runtimes in this process behind a fake of ``StageCalls``; a liar wraps one and
corrupts what it returns from training calls (as a Byzantine peer would) or from every call.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from swarmpipe.peer.events import EventLog
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.stage.runtime import StageRuntime
from swarmpipe.peer.swarm.records import StageRecord
from swarmpipe.peer.trainer.routing import PeerView, Router
from swarmpipe.peer.trainer.verification import Disputed, ReplicaVerifier, Tolerance, relative_difference

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

Corrupt = Callable[[torch.Tensor], torch.Tensor]
HONEST: Corrupt = lambda t: t  # noqa: E731
FLIP: Corrupt = lambda t: -t  # noqa: E731
SCALE: Corrupt = lambda t: 30.0 * t  # noqa: E731


def NOISE(t: torch.Tensor) -> torch.Tensor:  # noqa: N802 - reads like the other modes
    """Noise ten times as large as the tensor (milder noise still descends: the slope check lets it by)."""
    return t + 10 * t.pow(2).mean().sqrt() * torch.randn(t.shape, generator=torch.Generator().manual_seed(7))


class Replicas:
    """peer id -> (runtime, corruption of training answers, corruption of forward-only answers)."""

    def __init__(self, spec: RunSpec):
        self.spec = spec
        self.peers: dict[str, tuple[StageRuntime, Corrupt, Corrupt]] = {}
        self.calls: list[tuple[str, str, bool]] = []
        self.versions: dict[str, int] = {}  # StageCalls': the newest version each peer answered with
        self.answered: dict[tuple[str, str], int] = {}

    def add(self, peer_id: str, stage: int, training: Corrupt = HONEST, probes: Corrupt = HONEST) -> None:
        self.peers[peer_id] = (StageRuntime(self.spec, stage), training, probes)

    async def forward(self, view: PeerView, stage: int, mb_id: str, x, evaluate: bool = False, exact: bool = False):
        runtime, training, probes = self.peers[view.peer_id]
        self.calls.append(("Forward", view.peer_id, evaluate))
        return (probes if evaluate else training)(runtime.evaluate(x))

    async def forward_backward(self, view, stage, mb_id, x, targets, evaluate=False, exact=False):
        runtime, training, probes = self.peers[view.peer_id]
        self.calls.append(("ForwardBackward", view.peer_id, evaluate))
        if evaluate:
            return float(runtime.evaluate(x, targets)), None, False
        result = runtime.forward_backward(x, targets)
        return result.loss, training(result.grad_input), not result.applied

    def router(self) -> Router:
        router = Router(self.spec.num_stages, rng=random.Random(0))
        for stage in range(self.spec.num_stages):
            records = {
                pid: StageRecord(
                    address=f"127.0.0.1:{1000 + i}", state="online", throughput=1.0, queue=0, version=0, updated_at=1.0
                )
                for i, (pid, (rt, _, _)) in enumerate(self.peers.items())
                if rt.stage == stage
            }
            router.update_stage(stage, records)
        return router


def setup(stage0: dict[str, tuple[Corrupt, Corrupt]], stage1: dict[str, tuple[Corrupt, Corrupt]], ban_after=2):
    spec = RunSpec()
    replicas = Replicas(spec)
    for stage, group in ((0, stage0), (1, stage1)):
        for pid, (training, probes) in group.items():
            replicas.add(pid, stage, training, probes)
    router = replicas.router()
    verifier = ReplicaVerifier(spec, replicas, router, EventLog("", "trainer", "t"), 1.0, ban_after=ban_after, grace=0)
    return spec, replicas, router, verifier


def batch(spec: RunSpec) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 8, (spec.microbatch_size, spec.model.seq_len), generator=torch.Generator().manual_seed(1))
    return tokens, tokens.clone()


def test_tolerance_is_the_ceiling_until_learned_then_a_margin_over_agreeing_pairs() -> None:
    t = Tolerance(floor=0.01, ceiling=0.5, min_samples=4)
    assert t.limit() == 0.5
    for d in (0.02, 0.03, 0.01, 0.02):
        assert t.agrees(d)
    assert t.limit() == pytest.approx(4 * 0.03)
    assert not t.agrees(0.9) and len(t.seen) == 4, "a disagreement is not learned from"
    t.widen(5.0)
    assert max(t.seen) == 0.5, "what arbitration found honest widens it, capped at the ceiling"


def test_relative_difference_is_symmetric_and_scale_free() -> None:
    a = torch.randn(4, 8)
    assert relative_difference(a, a) == 0
    assert relative_difference(a, -a) == pytest.approx(2.0)
    assert relative_difference(10 * a, -10 * a) == pytest.approx(relative_difference(a, -a))


async def test_an_honest_last_stage_gradient_passes_the_probe() -> None:
    spec, replicas, router, verifier = setup({"a": (HONEST, HONEST)}, {"z": (HONEST, HONEST)})
    tokens, targets = batch(spec)
    x = replicas.peers["a"][0].evaluate(tokens)
    view = router.peers["z"]
    loss, grad, _ = await replicas.forward_backward(view, 1, "mb", x, targets)
    await verifier.check_gradient(view, 1, x, grad, targets=targets, loss=loss)
    assert verifier.stats.strikes == 0 and verifier.stats.checks == 1


@pytest.mark.parametrize("corrupt", [FLIP, SCALE, NOISE], ids=["flip", "scale", "noise"])
async def test_a_lying_last_stage_gradient_is_struck_and_banned(corrupt: Corrupt) -> None:
    spec, replicas, router, verifier = setup({"a": (HONEST, HONEST)}, {"z": (corrupt, HONEST)})
    tokens, targets = batch(spec)
    x = replicas.peers["a"][0].evaluate(tokens)
    view = router.peers["z"]
    for round_ in range(2):
        loss, grad, _ = await replicas.forward_backward(view, 1, f"mb{round_}", x, targets)
        with pytest.raises(Disputed, match="gradient failed verification"):
            await verifier.check_gradient(view, 1, x, grad, targets=targets, loss=loss)
    assert verifier.strikes == {"z": 2} and "z" in verifier.banned
    assert router.available(1) == [], "a banned replica is not routed to, whatever it announces"


async def test_a_reported_loss_that_its_function_does_not_give_is_struck() -> None:
    spec, replicas, router, verifier = setup({"a": (HONEST, HONEST)}, {"z": (HONEST, HONEST)})
    tokens, targets = batch(spec)
    x = replicas.peers["a"][0].evaluate(tokens)
    view = router.peers["z"]
    loss, grad, _ = await replicas.forward_backward(view, 1, "mb", x, targets)
    with pytest.raises(Disputed, match="reported loss"):
        await verifier.check_gradient(view, 1, x, grad, targets=targets, loss=loss / 3)


async def test_an_intermediate_gradient_is_probed_through_the_output_gradient() -> None:
    spec = RunSpec()
    spec.num_stages = 3
    replicas = Replicas(spec)
    replicas.add("a", 0)
    replicas.add("m", 1)
    replicas.add("z", 2)
    router = replicas.router()
    verifier = ReplicaVerifier(spec, replicas, router, EventLog("", "trainer", "t"), 1.0, grace=0)
    tokens, targets = batch(spec)
    x0 = replicas.peers["a"][0].evaluate(tokens)
    middle = replicas.peers["m"][0]
    x1 = middle.evaluate(x0)
    grad_out = replicas.peers["z"][0].forward_backward(x1, targets).grad_input
    grad_in = middle.replay_backward(x0, grad_out).grad_input
    view = router.peers["m"]
    await verifier.check_gradient(view, 1, x0, grad_in, grad_out)
    with pytest.raises(Disputed):
        await verifier.check_gradient(view, 1, x0, -grad_in, grad_out)
    assert verifier.strikes == {"m": 1}


async def test_outputs_that_agree_teach_the_tolerance() -> None:
    spec, replicas, router, verifier = setup({"a": (HONEST, HONEST), "b": (HONEST, HONEST)}, {"z": (HONEST, HONEST)})
    tokens, _ = batch(spec)
    view = router.peers["a"]
    y = await replicas.forward(view, 0, "mb", tokens)
    await verifier.check_output(view, 0, tokens, y)
    assert verifier.stats.disputes == 0 and list(verifier.outputs[0].seen) == [0.0]
    assert ("Forward", "b", True) in replicas.calls, "the second opinion is forward-only: nothing kept there"


async def test_a_replica_that_lies_only_on_training_calls_contradicts_itself() -> None:
    spec, replicas, router, verifier = setup({"a": (NOISE, HONEST)}, {"z": (HONEST, HONEST)})
    tokens, _ = batch(spec)  # no other replica is needed
    view = router.peers["a"]
    y = await replicas.forward(view, 0, "mb", tokens)
    with pytest.raises(Disputed, match="differs from its own forward-only answer"):
        await verifier.check_output(view, 0, tokens, y)
    assert verifier.strikes == {"a": 1}


async def test_a_consistent_liar_is_outvoted_by_two_replicas_and_its_call_fails() -> None:
    honest = (HONEST, HONEST)
    spec, replicas, router, verifier = setup({"a": (NOISE, NOISE), "b": honest, "c": honest}, {"z": honest})
    tokens, _ = batch(spec)
    view = router.peers["a"]
    y = await replicas.forward(view, 0, "mb", tokens)
    with pytest.raises(Disputed, match="outvoted by two replicas"):
        await verifier.check_output(view, 0, tokens, y)
    assert verifier.strikes == {"a": 1}


async def test_a_lying_checker_is_outvoted_and_the_primary_goes_on() -> None:
    honest = (HONEST, HONEST)
    spec, replicas, router, verifier = setup({"a": honest, "b": (FLIP, FLIP), "c": honest}, {"z": honest})
    verifier.rng = random.Random(1)
    tokens, _ = batch(spec)
    view = router.peers["a"]
    y = await replicas.forward(view, 0, "mb", tokens)
    for _ in range(4):  # whichever of b and c it asks first, b is the odd one out
        await verifier.check_output(view, 0, tokens, y)
    assert set(verifier.strikes) <= {"b"} and verifier.stats.disputes == verifier.strikes.get("b", 0)


async def test_two_replicas_that_disagree_are_inconclusive_and_nobody_is_struck() -> None:
    spec, replicas, router, verifier = setup({"a": (NOISE, NOISE), "b": (HONEST, HONEST)}, {"z": (HONEST, HONEST)})
    tokens, _ = batch(spec)
    view = router.peers["a"]
    y = await replicas.forward(view, 0, "mb", tokens)
    await verifier.check_output(view, 0, tokens, y)
    assert verifier.strikes == {} and verifier.stats.inconclusive == 1
    assert verifier.outputs[0].seen, "the disagreement widened the tolerance (capped at its ceiling)"


def test_the_last_stage_loss_is_recomputed_as_the_model_families_compute_it() -> None:
    from swarmpipe.peer.model import lm_loss
    from swarmpipe.peer.trainer.verification import _lm_loss

    logits, targets = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    assert _lm_loss(logits.double(), targets) == pytest.approx(float(lm_loss(logits, targets)), rel=1e-6)


async def test_a_check_is_judged_only_when_the_weights_barely_moved_and_endless_skips_are_struck() -> None:
    spec, replicas, router, verifier = setup({"a": (NOISE, HONEST)}, {"z": (HONEST, HONEST)})
    tokens, _ = batch(spec)
    view = router.peers["a"]
    y = await replicas.forward(view, 0, "mb", tokens)
    honest_answer = replicas.forward

    async def racing_ahead(view, stage, mb_id, x, evaluate=False, exact=False):
        replicas.versions["a"] = replicas.versions.get("a", 0) + 10  # "I stepped 10 times since"
        return await honest_answer(view, stage, mb_id, x, evaluate, exact)

    replicas.forward = racing_ahead
    for _ in range(29):
        await verifier.check_output(view, 0, tokens, y)  # a lie, but not judged: too far apart
    assert verifier.stats.skipped == 29 and verifier.strikes == {}
    await verifier.check_output(view, 0, tokens, y)
    assert verifier.strikes == {"a": 1}, "a replica whose checks always skip is struck as unverifiable"


async def test_a_trainers_first_checks_of_a_stage_only_log_their_failures() -> None:
    spec, replicas, router, verifier = setup({"a": (NOISE, HONEST)}, {"z": (HONEST, HONEST)})
    verifier.grace = 2
    tokens, _ = batch(spec)
    view = router.peers["a"]
    y = await replicas.forward(view, 0, "mb", tokens)
    for _ in range(2):
        with pytest.raises(Disputed):  # a young run moves fast: no strike yet, but the answer is redone elsewhere
            await verifier.check_output(view, 0, tokens, y)
    assert verifier.strikes == {} and verifier.stats.graced == 2
    with pytest.raises(Disputed):
        await verifier.check_output(view, 0, tokens, y)
    assert verifier.strikes == {"a": 1}


async def test_a_graced_outvote_is_not_learned_as_an_honest_spread() -> None:
    honest = (HONEST, HONEST)
    spec, replicas, router, verifier = setup({"a": (NOISE, NOISE), "b": honest, "c": honest}, {"z": honest})
    verifier.grace = 1
    tokens, _ = batch(spec)
    view = router.peers["a"]
    y = await replicas.forward(view, 0, "mb", tokens)
    with pytest.raises(Disputed, match="outvoted"):  # graced: logged, no strike, still not passed on
        await verifier.check_output(view, 0, tokens, y)
    assert verifier.stats.graced == 1 and verifier.stats.inconclusive == 0 and not verifier.outputs[0].seen


async def test_a_burst_of_failures_among_passes_is_struck_but_not_banned_while_a_liar_is() -> None:
    """Ban evidence: an honest replica whose inputs were poisoned failed three checks in a row between many passes
    (the Byzantine integration test); a liar fails nearly every check."""
    spec, replicas, router, verifier = setup({"a": (HONEST, HONEST)}, {"z": (HONEST, HONEST), "q": (FLIP, HONEST)})
    verifier.ban_after = 3
    tokens, targets = batch(spec)
    x = replicas.peers["a"][0].evaluate(tokens)
    honest, liar = router.peers["z"], router.peers["q"]
    for round_ in range(6):
        loss, grad, _ = await replicas.forward_backward(honest, 1, f"ok{round_}", x, targets)
        await verifier.check_gradient(honest, 1, x, grad, targets=targets, loss=loss)
    for round_ in range(3):  # three wrong answers in a row (here: flipped) after six good ones
        loss, grad, _ = await replicas.forward_backward(honest, 1, f"bad{round_}", x, targets)
        with pytest.raises(Disputed):
            await verifier.check_gradient(honest, 1, x, -grad, targets=targets, loss=loss)
    assert verifier.strikes == {"z": 3} and "z" not in verifier.banned, "3 of its last 9 failed: struck, not banned"
    for round_ in range(3):
        loss, grad, _ = await replicas.forward_backward(liar, 1, f"lie{round_}", x, targets)
        with pytest.raises(Disputed):
            await verifier.check_gradient(liar, 1, x, grad, targets=targets, loss=loss)
    assert "q" in verifier.banned and router.available(1) == [honest]
    for round_ in range(3):  # the honest replica goes on failing: once most of its recent checks fail, it goes too
        loss, grad, _ = await replicas.forward_backward(honest, 1, f"worse{round_}", x, targets)
        with pytest.raises(Disputed):
            await verifier.check_gradient(honest, 1, x, -grad, targets=targets, loss=loss)
    assert "z" in verifier.banned
    assert len(verifier.recent["z"]) == 10, "only the last RECENT_CHECKS outcomes are kept"
