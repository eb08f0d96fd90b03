"""Fault injection on the Compose deployment: one fault, its recovery, then the invariants.

Every scenario brings up its own Compose project (coordinator, 2 stages x 2
replicas, tiny model), starts the trainer once every peer serves, injects its
fault mid-training, times the recovery, and checks at the end, from the
trainer's JSON report and the coordinator's /api/swarm:
  * training progressed: every micro-batch ended (completed or dropped stale), the trainer exited 0;
  * the loss fell (last 10 micro-batches' mean below 85 % of the first 10's);
  * microbatches_lost == 0;
  * every surviving peer is listed online with a fresh record; killed peers are gone;
  * the recovery happened within the bound the scenario states.
Soft check (a warning in the verdict unless SWARMPIPE_COMPOSE_STRICT=1): a healed or
replacement peer gets work from the trainer again within 90 s.
Replicas: 2 per stage, so a stage keeps a live replica while the other one is faulted.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from compose_harness import HarnessError, wait_until
from fault_checks import (
    bring_up,
    finish_training,
    healed_while_training,
    progress_during,
    start_training,
    wait_listed,
    wait_takes_work,
)

pytestmark = [pytest.mark.compose, pytest.mark.slow]


# ---------------------------------------------------------------- 1
@pytest.mark.timeout(900)
def test_kill_and_replace(scenario):
    sc = scenario("kill-replace", "docker kill a stage-0 replica mid-training, then start a replacement")
    st = sc.stack
    bring_up(sc)
    victim = st.ids("peer0")[0]
    victim_id = st.peer_id(victim)
    survivors = [c for c in st.peer_ids() if c != victim]
    steps = start_training(sc, 130)

    st.kill(victim)
    t_kill = time.monotonic()
    sc.note(f"killed {st.short(victim)} ({victim_id[-6:]}) near step {st.trainer_step()}")
    time.sleep(5)  # the coordinator's view of the trainer's step lags a few seconds
    step_after_kill = st.trainer_step()
    try:
        wait_until(lambda: st.trainer_step() >= step_after_kill + 30, 40, "progress after the kill")
        continued = time.monotonic() - t_kill
    except HarnessError:
        continued = None
    sc.check(
        "training continued on the other replica within 45 s",
        continued is not None,
        f"+30 micro-batches after {continued:.0f} s" if continued is not None else "no progress",
    )

    replacement = st.add_replica("peer0")
    healed_while_training(sc)
    sc.note(f"started replacement {st.short(replacement)}")
    bound = 180
    try:
        serving = st.wait_serving([replacement], bound)
    except HarnessError:
        serving = None
    sc.check(
        f"replacement serving and listed within {bound} s",
        serving is not None,
        f"{serving:.0f} s" if serving is not None else "timed out",
    )
    if serving is not None:
        replacement_id = st.peer_id(replacement)
        took = wait_takes_work(sc, replacement_id, 90)
        sc.check(
            "replacement took work within 90 s",
            took is not None,
            f"{took:.0f} s" if took is not None else "never",
            soft=True,
        )
        survivors.append(replacement)
    sc.recovery = (f"training went on after {continued:.0f} s; " if continued is not None else "") + (
        f"replacement listed {serving:.0f} s after start (bound {bound})"
        if serving is not None
        else "replacement never served"
    )
    finish_training(sc, steps, survivors, gone=(victim_id,))
    sc.assert_passed()


# ---------------------------------------------------------------- 2
@pytest.mark.timeout(600)
def test_pause_and_unpause(scenario):
    sc = scenario("pause", "docker pause a stage-1 replica for 20 s, then unpause it")
    st = sc.stack
    bring_up(sc)
    victim = st.ids("peer1")[0]
    victim_id = st.peer_id(victim)
    steps = start_training(sc, 90)

    st.pause(victim)
    sc.note(f"paused {st.short(victim)} ({victim_id[-6:]})")
    progress_during(sc, 20, 30, "while a replica was paused")
    st.unpause(victim)
    sc.note("unpaused")
    healed_while_training(sc)
    bound = 30
    listed = wait_listed(sc, victim_id, bound)
    sc.check(
        f"unpaused peer listed online again within {bound} s",
        listed is not None,
        f"{listed:.0f} s" if listed is not None else "timed out",
    )
    took = wait_takes_work(sc, victim_id, 90)
    sc.check(
        "unpaused peer took work again within 90 s",
        took is not None,
        f"{took:.0f} s" if took is not None else "never",
        soft=True,
    )
    sc.recovery = (
        f"listed again {listed:.0f} s after unpause (bound {bound})" if listed is not None else "never listed again"
    )
    finish_training(sc, steps, st.peer_ids())
    sc.assert_passed()


# ---------------------------------------------------------------- 3
@pytest.mark.timeout(600)
def test_netem_delay_loss_rate(scenario):
    sc = scenario(
        "netem", "one stage-0 replica: 100 ms +- 20 ms delay, then 5 % loss, then 50 Mbit/s (tc in the container)"
    )
    st = sc.stack
    bring_up(sc)
    victim = st.ids("peer0")[1]
    victim_id = st.peer_id(victim)
    other = st.ids("peer1")[0]
    victim_addr = st.ready(victim)["address"]
    steps = start_training(sc, 100)

    for args, label in (
        (("delay", "100ms", "20ms"), "100 ms delay"),
        (("loss", "5%"), "5 % loss"),
        (("rate", "50mbit"), "50 Mbit/s"),
    ):
        sc.note(st.netem(victim, *args))
        progress_during(sc, 10, 20, f"under {label}")
        t0 = time.monotonic()
        out = st.exec(other, "swarmpipe", "healthcheck", "--address", victim_addr, "--timeout", "10", check=False)
        sc.check(
            f"impaired peer answers Info under {label}",
            out.startswith("healthy"),
            f"{out.strip()[:60]} in {time.monotonic() - t0:.1f} s",
        )
        time.sleep(5)
    sc.note(st.netem(victim, "clear"))
    healed_while_training(sc)
    bound = 20
    listed = wait_listed(sc, victim_id, bound)
    sc.check(
        f"impaired peer listed online within {bound} s after clearing",
        listed is not None,
        f"{listed:.0f} s" if listed is not None else "timed out",
    )
    took = wait_takes_work(sc, victim_id, 90)
    sc.check(
        "impaired peer takes work after clearing",
        took is not None,
        f"{took:.0f} s" if took is not None else "never",
        soft=True,
    )
    sc.recovery = (
        f"listed {listed:.0f} s after clearing (bound {bound}); progress in every phase"
        if listed is not None
        else "not listed after clearing"
    )
    finish_training(sc, steps, st.peer_ids())
    sc.assert_passed()


# ---------------------------------------------------------------- 4
@pytest.mark.timeout(600)
def test_partition_and_heal(scenario):
    sc = scenario("partition", "docker network disconnect a stage-1 replica for 25 s, then reconnect it (same address)")
    st = sc.stack
    bring_up(sc)
    victim = st.ids("peer1")[1]
    victim_id = st.peer_id(victim)
    steps = start_training(sc, 100)

    ip = st.disconnect(victim)
    sc.note(f"disconnected {st.short(victim)} ({victim_id[-6:]}, {ip})")
    progress_during(sc, 25, 30, "while a replica was partitioned")
    st.connect(victim, ip, "peer1")
    sc.note("reconnected")
    healed_while_training(sc)
    bound = 45
    listed = wait_listed(sc, victim_id, bound)
    sc.check(
        f"partitioned peer listed online again within {bound} s",
        listed is not None,
        f"{listed:.0f} s" if listed is not None else "timed out",
    )
    took = wait_takes_work(sc, victim_id, 90)
    sc.check(
        "partitioned peer took work again within 90 s",
        took is not None,
        f"{took:.0f} s" if took is not None else "never",
        soft=True,
    )
    sc.recovery = (
        f"listed again {listed:.0f} s after reconnect (bound {bound})" if listed is not None else "never listed again"
    )
    finish_training(sc, steps, st.peer_ids())
    sc.assert_passed()


# ---------------------------------------------------------------- 5
def _peer_versions(st) -> dict[str, int]:
    """Each peer's version, asked over gRPC (works with the coordinator down)."""

    def ask(cid: str) -> tuple[str, str]:
        info = st.ready(cid)
        return info["peer_id"], st.exec(cid, "swarmpipe", "healthcheck", "--address", info["address"], check=False)

    # All at once: asked one by one, the probes took long enough on a slow CI machine for the trainer to finish.
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(ask, st.peer_ids()))
    return {pid: int(out.split(" version ")[1].split()[0]) for pid, out in answers if " version " in out}


@pytest.mark.timeout(600)
def test_coordinator_restart(scenario):
    sc = scenario("coordinator", "docker stop the coordinator for 15 s mid-training, then start it again")
    st = sc.stack
    bring_up(sc)
    peer = st.ids("peer0")[0]
    maddr_before = st.exec(peer, "cat", "/bootstrap/initial_peers.txt").strip()
    steps = start_training(sc, 100)

    coordinator = st.ids("coordinator")[0]
    before = _peer_versions(st)
    st.stop(coordinator)
    sc.note("coordinator stopped")
    time.sleep(15)
    trainer_running = st.running(st.ids("trainer")[0])
    after = _peer_versions(st)
    advanced = [pid for pid, v in after.items() if v > before.get(pid, 0)]
    sc.check(
        "training went on without the coordinator",
        len(advanced) >= 2 and trainer_running,
        f"{len(advanced)}/{len(after)} peers' versions advanced while it was down",
    )
    st.start(coordinator)
    t0 = time.monotonic()
    sc.note("coordinator started")
    healed_while_training(sc)
    bound = 60
    peer_ids = {st.peer_id(c) for c in st.peer_ids()}

    def back() -> bool:
        snap = st.api()
        return bool(snap and peer_ids <= set(st.listed()) and snap.get("trainers"))

    try:
        wait_until(back, bound, "the coordinator to list every peer and the trainer again", poll=1.0)
        recovered = time.monotonic() - t0
    except HarnessError:
        recovered = None
    sc.check(
        f"coordinator back, listing all peers and the trainer within {bound} s",
        recovered is not None,
        f"{recovered:.0f} s" if recovered is not None else "timed out",
    )
    maddr_after = st.exec(peer, "cat", "/bootstrap/initial_peers.txt").strip()
    sc.check(
        "same multiaddr after the restart (identity + fixed port + fixed address)",
        maddr_after == maddr_before,
        maddr_after.split("/p2p/")[-1][-6:],
    )
    sc.recovery = (
        f"API complete {recovered:.0f} s after start (bound {bound})" if recovered is not None else "API incomplete"
    )
    finish_training(sc, steps, st.peer_ids())
    sc.assert_passed()
