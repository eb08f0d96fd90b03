"""The ``swarmpipe.Relay`` service as peers and coordinators serve it: reachability checks for everyone,
relaying (peer/transport/relay_server.py) for nodes started with ``--relay-capacity``; and the signed record
that tells the swarm where to find them (:class:`~swarmpipe.peer.swarm.records.RelayRecord`)."""

from __future__ import annotations

import grpc

from swarmpipe.peer.swarm.records import RelayRecord, now
from swarmpipe.peer.transport.error_contract import abort_malformed, generated_handlers, guard_handlers
from swarmpipe.peer.transport.reachability import ReachabilityChecker
from swarmpipe.peer.transport.relay_server import RelayServicer
from swarmpipe.protos import swarm_pb2_grpc

SERVICE = "swarmpipe.Relay"
RELAY_MODES = ("auto", "off", "always")
DHT_CLIENT_MODES = ("auto", "on", "off")


def check_settings(relay: str, dht_client_mode: str, relay_capacity: int) -> None:
    if relay not in RELAY_MODES:
        raise ValueError(f"--relay {relay!r}: one of {', '.join(RELAY_MODES)}")
    if dht_client_mode not in DHT_CLIENT_MODES:
        raise ValueError(f"--dht-client-mode {dht_client_mode!r}: one of {', '.join(DHT_CLIENT_MODES)}")
    if not 0 <= relay_capacity <= 10_000:
        raise ValueError(f"--relay-capacity {relay_capacity}: 0..10000")


def relay_servicer(cfg, own_id: str, role: str = "peer") -> RelayServicer:
    """From a role's config (``relay_capacity`` and ``relay_rate_mbit`` where it has them)."""
    capacity = getattr(cfg, "relay_capacity", 0)
    rate = getattr(cfg, "relay_rate_mbit", 0.0) * 1e6 / 8
    host = cfg.announce_host if cfg.announce_host not in ("", "auto") else cfg.host
    return RelayServicer(
        capacity, cfg.host, host, rate_bytes_s=rate, checker=ReachabilityChecker(own_id), role=role, own_id=own_id
    )


def relay_handlers(relay: RelayServicer) -> dict[str, dict[str, grpc.RpcMethodHandler]]:
    """For ``start_server(services=...)``: undecodable requests answer INVALID_ARGUMENT."""
    handlers = generated_handlers(relay, swarm_pb2_grpc.add_RelayServicer_to_server)
    return {SERVICE: guard_handlers(handlers, abort_malformed)}


def relay_record(relay: RelayServicer, address: str, role: str = "peer") -> RelayRecord:
    return RelayRecord(
        address=address,
        capacity=relay.capacity,
        in_use=min(relay.in_use, relay.capacity),
        rate_mbit=relay.rate_bytes_s * 8 / 1e6,
        role=role,
        updated_at=now(),
    )
