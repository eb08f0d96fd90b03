"""swarmpipe.peer.swarm.bootstrap: initial peers from flags or the shipped list, and which run to join."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmpipe.peer.swarm import bootstrap
from swarmpipe.peer.swarm.bootstrap import bootstrap_peers, neediest_run, resolve_initial_peers
from swarmpipe.peer.swarm.records import RunIndexRecord, StageRecord

pytestmark = pytest.mark.unit

_port = iter(range(2000, 60000))


def rec(throughput: float = 1.0, state: str = "online") -> StageRecord:
    return StageRecord(
        address=f"10.0.0.2:{next(_port)}", state=state, throughput=throughput, queue=0, version=0, updated_at=0.0
    )


def run(run_id: str, num_stages: int = 2) -> RunIndexRecord:
    return RunIndexRecord(run_id=run_id, num_stages=num_stages, updated_at=0.0)


@pytest.fixture
def shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the shipped bootstrap lists at a temporary package folder."""
    (tmp_path / "bootstrap").mkdir()
    monkeypatch.setattr(bootstrap.resources, "files", lambda package: tmp_path)
    return tmp_path / "bootstrap"


def test_explicit_list_wins() -> None:
    peers = ["/ip4/1.2.3.4/tcp/31337/p2p/QmA", "/ip4/1.2.3.5/tcp/31337/p2p/QmB"]
    assert resolve_initial_peers(peers, "public") == peers
    assert resolve_initial_peers(peers, "no-such-swarm") == peers  # the list is never read
    assert resolve_initial_peers(tuple(peers), "public") == peers


def test_shipped_public_list_is_empty_and_error_is_helpful() -> None:
    assert bootstrap_peers("public") == []  # only comments are shipped
    with pytest.raises(ValueError) as info:
        resolve_initial_peers([], "public")
    text = str(info.value)
    assert "'public'" in text and "empty" in text
    assert "--initial-peers" in text and "SWARMPIPE_INITIAL_PEERS" in text
    # ... and how to start a swarm of one's own: a coordinator with a stable identity and port, or the demo
    assert "swarmpipe coordinator" in text and "--identity" in text and "--dht-port" in text
    assert "swarmpipe demo" in text


def test_unknown_swarm() -> None:
    with pytest.raises(ValueError) as info:
        resolve_initial_peers([], "atlantis")
    assert "no bootstrap list is shipped for swarm 'atlantis'" in str(info.value)
    assert "--initial-peers" in str(info.value) and "swarmpipe coordinator" in str(info.value)


def test_shipped_list_parsing(shipped: Path) -> None:
    lines = [
        "# header comment",
        "/ip4/10.0.0.1/tcp/1/p2p/QmA",
        "",
        "   /ip4/10.0.0.2/tcp/2/p2p/QmB   ",
        "   # indented comment",
        "",
    ]
    (shipped / "lab.txt").write_text("\n".join(lines))
    assert bootstrap_peers("lab") == ["/ip4/10.0.0.1/tcp/1/p2p/QmA", "/ip4/10.0.0.2/tcp/2/p2p/QmB"]
    assert resolve_initial_peers([], "lab") == ["/ip4/10.0.0.1/tcp/1/p2p/QmA", "/ip4/10.0.0.2/tcp/2/p2p/QmB"]


def test_shipped_list_only_blank_lines(shipped: Path) -> None:
    (shipped / "blank.txt").write_text("\n\n   \n")
    with pytest.raises(ValueError, match="bootstrap list of swarm 'blank' is empty"):
        resolve_initial_peers([], "blank")


def test_unknown_swarm_with_patched_package(shipped: Path) -> None:
    with pytest.raises(ValueError, match="no bootstrap list is shipped"):
        bootstrap_peers("missing")


def test_an_organizers_list_by_path_or_by_name_in_the_swarms_folder(tmp_path: Path, monkeypatch) -> None:
    """A volunteer joins with nothing but --swarm: a list file given by path, or <name>.txt in
    $SWARMPIPE_SWARMS_DIR (a folder mounted into a container), before the shipped lists."""
    folder = tmp_path / "swarms"
    folder.mkdir()
    (folder / "public.txt").write_text(
        "# the organizers' nodes\n/ip4/1.2.3.4/tcp/31337/p2p/QmA\n/ip4/5.6.7.8/tcp/31337/p2p/QmB\n"
    )
    monkeypatch.setenv("SWARMPIPE_SWARMS_DIR", str(folder))
    assert bootstrap_peers("public") == ["/ip4/1.2.3.4/tcp/31337/p2p/QmA", "/ip4/5.6.7.8/tcp/31337/p2p/QmB"]
    assert bootstrap_peers(str(folder / "public.txt")) == bootstrap_peers("public")
    monkeypatch.delenv("SWARMPIPE_SWARMS_DIR")
    assert bootstrap_peers("public") == []  # the shipped one again
    with pytest.raises(ValueError, match=r"the bootstrap list .*nowhere.txt cannot be read"):
        bootstrap_peers(str(tmp_path / "nowhere.txt"))


# ------------------------------------------------------------------ neediest_run


def test_no_runs() -> None:
    with pytest.raises(LookupError, match="lists no runs"):
        neediest_run({}, {})


def test_single_run() -> None:
    assert neediest_run({"a": run("a")}, {"a": [{"p": rec()}, {"q": rec()}]}) == "a"


def test_run_with_fewest_peers_on_thinnest_stage() -> None:
    runs = {"a": run("a"), "b": run("b")}
    stages_of = {
        "a": [{"p1": rec(), "p2": rec()}, {"p3": rec()}],  # thinnest: 1 peer
        "b": [{"q1": rec(), "q2": rec()}, {"q3": rec(), "q4": rec()}],  # thinnest: 2 peers
    }
    assert neediest_run(runs, stages_of) == "a"


def test_run_without_any_peers_is_neediest() -> None:
    runs = {"a": run("a"), "b": run("b", num_stages=3)}
    stages_of = {"a": [{"p": rec()}, {"q": rec()}]}  # b never seen: every stage empty
    assert neediest_run(runs, stages_of) == "b"


def test_draining_peers_do_not_count() -> None:
    runs = {"a": run("a"), "b": run("b")}
    stages_of = {
        "a": [{"p1": rec(), "p2": rec(state="draining")}, {"p3": rec()}],  # 1 live on each stage
        "b": [{"q1": rec(), "q2": rec()}, {"q3": rec(), "q4": rec(state="draining"), "q5": rec()}],
    }
    assert neediest_run(runs, stages_of) == "a"
    stages_of["b"][0]["q1"] = rec(state="draining")
    stages_of["b"][0]["q2"] = rec(state="draining")
    assert neediest_run(runs, stages_of) == "b"  # 0 live on b's stage 0


def test_tie_on_peers_broken_by_throughput_then_run_id() -> None:
    runs = {"a": run("a"), "b": run("b"), "c": run("c")}
    stages_of = {
        "a": [{"p": rec(5.0)}, {"q": rec(5.0)}],
        "b": [{"p": rec(2.0)}, {"q": rec(9.0)}],  # thinnest (first of the 1-peer stages) has 2.0
        "c": [{"p": rec(5.0)}, {"q": rec(5.0)}],
    }
    assert neediest_run(runs, stages_of) == "b"
    stages_of["b"] = [{"p": rec(5.0)}, {"q": rec(5.0)}]
    assert neediest_run(runs, stages_of) == "a"  # full tie: smallest run id
