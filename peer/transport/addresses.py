"""What an address is, and which ones may be announced to whom.

A peer announces one ``host:port`` that others dial. Three kinds of hosts never work for strangers: a
wildcard (``0.0.0.0``, ``::``: a bind address, not a destination), a loopback (only this machine), and a
private or carrier-grade NAT range (only this network). :func:`announce_problem` says why an address cannot
be announced into a swarm whose members sit elsewhere; the reachability check (peer/transport/reachability.py)
decides the rest by dialling it.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import socket
from enum import Enum

_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]{1,253}|[0-9A-Fa-f:]+):(?P<port>\d{1,5})$")
CGNAT = ipaddress.ip_network("100.64.0.0/10")  # RFC 6598: carrier-grade NAT, not routable from the internet


class HostKind(str, Enum):
    WILDCARD = "wildcard"
    LOOPBACK = "loopback"
    PRIVATE = "private"  # RFC 1918, CGNAT, link-local, ULA
    PUBLIC = "public"
    NAME = "name"  # a DNS name: only dialling tells

    def __str__(self) -> str:
        return self.value


def split_host_port(address: str) -> tuple[str, int]:
    """``"1.2.3.4:5"`` / ``"[::1]:5"`` / ``"name:5"`` -> (host without brackets, port); ValueError otherwise."""
    match = _HOST_PORT.match(address or "")
    if match is None:
        raise ValueError(f"not a host:port address: {address[:80]!r}")
    port = int(match["port"])
    if not 0 < port < 65536:
        raise ValueError(f"port {port} out of range in {address[:80]!r}")
    return match["host"].strip("[]"), port


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def host_kind(host: str) -> HostKind:
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return HostKind.LOOPBACK if host.lower() == "localhost" else HostKind.NAME
    if ip.is_unspecified:
        return HostKind.WILDCARD
    if ip.is_loopback:
        return HostKind.LOOPBACK
    if ip.is_private or ip.is_link_local or (ip.version == 4 and ip in CGNAT):
        return HostKind.PRIVATE
    return HostKind.PUBLIC


def is_wildcard(host: str) -> bool:
    return host_kind(host) is HostKind.WILDCARD


def observed_host(peer: str) -> str:
    """The caller's host from grpc's ``context.peer()`` (``"ipv4:1.2.3.4:5678"``, ``"ipv6:[::1]:5678"``);
    '' for anything else (a unix socket, an unknown transport)."""
    if peer.startswith("ipv4:"):
        return peer[5:].rsplit(":", 1)[0]
    if peer.startswith("ipv6:"):
        return peer[5:].rsplit(":", 1)[0].strip("[]").split("%")[0]
    return ""


def announce_problem(host: str, swarm_hosts: list[str]) -> str:
    """Why ``host`` must not be announced to a swarm reached at ``swarm_hosts`` (the hosts of its bootstrap
    peers); '' when nothing rules it out before dialling. A loopback host is fine in a swarm on this machine
    (the local demo, tests), a private one in a swarm on private networks (a LAN, a Compose network)."""
    kind = host_kind(host)
    if kind is HostKind.WILDCARD:
        return f"{host} is a wildcard bind address; nobody can dial it (set --announce-host, or leave it 'auto')"
    kinds = {host_kind(h) for h in swarm_hosts if h}
    if kind is HostKind.LOOPBACK and kinds and kinds != {HostKind.LOOPBACK}:
        return (
            f"{host} is a loopback address and the swarm is on other machines ({', '.join(sorted(swarm_hosts))[:120]})"
        )
    if kind is HostKind.PRIVATE and HostKind.PUBLIC in kinds:
        return f"{host} is a private address and the swarm is on the public internet"
    return ""


def dht_announce_maddr(host: str, port: int) -> str | None:
    """The multiaddr a DHT node announces for ``--announce-host`` (``/ip4``, ``/ip6`` or ``/dns``); None when
    there is no concrete host to name: unset, 'auto' (learned later, from a reachability check) or a wildcard.
    Then p2pd announces what it listens on and what its peers observe."""
    if not host or not port or host == "auto" or is_wildcard(host):
        return None
    try:
        version = ipaddress.ip_address(host.strip("[]")).version
    except ValueError:
        return f"/dns/{host}/tcp/{port}"
    return f"/ip{version}/{host.strip('[]')}/tcp/{port}"


def hosts_of_multiaddrs(maddrs: list[str]) -> list[str]:
    """``/ip4/1.2.3.4/tcp/5/p2p/Qm...`` -> ``1.2.3.4`` (``/dns*/name`` -> name); others skipped."""
    hosts = []
    for maddr in maddrs:
        parts = maddr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6"):
            hosts.append(parts[2])
    return hosts


def loopback_alias(caller: str) -> str:
    """A loopback source address standing for a relayed ``caller`` (``127.x.y.z``, never ``127.0.0.1``): the
    relayed peer's server then tells relayed callers apart by address (per-caller quotas and micro-batch
    ownership are keyed by the caller's host) although all of them arrive over loopback."""
    digest = hashlib.blake2b(observed_host(caller).encode() or caller.encode(), digest_size=3).digest()
    a, b, c = digest
    if (a, b) == (0, 0) and c in (0, 1, 255):
        c = 2
    return f"127.{a}.{b}.{c if c != 255 else 254}"


def resolvable(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
        return True
    except (OSError, UnicodeError):
        return False
