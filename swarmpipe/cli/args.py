"""Flags from dataclasses: one source of truth for CLI, environment, config files and tests.

Precedence, highest first: command-line flag, ``SWARMPIPE_<FLAG>`` environment
variable, ``--config FILE`` (TOML, the command's table or top level), the
dataclass default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from typing import Any, TypeVar

import tomllib

T = TypeVar("T")
ENV_PREFIX = "SWARMPIPE_"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _convert(raw: Any, default: Any, name: str) -> Any:
    """Turn a string (env) or TOML value into the field's type."""
    if isinstance(default, bool):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{name}: expected a boolean, got {raw!r}")
    if isinstance(default, list):
        if isinstance(raw, list):
            return [str(v) for v in raw]
        return [part for part in str(raw).replace(",", " ").split() if part]
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    return str(raw)


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    parser.add_argument("--config", default=None, help="TOML file with these options")
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        help_text = f.metadata.get("help", "") + f" [env {env_name(f.name)}]"
        if isinstance(default, bool):
            parser.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=help_text)
        elif isinstance(default, list):
            parser.add_argument(flag, dest=f.name, default=None, nargs="*", help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, default=None, type=type(default), help=help_text)


def resolve(
    cls: type[T],
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    file_section: str | None = None,
) -> T:
    """Build ``cls`` from flags, environment, an optional ``config`` file, and defaults."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    env = os.environ if env is None else env
    file_values: dict[str, Any] = {}
    config_path = given.get("config") or env.get(ENV_PREFIX + "CONFIG")
    if config_path:
        with open(config_path, "rb") as fh:
            data = tomllib.load(fh)
        section = data.get(file_section, data) if file_section else data
        file_values = {k.replace("-", "_"): v for k, v in section.items() if not isinstance(v, dict)}
    names = {f.name for f in dataclasses.fields(cls)}
    if config_path:  # [transport]: the data path's options (route = "chain" | "hub"), for the roles that have them
        shared = data.get("transport") if isinstance(data.get("transport"), dict) else {}
        file_values = {**{k: v for k, v in shared.items() if k in names}, **file_values}
    unknown = set(file_values) - names
    if unknown:
        raise ValueError(f"unknown option(s) in {config_path}: {', '.join(sorted(unknown))}")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if given.get(f.name) is not None:
            values[f.name] = given[f.name]
        elif env_name(f.name) in env:
            values[f.name] = _convert(env[env_name(f.name)], default, env_name(f.name))
        elif f.name in file_values:
            values[f.name] = _convert(file_values[f.name], default, f"{config_path}:{f.name}")
    return cls(**values)
