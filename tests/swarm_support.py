"""Helpers for tests that run a real swarm of subprocesses on 127.0.0.1 (imported as ``swarm_support``).

The swarm itself is :class:`swarmpipe.cli.local_swarm.LocalSwarm`, the launcher ``swarmpipe demo``
and ``bench/`` use too; here it gets the test defaults and the invariants every scenario checks.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

import grpc

from swarmpipe.cli.launcher import Launched, wait_for
from swarmpipe.cli.local_swarm import LocalSwarm
from swarmpipe.protos import swarm_pb2


def service_methods(service: str = "Stage") -> dict[str, tuple[bool, bool]]:
    """method -> (request streaming, response streaming), read from swarm.proto: a new RPC joins every
    hostile-input and credential test that loops over a service's methods without being listed by hand."""
    methods = swarm_pb2.DESCRIPTOR.services_by_name[service].methods
    return {m.name: (m.client_streaming, m.server_streaming) for m in methods}


@dataclass
class Swarm(LocalSwarm):
    """A LocalSwarm for run ``test`` whose coordinator gets the template spec unless given one."""

    run_id: str = "test"
    # A peer that holds forwards whose backward never comes (a hostile caller's, a stopped trainer's) drains for
    # the whole --drain-timeout (20 s) at teardown, past the launcher's 10 s grace; 3 s is what a test's
    # in-flight backward needs. Tests about draining pass their own (a later flag wins).
    peer_drain_timeout: float | None = 3.0

    def start_coordinator(
        self, spec: Path | None = None, *args: str, wait: bool = True, http_port: int = 0, timeout: float = 60
    ) -> Launched:
        return super().start_coordinator(
            spec or self.write_spec(), *args, wait=wait, http_port=http_port, timeout=timeout
        )


def kill_tree(launched: Launched) -> None:
    """SIGKILL a role and its children (its DHT process and p2pd), like a machine vanishing."""
    launched.kill_tree()


def events_of(swarm: LocalSwarm, kind: str) -> list[dict]:
    return swarm.events_of(kind)


def wait_step(swarm: LocalSwarm, step: int, trainer: Launched, timeout: float = 180) -> int:
    """Wait until the trainer reports at least ``step`` completed micro-batches; returns the newest step."""

    def newest() -> int:
        steps = [e.get("step") or 0 for e in events_of(swarm, "progress")]
        return max(steps, default=0)

    wait_for(lambda: newest() >= step and newest() or (step == 0), timeout, f"trainer step {step}", procs=[trainer])
    return newest()


def stop_trainer(swarm: LocalSwarm, trainer: Launched, report: Path, timeout: float = 60) -> dict:
    """SIGTERM a trainer started with more steps than it needs, once the test has seen what it waited for: it
    starts nothing new, gives what is in flight a few seconds and writes its report (check it with
    ``assert_trained(..., stopped=True)``). Returns the report."""
    trainer.signal(signal.SIGTERM)
    return swarm.wait_report(trainer, report, timeout=timeout)


def assert_trained(report: dict, min_steps: int, *, stopped: bool = False) -> None:
    """The invariants every fault scenario ends with. ``stopped``: the test ended the trainer with SIGTERM
    (:func:`stop_trainer`), so what was still in flight may be reported unfinished; never lost."""
    report = {k: v for k, v in report.items() if k != "losses"}
    assert report["microbatches_lost"] == 0, report
    unfinished = report["microbatches_unfinished"] if stopped else 0
    ended = report["microbatches_completed"] + report["microbatches_dropped_stale"]
    assert ended + unfinished == report["microbatches_started"], report
    assert report["microbatches_completed"] >= min_steps, report
    assert report["loss_last"] < report["loss_first"] - 0.3, (report["loss_first"], report["loss_last"])
    # Every scenario runs the default route, and mostly chained (the 5 % verified go the hub way, and the hops
    # re-routed for a while after a fault): the faults were survived in chain mode, not by quietly going hub.
    assert report["route"] == "chain", report
    assert report["microbatches_chained"] >= 0.5 * report["microbatches_completed"], report


async def call_raw(channel: grpc.aio.Channel, path: str, payload: bytes, streaming: tuple[bool, bool]) -> None:
    """``payload`` as the request bytes of ``path`` (no serializer: the bytes go as they are); ``streaming`` is
    (the request streams, the response streams), as :func:`service_methods` gives it. Raises what the call does."""
    request_streaming, response_streaming = streaming
    if request_streaming and response_streaming:
        async for _ in channel.stream_stream(path)(iter([payload]), timeout=10):
            pass
    elif request_streaming:
        await channel.stream_unary(path)(iter([payload]), timeout=10)
    elif response_streaming:
        async for _ in channel.unary_stream(path)(payload, timeout=10):
            pass
    else:
        await channel.unary_unary(path)(payload, timeout=10)
