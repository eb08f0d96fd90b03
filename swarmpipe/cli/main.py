"""``swarmpipe`` command line: parses flags into the config dataclasses and hands over.

No protocol logic lives here; each subcommand calls into its module.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from swarmpipe.cli.args import add_dataclass_flags, resolve
from swarmpipe.peer.config import (
    CoordinatorConfig,
    DemoConfig,
    HealthcheckConfig,
    PeerConfig,
    StatusConfig,
    TrainerConfig,
    opt,
)
from swarmpipe.peer.events import setup_logging


def run_async(coro_factory: Callable[[], Any]) -> Any:
    """Run on uvloop where available (every long-running process), else asyncio's loop."""
    try:
        import uvloop

        return uvloop.run(coro_factory())
    except ImportError:
        return asyncio.run(coro_factory())


def cmd_peer(cfg: PeerConfig) -> int:
    from swarmpipe.peer.stage.daemon import PeerDaemon

    return run_async(lambda: PeerDaemon(cfg).run())


def cmd_train(cfg: TrainerConfig) -> int:
    from swarmpipe.peer.trainer.trainer import Trainer

    report = run_async(lambda: Trainer(cfg).run())
    return 0 if report.get("microbatches_lost", 0) == 0 else 3


def cmd_coordinator(cfg: CoordinatorConfig) -> int:
    from swarmpipe.coordinator.service import Coordinator

    return run_async(lambda: Coordinator(cfg).run())


def cmd_demo(cfg: DemoConfig) -> int:
    from swarmpipe.cli.demo import run_demo

    return run_demo(cfg)


def cmd_status(cfg: StatusConfig) -> int:
    from swarmpipe.cli.status import run_status

    return run_status(cfg)


def cmd_healthcheck(cfg: HealthcheckConfig) -> int:
    from swarmpipe.cli.healthcheck import run_healthcheck

    return run_healthcheck(cfg)


@dataclass
class ExportConfig:
    checkpoint: str = opt("", "checkpoint root (its `latest` is exported) or one ckpt-* folder")
    out: str = opt("", "folder to write the Hugging Face model (or PEFT adapter) into; absent or empty")
    merge: bool = opt(False, "LoRA runs: merge the adapters into the base weights (default: a PEFT adapter folder)")
    base: str = opt("", "base Hugging Face folder (default: the spec's model.checkpoint)")
    spec: str = opt("", "run spec file (TOML or JSON) for a checkpoint without spec.json")
    log_level: str = opt("WARNING", "logging level")


def cmd_export(cfg: ExportConfig) -> int:
    from swarmpipe.coordinator.export import export_checkpoint

    if not cfg.checkpoint or not cfg.out:
        raise ValueError("--checkpoint and --out are required")
    s = export_checkpoint(cfg.checkpoint, cfg.out, merge=cfg.merge, base=cfg.base or None, spec=cfg.spec or None)
    print(
        f"exported step {s['step']} of {s['checkpoint']} to {s['out']}: {s['architecture']}, {s['parameters']:,} parameters"
    )
    return 0


COMMANDS: dict[str, tuple[type, Callable[[Any], int], str]] = {
    "peer": (PeerConfig, cmd_peer, "serve one pipeline stage (volunteer daemon)"),
    "train": (TrainerConfig, cmd_train, "drive micro-batches through the swarm"),
    "coordinator": (CoordinatorConfig, cmd_coordinator, "bootstrap the DHT, publish the spec, serve the dashboard"),
    "demo": (DemoConfig, cmd_demo, "run a whole swarm on 127.0.0.1 and train it"),
    "status": (StatusConfig, cmd_status, "show the swarm as a table, read from the DHT"),
    "healthcheck": (HealthcheckConfig, cmd_healthcheck, "exit 0 when a peer or coordinator answers"),
    "export": (ExportConfig, cmd_export, "write a checkpoint as a Hugging Face model folder"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmpipe", description="Asynchronous pipeline training on a volunteer swarm."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (cls, _, help_text) in COMMANDS.items():
        add_dataclass_flags(sub.add_parser(name, help=help_text, description=help_text), cls)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cls, handler, _ = COMMANDS[args.command]
    try:
        cfg = resolve(cls, args, file_section=args.command)
    except (ValueError, OSError) as e:
        print(f"swarmpipe {args.command}: {e}", file=sys.stderr)
        return 2
    setup_logging(getattr(cfg, "log_level", "INFO"))
    try:
        return int(handler(cfg) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, LookupError, TimeoutError) as e:
        print(f"swarmpipe {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
