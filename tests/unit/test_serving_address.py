"""ServingAddress.establish: which address a peer announces after a reachability check (no sockets: the check
and the DHT are stand-ins). What a checker reports is announced only when it passes the same rules as a
configured address: no loopback or private host into a swarm on the public internet. (Public hosts here are
real ones, never dialled: Python counts the documentation ranges, 192.0.2/24, 198.51.100/24, 203.0.113/24, as
private.)"""

from __future__ import annotations

import pytest

from swarmpipe.peer.config import PeerConfig
from swarmpipe.peer.stage import serving_address
from swarmpipe.peer.stage.serving_address import NotReachable, ServingAddress
from swarmpipe.peer.transport.reachability import ELSEWHERE, REACHABLE, UNREACHABLE, Verdict

pytestmark = pytest.mark.unit
PEER = "QmHome1111111111111111111111111111111111111111"


class _Swarm:
    """Answers what establish() asks of the DHT: one relay record (a checker) and no stage records."""

    class security:
        cert_pem = ""

    async def relays(self):
        class Record:
            address, free = "8.8.4.4:7000", 0

        return {"QmChecker": Record()}

    async def all_stages(self, num_stages):
        return [{} for _ in range(num_stages)]


class _Events:
    def __init__(self):
        self.emitted = []

    def emit(self, kind, **fields):
        self.emitted.append((kind, fields))


def _serving(monkeypatch, verdict: Verdict, swarm_hosts: list[str], **cfg) -> ServingAddress:
    async def check(candidate, peer_id, checkers, tls_cert=""):
        assert checkers == ["8.8.4.4:7000"]
        return verdict

    monkeypatch.setattr(serving_address, "check_reachability", check)
    config = PeerConfig(host="0.0.0.0", announce_host="auto", relay="off", **cfg)
    return ServingAddress(config, _Swarm(), PEER, _Events(), 4000, 2, swarm_hosts)


async def test_reachable_elsewhere_at_a_public_host_is_announced(monkeypatch):
    verdict = Verdict(ELSEWHERE, "1.1.1.1", "1.1.1.1:4000", checker="8.8.4.4:7000")
    serving = _serving(monkeypatch, verdict, ["8.8.4.4"])
    assert await serving.establish() == "1.1.1.1:4000"
    assert serving.events.emitted[0][1]["outcome"] == ELSEWHERE


@pytest.mark.parametrize("host", ["10.1.2.3", "127.0.0.1", "100.64.0.9"])
async def test_a_learned_private_or_loopback_host_is_never_announced_to_a_public_swarm(monkeypatch, host):
    verdict = Verdict(ELSEWHERE, host, f"{host}:4000", checker="8.8.4.4:7000")
    serving = _serving(monkeypatch, verdict, ["8.8.4.4"])
    with pytest.raises(NotReachable) as refused:
        await serving.establish()
    assert host in str(refused.value) and "forward TCP port 4000" in str(refused.value)


async def test_a_learned_private_host_is_fine_in_a_private_swarm(monkeypatch):
    verdict = Verdict(ELSEWHERE, "10.1.2.3", "10.1.2.3:4000", checker="10.1.2.1:7000")
    serving = _serving(monkeypatch, verdict, ["10.1.2.1"])
    assert await serving.establish() == "10.1.2.3:4000"


async def test_unreachable_without_relays_exits_with_the_advice(monkeypatch):
    verdict = Verdict(UNREACHABLE, "1.1.1.1", detail="0.0.0.0:4000: not dialled")
    serving = _serving(monkeypatch, verdict, ["8.8.4.4"], dht_port=31337)
    with pytest.raises(NotReachable) as refused:
        await serving.establish()
    assert "forward TCP port 4000 and 31337" in str(refused.value) and "--relay auto" in str(refused.value)


async def test_reachable_announces_the_configured_address(monkeypatch):
    verdict = Verdict(REACHABLE, "1.1.1.1", "1.1.1.1:4000")
    serving = _serving(monkeypatch, verdict, ["8.8.4.4"])
    serving.cfg.announce_host = "1.1.1.1"
    assert await serving.establish() == "1.1.1.1:4000"


async def test_unreachable_with_relays_auto_waits_for_a_relay_with_backoff(monkeypatch):
    """A home peer started before any relay has room (issue 30): it says so, looks again 2, 4, 8 ... s later
    (capped) and goes on once a relay has room, instead of exiting."""
    verdict = Verdict(UNREACHABLE, "1.1.1.1", detail="0.0.0.0:4000: not dialled")
    serving = _serving(monkeypatch, verdict, ["8.8.4.4"])
    serving.cfg.relay = "auto"
    looks = {"n": 0}
    full_until = 3

    class _Filling(_Swarm):
        async def relays(self):
            looks["n"] += 1

            class Record:
                address, free = "8.8.4.4:7000", 0 if looks["n"] <= 2 * full_until else 1

            return {"QmChecker": Record()}

    serving.swarm = _Filling()
    slept = []

    async def sleep(seconds):
        slept.append(seconds)

    monkeypatch.setattr(serving_address.asyncio, "sleep", sleep)
    assert await serving.establish() == ""  # a relay has room now: the daemon goes on to serve through it
    waits = [fields for kind, fields in serving.events.emitted if kind == "waiting_for_relay"]
    assert len(waits) == full_until and slept == [2.0, 4.0, 8.0]
    assert [w["retry_in_s"] for w in waits] == slept and "--relay-capacity" in waits[0]["advice"]
    monkeypatch.setattr(serving_address, "MAX_RETRY_S", 5.0)
    serving.events.emitted.clear()
    slept.clear()
    looks["n"] = 0
    assert await serving.establish() == ""
    assert slept == [2.0, 4.0, 5.0]  # capped
