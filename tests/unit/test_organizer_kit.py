"""The organizer's kit (deploy/public/) says what the roles understand: every SWARMPIPE_* variable its services and
units set is a flag of the role they run, the ports it publishes are the fixed ones it configures, the state that
must survive a restart lives on a volume, and every service restarts on failure. (A flag renamed in peer/config.py
would otherwise leave the kit silently running with a default.)"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from swarmpipe.cli.args import env_name
from swarmpipe.peer.config import CoordinatorConfig, MonitorConfig

yaml = pytest.importorskip("yaml")
pytestmark = pytest.mark.unit
KIT = Path(__file__).resolve().parents[2] / "deploy" / "public"
ROLES = {"coordinator": CoordinatorConfig, "monitor": MonitorConfig}
# read by deploy/entrypoint.sh, not by a role
ENTRYPOINT_VARIABLES = {"SWARMPIPE_PEERS_FILE", "SWARMPIPE_PEERS_FILE_WAIT", "SWARMPIPE_INITIAL_PEERS"}


def _flags(cls: type) -> set[str]:
    return {env_name(f.name) for f in dataclasses.fields(cls)}


def test_the_compose_services_set_only_flags_their_role_has_and_keep_state_on_volumes() -> None:
    compose = yaml.safe_load((KIT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"coordinator", "monitor", "https"} <= set(services)
    for name, role in ROLES.items():
        service = services[name]
        assert service["command"] == [name] and service["restart"] == "unless-stopped"
        unknown = (
            {k for k in service["environment"] if k.startswith("SWARMPIPE_")} - _flags(role) - ENTRYPOINT_VARIABLES
        )
        assert not unknown, f"{name}: {unknown} are not flags of swarmpipe {name}"
        assert "healthcheck" in service["healthcheck"]["test"]
    coordinator = services["coordinator"]["environment"]
    published = {p.split(":")[-1] for p in services["coordinator"]["ports"]}
    assert {coordinator["SWARMPIPE_DHT_PORT"], coordinator["SWARMPIPE_GRPC_PORT"], "8080"} <= published
    for path in (coordinator["SWARMPIPE_IDENTITY"], coordinator["SWARMPIPE_CHECKPOINT_DIR"]):
        assert any(v.split(":")[1] == "/data" for v in services["coordinator"]["volumes"]) and path.startswith("/data/")
    assert services["https"]["profiles"] == ["tls"]  # plain `up` needs nothing but the swarmpipe image


def test_the_systemd_units_set_only_flags_their_role_has() -> None:
    for name, role in ROLES.items():
        unit = (KIT / "systemd" / f"swarmpipe-{name}.service").read_text()
        assert f"swarmpipe {name}" in unit and "Restart=on-failure" in unit
        variables = set(re.findall(r"\b(SWARMPIPE_[A-Z_]+)=", unit))
        assert not variables - _flags(role) - ENTRYPOINT_VARIABLES, (name, variables - _flags(role))
