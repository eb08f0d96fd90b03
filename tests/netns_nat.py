"""A home network behind a NAT gateway, built from Linux network namespaces (imported as ``netns_nat``).

The topology of the Compose ``nat`` scenario (tests/compose/home_network.py) without Docker:

    root namespace  --veth-- gateway namespace --veth-- home namespace
    10.214.N.1/30            10.214.N.2 | 10.215.N.1    10.215.N.2/30, default route via the gateway

The gateway forwards and MASQUERADEs what leaves the home (iptables, as a home router does) and drops every
connection that starts on the outside; the root namespace has an ``unreachable`` route for the home subnet,
so dialling into the home fails at once, as dialling a private address across the internet does. A process
in the home reaches the swarm only by connecting out, and the swarm sees it at the gateway's address.

Needs root, iproute2 and iptables; :func:`unavailable_reason` says why not elsewhere. Everything is deleted at
:meth:`NamespaceNat.delete` (the namespaces take their veths and rules with them).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def unavailable_reason() -> str | None:
    """Why a NAT topology cannot be built on this machine, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root for network namespaces (ip netns) and iptables"
    for tool, package in (("ip", "iproute2"), ("iptables", "iptables")):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (apt-get install {package})"
    probe = f"spnatprobe{os.getpid()}"
    made = _sh("ip", "netns", "add", probe, check=False)
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        nat = _sh("ip", "netns", "exec", probe, "iptables", "-t", "nat", "-L", "-n", check=False)
        if nat.returncode:
            return f"iptables has no nat table in a namespace here: {nat.stderr.strip()[:200]}"
    finally:
        _sh("ip", "netns", "del", probe, check=False)
    return None


class NamespaceNat:
    """The three namespaces above; :attr:`public_ip` is the root side, :attr:`home_ip` the home peer's."""

    def __init__(self) -> None:
        n = os.getpid() % 250 + 1
        tag = f"{os.getpid() % 100000}"
        self.gateway, self.home = f"spgw{tag}", f"sphome{tag}"
        self.root_if, self.wan_if = f"spnr{tag}", f"spnw{tag}"  # root <-> gateway
        self.lan_if, self.home_if = f"spnl{tag}", f"spnh{tag}"  # gateway <-> home
        self.public_ip, self.gateway_wan_ip = f"10.214.{n}.1", f"10.214.{n}.2"
        self.gateway_lan_ip, self.home_ip = f"10.215.{n}.1", f"10.215.{n}.2"
        self.home_subnet = f"10.215.{n}.0/30"
        self._created = False

    # ------------------------------------------------------------ build and tear down
    def create(self) -> None:
        self._created = True  # from here on delete() has something to remove
        gw, home = ["ip", "netns", "exec", self.gateway], ["ip", "netns", "exec", self.home]
        _sh("ip", "netns", "add", self.gateway)
        _sh("ip", "netns", "add", self.home)
        _sh("ip", "link", "add", self.root_if, "type", "veth", "peer", "name", self.wan_if)
        _sh("ip", "link", "set", self.wan_if, "netns", self.gateway)
        _sh("ip", "addr", "add", f"{self.public_ip}/30", "dev", self.root_if)
        _sh("ip", "link", "set", self.root_if, "up")
        _sh("ip", "route", "add", "unreachable", self.home_subnet)  # no way in from the swarm's side
        _sh(*gw, "ip", "addr", "add", f"{self.gateway_wan_ip}/30", "dev", self.wan_if)
        _sh(*gw, "ip", "link", "set", self.wan_if, "up")
        _sh(*gw, "ip", "link", "set", "lo", "up")
        _sh(*gw, "ip", "link", "add", self.lan_if, "type", "veth", "peer", "name", self.home_if)
        _sh(*gw, "ip", "link", "set", self.home_if, "netns", self.home)
        _sh(*gw, "ip", "addr", "add", f"{self.gateway_lan_ip}/30", "dev", self.lan_if)
        _sh(*gw, "ip", "link", "set", self.lan_if, "up")
        _sh(*gw, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        _sh(*gw, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", self.wan_if, "-j", "MASQUERADE")
        established = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED"]
        _sh(*gw, "iptables", "-A", "FORWARD", "-i", self.wan_if, "-o", self.lan_if, *established, "-j", "ACCEPT")
        _sh(*gw, "iptables", "-A", "FORWARD", "-i", self.wan_if, "-o", self.lan_if, "-j", "DROP")
        _sh(*gw, "iptables", "-A", "INPUT", "-i", self.wan_if, *established, "-j", "ACCEPT")
        _sh(*gw, "iptables", "-A", "INPUT", "-i", self.wan_if, "-j", "DROP")  # no port forwarding on the router
        _sh(*home, "ip", "addr", "add", f"{self.home_ip}/30", "dev", self.home_if)
        _sh(*home, "ip", "link", "set", self.home_if, "up")
        _sh(*home, "ip", "link", "set", "lo", "up")
        _sh(*home, "ip", "route", "add", "default", "via", self.gateway_lan_ip)

    def delete(self) -> None:
        if not self._created:
            return
        self._created = False
        _sh("ip", "route", "del", "unreachable", self.home_subnet, check=False)
        _sh("ip", "netns", "del", self.home, check=False)
        _sh("ip", "netns", "del", self.gateway, check=False)  # takes the root-side veth with it
        _sh("ip", "link", "del", self.root_if, check=False)

    def refuse_outbound(self, port: int) -> None:
        """An egress firewall on the home's router: connections from the home to TCP ``port`` are refused."""
        _sh(
            *["ip", "netns", "exec", self.gateway, "iptables", "-I", "FORWARD", "-i", self.lan_if],
            *["-p", "tcp", "--dport", str(port), "-j", "REJECT", "--reject-with", "tcp-reset"],
        )

    def prefix(self) -> list[str]:
        """The command prefix that runs a process inside the home."""
        return ["ip", "netns", "exec", self.home]

    # ------------------------------------------------------------ what the topology promises
    def outbound_source(self) -> str:
        """Connect from the home to a listener on the public side; the source address the listener saw."""
        with socket.socket() as server:
            server.bind((self.public_ip, 0))
            server.listen()
            server.settimeout(10)
            code = f"import socket; socket.create_connection(({self.public_ip!r}, {server.getsockname()[1]}), 5)"
            dialler = subprocess.Popen([*self.prefix(), sys.executable, "-c", code])
            try:
                conn, (host, _port) = server.accept()
                conn.close()
            finally:
                dialler.wait(timeout=10)
        return host

    def can_dial_home(self, port: int, timeout: float = 2.0) -> bool:
        """Whether a connection from the public side to ``home_ip:port`` (or the gateway's port) gets through."""
        for host in (self.home_ip, self.gateway_wan_ip):
            try:
                socket.create_connection((host, port), timeout=timeout).close()
                return True
            except OSError:
                continue
        return False
