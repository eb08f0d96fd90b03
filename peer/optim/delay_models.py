"""Per-micro-batch gradient delays for the delay simulator: fixed, random, heavy-tailed, replayed.

A real swarm's delays are not the 1F1B formula ``P - 1 - k``: server-side batching, replicas
at different speeds, stragglers and replayed backwards all stretch some of them. Each model
here gives, for every micro-batch, the delay (in local updates) its gradient has at each
stage; :class:`~swarmpipe.peer.optim.delay_simulator.DelaySimulator` then runs that micro-batch's
forward and backward at stage k on the weights from ``delays[k]`` updates before.

A hold-up at stage s (a slow peer, a lost backward) reaches every stage the backward has
still to pass, so the extra delay of :class:`Stragglers`, :class:`SlowReplica` and
:class:`Replays` applies to stages ``0..s``; later stages saw the micro-batch's forward and
backward close together. Every model caps its delays at ``max_delay`` (the simulator keeps
that many old versions; a real peer drops gradients staler than ``update.max_staleness``,
the simulator caps them instead, so no sample is lost) and counts how often it capped.

:class:`RecordedDelays` replays the histogram a peer exports (``swarmpipe_gradient_delay_steps``,
Prometheus text format): one scrape per stage, or one scrape whose series carry a ``stage`` label.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Protocol

from prometheus_client.parser import text_string_to_metric_families

DELAY_METRIC = "swarmpipe_gradient_delay_steps"
MAX_SCRAPE_BYTES = 4 << 20  # a peer's whole /metrics page is a few kB
MAX_BUCKETS = 256


class DelayModel(Protocol):
    num_stages: int
    max_delay: int
    capped: int  # samples cut down to max_delay so far

    def delays(self, micro: int) -> list[int]:
        """The delay at each stage of micro-batch ``micro`` (0-based), each in ``0..max_delay``."""
        ...


def one_f_one_b(num_stages: int) -> list[int]:
    """Delays of asynchronous 1F1B: the last stage is current, stage 0 is P - 1 updates behind."""
    return [num_stages - 1 - k for k in range(num_stages)]


class _Base:
    """1F1B delays plus an extra delay from a seeded generator, capped at ``max_delay``."""

    def __init__(self, num_stages: int, max_delay: int, seed: int, base: Sequence[int] | None = None):
        self.base = list(one_f_one_b(num_stages) if base is None else base)
        if len(self.base) != num_stages or min(self.base) < 0:
            raise ValueError(f"need {num_stages} non-negative base delays, got {self.base}")
        if max_delay < max(self.base):
            raise ValueError(f"max_delay {max_delay} is below the base delays {self.base}")
        self.num_stages, self.max_delay, self.capped = num_stages, max_delay, 0
        self.rng = random.Random(seed)

    def _cap(self, delays: list[int]) -> list[int]:
        out = []
        for d in delays:
            self.capped += d > self.max_delay
            out.append(min(max(0, d), self.max_delay))
        return out

    def _hold_up(self, stage: int, extra: int) -> list[int]:
        """Base delays with ``extra`` added at stages 0..stage (those the late backward has yet to reach)."""
        return self._cap([d + (extra if k <= stage else 0) for k, d in enumerate(self.base)])


class FixedDelays(_Base):
    """The same delays for every micro-batch (default: 1F1B)."""

    def __init__(self, num_stages: int, base: Sequence[int] | None = None):
        delays = list(one_f_one_b(num_stages) if base is None else base)
        super().__init__(num_stages, max(delays, default=0), 0, delays)

    def delays(self, micro: int) -> list[int]:
        return list(self.base)


class Jitter(_Base):
    """1F1B plus independent uniform noise of +-``spread`` per stage (batching, uneven compute)."""

    def __init__(self, num_stages: int, spread: int, seed: int = 0, max_delay: int = 32):
        super().__init__(num_stages, max_delay, seed)
        self.spread = spread

    def delays(self, micro: int) -> list[int]:
        return self._cap([d + self.rng.randint(-self.spread, self.spread) for d in self.base])


class Stragglers(_Base):
    """With probability ``p`` a micro-batch is held up at a uniformly chosen stage for a heavy-tailed
    time: ``floor(scale * Pareto(alpha))`` extra updates (alpha <= 2: infinite variance)."""

    def __init__(
        self, num_stages: int, p: float, alpha: float = 1.5, scale: float = 2.0, seed: int = 0, max_delay: int = 32
    ):
        super().__init__(num_stages, max_delay, seed)
        if not (0.0 <= p <= 1.0 and alpha > 0 and scale > 0):
            raise ValueError("need 0 <= p <= 1, alpha > 0 and scale > 0")
        self.p, self.alpha, self.scale = p, alpha, scale

    def delays(self, micro: int) -> list[int]:
        if self.rng.random() >= self.p:
            return self._cap(list(self.base))
        extra = int(self.scale * self.rng.paretovariate(self.alpha))
        return self._hold_up(self.rng.randrange(self.num_stages), extra)


class SlowReplica(_Base):
    """Stage ``stage`` has ``replicas`` replicas served round-robin, one ``slowdown`` times slower: the
    micro-batches it gets (every ``replicas``-th) wait ``round((slowdown - 1) * step_time)`` extra updates."""

    def __init__(self, num_stages: int, stage: int, replicas: int = 2, slowdown: float = 4.0, step_time: float = 1.0):
        if not (0 <= stage < num_stages and replicas >= 1 and slowdown >= 1.0 and step_time > 0):
            raise ValueError("need a stage in range, replicas >= 1, slowdown >= 1 and step_time > 0")
        self.stage, self.replicas = stage, replicas
        self.extra = round((slowdown - 1.0) * step_time)
        super().__init__(num_stages, num_stages - 1 + self.extra, 0)

    def delays(self, micro: int) -> list[int]:
        return self._hold_up(self.stage, self.extra if micro % self.replicas == 0 else 0)


class Replays(_Base):
    """With probability ``p`` a micro-batch's backward is lost at a uniformly chosen stage and replayed
    after a round trip: ``extra`` more updates (default 2 (P - 1)) at that stage and the ones before."""

    def __init__(self, num_stages: int, p: float, extra: int | None = None, seed: int = 0, max_delay: int = 32):
        super().__init__(num_stages, max_delay, seed)
        if not 0.0 <= p <= 1.0:
            raise ValueError("need 0 <= p <= 1")
        self.p = p
        self.extra = 2 * (num_stages - 1) if extra is None else extra

    def delays(self, micro: int) -> list[int]:
        if self.rng.random() >= self.p:
            return self._cap(list(self.base))
        return self._hold_up(self.rng.randrange(self.num_stages), self.extra)


def parse_delay_histograms(text: str, metric: str = DELAY_METRIC) -> dict[str, list[tuple[float, float]]]:
    """``{stage label or "": [(le, cumulative count), ...]}`` from a Prometheus text scrape.

    Raises ValueError on anything that is not a sane histogram: too large, unparsable, no such
    metric, fewer than one finite bucket, negative or decreasing counts, too many buckets.
    """
    if len(text) > MAX_SCRAPE_BYTES:
        raise ValueError(f"scrape of {len(text)} bytes is over {MAX_SCRAPE_BYTES}")
    series: dict[str, list[tuple[float, float]]] = {}
    try:
        for family in text_string_to_metric_families(text):  # without a TYPE line buckets are their own family
            for sample in family.samples:
                if sample.name != metric + "_bucket":
                    continue
                le = float(sample.labels["le"])
                key = sample.labels.get("stage", "")
                series.setdefault(key, []).append((le, float(sample.value)))
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"not a Prometheus text scrape with {metric}: {err}") from None
    if not series:
        raise ValueError(f"no {metric}_bucket samples in the scrape")
    for key, buckets in series.items():
        buckets.sort()
        counts = [c for _, c in buckets]
        bounds = [le for le, _ in buckets]
        if len(buckets) > MAX_BUCKETS or not any(math.isfinite(b) and b >= 0 for b in bounds):
            raise ValueError(f"series {key!r}: need 1..{MAX_BUCKETS} buckets with a finite bound >= 0")
        if any(not math.isfinite(c) or c < 0 for c in counts) or any(b < a for a, b in zip(counts, counts[1:])):
            raise ValueError(f"series {key!r}: counts must be finite, >= 0 and cumulative")
        if counts[-1] <= 0:
            raise ValueError(f"series {key!r}: no observations")
    return series


class RecordedDelays(_Base):
    """Delays drawn from recorded ``swarmpipe_gradient_delay_steps`` histograms, one per stage.

    A bucket ``(previous le, le]`` gives a uniform integer in that range; the ``+Inf`` bucket gives
    the last finite bound (a lower bound of what was seen). ``scrapes``: one text per stage, in
    stage order (fewer are cycled), or a single text whose series have a ``stage`` label.
    """

    def __init__(self, num_stages: int, scrapes: Sequence[str], seed: int = 0, max_delay: int = 32):
        super().__init__(num_stages, max_delay, seed, [0] * num_stages)
        if not scrapes:
            raise ValueError("need at least one scrape")
        parsed = [parse_delay_histograms(t) for t in scrapes]
        labelled = parsed[0] if len(parsed) == 1 and "" not in parsed[0] else None
        self.tables: list[list[tuple[int, int, float]]] = []
        for k in range(num_stages):
            if labelled is not None:
                if str(k) not in labelled:
                    raise ValueError(f'the scrape has no series with stage="{k}"')
                buckets = labelled[str(k)]
            else:
                one = parsed[k % len(parsed)]
                buckets = one.get("", next(iter(one.values())))
            self.tables.append(self._table(buckets))

    @staticmethod
    def _table(buckets: list[tuple[float, float]]) -> list[tuple[int, int, float]]:
        """(lowest, highest delay, cumulative probability) per non-empty bucket."""
        total, table, prev_le, prev_count = buckets[-1][1], [], -1.0, 0.0
        last_finite = max(int(le) for le, _ in buckets if math.isfinite(le))
        for le, count in buckets:
            if count > prev_count:
                low = 0 if prev_le < 0 else int(math.floor(prev_le)) + 1
                high = int(math.floor(le)) if math.isfinite(le) else last_finite
                table.append((min(low, high), high, count / total))
            prev_le, prev_count = le, count
        return table

    def delays(self, micro: int) -> list[int]:
        out = []
        for table in self.tables:
            u = self.rng.random()
            low, high, _ = next((row for row in table if u < row[2]), table[-1])
            out.append(self.rng.randint(low, high))
        return self._cap(out)

    def mean(self, stage: int) -> float:
        """Expected delay at ``stage`` (before the cap), from the histogram."""
        total, prev = 0.0, 0.0
        for low, high, cum in self.tables[stage]:
            total += (cum - prev) * (low + high) / 2
            prev = cum
        return total
