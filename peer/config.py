"""Configuration of each role: one dataclass per command, shared by CLI, files, env and tests.

Every field becomes a flag ``--field-name`` and reads ``SWARMPIPE_FIELD_NAME``;
see :mod:`swarmpipe.cli.args` for precedence (flag > environment > config file > default).
Field metadata ``help`` documents the flag.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def opt(default, help: str, **extra):  # noqa: A002 - "help" mirrors argparse
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class CommonConfig:
    initial_peers: list[str] = opt([], "multiaddrs of DHT peers to join (default: the --swarm bootstrap list)")
    swarm: str = opt("public", "named swarm whose shipped bootstrap list to use when --initial-peers is empty")
    run_id: str = opt("", "run to join (default: the run that most needs peers)")
    coordinator_id: list[str] = opt(
        [], "peer ids of the coordinators whose signed spec to trust (default: the peer ids in --initial-peers)"
    )
    host: str = opt("127.0.0.1", "interface to bind servers to")
    announce_host: str = opt(
        "", "host others should dial: a name or IP, or 'auto' (learned from a reachability check; default: --host)"
    )
    log_level: str = opt("INFO", "logging level")
    event_log: str = opt("", "append JSON-lines events to this file")
    threads: int = opt(0, "torch threads for this process (0: the cores it may use, by affinity and cgroup quota)")
    # private swarms (off by default; peer/swarm/access.py): every role of one swarm gets the same settings
    identity: str = opt("", "private key file, created when missing: a stable peer id (needed with --allow-peers)")
    auth_token: str = opt(
        "", "private swarm: the shared secret of its members, 16+ characters (prefer the env var or the file)"
    )
    auth_token_file: str = opt("", "private swarm: read the shared secret from this file")
    allow_peers: str = opt("", "private swarm: file of member peer ids or ssh-rsa public keys, one per line")
    tls: bool = opt(
        False, "TLS on gRPC: serve with a certificate published in our signed record; dial only pinned ones"
    )
    tls_cert: str = opt("", "PEM certificate for --tls (default: a fresh self-signed one per start)")
    tls_key: str = opt("", "PEM private key of --tls-cert")


@dataclass
class PeerConfig(CommonConfig):
    stage: int = opt(-1, "stage to serve (default: the stage with the least total throughput)")
    port: int = opt(0, "gRPC port (0 picks a free one)")
    dht_port: int = opt(0, "DHT port (0 picks a free one)")
    metrics_port: int = opt(-1, "Prometheus /metrics port (-1 disables, 0 picks a free one)")
    announce_period: float = opt(
        5.0, "seconds between DHT announcements (records expire after 3 periods, 10 s at least)"
    )
    drain_timeout: float = opt(20.0, "seconds to finish in-flight work on SIGTERM")
    ready_file: str = opt("", "write a JSON line with the peer's address and stage once it serves")
    spec_timeout: float = opt(120.0, "seconds to wait for the run spec in the DHT")
    rebalance_period: float = opt(0.0, "mean seconds between rebalancing checks (0 disables)")
    state_download: bool = opt(True, "download the stage's state from replicas or a checkpoint when joining")
    device: str = opt("auto", "where the stage computes: auto (CUDA, then MPS, then CPU) | cpu | cuda | cuda:N | mps")
    max_memory_mb: int = opt(0, "memory this peer may use on its device, MiB (0: what the device has free)")
    checkpoint: str = opt(
        "",
        "local copy of the run's base Hugging Face checkpoint (default: the spec's path if it exists here, else the swarm serves it)",
    )
    # volunteering from home (peer/stage/serving_address.py): reachability check, relays, DHT client mode
    reachability_check: bool = opt(True, "before announcing, have a reachable node dial our address back")
    relay: str = opt("auto", "when nobody can dial us: auto (serve through a relay) | off (exit with advice) | always")
    relay_capacity: int = opt(0, "relay up to N peers that cannot be dialled (only when we can be)")
    relay_rate_mbit: float = opt(200.0, "bytes forwarded per relayed peer, Mbit/s (0: no cap)")
    dht_client_mode: str = opt("auto", "DHT client mode: auto (when nobody can dial us) | on | off")


@dataclass
class TrainerConfig(CommonConfig):
    steps: int = opt(200, "micro-batches to complete")
    max_time: float = opt(0.0, "stop after this many seconds of training (0: no limit); in-flight work still finishes")
    in_flight: int = opt(0, "micro-batches in flight (0: two per stage)")
    flush_every: int = opt(
        0,
        "synchronous baseline: wait for every micro-batch in flight after each K started (0: never, the asynchronous schedule)",
    )
    data: str = opt(
        "",
        "training data: text/JSONL/Parquet file or folder (tokenized with --tokenizer), a token file from "
        "`swarmpipe tokenize`, or plain text as bytes (default: the Python standard library's source)",
    )
    tokenizer: str = opt("", "Hugging Face tokenizer folder (default: the run's checkpoint folder, if here)")
    shard: int = opt(0, "this trainer's data shard, 0 .. num_shards-1 (trainers of one run read disjoint shards)")
    num_shards: int = opt(1, "how many data shards the run's trainers split the data into")
    state_file: str = opt("", "save the data cursor and counters here; a restarted trainer resumes from it")
    report: str = opt("", "write a JSON report here at the end")
    seed: int = opt(1, "data sampling seed")
    eval_every: int = opt(0, "validation loss after every N completed micro-batches and at the end (0: off)")
    eval_batches: int = opt(4, "held-out micro-batches in the validation set")
    call_timeout: float = opt(30.0, "deadline for each stage call, seconds")
    route: str = opt(
        "chain",
        "how a micro-batch travels: chain (peer to peer; the trainer sends tokens, gets the loss) | hub (every hop "
        "through the trainer); also `route` in a --config file's [transport] table",
    )
    verify_fraction: float = opt(
        0.05,
        "Byzantine checks: fraction of micro-batches per stage whose output is recomputed on a second replica "
        "and whose gradient is probed (0: off; each check costs about one extra forward)",
    )
    verify_ban_after: int = opt(3, "failed checks after which this trainer bans a replica (for an hour)")
    wait_timeout: float = opt(600.0, "give up when a stage has had no live replica this long")
    progress: bool = opt(True, "show a progress bar")
    announce_period: float = opt(5.0, "seconds between trainer progress records in the DHT")
    spec_timeout: float = opt(120.0, "seconds to wait for the run spec in the DHT")


@dataclass
class CoordinatorConfig(CommonConfig):
    spec: str = opt("", "TOML run spec (default: built-in)")
    num_stages: int = opt(0, "override the spec's number of stages")
    dht_port: int = opt(0, "DHT port (0: the port saved next to the identity, else a free one)")
    http_port: int = opt(8080, "HTTP port for the dashboard and /api/swarm (0 picks a free one)")
    grpc_port: int = opt(0, "gRPC port serving checkpoints to joining peers (0 picks a free one)")
    identity: str = opt("", "private key file: the same multiaddr after a restart")
    checkpoint_dir: str = opt("", "where checkpoints live (default: none kept)")
    peers_file: str = opt("", "write the initial peers multiaddrs here")
    checkpoint_every: float = opt(30.0, "seconds between checkpoint pulls (0 disables)")
    publish_period: float = opt(10.0, "seconds between spec / index re-publications")


@dataclass
class DemoConfig:
    num_stages: int = opt(2, "pipeline stages")
    replicas: int = opt(1, "peers per stage")
    steps: int = opt(1000, "micro-batches to train")
    workdir: str = opt("", "folder for logs and reports (default: runs/demo-<time>)")
    spec: str = opt("", "TOML run spec (default: built-in)")
    http_port: int = opt(0, "coordinator HTTP port (0 picks a free one)")
    data: str = opt("", "training data (see swarmpipe train --help)")
    tokenizer: str = opt("", "Hugging Face tokenizer folder (default: the run's checkpoint folder)")
    eval_every: int = opt(0, "validation loss every N completed micro-batches and at the end (0: off)")
    private: bool = opt(
        False, "run it as a private swarm: a fresh shared token (in the workdir) and TLS for every role"
    )
    log_level: str = opt("INFO", "logging level")


@dataclass
class SwarmReaderConfig:
    """What every read-only view of the swarm needs: where the DHT is, whose records to trust, a private swarm's
    credentials (``status``, ``monitor``)."""

    initial_peers: list[str] = opt([], "multiaddrs of DHT peers to read from (default: the --swarm bootstrap list)")
    swarm: str = opt("public", "named swarm whose bootstrap list to use")
    run_id: str = opt("", "run to show (default: every run in the swarm index a trusted coordinator lists)")
    coordinator_id: list[str] = opt([], "peer ids of trusted coordinators (default: the peer ids in --initial-peers)")
    auth_token: str = opt("", "private swarm: show only records proven with this shared secret")
    auth_token_file: str = opt("", "private swarm: read the shared secret from this file")
    allow_peers: str = opt("", "private swarm: show only records of the peers listed in this file")


@dataclass
class StatusConfig(SwarmReaderConfig):
    coordinator: str = opt("", "read from a coordinator's HTTP API instead (http://host:port)")
    json: bool = opt(False, "print JSON instead of a table")
    log_level: str = opt("WARNING", "logging level")


@dataclass
class MonitorConfig(SwarmReaderConfig):
    host: str = opt("127.0.0.1", "interface to serve the page on (0.0.0.0: everyone)")
    http_port: int = opt(8090, "HTTP port of the health page and /api/monitor (0 picks a free one)")
    refresh: float = opt(15.0, "seconds between reads of the DHT")
    probe: bool = opt(True, "dial every announced peer once per refresh (reachability history)")
    ready_file: str = opt("", "write the page's URL here once it serves")
    log_level: str = opt("INFO", "logging level")


@dataclass
class HealthcheckConfig:
    address: str = opt("", "gRPC address of a peer (host:port) to ask for Info")
    url: str = opt("", "HTTP URL that must answer 200 (e.g. a coordinator's /api/swarm)")
    timeout: float = opt(5.0, "seconds")
    auth_token: str = opt("", "private swarm: the shared secret to call with")
    auth_token_file: str = opt("", "private swarm: read the shared secret from this file")
    identity: str = opt("", "private swarm with --allow-peers: call as the peer id of this key file (on the list)")
    tls_cert: str = opt("", "TLS: the certificate the peer serves (PEM file), pinned for --address")
    log_level: str = opt("WARNING", "logging level")


def default_threads() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup CPU quota (containers)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)
