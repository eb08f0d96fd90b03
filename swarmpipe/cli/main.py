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
    CommonConfig,
    CoordinatorConfig,
    DemoConfig,
    HealthcheckConfig,
    MonitorConfig,
    PeerConfig,
    StatusConfig,
    SwarmReaderConfig,
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


def cmd_monitor(cfg: MonitorConfig) -> int:
    from swarmpipe.coordinator.monitor.service import run_monitor

    return run_monitor(cfg)


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


@dataclass
class IdentityConfig:
    identity: str = opt("", "private key file (created when missing) to give --identity and list in --allow-peers")
    log_level: str = opt("WARNING", "logging level")


def cmd_identity(cfg: IdentityConfig) -> int:
    from swarmpipe.peer.swarm.identity import load_identity

    if not cfg.identity:
        raise ValueError("--identity FILE is required (it is created when missing)")
    identity = load_identity(cfg.identity)
    print(f"peer id: {identity.peer_id}")
    print(f"public key: {identity.key.get_public_key().to_bytes().decode()}")
    return 0


@dataclass
class TokenizeConfig:
    data: str = opt("", "text, JSONL or Parquet file, or a folder of them, to tokenize")
    tokenizer: str = opt("", "Hugging Face tokenizer folder (e.g. the model's checkpoint folder)")
    out: str = opt("", "token file to write (*.tokens or *.bin), with its sidecar <out>.json")
    max_tokens: int = opt(0, "stop after this many tokens (0: all of the data)")
    log_level: str = opt("WARNING", "logging level")


def cmd_tokenize(cfg: TokenizeConfig) -> int:
    from swarmpipe.peer.data import tokenize_to_file

    if not cfg.data or not cfg.tokenizer or not cfg.out:
        raise ValueError("--data, --tokenizer and --out are required")
    s = tokenize_to_file(cfg.data, cfg.tokenizer, cfg.out, max_tokens=cfg.max_tokens or None)
    print(f"tokenized {s['tokens']:,} tokens in {s['documents']:,} documents as {s['dtype']} into {cfg.out}")
    return 0


@dataclass
class TinyLlamaConfig:
    out: str = opt("", "folder to write the checkpoint and its tokenizer into; absent or empty")
    text: str = opt("", "text file or folder to train the tokenizer on (default: a few hundred KB of the stdlib)")
    vocab_size: int = opt(512, "tokenizer and model vocabulary (at least 260; fewer when the text is too small)")
    layers: int = opt(4, "decoder layers")
    hidden: int = opt(128, "hidden size")
    heads: int = opt(4, "attention heads")
    kv_heads: int = opt(2, "key/value heads (grouped-query attention)")
    intermediate: int = opt(0, "MLP width (0: 8/3 of --hidden, rounded up to a multiple of 64)")
    seq_len: int = opt(256, "max_position_embeddings and the tokenizer's model_max_length")
    tie: bool = opt(False, "tie the output head to the embedding")
    seed: int = opt(0, "weight init seed")
    log_level: str = opt("WARNING", "logging level")


def cmd_tiny_llama(cfg: TinyLlamaConfig) -> int:
    from swarmpipe.peer.model.tiny import make_tiny_llama_checkpoint

    if not cfg.out:
        raise ValueError("--out is required")
    s = make_tiny_llama_checkpoint(
        cfg.out,
        text=cfg.text or None,
        vocab_size=cfg.vocab_size,
        layers=cfg.layers,
        hidden=cfg.hidden,
        heads=cfg.heads,
        kv_heads=cfg.kv_heads,
        intermediate=cfg.intermediate,
        seq_len=cfg.seq_len,
        tie=cfg.tie,
        seed=cfg.seed,
    )
    print(
        f"wrote a random {s['architecture']} to {s['out']}: {s['layers']} layers, hidden {s['hidden']}, "
        f"vocab {s['vocab_size']}, {s['parameters']:,} parameters; tokenizer trained on {s['text']}"
    )
    return 0


COMMANDS: dict[str, tuple[type, Callable[[Any], int], str]] = {
    "peer": (PeerConfig, cmd_peer, "serve one pipeline stage (volunteer daemon)"),
    "train": (TrainerConfig, cmd_train, "drive micro-batches through the swarm"),
    "coordinator": (CoordinatorConfig, cmd_coordinator, "bootstrap the DHT, publish the spec, serve the dashboard"),
    "demo": (DemoConfig, cmd_demo, "run a whole swarm on 127.0.0.1 and train it"),
    "status": (StatusConfig, cmd_status, "show the swarm as a table, read from the DHT"),
    "monitor": (MonitorConfig, cmd_monitor, "serve a health page of every trusted run in the swarm, read from the DHT"),
    "healthcheck": (HealthcheckConfig, cmd_healthcheck, "exit 0 when a peer or coordinator answers"),
    "export": (ExportConfig, cmd_export, "write a checkpoint as a Hugging Face model folder"),
    "tokenize": (TokenizeConfig, cmd_tokenize, "tokenize text into a token file for training"),
    "tiny-llama": (TinyLlamaConfig, cmd_tiny_llama, "make a small random Llama checkpoint and tokenizer, offline"),
    "identity": (IdentityConfig, cmd_identity, "print the peer id of a key file (for --allow-peers), creating it"),
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
        if isinstance(cfg, (CommonConfig, SwarmReaderConfig)):  # private swarms: token / allow-list / TLS
            from swarmpipe.peer.swarm.access import SwarmAccess, install_access

            install_access(SwarmAccess.from_config(cfg))
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
