"""``swarmpipe demo``: a whole swarm on 127.0.0.1 as real processes, trained, summarised, stopped."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

from swarmpipe.cli.launcher import read_json
from swarmpipe.cli.local_swarm import LocalSwarm
from swarmpipe.peer.config import DemoConfig


def _latest_progress(swarm: LocalSwarm, offset: int) -> tuple[dict | None, int]:
    """Newest trainer ``progress`` event appended since ``offset``."""
    events, offset = swarm.tail_events(offset)
    progress = [e for e in events if e.get("role") == "trainer" and e.get("kind") == "progress"]
    return (progress[-1] if progress else None), offset


def _private_args(workdir: Path) -> list[str]:
    """``--private``: a fresh token, readable only by us, that every role of the demo reads; TLS on."""
    token = workdir / "swarm.token"
    token.touch(mode=0o600)
    token.write_text(secrets.token_hex(32) + "\n")
    return ["--auth-token-file", str(token), "--tls"]


def run_demo(cfg: DemoConfig) -> int:
    from tqdm import tqdm

    workdir = Path(cfg.workdir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    # The roles' own announce periods: the demo shows the swarm as a volunteer would see it.
    swarm = LocalSwarm(
        workdir, run_id="demo", log_level=cfg.log_level, peer_announce_period=None, trainer_announce_period=None
    )
    print(
        f"swarmpipe demo: {cfg.num_stages} stages x {cfg.replicas} replica(s), {cfg.steps} micro-batches; logs in {workdir}"
    )
    started = time.monotonic()
    private = _private_args(workdir) if cfg.private else []  # the same token and TLS for every role
    try:
        # --run-id and --num-stages override a given spec's, as they do the built-in one.
        swarm.start_coordinator(
            Path(cfg.spec) if cfg.spec else None,
            "--run-id",
            "demo",
            "--num-stages",
            str(cfg.num_stages),
            *private,
            http_port=cfg.http_port,
            timeout=60,
        )
        print(f"coordinator up: {swarm.maddr}\ndashboard: {swarm.url}/")
        peers = [
            swarm.start_peer(stage, *private, wait=False, name=f"peer-s{stage}-r{replica}")
            for stage in range(cfg.num_stages)
            for replica in range(cfg.replicas)
        ]
        for peer in peers:
            swarm.wait_ready(peer, timeout=120)
        print(f"{len(peers)} peers serving; training")
        trainer_args = private + (["--data", cfg.data] if cfg.data else [])
        trainer_args += ["--tokenizer", cfg.tokenizer] if cfg.tokenizer else []
        trainer_args += ["--eval-every", str(cfg.eval_every)] if cfg.eval_every else []
        trainer, report_path = swarm.start_trainer(cfg.steps, *trainer_args, report=workdir / "report.json")
        bar = tqdm(total=cfg.steps, desc="training", unit="mb", dynamic_ncols=True)
        offset = 0
        while trainer.alive():
            event, offset = _latest_progress(swarm, offset)
            if event:
                bar.n = min(cfg.steps, int(event.get("step") or 0))
                bar.set_postfix(
                    loss=f"{event.get('loss') or 0:.3f}",
                    sps=event.get("samples_per_s"),
                    retried=event.get("retried"),
                    refresh=False,
                )
                bar.refresh()
            time.sleep(0.5)
        bar.n = cfg.steps if trainer.proc.returncode == 0 else bar.n
        bar.close()
        if trainer.proc.returncode != 0:
            print(f"trainer failed (exit {trainer.proc.returncode}); last log lines:\n{trainer.log_text()[-2000:]}")
            return 1
        report = read_json(report_path) or {}
        print_summary(report, workdir, time.monotonic() - started)
        return 0 if report.get("microbatches_lost", 1) == 0 else 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process the demo started")
        return 130
    finally:
        swarm.stop()


def print_summary(report: dict, workdir: Path, wall_s: float) -> None:
    first, last = report.get("loss_first"), report.get("loss_last")
    fmt = lambda v: f"{v:.3f}" if isinstance(v, (int, float)) else "n/a"  # noqa: E731
    print("\n== swarmpipe demo summary ==")
    print(f"loss                 {fmt(first)} -> {fmt(last)}")
    val = report.get("val_losses") or []
    if val:
        print(f"validation loss      {fmt(val[0][1])} -> {fmt(val[-1][1])} ({len(val)} evaluations)")
    print(
        f"micro-batches        completed {report.get('microbatches_completed')}, retried {report.get('microbatches_retried')}, "
        f"dropped stale {report.get('microbatches_dropped_stale')}, lost {report.get('microbatches_lost')}"
    )
    print(f"throughput           {report.get('samples_per_s', 0):.1f} samples/s")
    print(f"wall time            {wall_s:.0f} s")
    print(f"logs and report      {workdir}")
