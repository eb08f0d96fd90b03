"""Prometheus metrics of one peer (served on ``--metrics-port``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

from swarmpipe.peer.stage.device import memory_in_use

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
DELAY_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# The ``method`` label of requests: the stage RPCs; "evaluate" is a Forward or ForwardBackward for validation.
METHODS = ("forward", "backward", "forward_backward", "evaluate", "download_state", "push_state")


class PeerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_cpu_seconds_total and friends: CPU beside compute busy time
        self.requests = Counter("swarmpipe_requests_total", "RPCs served", ["method"], registry=r)
        for method in METHODS:  # every method's series exists from the start, at zero
            self.requests.labels(method)
        self.errors = Counter("swarmpipe_errors_total", "RPCs rejected or failed", ["method", "kind"], registry=r)
        self.bytes_in = Counter(
            "swarmpipe_received_bytes_total", "Tensor payload bytes received", ["codec"], registry=r
        )
        self.bytes_out = Counter("swarmpipe_sent_bytes_total", "Tensor payload bytes sent", ["codec"], registry=r)
        self.queue = Gauge("swarmpipe_queue_depth", "Requests waiting for compute", registry=r)
        self.latency = Histogram(
            "swarmpipe_compute_seconds", "Compute time per call", ["method"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.batch = Histogram(
            "swarmpipe_batch_microbatches",
            "Micro-batches per compute call (server-side batching)",
            ["method"],
            buckets=(1, 2, 3, 4, 6, 8, 12, 16),
            registry=r,
        )
        self.delay = Histogram(
            "swarmpipe_gradient_delay_steps",
            "Local updates between a micro-batch's forward and backward",
            buckets=DELAY_BUCKETS,
            registry=r,
        )
        self.optimizer_steps = Counter("swarmpipe_optimizer_steps_total", "Local optimizer steps", registry=r)
        self.dropped = Counter("swarmpipe_dropped_gradients_total", "Gradients not applied", ["reason"], registry=r)
        self.version = Gauge("swarmpipe_weight_version", "Local weight version", registry=r)
        self.throughput = Gauge(
            "swarmpipe_throughput_microbatches_per_second", "Measured compute throughput", registry=r
        )
        self.device_memory = Gauge(
            "swarmpipe_device_memory_bytes", "Memory this peer holds on its device (CPU: resident)", registry=r
        )
        self.stash_bytes = Gauge("swarmpipe_stash_bytes", "Bytes of stashed weight snapshots", registry=r)
        self.stash_versions = Gauge("swarmpipe_stash_versions", "Stashed weight versions held", registry=r)

    def watch_runtime(self, runtime: Callable[[], Any]) -> None:
        """Gauges read when scraped, not on every backward: the stash and the device's memory of whichever
        runtime the server holds then (``runtime`` returns it; a move swaps it)."""
        self.stash_versions.set_function(lambda: len(runtime().pending.versions()))
        self.stash_bytes.set_function(lambda: runtime().pending.snapshot_bytes())
        self.device_memory.set_function(lambda: memory_in_use(runtime().device))

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Start the /metrics endpoint; returns the bound port (port 0 picks a free one)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)
