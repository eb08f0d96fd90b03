"""State download from several donors over real gRPC servers on 127.0.0.1: replicas at different
versions never hand a joiner a mixed state; it retries until every shard comes from one snapshot."""

from __future__ import annotations

import pytest
import torch

from swarmpipe.peer.spec import load_spec
from swarmpipe.peer.stage.lifecycle import Lifecycle
from swarmpipe.peer.stage.runtime import StageRuntime
from swarmpipe.peer.stage.server import StageServicer, start_server
from swarmpipe.peer.state.format import StateError
from swarmpipe.peer.state.transfer import download_state
from swarmpipe.peer.swarm.records import PeerState

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SPEC = load_spec(
    run_id="dl",
    num_stages=2,
    averaging_interval_s=0,
    model={"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
    optimizer={"kind": "adamw"},
)


def _trained(steps: int) -> StageRuntime:
    runtime = StageRuntime(SPEC, 0)
    gen = torch.Generator().manual_seed(steps)
    for i in range(steps):
        out = runtime.forward(f"mb{i}", torch.randint(0, 256, (2, 16), generator=gen))
        runtime.backward(f"mb{i}", torch.randn(out.shape, generator=gen))
    return runtime


@pytest.fixture
async def donors():
    servers, runtimes, addresses = [], [], []
    for steps in (2, 5):  # two replicas of stage 0 at different versions
        runtime = _trained(steps)
        lifecycle = Lifecycle()
        lifecycle.change(PeerState.ONLINE)
        server, port = await start_server(StageServicer(runtime, f"donor{steps}", lifecycle=lifecycle), "127.0.0.1", 0)
        servers.append(server)
        runtimes.append(runtime)
        addresses.append(f"127.0.0.1:{port}")
    yield addresses, runtimes
    for server, runtime in zip(servers, runtimes):
        await server.stop(grace=None)
        runtime.close()


async def test_two_donors_at_different_versions_give_one_consistent_state(donors):
    addresses, runtimes = donors
    digests = {r.weights.export_state().digest(): r.version for r in runtimes}
    assert len(digests) == 2
    state = await download_state(addresses, "dl", 0)
    assert state.digest() in digests, "a state mixed from two replicas was assembled"
    assert state.version == digests[state.digest()] == 5, "the newest donor's snapshot is preferred"
    joiner = StageRuntime(SPEC, 0)
    joiner.weights.import_state(state)
    assert joiner.version == 5
    joiner.close()


async def test_one_donor_alone_serves_every_shard_from_one_snapshot(donors):
    addresses, runtimes = donors
    state = await download_state([addresses[0], addresses[0], addresses[0]], "dl", 0)
    assert state.digest() == runtimes[0].weights.export_state().digest()


async def test_a_joining_donor_is_refused_and_nothing_is_assembled():
    runtime = _trained(1)
    server, port = await start_server(StageServicer(runtime, "joining"), "127.0.0.1", 0)  # never went online
    try:
        with pytest.raises(StateError, match="still joining"):
            await download_state([f"127.0.0.1:{port}"], "dl", 0)
    finally:
        await server.stop(grace=None)
        runtime.close()
