"""Where a chain that ends before the last stage parks its output (peer/stage/chain/handover.py): the trainer takes
it (even when it asks before the chain arrives), gives back the gradient or abandons, and nothing waits forever or
without bound."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from swarmpipe.peer.stage.chain.handover import Abandoned, Handovers
from swarmpipe.peer.stage.request_checks import RequestError

pytestmark = pytest.mark.timeout(30)


async def test_the_trainer_takes_the_output_and_its_gradient_resumes_the_chain():
    handovers = Handovers()
    out = torch.randn(2, 3, 4)
    early = asyncio.ensure_future(handovers.handover("k", "trainer", wait_s=5))  # asks before the chain arrives
    await asyncio.sleep(0.01)
    assert handovers.waiting == 1
    park = asyncio.ensure_future(handovers.park("k", out, version=7, timeout=5))
    taken = await early
    assert taken.output is out and taken.version == 7 and handovers.waiting == 0
    assert (await handovers.handover("k", "trainer", wait_s=1)).output is out  # asked again: the same output
    grad = torch.ones_like(out)
    handovers.resume("k", grad)
    assert await park is grad
    assert "k" not in handovers.parked and not handovers._arrivals  # nothing left behind
    with pytest.raises(RequestError) as info:  # resumed once: a second gradient finds nothing waiting
        handovers.resume("k", grad)
    assert info.value.code == grpc.StatusCode.NOT_FOUND


async def test_an_abandoned_or_forgotten_park_ends_with_abandoned():
    handovers = Handovers()
    park = asyncio.ensure_future(handovers.park("a", torch.zeros(1, 1, 1), 0, timeout=5))
    await asyncio.sleep(0.01)
    handovers.resume("a", None)
    with pytest.raises(Abandoned, match="abandoned"):
        await park
    with pytest.raises(Abandoned, match="within"):  # the trainer vanished: the park does not outlive its timeout
        await handovers.park("b", torch.zeros(1, 1, 1), 0, timeout=0.05)
    assert not handovers.parked and handovers.abandoned == 2
    park = asyncio.ensure_future(handovers.park("c", torch.zeros(1, 1, 1), 0, timeout=5))
    await asyncio.sleep(0.01)
    handovers.close()  # the peer leaves: its parked chains end at once
    with pytest.raises(Abandoned):
        await park


async def test_a_handover_for_nothing_parked_here_ends_not_found_and_waiting_is_bounded():
    handovers = Handovers(max_waiting=3, max_waiting_per_caller=2)
    with pytest.raises(RequestError) as info:
        await handovers.handover("never", "x", wait_s=0.05)
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert handovers.waiting == 0 and not handovers._arrivals
    hogs = [asyncio.ensure_future(handovers.handover(f"k{i}", "hog", wait_s=5)) for i in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(RequestError) as info:  # one caller's share
        await handovers.handover("k9", "hog", wait_s=5)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    other = asyncio.ensure_future(handovers.handover("k5", "other", wait_s=5))
    await asyncio.sleep(0.01)
    with pytest.raises(RequestError) as info:  # everyone's
        await handovers.handover("k6", "third", wait_s=5)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    for task in [*hogs, other]:  # a caller that goes away frees its slots
        task.cancel()
    await asyncio.gather(*hogs, other, return_exceptions=True)
    assert handovers.waiting == 0 and not handovers._arrivals
    with pytest.raises(RequestError) as info:
        handovers.waiting_for("k0")
    assert info.value.code == grpc.StatusCode.NOT_FOUND
