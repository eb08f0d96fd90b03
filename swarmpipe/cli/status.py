"""``swarmpipe status``: the swarm as a terminal table, read from the DHT (or a coordinator's API)."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from typing import Any

from swarmpipe.peer.config import StatusConfig
from swarmpipe.peer.swarm.bootstrap import resolve_initial_peers
from swarmpipe.peer.swarm.dht import SwarmDHT, start_dht


async def _read_dht(cfg: StatusConfig) -> list[dict[str, Any]]:
    initial = resolve_initial_peers(cfg.initial_peers, cfg.swarm)
    dht = await asyncio.to_thread(start_dht, initial, "127.0.0.1", 0, coordinators=cfg.coordinator_id)
    try:
        index = await SwarmDHT(dht, "").runs()
        run_ids = [cfg.run_id] if cfg.run_id else sorted(index)
        runs = []
        for run_id in run_ids:
            swarm = SwarmDHT(dht, run_id)
            spec = await swarm.fetch_spec()
            num_stages = spec.num_stages if spec else (index[run_id].num_stages if run_id in index else 0)
            stages = await swarm.all_stages(num_stages)
            trainers = await swarm.trainers()
            runs.append(
                {
                    "run_id": run_id,
                    "stages": [
                        {"index": s, "peers": [{"peer_id": pid, **r.model_dump()} for pid, r in sorted(peers.items())]}
                        for s, peers in enumerate(stages)
                    ],
                    "trainers": [{"peer_id": pid, **t.model_dump()} for pid, t in sorted(trainers.items())],
                }
            )
        return runs
    finally:
        dht.shutdown()


def _read_coordinator(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(url.rstrip("/") + "/api/swarm", timeout=10) as response:
        return [json.loads(response.read())]


DEVICE_WIDTH = 24  # the device label's column; longer labels are shortened to fit
# words a device label can lose and still say what the device is
_LABEL_NOISE = re.compile(r"\((?:R|TM|tm)\)|\s+CPU @ [\d.]+GHz|\s\d+-Core\b|\b(?:CPU|GPU|Processor|GeForce)\b")


def short_device(label: str, width: int = DEVICE_WIDTH) -> str:
    """A peer's device label to fit ``width``: trademark marks and clock speeds dropped, then cut."""
    text = " ".join(_LABEL_NOISE.sub("", label or "").split()).replace("( ", "(").replace(" )", ")")
    if not text:
        return "-"  # a peer that predates device reporting
    if len(text) <= width:
        return text
    end = "...)" if text.endswith(")") else "..."  # "cpu (Intel Xeon Pla...)": still reads as name (model)
    return text[: width - len(end)].rstrip() + end


def _gib(n: float) -> str:
    v = n / 2**30
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def device_memory(peer: dict[str, Any]) -> str:
    """The peer's device memory as "used / total GiB", or "-" when the peer does not report it."""
    total = peer.get("device_memory_total") or 0
    if not total:
        return "-"
    return f"{_gib(peer.get('device_memory_used') or 0)} / {_gib(total)} GiB"


def render(runs: list[dict[str, Any]]) -> str:
    if not runs:
        return "no runs found in the swarm index"
    lines = []
    for run in runs:
        lines.append(f"run {run['run_id']}")
        lines.append(
            f"  {'stage':>5}  {'peer':<8} {'state':<9} {'address':<22} {'mb/s':>7} {'queue':>5} {'version':>8} "
            f"{'age':>5}  {'device':<{DEVICE_WIDTH}} memory"
        )
        for stage in run["stages"]:
            if not stage["peers"]:
                lines.append(f"  {stage['index']:>5}  {'-':<8} {'NO PEERS':<9}")
            for p in stage["peers"]:
                age = time.time() - p.get("updated_at", time.time())
                lines.append(
                    f"  {stage['index']:>5}  {p['peer_id'][-6:]:<8} {p['state']:<9} {p['address']:<22} "
                    f"{p['throughput']:>7.2f} {p['queue']:>5} {p['version']:>8} {f'{age:.0f}s':>5}  "
                    f"{short_device(p.get('device', '')):<{DEVICE_WIDTH}} {device_memory(p)}"
                )
        for t in run.get("trainers", []):
            loss = f"{t['loss']:.3f}" if t.get("loss") is not None else "n/a"
            lines.append(
                f"  trainer {t['peer_id'][-6:]}: step {t['step']}, loss {loss}, {t['samples_per_s']:.1f} samples/s"
            )
    return "\n".join(lines)


def run_status(cfg: StatusConfig) -> int:
    runs = _read_coordinator(cfg.coordinator) if cfg.coordinator else asyncio.run(_read_dht(cfg))
    print(json.dumps(runs, indent=2) if cfg.json else render(runs))
    return 0
