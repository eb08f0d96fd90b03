"""How fast a stage computes: an EMA of compute seconds per sample, and micro-batches per second from it.

It is what a peer announces and what routing and rebalancing compare, so it must not chase load:
unbatched calls feed the estimate; batched ones only when nothing else comes (no estimate yet, or a long
run of batches), because a batch's cost per sample falls with its size, which grows with load, so a busy
stage would look faster than an idle one and rebalancing would chase the noise.
"""

from __future__ import annotations

BATCHED_RUN = 20  # batched calls in a row after which they feed the estimate anyway
EMA = 0.9


class ThroughputEstimate:
    def __init__(self, microbatch_size: int):
        self.microbatch_size = microbatch_size
        self.seconds_per_sample: float | None = None
        self._batched_run = 0  # batched calls since the last unbatched one

    def observe(self, seconds: float, samples: int, weight: float, microbatches: int = 1) -> None:
        """One compute call of ``samples`` that took ``seconds``; ``weight`` is its share of a full
        forward + backward (1/3 a forward, 2/3 a backward, 1 both)."""
        if microbatches > 1 and self.seconds_per_sample is not None:
            self._batched_run += 1
            if self._batched_run < BATCHED_RUN:
                return
        else:
            self._batched_run = 0
        per_sample = seconds / max(1, samples) / weight
        ema = self.seconds_per_sample
        self.seconds_per_sample = per_sample if ema is None else EMA * ema + (1 - EMA) * per_sample

    def assume(self, microbatches_per_s: float) -> None:
        """Seed the estimate (e.g. after moving to another stage) until real measurements take over."""
        if microbatches_per_s > 0 and self.seconds_per_sample is None:
            self.seconds_per_sample = 1.0 / (microbatches_per_s * self.microbatch_size)

    def microbatches_per_s(self) -> float:
        if not self.seconds_per_sample:
            return 0.0
        return 1.0 / (self.seconds_per_sample * self.microbatch_size)
