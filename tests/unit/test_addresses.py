"""Address rules (issue 15, item 4): what a host is, what may be announced to whom, and the records that
carry addresses refusing what nobody can dial."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from swarmpipe.peer.swarm.records import RelayRecord, StageRecord
from swarmpipe.peer.transport.addresses import (
    HostKind,
    announce_problem,
    dht_announce_maddr,
    host_kind,
    hosts_of_multiaddrs,
    join_host_port,
    loopback_alias,
    observed_host,
    split_host_port,
)
from swarmpipe.peer.transport.reachability import _clean_host, _may_dial

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


@pytest.mark.parametrize(
    "host,kind",
    [
        ("0.0.0.0", HostKind.WILDCARD),
        ("::", HostKind.WILDCARD),
        ("127.0.0.1", HostKind.LOOPBACK),
        ("127.3.4.5", HostKind.LOOPBACK),
        ("localhost", HostKind.LOOPBACK),
        ("::1", HostKind.LOOPBACK),
        ("10.1.2.3", HostKind.PRIVATE),
        ("192.168.0.7", HostKind.PRIVATE),
        ("172.20.0.2", HostKind.PRIVATE),
        ("100.72.1.1", HostKind.PRIVATE),  # carrier-grade NAT
        ("fd00::1", HostKind.PRIVATE),
        ("8.8.8.8", HostKind.PUBLIC),
        ("2001:4860::8888", HostKind.PUBLIC),
        ("peer.example.org", HostKind.NAME),
    ],
)
def test_host_kinds(host: str, kind: HostKind) -> None:
    assert host_kind(host) is kind


def test_host_port_round_trip_and_garbage() -> None:
    assert split_host_port("1.2.3.4:5") == ("1.2.3.4", 5)
    assert split_host_port("[::1]:8080") == ("::1", 8080)
    assert split_host_port("peer-1.example:443") == ("peer-1.example", 443)
    assert join_host_port("::1", 80) == "[::1]:80" and join_host_port("1.2.3.4", 80) == "1.2.3.4:80"
    for bad in ("", "1.2.3.4", "1.2.3.4:0", "1.2.3.4:70000", "a b:1", "x" * 300 + ":1", "1.2.3.4:5/p2p"):
        with pytest.raises(ValueError):
            split_host_port(bad)


def test_what_may_be_announced_where() -> None:
    local = ["127.0.0.1"]
    lan = ["192.168.1.10"]
    internet = ["8.8.8.8"]
    assert "wildcard" in announce_problem("0.0.0.0", local)
    assert announce_problem("127.0.0.1", local) == ""  # the local demo and the tests
    assert "loopback" in announce_problem("127.0.0.1", lan)
    assert "loopback" in announce_problem("127.0.0.1", internet)
    assert announce_problem("192.168.1.20", lan) == ""  # a LAN or a Compose network
    assert "private" in announce_problem("192.168.1.20", internet)
    assert announce_problem("1.1.1.1", internet) == ""
    assert announce_problem("10.0.0.5", []) == ""  # nothing known yet: only dialling tells


def test_the_dht_announces_only_a_concrete_host() -> None:
    """'auto' (the advice's own fix, with --dht-port) once made ``/ip4/auto/tcp/N``, which hivemind refuses."""
    assert dht_announce_maddr("auto", 31337) is None
    assert dht_announce_maddr("0.0.0.0", 31337) is None and dht_announce_maddr("::", 31337) is None
    assert dht_announce_maddr("", 31337) is None and dht_announce_maddr("1.2.3.4", 0) is None
    assert dht_announce_maddr("1.2.3.4", 31337) == "/ip4/1.2.3.4/tcp/31337"
    assert dht_announce_maddr("2001:db8::1", 31337) == "/ip6/2001:db8::1/tcp/31337"
    assert dht_announce_maddr("[2001:db8::1]", 31337) == "/ip6/2001:db8::1/tcp/31337"
    assert dht_announce_maddr("peer.example.org", 31337) == "/dns/peer.example.org/tcp/31337"


def test_observed_hosts_and_multiaddrs() -> None:
    assert observed_host("ipv4:10.0.0.7:51234") == "10.0.0.7"
    assert observed_host("ipv6:[::1]:5") == "::1"
    assert observed_host("unix:/tmp/x") == ""
    assert hosts_of_multiaddrs(["/ip4/1.2.3.4/tcp/5/p2p/QmX", "/dns4/boot.example/tcp/1", "garbage"]) == [
        "1.2.3.4",
        "boot.example",
    ]


def test_loopback_aliases_tell_callers_apart_and_are_never_the_plain_loopback() -> None:
    a, b = loopback_alias("ipv4:203.0.113.1:5000"), loopback_alias("ipv4:203.0.113.2:5000")
    assert a != b and a.startswith("127.") and host_kind(a) is HostKind.LOOPBACK
    assert loopback_alias("ipv4:203.0.113.1:6000") == a  # the same caller host, another port: one caller
    assert all(loopback_alias(f"ipv4:10.0.{i}.1:1") != "127.0.0.1" for i in range(256))


def test_the_checker_never_dials_wildcards_nor_its_own_loopback_for_strangers() -> None:
    assert not _may_dial("0.0.0.0", "127.0.0.1")
    assert not _may_dial("127.0.0.1", "203.0.113.5")  # a stranger asking us to probe our own localhost
    assert _may_dial("127.0.0.1", "127.0.0.1")
    assert _may_dial("203.0.113.5", "198.51.100.1")
    assert _clean_host("10.0.0.1") == "10.0.0.1" and _clean_host("evil; rm -rf") == "" and _clean_host("") == ""


def _stage(address: str, **extra) -> StageRecord:
    return StageRecord.model_validate(
        {"address": address, "state": "online", "throughput": 1.0, "queue": 0, "version": 0, "updated_at": 0.0, **extra}
    )


def test_records_refuse_wildcards_and_forged_relay_fields() -> None:
    for wildcard in ("0.0.0.0:5000", "[::]:5000"):
        with pytest.raises(ValidationError, match="wildcard"):
            _stage(wildcard)
    assert _stage("203.0.113.5:5000", relay="QmRe1ay").relay == "QmRe1ay"
    for relay in ("not base58 0OIl", "x" * 65, 5):
        with pytest.raises(ValidationError):
            _stage("203.0.113.5:5000", relay=relay)
    good = {"address": "203.0.113.5:5000", "capacity": 4, "in_use": 1, "updated_at": 0.0}
    assert RelayRecord.model_validate(good).free == 3
    for bad in (
        {"address": "0.0.0.0:1"},
        {"capacity": -1},
        {"capacity": 10**9},
        {"in_use": "1"},  # strict: no coercion
        {"role": "admin"},
        {"rate_mbit": float("inf")},
        {"tls_cert": "not a certificate"},
        {"address": "x" * 300 + ":1"},
    ):
        with pytest.raises(ValidationError):
            RelayRecord.model_validate({**good, **bad})
