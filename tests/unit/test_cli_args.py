"""swarmpipe.cli.args / swarmpipe.peer.config / swarmpipe.cli.main: flag > env > config file > default, and the parser."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from swarmpipe.cli import main as cli
from swarmpipe.cli.args import ENV_PREFIX, _convert, add_dataclass_flags, env_name, resolve
from swarmpipe.peer.config import (
    CommonConfig,
    CoordinatorConfig,
    DemoConfig,
    HealthcheckConfig,
    PeerConfig,
    StatusConfig,
    TrainerConfig,
)

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)


def toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return str(path)


# field, flag value (already typed, as argparse gives it), env text, TOML literal, value the TOML gives
CASES = [
    ("run_id", "flag-run", "env-run", '"file-run"', "file-run"),  # str
    ("port", 1111, "2222", "3333", 3333),  # int
    ("announce_period", 1.5, "2.5", "3.5", 3.5),  # float
    ("state_download", False, "0", "false", False),  # bool (default True)
    (
        "initial_peers",
        ["/ip4/1.1.1.1/tcp/1"],
        "/ip4/2.2.2.2/tcp/2,/ip4/2.2.2.3/tcp/3",
        '["/ip4/3.3.3.3/tcp/3"]',
        ["/ip4/3.3.3.3/tcp/3"],
    ),  # list
]
ENV_VALUE = {
    "run_id": "env-run",
    "port": 2222,
    "announce_period": 2.5,
    "state_download": False,
    "initial_peers": ["/ip4/2.2.2.2/tcp/2", "/ip4/2.2.2.3/tcp/3"],
}


@pytest.mark.parametrize("name, flag, env_text, toml_literal, file_value", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("table", [True, False], ids=["command-table", "top-level"])
def test_precedence(tmp_path: Path, name, flag, env_text, toml_literal, file_value, table: bool) -> None:
    default = getattr(PeerConfig(), name)
    text = f"[peer]\n{name} = {toml_literal}\n" if table else f"{name} = {toml_literal}\n"
    path = toml(tmp_path, text)
    env = {env_name(name): env_text}
    # default only
    assert getattr(resolve(PeerConfig, {}, env={}, file_section="peer"), name) == default
    # file beats default
    assert getattr(resolve(PeerConfig, {"config": path}, env={}, file_section="peer"), name) == file_value
    # env beats file
    assert getattr(resolve(PeerConfig, {"config": path}, env=env, file_section="peer"), name) == ENV_VALUE[name]
    # flag beats env and file
    assert getattr(resolve(PeerConfig, {"config": path, name: flag}, env=env, file_section="peer"), name) == flag
    # env beats default without a file
    assert getattr(resolve(PeerConfig, {}, env=env), name) == ENV_VALUE[name]


def test_bool_file_value_true_over_default_false(tmp_path: Path) -> None:
    path = toml(tmp_path, "[status]\njson = true\n")
    assert resolve(StatusConfig, {"config": path}, env={}, file_section="status").json is True
    assert resolve(StatusConfig, {"config": path}, env={"SWARMPIPE_JSON": "no"}, file_section="status").json is False
    assert resolve(StatusConfig, {"config": path, "json": False}, env={}, file_section="status").json is False


def test_flag_false_is_not_treated_as_missing() -> None:
    cfg = resolve(
        TrainerConfig, {"progress": False, "steps": 0, "data": ""}, env={"SWARMPIPE_STEPS": "9", "SWARMPIPE_DATA": "x"}
    )
    assert cfg.progress is False and cfg.steps == 0 and cfg.data == ""


def test_namespace_args() -> None:
    ns = argparse.Namespace(config=None, steps=7, progress=None)
    cfg = resolve(TrainerConfig, ns, env={"SWARMPIPE_PROGRESS": "off"})
    assert cfg.steps == 7 and cfg.progress is False


def test_config_path_from_env(tmp_path: Path) -> None:
    path = toml(tmp_path, "[train]\nsteps = 42\n")
    cfg = resolve(TrainerConfig, {}, env={"SWARMPIPE_CONFIG": path}, file_section="train")
    assert cfg.steps == 42


def test_command_table_and_other_tables(tmp_path: Path) -> None:
    path = toml(
        tmp_path,
        """
[peer]
stage = 1
[train]
steps = 5
""",
    )
    assert resolve(PeerConfig, {"config": path}, env={}, file_section="peer").stage == 1
    assert resolve(TrainerConfig, {"config": path}, env={}, file_section="train").steps == 5
    # a command without a table reads the top level, where other commands' tables are ignored
    assert resolve(DemoConfig, {"config": path}, env={}, file_section="demo") == DemoConfig()


def test_top_level_ignores_tables_without_section(tmp_path: Path) -> None:
    path = toml(tmp_path, "threads = 3\n[peer]\nstage = 1\n")
    cfg = resolve(PeerConfig, {"config": path}, env={})
    assert cfg.threads == 3 and cfg.stage == -1


def test_dashes_in_file_keys(tmp_path: Path) -> None:
    path = toml(tmp_path, '[peer]\ndht-port = 4444\nrun_id = "x"\n')
    cfg = resolve(PeerConfig, {"config": path}, env={}, file_section="peer")
    assert cfg.dht_port == 4444 and cfg.run_id == "x"


def test_unknown_key_in_config_file(tmp_path: Path) -> None:
    path = toml(tmp_path, "[peer]\nstage = 1\nstagee = 2\nzzz = 0\n")
    with pytest.raises(ValueError) as info:
        resolve(PeerConfig, {"config": path}, env={}, file_section="peer")
    assert "unknown option(s)" in str(info.value) and "stagee, zzz" in str(info.value)
    assert path in str(info.value)


def test_unknown_key_top_level(tmp_path: Path) -> None:
    path = toml(tmp_path, "steps = 1\n")  # a trainer option, not a peer option
    with pytest.raises(ValueError, match="unknown option.*steps"):
        resolve(PeerConfig, {"config": path}, env={}, file_section="peer")


def test_missing_config_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        resolve(PeerConfig, {"config": str(tmp_path / "nope.toml")}, env={})


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a,b,c", ["a", "b", "c"]),
        ("a b  c", ["a", "b", "c"]),
        (" a, b ,c ,, ", ["a", "b", "c"]),
        (
            "/ip4/1.2.3.4/tcp/5/p2p/Qm1\n/ip4/1.2.3.4/tcp/6/p2p/Qm2",
            ["/ip4/1.2.3.4/tcp/5/p2p/Qm1", "/ip4/1.2.3.4/tcp/6/p2p/Qm2"],
        ),
        ("", []),
        ("single", ["single"]),
    ],
)
def test_env_list_parsing(text: str, expected: list[str]) -> None:
    assert resolve(CommonConfig, {}, env={"SWARMPIPE_INITIAL_PEERS": text}).initial_peers == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        (" on ", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("off", False),
        ("", False),
    ],
)
def test_env_bool_parsing(text: str, expected: bool) -> None:
    assert resolve(TrainerConfig, {}, env={"SWARMPIPE_PROGRESS": text}).progress is expected


@pytest.mark.parametrize("text", ["maybe", "2", "tru", "enabled"])
def test_bad_env_bool_raises(text: str) -> None:
    with pytest.raises(ValueError) as info:
        resolve(TrainerConfig, {}, env={"SWARMPIPE_PROGRESS": text})
    assert "SWARMPIPE_PROGRESS" in str(info.value) and "expected a boolean" in str(info.value)
    assert repr(text) in str(info.value)


def test_bad_bool_in_config_file_raises(tmp_path: Path) -> None:
    path = toml(tmp_path, '[train]\nprogress = "sometimes"\n')
    with pytest.raises(ValueError, match="progress: expected a boolean"):
        resolve(TrainerConfig, {"config": path}, env={}, file_section="train")


def test_bad_int_env_raises() -> None:
    with pytest.raises(ValueError):
        resolve(PeerConfig, {}, env={"SWARMPIPE_STAGE": "one"})


def test_env_numbers() -> None:
    cfg = resolve(
        PeerConfig, {}, env={"SWARMPIPE_STAGE": "2", "SWARMPIPE_DRAIN_TIMEOUT": "1e-1", "SWARMPIPE_THREADS": " 3 "}
    )
    assert cfg.stage == 2 and cfg.drain_timeout == 0.1 and cfg.threads == 3


def test_process_environment_is_default_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMPIPE_RUN_ID", "from-os-env")
    assert resolve(PeerConfig, {}).run_id == "from-os-env"


def test_convert_helpers() -> None:
    assert _convert(["a", 1], [], "x") == ["a", "1"]
    assert _convert(True, False, "x") is True
    assert _convert("7", 0, "x") == 7 and _convert("7", 0.0, "x") == 7.0
    assert _convert(5, "", "x") == "5"
    assert env_name("initial_peers") == "SWARMPIPE_INITIAL_PEERS"


def test_list_defaults_are_not_shared() -> None:
    a, b = CommonConfig(), CommonConfig()
    a.initial_peers.append("x")
    assert b.initial_peers == []


def test_every_field_has_help() -> None:
    for cls in (PeerConfig, TrainerConfig, CoordinatorConfig, DemoConfig, StatusConfig, HealthcheckConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"


# ------------------------------------------------------------------ the parser


def test_parse_peer_flags() -> None:
    args = cli.build_parser().parse_args(["peer", "--stage", "1", "--port", "0"])
    assert args.command == "peer" and args.stage == 1 and args.port == 0
    assert args.run_id is None and args.state_download is None  # unset flags stay None
    cfg = resolve(PeerConfig, args, env={}, file_section="peer")
    assert cfg.stage == 1 and cfg.port == 0 and cfg.state_download is True


def test_parse_train_flags() -> None:
    args = cli.build_parser().parse_args(["train", "--steps", "5", "--no-progress"])
    cfg = resolve(TrainerConfig, args, env={}, file_section="train")
    assert cfg.steps == 5 and cfg.progress is False


def test_parse_list_and_config_flags(tmp_path: Path) -> None:
    path = toml(tmp_path, "[peer]\nport = 9\nstage = 0\n")
    args = cli.build_parser().parse_args(["peer", "--config", path, "--initial-peers", "/a", "/b", "--stage", "1"])
    cfg = resolve(PeerConfig, args, env={"SWARMPIPE_PORT": "8"}, file_section="peer")
    assert cfg.initial_peers == ["/a", "/b"] and cfg.stage == 1 and cfg.port == 8


def _flag_value(default):
    """A non-default command-line value for a field and what it should parse to."""
    if isinstance(default, bool):
        return (["--no-X"] if default else ["--X"]), (not default)
    if isinstance(default, list):
        return ["--X", "p1", "p2"], ["p1", "p2"]
    if isinstance(default, int):
        return ["--X", str(default + 3)], default + 3
    if isinstance(default, float):
        return ["--X", str(default + 0.25)], default + 0.25
    return ["--X", "some-value"], "some-value"


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_subcommand_parses_every_flag(command: str) -> None:
    cls = cli.COMMANDS[command][0]
    argv, expected = [command], {}
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        tokens, value = _flag_value(default)
        flag = f.name.replace("_", "-")
        argv += [t.replace("X", flag) for t in tokens]
        expected[f.name] = value
    args = cli.build_parser().parse_args(argv)
    assert args.command == command
    cfg = resolve(cls, args, env={}, file_section=command)
    for name, value in expected.items():
        assert getattr(cfg, name) == value, name


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_subcommand_defaults(command: str) -> None:
    cls = cli.COMMANDS[command][0]
    args = cli.build_parser().parse_args([command])
    assert resolve(cls, args, env={}, file_section=command) == cls()


def test_parser_requires_a_command_and_rejects_unknown_flags(capsys) -> None:
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args([])
    with pytest.raises(SystemExit):
        parser.parse_args(["peer", "--steps", "3"])  # a trainer flag
    with pytest.raises(SystemExit):
        parser.parse_args(["peer", "--stage", "one"])


def test_add_dataclass_flags_standalone() -> None:
    @dataclasses.dataclass
    class Small:
        name: str = "n"
        count: int = 1
        ratio: float = 0.5
        on: bool = False
        items: list = dataclasses.field(default_factory=list)

    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, Small)
    args = parser.parse_args(["--count", "4", "--on", "--items", "a", "--ratio", "2"])
    assert resolve(Small, args, env={}) == Small(count=4, ratio=2.0, on=True, items=["a"])


def test_main_reports_bad_config_with_exit_code_2(tmp_path: Path, capsys) -> None:
    path = toml(tmp_path, "[healthcheck]\nbogus = 1\n")
    assert cli.main(["healthcheck", "--config", path]) == 2
    err = capsys.readouterr().err
    assert "swarmpipe healthcheck:" in err and "bogus" in err


def test_main_reports_bad_env_bool(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("SWARMPIPE_JSON", "perhaps")
    assert cli.main(["status"]) == 2
    assert "expected a boolean" in capsys.readouterr().err
