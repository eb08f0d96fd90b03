"""swarmpipe.peer.spec: defaults, TOML loading with overrides, validation errors, dict round trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from swarmpipe.peer.spec import OPTIONAL_AT_DEFAULT, SCHEMA_VERSION, RunSpec, SpecError, load_spec, spec_from_dict
from swarmpipe.peer.transport import codecs

pytestmark = pytest.mark.unit


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return path


def test_defaults_validate() -> None:
    spec = RunSpec().validate()
    assert spec.schema_version == SCHEMA_VERSION
    assert sum(spec.blocks_per_stage()) == spec.model.n_layers
    assert load_spec() == spec


def test_even_split_and_block_ranges() -> None:
    spec = spec_from_dict({"num_stages": 3, "model": {"n_layers": 4}})
    assert spec.blocks_per_stage() == [2, 1, 1]
    assert [list(spec.block_range(s)) for s in range(3)] == [[0, 1], [2], [3]]


def test_explicit_layer_split() -> None:
    spec = spec_from_dict({"num_stages": 2, "layer_split": [3, 1]})
    assert spec.blocks_per_stage() == [3, 1]
    assert list(spec.block_range(1)) == [3]


def test_toml_load_with_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
run_id = "from-file"
num_stages = 4
microbatch_size = 8

[model]
d_model = 64
n_heads = 2

[optimizer]
kind = "nesterov"
lr = 0.01
betas = [0.8, 0.95]
stash = false

[compression]
activations = "blockwise8"
""",
    )
    spec = load_spec(path, run_id="override", num_stages=2, seed=None)
    assert spec.run_id == "override"
    assert spec.num_stages == 2  # override wins over the file
    assert spec.microbatch_size == 8
    assert spec.seed == 0  # None overrides are ignored
    assert spec.model.d_model == 64 and spec.model.n_heads == 2
    assert spec.optimizer.kind == "nesterov" and spec.optimizer.lr == 0.01
    assert spec.optimizer.betas == (0.8, 0.95)
    assert spec.optimizer.stash is False
    assert spec.compression.activations == "blockwise8"
    assert spec.compression.gradients == "fp16"  # untouched default


def test_int_field_given_as_float_in_toml_is_coerced_and_float_field_accepts_int(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, "[optimizer]\nlr = 1\n"))
    assert isinstance(spec.optimizer.lr, float) and spec.optimizer.lr == 1.0


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"bogus": 1}, "unknown field(s) in spec: bogus"),
        ({"model": {"d_modle": 64}}, "unknown field(s) in model: d_modle"),
        ({"optimizer": {"a": 1, "b": 2}}, "optimizer: a, b"),
    ],
)
def test_unknown_field(data: dict, needle: str) -> None:
    with pytest.raises(SpecError) as info:
        spec_from_dict(data)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"num_stages": "two"}, "num_stages must be a number"),
        ({"num_stages": True}, "num_stages must be a number"),
        ({"model": {"d_model": "big"}}, "model.d_model must be a number"),
        ({"optimizer": {"lr": "fast"}}, "optimizer.lr must be a number"),
        ({"optimizer": {"stash": 1}}, "optimizer.stash must be a boolean"),
        ({"model": 5}, "model must be a table, got int"),
    ],
)
def test_wrong_type(data: dict, needle: str) -> None:
    with pytest.raises(SpecError) as info:
        spec_from_dict(data)
    assert needle in str(info.value)


def test_wrong_type_in_toml_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="update.max_staleness must be a number"):
        load_spec(write(tmp_path, '[update]\nmax_staleness = "many"\n'))


def test_not_a_table_at_top_level() -> None:
    with pytest.raises(SpecError, match="spec must be a table"):
        spec_from_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "data",
    [
        {"num_stages": 2, "layer_split": [1, 1]},  # sums to 2, not 4
        {"num_stages": 2, "layer_split": [4]},  # wrong number of stages
        {"num_stages": 3, "layer_split": [5, -1, 0]},  # negative count
        {"num_stages": 2, "layer_split": [2, 1, 1]},
    ],
)
def test_bad_split(data: dict) -> None:
    with pytest.raises(SpecError, match="does not split 4 blocks into"):
        spec_from_dict(data)


def test_zero_stages() -> None:
    with pytest.raises(SpecError, match="num_stages must be within 1..256"):
        spec_from_dict({"num_stages": 0})


def test_heads_must_divide_d_model() -> None:
    with pytest.raises(SpecError, match="not divisible by n_heads"):
        spec_from_dict({"model": {"d_model": 30, "n_heads": 4}})


@pytest.mark.parametrize("role", ["activations", "gradients", "state"])
def test_unknown_codec(role: str) -> None:
    with pytest.raises(SpecError) as info:
        spec_from_dict({"compression": {role: "zstd"}})
    message = str(info.value)
    assert "codec 'zstd' cannot be used" in message and role in message
    assert all(codec in message for codec in codecs.allowed_in_spec(role))


def test_state_codec_cannot_be_auto() -> None:
    """State moves once per join over DownloadState, with no link measurement to choose from: "auto"
    there used to pass validation and make every donor's export fail, so joiners fell back to the seed."""
    with pytest.raises(SpecError, match="'auto' cannot be used for state"):
        spec_from_dict({"compression": {"state": "auto"}})
    for role in ("activations", "gradients"):
        assert getattr(spec_from_dict({"compression": {role: "auto"}}).compression, role) == "auto"


def test_every_registered_codec_is_valid_in_the_spec() -> None:
    for name in codecs.REGISTRY:
        spec_from_dict({"compression": {"activations": name, "gradients": name, "state": name}})


def test_unknown_optimizer_kind() -> None:
    with pytest.raises(SpecError, match="unknown optimizer kind 'sgd'"):
        spec_from_dict({"optimizer": {"kind": "sgd"}})


@pytest.mark.parametrize("data", [{"microbatch_size": 0}, {"update": {"step_every": 0}}])
def test_counts_must_be_positive(data: dict) -> None:
    with pytest.raises(SpecError, match=">= 1"):
        spec_from_dict(data)


@pytest.mark.parametrize("version", [0, SCHEMA_VERSION + 1, 99])
def test_unknown_schema_version(version: int) -> None:
    with pytest.raises(SpecError) as info:
        spec_from_dict({"schema_version": version})
    assert f"schema version {version} is not supported" in str(info.value)
    assert str(SCHEMA_VERSION) in str(info.value)


def test_unknown_schema_version_in_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="schema version 7"):
        load_spec(write(tmp_path, "schema_version = 7\n"))


def test_spec_error_is_a_value_error() -> None:
    assert issubclass(SpecError, ValueError)


def test_round_trip_default() -> None:
    spec = RunSpec()
    assert spec_from_dict(spec.to_dict()) == spec


def test_round_trip_customised() -> None:
    spec = RunSpec(run_id="r", num_stages=3, layer_split=[2, 1, 1], seed=5)
    spec.model.d_model = 64
    spec.optimizer.kind = "basis_rotation"
    spec.optimizer.betas = (0.5, 0.75)
    spec.optimizer.stash = False
    spec.update.max_staleness = 3
    spec.compression.gradients = "uint8"
    spec.limits.max_message_mb = 8
    spec.validate()
    data = spec.to_dict()
    assert isinstance(data["model"], dict) and data["layer_split"] == [2, 1, 1]
    back = spec_from_dict(data)
    assert back == spec
    assert back.to_dict() == data


def test_fields_newer_than_deployed_peers_are_left_out_at_their_default() -> None:
    """A peer of the version before ``rotation_factor_dtype`` refuses unknown fields: a spec that keeps the
    default must not carry it (so mixed versions share a swarm); one that sets it must (and is refused there)."""
    spec = RunSpec()
    data = spec.to_dict()
    assert "rotation_factor_dtype" not in data["optimizer"] and "rotation_max_dim" in data["optimizer"]
    assert spec_from_dict(data).optimizer.rotation_factor_dtype == "float32"
    older_fields = set(dataclasses.asdict(spec)["optimizer"]) - set(OPTIONAL_AT_DEFAULT["optimizer"])
    assert set(data["optimizer"]) == older_fields
    spec.optimizer.rotation_factor_dtype = "bfloat16"
    data = spec.to_dict()
    assert data["optimizer"]["rotation_factor_dtype"] == "bfloat16" and spec_from_dict(data) == spec
    for table, fields in OPTIONAL_AT_DEFAULT.items():  # the recorded defaults are the dataclasses' own
        assert {k: v for k, v in dataclasses.asdict(RunSpec())[table].items() if k in fields} == fields


def test_round_trip_through_msgpack_turns_tuples_into_lists() -> None:
    msgpack = pytest.importorskip("msgpack")
    spec = RunSpec(run_id="wire")
    data = msgpack.unpackb(msgpack.packb(spec.to_dict()))
    assert isinstance(data["optimizer"]["betas"], list)
    assert spec_from_dict(data) == spec


# --- wrong types in list / tuple / string fields -------------------------------------------
# _build converts these with int()/float()/str() without checking, so a malformed spec (from a
# TOML file or from the DHT) escapes as TypeError / plain ValueError or is silently accepted.


@pytest.mark.parametrize("data", [{"layer_split": 5}, {"optimizer": {"betas": 0.9}}])
def test_non_list_for_list_field_raises_spec_error(data: dict) -> None:
    with pytest.raises(SpecError):
        spec_from_dict(data)


def test_non_numeric_list_elements_raise_spec_error() -> None:
    with pytest.raises(SpecError):
        spec_from_dict({"layer_split": ["a", "b"]})


def test_betas_must_have_two_values() -> None:
    with pytest.raises(SpecError):
        spec_from_dict({"optimizer": {"betas": [0.9, 0.99, 0.5]}})


def test_table_for_string_field_raises_spec_error() -> None:
    with pytest.raises(SpecError):
        spec_from_dict({"run_id": {"x": 1}})


def test_retired_checkpoint_every_is_accepted_and_ignored(caplog) -> None:
    """It never did anything (the coordinator's --checkpoint-every counts seconds); a spec published by an
    older coordinator still carries it and must still load."""
    spec = spec_from_dict({"checkpoint_every": 100, "num_stages": 3})
    assert spec.num_stages == 3 and not hasattr(spec, "checkpoint_every")
    assert "retired field(s) checkpoint_every" in caplog.text


@pytest.mark.parametrize(
    "section, field, value, words",
    [
        ("optimizer", "lr", 1000.0, "lr must be in"),
        ("optimizer", "lr", -1.0, "lr must be in"),
        ("optimizer", "betas", (0.9, 1.5), "betas in [0, 1)"),
        ("limits", "max_stream_mb", 1 << 20, "limits.max_stream_mb"),
        ("limits", "max_message_mb", 4096, "limits.max_message_mb"),
        ("limits", "max_tensor_elements", 0, "limits must be >= 1"),
        ("model", "d_model", 1 << 20, "model.d_model"),
        ("model", "vocab_size", 1 << 30, "model.vocab_size"),
    ],
)
def test_a_spec_from_the_swarm_must_stay_within_sane_bounds(section, field, value, words) -> None:
    """A spec arrives over the DHT: even a signed one may not ask a volunteer for absurd limits."""
    spec = RunSpec()
    setattr(getattr(spec, section), field, value)
    with pytest.raises(SpecError) as info:
        spec.validate()
    assert words in str(info.value)


@pytest.mark.parametrize("run_id", ["", "a" * 129, "has space", "slash/y", "emoji-\u2603"])
def test_run_ids_are_short_plain_names(run_id) -> None:
    with pytest.raises(SpecError, match="run_id must be"):
        RunSpec(run_id=run_id).validate()


def test_too_many_stages() -> None:
    with pytest.raises(SpecError, match="num_stages must be within"):
        RunSpec(num_stages=257).validate()
