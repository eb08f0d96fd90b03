"""Where a participant finds the swarm, and which run it joins when none is named."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import hivemind

from swarmpipe.peer.swarm.records import PeerState, RunIndexRecord, StageRecord

log = logging.getLogger("swarmpipe.dht")

# How to find a swarm or start one: the second half of every "no bootstrap peers" error.
FIND_OR_START = (
    "To join a swarm, pass --initial-peers MADDR (or set SWARMPIPE_INITIAL_PEERS) with the 'initial peers:' line "
    "its coordinator printed; a run's organizers publish it (README: Joining a public swarm). To start one, run "
    "'swarmpipe coordinator --host 0.0.0.0 --announce-host PUBLIC_IP --dht-port 31337 --identity coordinator.key' "
    "and hand out the line it prints; 'swarmpipe demo' runs a whole swarm on this machine."
)


SWARMS_DIR_ENV = "SWARMPIPE_SWARMS_DIR"  # folder of <name>.txt bootstrap lists, looked at before the shipped ones
SWARMS_DIRS = ("/etc/swarmpipe/swarms",)


def bootstrap_list_file(swarm: str) -> Path | None:
    """Where ``--swarm`` points: a list file given by path, else ``<name>.txt`` in ``$SWARMPIPE_SWARMS_DIR`` or
    /etc/swarmpipe/swarms (an organizer's list mounted into a container), else None (the shipped lists)."""
    if "/" in swarm or swarm.endswith(".txt"):
        return Path(swarm)
    folders = [os.environ[SWARMS_DIR_ENV]] if os.environ.get(SWARMS_DIR_ENV) else []
    for folder in [*folders, *SWARMS_DIRS]:
        candidate = Path(folder) / f"{swarm}.txt"
        if candidate.is_file():
            return candidate
    return None


def bootstrap_peers(swarm: str) -> list[str]:
    """The bootstrap list of a named swarm: :func:`bootstrap_list_file`, else the one shipped in
    ``peer/swarm/bootstrap/<swarm>.txt``. One multiaddr per line; any of them lets a node in, and the peer id of
    each is trusted as a coordinator (several organizers' bootstrap nodes in one list)."""
    path = bootstrap_list_file(swarm)
    try:
        if path is not None:
            text = path.read_text()
        else:
            text = resources.files(__package__).joinpath("bootstrap", f"{swarm}.txt").read_text()
    except (FileNotFoundError, OSError) as e:
        if path is None:
            raise ValueError(f"no bootstrap list is shipped for swarm {swarm!r}. {FIND_OR_START}") from None
        raise ValueError(f"the bootstrap list {path} cannot be read ({e.strerror or e}). {FIND_OR_START}") from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def resolve_initial_peers(initial_peers: list[str], swarm: str) -> list[str]:
    peers = list(initial_peers) or bootstrap_peers(swarm)
    if not peers:
        raise ValueError(
            f"the bootstrap list of swarm {swarm!r} is empty: no --initial-peers to start from. {FIND_OR_START}"
        )
    return peers


def neediest_run(runs: dict[str, RunIndexRecord], stages_of: dict[str, list[dict[str, StageRecord]]]) -> str:
    """The run whose thinnest stage has the fewest live peers (then the least throughput)."""
    if not runs:
        raise LookupError("the swarm index lists no runs; pass --run-id or wait for a coordinator")

    def need(run_id: str) -> tuple[int, float, str]:
        stages = stages_of.get(run_id) or [{} for _ in range(runs[run_id].num_stages)]
        live = [[r for r in s.values() if r.state is not PeerState.DRAINING] for s in stages]
        thinnest = min(live, key=len)
        return len(thinnest), sum(r.throughput for r in thinnest), run_id

    return min(runs, key=need)


async def _ping_bootstrap(maddrs: list[str], dht: hivemind.DHT, node: Any) -> int:
    """Runs inside the DHT process: reconnect to bootstrap peers and ping them, which also makes
    them add us to their routing tables. A restarted coordinator (same identity and port) starts
    with an empty table; this is how the swarm finds it again."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    answered = 0
    for maddr in maddrs:
        try:
            address, peer = maddr.rsplit("/p2p/", 1)
            peer_id = PeerID.from_base58(peer)
            await asyncio.wait_for(node.p2p._client.connect(peer_id, [Multiaddr(address)]), 5)
            if await asyncio.wait_for(node.protocol.call_ping(peer_id), 5) is not None:
                answered += 1
        except Exception:  # unreachable now: the next round tries again
            continue
    return answered


async def reconnect_bootstrap(dht: hivemind.DHT, maddrs: Sequence[str]) -> int:
    """How many bootstrap peers answered (see :func:`_ping_bootstrap`)."""
    if not maddrs:
        return 0
    future = dht.run_coroutine(functools.partial(_ping_bootstrap, list(maddrs)), return_future=True)
    try:
        return int(await asyncio.wait_for(future, 30))
    except Exception as e:
        log.debug("bootstrap reconnect failed: %s", e)
        return 0
