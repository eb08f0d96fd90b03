"""A 2x2 swarm with a Byzantine replica on each stage: trainers catch and ban both, and training ends as well as an
honest run of the same length.

The liars are real peer processes (tests/byzantine_peer.py) that answer training calls wrongly and forward-only
calls honestly: stage 0's adds noise as large as its outputs, stage 1's (the last) flips the sign of the input
gradients it returns. The trainer checks half of the micro-batches per stage (a test setting: the default is
5 %) and bans after three failed checks (the default).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from swarm_support import Swarm, events_of

from swarmpipe.cli.launcher import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STEPS = 400  # long enough for a liar to come back from its 2 s call-failure backoff and fail again
LIAR = [sys.executable, str(Path(__file__).resolve().parents[1] / "byzantine_peer.py")]
TRAINER_ARGS = (
    "--eval-every",
    str(STEPS),
    "--eval-batches",
    "4",
    "--verify-fraction",
    "0.5",
    "--verify-ban-after",
    "3",
)


def _train(swarm: Swarm, liars: dict[int, str]) -> tuple[dict, list[dict]]:
    """Coordinator, two replicas per stage (a liar where ``liars`` names a mode), one trainer; its report and the
    ready files of the liars."""
    swarm.start_coordinator(swarm.write_spec(top="averaging_interval_s = 0.0"))
    peers, liar_peers = [], []
    for stage in (0, 0, 1, 1):
        mode = liars.get(stage) if stage not in [s for s, _ in liar_peers] else None
        launched = swarm.start_peer(stage, wait=False, prefix=[*LIAR, mode, "--"] if mode else None)
        peers.append(launched)
        if mode:
            liar_peers.append((stage, launched))
    for p in peers:
        swarm.wait_ready(p)
    trainer, report_path = swarm.start_trainer(STEPS, *TRAINER_ARGS)
    report = swarm.wait_report(trainer, report_path, timeout=400)
    assert trainer.proc.returncode == 0, trainer.log_text()[-3000:]
    return report, [swarm.wait_ready(p) for _, p in liar_peers]


def test_byzantine_replicas_are_banned_and_training_matches_an_honest_run(tmp_path: Path) -> None:
    honest_swarm = Swarm(tmp_path / "honest")
    try:
        honest, _ = _train(honest_swarm, {})
    finally:
        honest_swarm.stop()
    # Honest replicas are never banned. A stray failed check is possible (0 to 3 in about 400 judged checks in
    # these runs, at most one per replica, the most on a loaded machine: a young run's weights move fast between
    # an answer and its check); bans need three, most of a replica's last ten judged checks failed.
    verification = honest["verification"]
    assert not verification["banned"] and verification["strikes"] <= 0.02 * verification["checks"], verification

    swarm = Swarm(tmp_path / "byzantine")
    try:
        report, liars = _train(swarm, {0: "noise", 1: "flip"})
        liar_ids = {info["peer_id"] for info in liars}
        assert set(report["verification"]["banned"]) == liar_ids, report["verification"]
        banned = {e["peer"]: e for e in events_of(swarm, "replica_banned")}
        assert len(banned) == 2
        reports = wait_for(
            lambda: events_of(swarm, "replica_reported") if len(events_of(swarm, "replica_reported")) >= 2 else None,
            30,
            "the coordinator to report both bans",
        )
        assert {e["peer"] for e in reports} == liar_ids
        api = swarm.api()
        flagged = {p["peer_id"] for s in api["stages"] for p in s["peers"] if p.get("reported_by", 0) > 0}
        assert flagged == liar_ids
        # Bounded exposure: a liar applied a fraction of its honest sibling's updates before its ban
        for stage in api["stages"]:
            versions = {p["peer_id"] in liar_ids: p["version"] for p in stage["peers"]}
            assert versions[True] < 0.5 * versions[False], (stage["index"], versions)
    finally:
        swarm.stop()
    assert report["microbatches_lost"] == 0, report
    assert report["val_loss"] <= honest["val_loss"] * 1.05, (report["val_loss"], honest["val_loss"])
