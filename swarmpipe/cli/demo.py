"""``swarmpipe demo``: a whole swarm on 127.0.0.1 as real processes, trained, summarised, stopped."""
from __future__ import annotations

import json
import time
from pathlib import Path

from swarmpipe.peer.config import DemoConfig
from swarmpipe.cli.launcher import ProcessGroup, coordinator_http_url, read_json, wait_for


def _tail_progress(events_path: Path, offset: int) -> tuple[dict | None, int]:
    """Newest trainer ``progress`` event appended since ``offset``."""
    latest = None
    try:
        with open(events_path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return None, offset
    end = data.rfind(b"\n") + 1
    for line in data[:end].splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("role") == "trainer" and event.get("kind") == "progress":
            latest = event
    return latest, offset + end


def run_demo(cfg: DemoConfig) -> int:
    from tqdm import tqdm

    workdir = Path(cfg.workdir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    events = workdir / "events.jsonl"
    group = ProcessGroup(workdir, env={"SWARMPIPE_LOG_LEVEL": cfg.log_level})
    print(f"swarmpipe demo: {cfg.num_stages} stages x {cfg.replicas} replica(s), {cfg.steps} micro-batches; logs in {workdir}")
    started = time.monotonic()
    try:
        coord_args = ["--run-id", "demo", "--num-stages", str(cfg.num_stages), "--http-port", str(cfg.http_port),
                      "--peers-file", str(workdir / "initial_peers.txt"), "--identity", str(workdir / "swarmpipe.coordinator.key"),
                      "--checkpoint-dir", str(workdir / "checkpoints"), "--event-log", str(events)]
        if cfg.spec:
            coord_args += ["--spec", cfg.spec]
        coordinator = group.start("coordinator", "coordinator", *coord_args)
        peers_file = workdir / "initial_peers.txt"
        wait_for(peers_file.exists, 60, "the coordinator's initial peers", procs=[coordinator])
        maddr = peers_file.read_text().split()[0]
        url = wait_for(lambda: coordinator_http_url(coordinator), 10, "the dashboard address", procs=[coordinator])
        print(f"coordinator up: {maddr}\ndashboard: {url}/")
        peers = []
        for stage in range(cfg.num_stages):
            for replica in range(cfg.replicas):
                name = f"peer-s{stage}-r{replica}"
                peers.append(group.start(name, "peer", "--initial-peers", maddr, "--run-id", "demo", "--stage", str(stage),
                                         "--ready-file", str(workdir / f"{name}.ready"), "--event-log", str(events)))
        wait_for(lambda: all((workdir / f"{p.name}.ready").exists() for p in peers), 120, "every peer to serve", procs=peers)
        print(f"{len(peers)} peers serving; training")
        train_args = ["--initial-peers", maddr, "--run-id", "demo", "--steps", str(cfg.steps), "--no-progress",
                      "--report", str(workdir / "report.json"), "--event-log", str(events)]
        if cfg.data:
            train_args += ["--data", cfg.data]
        trainer = group.start("trainer", "train", *train_args)
        bar = tqdm(total=cfg.steps, desc="training", unit="mb", dynamic_ncols=True)
        offset = 0
        while trainer.alive():
            event, offset = _tail_progress(events, offset)
            if event:
                bar.n = min(cfg.steps, int(event.get("step") or 0))
                bar.set_postfix(loss=f"{event.get('loss') or 0:.3f}", sps=event.get("samples_per_s"), retried=event.get("retried"),
                                refresh=False)
                bar.refresh()
            time.sleep(0.5)
        bar.n = cfg.steps if trainer.proc.returncode == 0 else bar.n
        bar.close()
        if trainer.proc.returncode != 0:
            print(f"trainer failed (exit {trainer.proc.returncode}); last log lines:\n{trainer.log_text()[-2000:]}")
            return 1
        report = read_json(workdir / "report.json") or {}
        print_summary(report, workdir, time.monotonic() - started)
        return 0 if report.get("microbatches_lost", 1) == 0 else 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process the demo started")
        return 130
    finally:
        group.stop_all()


def print_summary(report: dict, workdir: Path, wall_s: float) -> None:
    first, last = report.get("loss_first"), report.get("loss_last")
    fmt = lambda v: f"{v:.3f}" if isinstance(v, (int, float)) else "n/a"  # noqa: E731
    print("\n== swarmpipe demo summary ==")
    print(f"loss                 {fmt(first)} -> {fmt(last)}")
    print(f"micro-batches        completed {report.get('microbatches_completed')}, retried {report.get('microbatches_retried')}, "
          f"dropped stale {report.get('microbatches_dropped_stale')}, lost {report.get('microbatches_lost')}")
    print(f"throughput           {report.get('samples_per_s', 0):.1f} samples/s")
    print(f"wall time            {wall_s:.0f} s")
    print(f"logs and report      {workdir}")
