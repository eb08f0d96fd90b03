"""A stranger's DHT node cannot forge the run's control plane or stand in for a peer, and the swarm trains on.

The forger is a real DHT node in the swarm with its own (valid) signing identity. It tries every write the
issue lists: a plain value over the stage's records, a plain-string subkey, a victim's subkey with the
victim's key (it cannot sign) and with its own key, a spec, a checkpoint record and index entries of its own.
Then it leaves, so what remains is what the honest nodes accepted: none of it.
"""

from __future__ import annotations

import asyncio
import time

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarmpipe.cli.launcher import wait_for
from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.swarm.dht import SwarmDHT, identity_of, start_dht
from swarmpipe.peer.swarm.identity import split_signed_subkey
from swarmpipe.peer.swarm.records import RUNS_INDEX_KEY, checkpoint_key, spec_key, stage_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

FORGED_STAGE = {
    "address": "203.0.113.66:1",
    "state": "online",
    "throughput": 1e6,
    "queue": 0,
    "version": 0,
    "updated_at": 0.0,
    "protocol": 2,
}


async def _forge_everything(forger: hivemind.DHT, victim: str, victim_subkey: bytes) -> None:
    me = identity_of(forger)
    expires = get_dht_time() + 3600
    stage = {**FORGED_STAGE, "updated_at": time.time()}
    evil_spec = RunSpec(run_id="test").to_dict()
    evil_spec["optimizer"]["lr"] = 0.5  # within bounds: only the signature tells it apart
    evil_checkpoint = {"step": 10**6, "versions": [10**6, 10**6], "digests": ["", ""], "created_at": time.time()}
    evil_checkpoint["url"] = "203.0.113.66:1"
    attempts = [
        (stage_key("test", 0), stage, None),  # a plain value over every replica's record
        (stage_key("test", 0), stage, victim),  # an unsigned plain-string subkey naming the victim
        (stage_key("test", 0), stage, victim_subkey),  # the victim's own subkey: the forger cannot sign it
        (stage_key("test", 0), stage, victim.encode() + me.validator.local_public_key),  # victim's id, forger's key
        (spec_key("test"), evil_spec, None),
        (spec_key("test"), evil_spec, me.owner_subkey()),
        (checkpoint_key("test"), evil_checkpoint, me.owner_subkey()),
        (RUNS_INDEX_KEY, {"run_id": "test", "num_stages": 9, "updated_at": time.time()}, me.owner_subkey("test")),
        (RUNS_INDEX_KEY, {"run_id": "trap", "num_stages": 1, "updated_at": time.time()}, me.owner_subkey("trap")),
    ]
    for key, value, subkey in attempts:
        await asyncio.wait_for(forger.store(key, value, expires, subkey=subkey, return_future=True), 30)


async def _raw_subkeys(reader: hivemind.DHT, key: str) -> list:
    """hivemind's own async API (awaiting its MPFutures), as the daemon uses it."""
    found = await asyncio.wait_for(reader.get(key, latest=True, return_future=True), 30)
    return [] if found is None or not isinstance(found.value, dict) else list(found.value)


async def test_forged_control_plane_and_impersonation_are_refused(swarm):
    swarm.start_coordinator()
    first = swarm.start_peer(0, wait=False)
    second = swarm.start_peer(1, wait=False)
    victim = await asyncio.to_thread(swarm.wait_ready, first)
    await asyncio.to_thread(swarm.wait_ready, second)
    coordinator_id = swarm.maddr.rsplit("/p2p/", 1)[1]

    # a stranger that trusts no coordinator: no validator of ours protects its own storage
    forger = await asyncio.to_thread(start_dht, [swarm.maddr], coordinators=["nobody"])
    try:
        subkeys = await _raw_subkeys(forger, stage_key("test", 0))
        victim_subkey = next(k for k in subkeys if isinstance(k, bytes) and k.startswith(victim["peer_id"].encode()))
        await _forge_everything(forger, victim["peer_id"], victim_subkey)
    finally:
        forger.shutdown()  # what it kept itself leaves with it

    # A raw reader with none of our rules (only hivemind's signature check, which also strips signatures)
    # sees what the honest nodes stored: only honest subkeys.
    raw = await asyncio.to_thread(
        hivemind.DHT,
        initial_peers=[swarm.maddr],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        start=True,
        record_validators=[RSASignatureValidator(RSAPrivateKey())],
    )
    try:
        for key in (stage_key("test", 0), spec_key("test"), checkpoint_key("test"), RUNS_INDEX_KEY):
            for subkey in await _raw_subkeys(raw, key):
                signed = split_signed_subkey(subkey)
                assert signed is not None, (key, subkey)
                name, signer = signed
                if key == RUNS_INDEX_KEY:  # another run's entry is its signer's business; readers filter it
                    assert name == "trap" or signer == coordinator_id, (name, signer)
                elif key in (spec_key("test"), checkpoint_key("test")):
                    assert signer == coordinator_id, (key, signer)
                else:
                    assert name == signer, (name, signer)
    finally:
        raw.shutdown()

    reader = await asyncio.to_thread(start_dht, [swarm.maddr])  # honest: trusts the coordinator its maddr names
    try:
        swarm_dht = SwarmDHT(reader, "test")
        peers = await swarm_dht.stage_peers(0)
        spec = await swarm_dht.fetch_spec()
        checkpoint = await swarm_dht.checkpoint()
        runs = await swarm_dht.runs()
        assert peers[victim["peer_id"]].address == victim["address"] and len(peers) == 1
        assert spec is not None and spec.optimizer.lr != 0.5
        assert checkpoint is None or checkpoint.url != "203.0.113.66:1"
        assert set(runs) == {"test"} and runs["test"].num_stages == 2
    finally:
        reader.shutdown()

    # A trainer that names no run picks the only run its coordinator signed (not the stranger's "trap").
    trainer, report_path = swarm.start_trainer(20, "--run-id", "")
    report = await asyncio.to_thread(swarm.wait_report, trainer, report_path, 180)
    assert report["run_id"] == "test" and report["microbatches_completed"] == 20, report
    assert report["microbatches_lost"] == 0, report


async def test_a_spec_signed_by_a_stranger_is_never_trusted(swarm):
    """A run whose spec only a stranger published stays unjoinable: the peer waits, then says why."""
    swarm.start_coordinator()
    forger = await asyncio.to_thread(start_dht, [swarm.maddr], coordinators=["nobody"])
    try:
        spec = RunSpec(run_id="hijack").to_dict()
        subkey = identity_of(forger).owner_subkey()
        await forger.store(spec_key("hijack"), spec, get_dht_time() + 600, subkey=subkey, return_future=True)
        peer = swarm.start_role(
            "joiner",
            "peer",
            *("--initial-peers", swarm.maddr, "--run-id", "hijack", "--spec-timeout", "6", "--host", "127.0.0.1"),
        )
        await asyncio.to_thread(wait_for, lambda: not peer.alive(), 60, "the joiner to give up", poll=0.5)
        assert peer.proc.returncode != 0
        assert "signed by a trusted coordinator" in peer.log_text(), peer.log_text()[-2000:]
    finally:
        forger.shutdown()
