"""``swarmpipe healthcheck``: exit 0 when a peer's gRPC server or an HTTP endpoint answers (for containers)."""

from __future__ import annotations

import asyncio
import sys
import urllib.request

import grpc

from swarmpipe.peer.config import HealthcheckConfig
from swarmpipe.peer.transport.security import Security
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc


def _security(cfg: HealthcheckConfig) -> Security:
    """A private swarm's peer answers only calls with credentials (its token, or the signature of a key on its
    allow-list), and with --tls only over TLS to the certificate it serves."""
    if not (cfg.auth_token or cfg.auth_token_file or cfg.identity):
        # Open swarm: skip the credential modules, which import hivemind (3 s of a probe that runs every few seconds).
        return _with_pinned_cert(Security(require_tls=bool(cfg.tls_cert)), cfg)
    from swarmpipe.peer.swarm.access import key_credentials, read_token, token_credentials
    from swarmpipe.peer.swarm.identity import load_identity

    token = read_token(cfg.auth_token, cfg.auth_token_file)
    credentials = None
    if token:
        credentials = token_credentials(token)
    elif cfg.identity:
        credentials = key_credentials(load_identity(cfg.identity))
    return _with_pinned_cert(Security(credentials=credentials, require_tls=bool(cfg.tls_cert)), cfg)


def _with_pinned_cert(security: Security, cfg: HealthcheckConfig) -> Security:
    if cfg.tls_cert:
        with open(cfg.tls_cert) as f:
            if not security.pins.learn(cfg.address, f.read()):
                raise ValueError(f"{cfg.tls_cert} is not one PEM certificate")
    return security


async def _grpc_info(address: str, timeout: float, security: Security) -> swarm_pb2.InfoResponse:
    async with security.channel(address) as channel:
        return await swarm_pb2_grpc.StageStub(channel).Info(swarm_pb2.InfoRequest(), timeout=timeout)


def run_healthcheck(cfg: HealthcheckConfig) -> int:
    if not cfg.address and not cfg.url:
        print("healthcheck: pass --address HOST:PORT (a peer) or --url URL (a coordinator)", file=sys.stderr)
        return 2
    try:
        if cfg.address:
            info = asyncio.run(_grpc_info(cfg.address, cfg.timeout, _security(cfg)))
            if info.state == "draining":
                print(f"unhealthy: peer {info.peer_id[-6:]} is draining")
                return 1
            print(f"healthy: peer {info.peer_id[-6:]} stage {info.stage} {info.state} version {info.version}")
        if cfg.url:
            with urllib.request.urlopen(cfg.url, timeout=cfg.timeout) as response:
                if response.status != 200:
                    print(f"unhealthy: {cfg.url} answered {response.status}")
                    return 1
            print(f"healthy: {cfg.url}")
        return 0
    except (grpc.RpcError, OSError) as e:
        print(f"unhealthy: {e}")
        return 1
