"""A volunteer's home for the Compose suite: a LAN behind a NAT gateway container.

The home network is a Docker bridge of its own; its containers' default route is the gateway, which sits on
both networks and masquerades (iptables MASQUERADE) what leaves the home subnet. Nothing on the swarm network
can open a connection into the home: Docker isolates user networks from each other, and the gateway drops new
connections towards the home subnet as a home router would. A peer inside sees the swarm (outbound only), and
the swarm sees its connections come from the gateway's address.
"""

from __future__ import annotations

from compose_harness import SUBNET_PREFIX, HarnessError, Stack, sh

HOME_PREFIX = SUBNET_PREFIX.rsplit(".", 1)[0] + f".{(int(SUBNET_PREFIX.rsplit('.', 1)[1]) + 1) % 256}"
HOME_SUBNET = f"{HOME_PREFIX}.0/24"
GATEWAY_HOME_IP = f"{HOME_PREFIX}.254"


class HomeNetwork:
    def __init__(self, stack: Stack, image: str):
        self.stack = stack
        self.image = image
        self.name = f"{stack.project}_home"
        self.gateway = f"{stack.project}_gateway"
        self.containers: list[str] = []
        self._labels = ["--label", f"com.docker.compose.project={stack.project}"]

    def create(self) -> None:
        self.remove()
        sh(["docker", "network", "create", *self._labels, "--subnet", HOME_SUBNET, self.name])
        sh(
            [
                "docker", "run", "-d", "--name", self.gateway, *self._labels,
                "--network", self.stack.network, "--cap-add", "NET_ADMIN",
                "--sysctl", "net.ipv4.ip_forward=1", "--entrypoint", "sh", self.image, "-c", "sleep infinity",
            ]
        )  # fmt: skip
        self.containers.append(self.gateway)
        sh(["docker", "network", "connect", "--ip", GATEWAY_HOME_IP, self.name, self.gateway])
        rules = [
            [
                "iptables",
                "-t",
                "nat",
                "-A",
                "POSTROUTING",
                "-s",
                HOME_SUBNET,
                "!",
                "-d",
                HOME_SUBNET,
                "-j",
                "MASQUERADE",
            ],
            ["iptables", "-A", "FORWARD", "-d", HOME_SUBNET, "-m", "state", "--state", "NEW", "-j", "DROP"],
        ]
        for rule in rules:
            r = sh(["docker", "exec", "-u", "0", self.gateway, *rule], check=False)
            if r.returncode != 0 and "MASQUERADE" in rule:
                raise HarnessError(f"the NAT gateway could not masquerade: {r.stderr.strip()[:200]}")

    def start_peer(self, stage: int, name: str, **env: str) -> str:
        """A peer in the home network (SWARMPIPE_* settings in ``env``); its container id."""
        settings = {
            "SWARMPIPE_RUN_ID": "compose",
            "SWARMPIPE_PEERS_FILE": "/bootstrap/initial_peers.txt",
            "SWARMPIPE_THREADS": "1",
            "SWARMPIPE_STAGE": str(stage),
            **env,
        }
        container = f"{self.stack.project}_{name}"  # as root: it sets its own default route first
        boot = f"ip route replace default via {GATEWAY_HOME_IP} && exec swarmpipe-entrypoint peer"
        args = ["docker", "run", "-d", "--name", container, *self._labels, "--label", "com.docker.compose.service=home"]
        args += [
            "--user",
            "0",
            "--network",
            self.name,
            "--cap-add",
            "NET_ADMIN",
            "-v",
            f"{self.stack.project}_bootstrap:/bootstrap:ro",
        ]
        for key, value in settings.items():
            args += ["-e", f"{key}={value}"]
        cid = sh([*args, "--entrypoint", "sh", self.image, "-c", boot]).stdout.strip()
        self.containers.append(container)
        return cid

    def home_ip(self, cid: str) -> str:
        fmt = f'{{{{(index .NetworkSettings.Networks "{self.name}").IPAddress}}}}'
        return sh(["docker", "inspect", "-f", fmt, cid]).stdout.strip()

    def can_reach(self, cid: str, port: int, from_home: bool = False) -> bool:
        """Whether a TCP connection to ``cid``'s home address and ``port`` opens: from the swarm network (the
        coordinator's container), or, as the probe's own positive control, from inside the home (the gateway)."""
        probe = (
            "import socket,sys; s=socket.socket(); s.settimeout(3); "
            f"sys.exit(0 if s.connect_ex(('{self.home_ip(cid)}', {port})) == 0 else 1)"
        )
        source = self.gateway if from_home else self.stack.ids("coordinator")[0]
        return sh(["docker", "exec", source, "python3", "-c", probe], check=False).returncode == 0

    def remove(self) -> None:
        for container in [*self.containers, self.gateway]:
            sh(["docker", "rm", "-f", container], check=False)
        self.containers.clear()
        sh(["docker", "network", "rm", self.name], check=False)
