"""Warm-started roles (swarmpipe/cli/warm_start.py) behave as processes started cold: their own session, log,
environment and exit code, real signals, fresh random state; and a cold start is still one flag away."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from swarmpipe.cli.launcher import ProcessGroup, wait_for
from swarmpipe.cli.warm_start import WarmProcess, WarmStarter

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def starter(tmp_path_factory: pytest.TempPathFactory):
    starter = WarmStarter(tmp_path_factory.mktemp("warm") / "server.log")
    yield starter
    starter.close()
    assert starter._server.returncode == 0


def test_a_role_gets_its_own_session_log_environment_and_exit_code(starter: WarmStarter, tmp_path: Path) -> None:
    log = tmp_path / "role.log"
    # an unknown flag: argparse prints to stderr and exits 2, as it would cold
    proc = starter.start(["peer", "--no-such-flag"], {**os.environ, "SWARMPIPE_PROBE": "x"}, log)
    assert proc.wait(60) == 2
    assert "unrecognized arguments: --no-such-flag" in log.read_text()
    # a role that runs: its own session (pid == session id), the environment it was given, stdout in its log
    log = tmp_path / "identity.log"
    proc = starter.start(["identity", "--identity", str(tmp_path / "key")], {**os.environ, "SWARMPIPE_PROBE": "y"}, log)
    assert proc.wait(60) == 0, log.read_text()
    assert "peer id: " in log.read_text()


def test_signals_reach_the_role_and_its_code_says_so(starter: WarmStarter, tmp_path: Path) -> None:
    """A coordinator (it serves until told to stop): SIGSTOP/SIGCONT/SIGKILL on its process group, -9 back."""
    log = tmp_path / "coordinator.log"
    ready = tmp_path / "peers.txt"
    proc = starter.start(
        ["coordinator", "--host", "127.0.0.1", "--http-port", "0", "--peers-file", str(ready)], dict(os.environ), log
    )
    wait_for(ready.exists, 60, "the warm coordinator to serve")
    assert os.getsid(proc.pid) == proc.pid, "its own session, as start_new_session gives a cold one"
    os.killpg(proc.pid, signal.SIGSTOP)
    os.killpg(proc.pid, signal.SIGCONT)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(20) == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        WarmProcess(starter, 2**22 + 12345).wait(0.1)  # a pid it never started never ends


def test_forked_roles_do_not_share_random_state(starter: WarmStarter, tmp_path: Path) -> None:
    keys = []
    for i in range(2):
        key = tmp_path / f"key{i}"
        assert (
            starter.start(["identity", "--identity", str(key)], dict(os.environ), tmp_path / f"id{i}.log").wait(60) == 0
        )
        keys.append(key.read_bytes())
    assert keys[0] != keys[1]


def test_the_launcher_starts_cold_when_warm_starts_are_off(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SWARMPIPE_WARM_START", "0")
    group = ProcessGroup(tmp_path)
    launched = group.start("cold", "peer", "--no-such-flag")
    assert isinstance(launched.proc, subprocess.Popen)
    assert launched.proc.wait(60) == 2


WRAPPER = """
import os, sys
from swarmpipe.cli.main import main
print("wrapper argv:", sys.argv[1:3], "net:", os.readlink("/proc/self/ns/net"), flush=True)
sys.exit(main(sys.argv[sys.argv.index("swarmpipe.cli.main") + 1 :]))
"""


def test_a_wrapper_script_and_a_network_namespace_run_warm_as_their_prefix_would(
    starter: WarmStarter, tmp_path: Path
) -> None:
    """``python SCRIPT ARGS`` runs the script as __main__ with the argv it would have had cold; ``ip netns exec NS``
    puts the role in that namespace; both together as the relayed tests use them; other prefixes start cold."""
    import shutil
    import sys

    from swarmpipe.cli import warm_start

    script = tmp_path / "wrapper.py"
    script.write_text(WRAPPER)
    wrapper = [sys.executable, str(script), "MODE", "--"]
    assert warm_start.takes(wrapper) and warm_start.takes(["ip", "netns", "exec", "ns", *wrapper])
    assert not warm_start.takes(["taskset", "-c", "0"]) and not warm_start.takes(["/usr/bin/env", str(script)])
    with pytest.raises(ValueError, match="start it cold"):
        starter.start(["identity"], dict(os.environ), tmp_path / "x.log", ["taskset", "-c", "0"])

    log = tmp_path / "wrapped.log"
    proc = starter.start(["identity", "--identity", str(tmp_path / "k1")], dict(os.environ), log, wrapper)
    assert proc.wait(60) == 0, log.read_text()
    own_net = os.readlink("/proc/self/ns/net")
    assert f"wrapper argv: ['MODE', '--'] net: {own_net}" in log.read_text()
    assert "peer id: " in log.read_text()

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    name = f"warm{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        inode = os.stat(f"/var/run/netns/{name}").st_ino
        log = tmp_path / "netns.log"
        prefix = ["ip", "netns", "exec", name, *wrapper]
        proc = starter.start(["identity", "--identity", str(tmp_path / "k2")], dict(os.environ), log, prefix)
        assert proc.wait(60) == 0, log.read_text()
        assert f"net: net:[{inode}]" in log.read_text()
        log = tmp_path / "missing.log"  # a namespace that is gone: the role fails with the reason, the server goes on
        proc = starter.start(["identity"], dict(os.environ), log, ["ip", "netns", "exec", f"{name}-gone"])
        assert proc.wait(60) == 1 and "No such file" in log.read_text()
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
