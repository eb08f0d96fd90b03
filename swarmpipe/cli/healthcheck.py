"""``swarmpipe healthcheck``: exit 0 when a peer's gRPC server or an HTTP endpoint answers (for containers)."""

from __future__ import annotations

import asyncio
import sys
import urllib.request

import grpc

from swarmpipe.peer.config import HealthcheckConfig
from swarmpipe.protos import swarm_pb2, swarm_pb2_grpc


async def _grpc_info(address: str, timeout: float) -> swarm_pb2.InfoResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await swarm_pb2_grpc.StageStub(channel).Info(swarm_pb2.InfoRequest(), timeout=timeout)


def run_healthcheck(cfg: HealthcheckConfig) -> int:
    if not cfg.address and not cfg.url:
        print("healthcheck: pass --address HOST:PORT (a peer) or --url URL (a coordinator)", file=sys.stderr)
        return 2
    try:
        if cfg.address:
            info = asyncio.run(_grpc_info(cfg.address, cfg.timeout))
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
