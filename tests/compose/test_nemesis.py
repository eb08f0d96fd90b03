"""The nemesis: seeded random faults, several at once, on the Compose deployment, then the same
invariants as every single-fault scenario (test_faults.py). Rerun a failure with its printed seed:
SWARMPIPE_NEMESIS_SEED=<seed> make compose-test COMPOSE_ARGS='-k nemesis'."""

from __future__ import annotations

import os
import random
import time

import pytest
from compose_harness import HarnessError, wait_until
from fault_checks import bring_up, finish_training, healed_while_training, start_training

pytestmark = [pytest.mark.compose, pytest.mark.slow]

KINDS = ("pause", "partition", "delay", "loss", "rate", "kill", "coordinator")


def nemesis_plan(seed: int, seconds: float) -> list[tuple[float, str, int, int, float]]:
    """(start s, kind, stage, replica slot, duration s): a fault every 6-16 s, several overlapping."""
    rng = random.Random(seed)
    plan, t = [], 3.0
    coordinator_used = kills = 0
    while t < seconds:
        kind = rng.choice(KINDS)
        if kind == "coordinator" and coordinator_used:
            kind = "pause"
        if kind == "kill" and kills >= 2:
            kind = "delay"
        coordinator_used += kind == "coordinator"
        kills += kind == "kill"
        plan.append((round(t, 1), kind, rng.randrange(2), rng.randrange(2), round(rng.uniform(8, 20), 1)))
        t += rng.uniform(6, 16)
    return plan


@pytest.mark.timeout(1200)
def test_nemesis(scenario):
    seed = int(os.environ.get("SWARMPIPE_NEMESIS_SEED") or random.SystemRandom().randrange(1, 10**6))
    seconds = float(os.environ.get("SWARMPIPE_NEMESIS_SECONDS", "120"))
    sc = scenario("nemesis", f"seeded random faults for {seconds:.0f} s, several at once (seed {seed})")
    print(f"NEMESIS SEED {seed} (rerun with SWARMPIPE_NEMESIS_SEED={seed})", flush=True)
    sc.facts["seed"] = seed
    st = sc.stack
    bring_up(sc)
    plan = nemesis_plan(seed, seconds)
    for item in plan:
        sc.note(f"plan: t={item[0]:>5}s {item[1]:<11} stage {item[2]} slot {item[3]} for {item[4]} s")
    steps = start_training(sc, seconds + 60)

    slots = {(s, r): cid for s in range(2) for r, cid in enumerate(st.ids(f"peer{s}"))}
    service_of = {cid: f"peer{s}" for (s, _), cid in slots.items()}
    busy: dict[tuple[int, int], tuple[float, str, object]] = {}  # slot -> (ends at, kind, undo data)
    coordinator_down: tuple[float, str] | None = None
    killed: list[str] = []
    booting: dict[tuple[int, int], str] = {}  # slot -> replacement still starting
    injected, skipped = [], 0
    t0 = time.monotonic()

    def heal(slot, kind, data) -> None:
        cid = slots[slot]
        if kind == "pause":
            st.unpause(cid)
        elif kind == "partition":
            st.connect(cid, data, service_of[cid])
        elif kind in ("delay", "loss", "rate"):
            st.netem(cid, "clear")
        sc.note(f"t={time.monotonic() - t0:5.0f}s healed {kind} on {st.short(cid)}")

    def healthy_replicas(stage: int) -> int:
        return sum(1 for r in range(2) if (stage, r) not in busy and (stage, r) not in booting)

    pending = list(plan)
    while pending or busy or coordinator_down or booting:
        now = time.monotonic() - t0
        for slot, (ends, kind, data) in list(busy.items()):
            if now >= ends:
                heal(slot, kind, data)
                del busy[slot]
        if coordinator_down and now >= coordinator_down[0]:
            st.start(coordinator_down[1])
            sc.note(f"t={now:5.0f}s coordinator started again")
            coordinator_down = None
        for slot, cid in list(booting.items()):
            if st.ready(cid) and st.peer_id(cid) in st.listed():
                sc.note(f"t={now:5.0f}s replacement {st.short(cid)} serving")
                del booting[slot]
        if pending and st.trainer_step() >= 0.7 * steps:
            # The trainer runs faster than its sizing assumed: heal what is active while it still trains.
            sc.note(
                f"t={now:5.0f}s trainer at {st.trainer_step()}/{steps}: dropping the last {len(pending)} planned fault(s)"
            )
            skipped += len(pending)
            pending.clear()
        if pending and now >= pending[0][0]:
            start, kind, stage, slot_r, duration = pending.pop(0)
            slot = (stage, slot_r)
            if kind == "coordinator":
                if booting:  # a replacement still joining needs the coordinator to bootstrap its DHT
                    skipped += 1
                    sc.note(f"t={now:5.0f}s skipped coordinator stop (a replacement is still joining)")
                elif coordinator_down is None:
                    cid = st.ids("coordinator")[0]
                    st.stop(cid, grace=5)
                    coordinator_down = (now + duration, cid)
                    injected.append(kind)
                    sc.note(f"t={now:5.0f}s coordinator stopped for {duration} s")
                continue
            if kind == "kill" and coordinator_down:
                skipped += 1  # a replacement could not bootstrap its DHT without the coordinator
                sc.note(f"t={now:5.0f}s skipped kill (the coordinator is down)")
                continue
            if kind == "kill" and any(k == "partition" for _, k, _ in busy.values()):
                skipped += 1  # Docker would give the replacement the partitioned peer's address
                sc.note(f"t={now:5.0f}s skipped kill (a partitioned peer's address must stay free)")
                continue
            if slot in busy or slot in booting or healthy_replicas(stage) < 2:
                # Keep a healthy replica in every stage: move the fault to the other stage if it can take it.
                if healthy_replicas(1 - stage) == 2:
                    stage, slot = 1 - stage, (1 - stage, slot_r)
                else:
                    skipped += 1
                    sc.note(f"t={now:5.0f}s skipped {kind} (no stage has two healthy replicas)")
                    continue
            cid = slots[slot]
            if kind == "kill":
                dead_id = st.peer_id(cid)
                st.short(cid)  # remember its name: add_replica removes the dead container
                st.kill(cid)
                killed.append(dead_id)
                new = st.add_replica(service_of[cid])
                service_of[new] = service_of[cid]
                slots[slot] = new
                booting[slot] = new
                sc.note(f"t={now:5.0f}s killed {st.short(cid)}, started replacement {st.short(new)}")
            else:
                data = None
                if kind == "pause":
                    st.pause(cid)
                elif kind == "partition":
                    data = st.disconnect(cid)
                elif kind == "delay":
                    st.netem(cid, "delay", "100ms", "20ms")
                elif kind == "loss":
                    st.netem(cid, "loss", "5%")
                elif kind == "rate":
                    st.netem(cid, "rate", "50mbit")
                busy[slot] = (now + duration, kind, data)
                sc.note(f"t={now:5.0f}s {kind} on {st.short(cid)} for {duration} s")
            injected.append(kind)
        if now > seconds + 300:
            raise HarnessError("the nemesis did not wind down within 300 s of its schedule")
        time.sleep(0.5)
    sc.facts["faults"] = len(injected)
    sc.note(f"faults injected: {len(injected)} ({', '.join(sorted(set(injected)))}), skipped {skipped}")
    healed_while_training(sc)
    survivors = list(slots.values())
    try:
        wait_until(lambda: {st.peer_id(c) for c in survivors} <= set(st.listed()), 60, "every current peer listed")
        healed = True
    except HarnessError:
        healed = False
    sc.check("every current peer listed within 60 s of the last heal", healed)
    sc.recovery = (
        f"{len(injected)} faults; all peers listed {'within 60 s' if healed else 'NOT within 60 s'} of the last heal"
    )
    finish_training(sc, steps, survivors, gone=tuple(k for k in killed if k))
    sc.assert_passed()
