"""Choosing a codec per hop from the bandwidth measured to that peer, and error feedback for gradients.

``BandwidthMeter`` keeps, per peer address, an EWMA of bytes/s observed on real calls (bytes sent
plus received over the call's wall time, which includes the peer's compute, so it is a
conservative estimate of the link). ``CodecPolicy.choose`` picks, for a tensor of ``nbytes``
float32 bytes, the codec minimising  wire_bytes(codec) / bandwidth + nbytes / codec_speed(codec),
among the codecs allowed for the tensor's role: slow links get 8-bit codecs, loopback or fast
datacenter links get fp16 or none. A role configured with a fixed codec keeps it ("auto" opts in).

``ErrorFeedback`` removes the bias of lossy gradient codecs: the part of a gradient that
quantization lost is kept (per stream key, e.g. (stage, shape)) and added to the next gradient
sent on that key, so the errors do not accumulate over steps (EF-SGD).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from swarmpipe.peer.transport import codecs
from swarmpipe.peer.transport.wire import decode, encode

DEFAULT_BANDWIDTH = 100e6 / 8  # before any measurement: assume a 100 Mbit/s volunteer link


@dataclass
class BandwidthMeter:
    alpha: float = 0.3
    min_bytes: int = 64 * 1024  # smaller calls measure latency, not bandwidth
    estimates: dict[str, float] = field(default_factory=dict)

    def observe(self, address: str, nbytes: int, seconds: float) -> None:
        if nbytes < self.min_bytes or seconds <= 0:
            return
        rate = nbytes / seconds
        old = self.estimates.get(address)
        self.estimates[address] = rate if old is None else (1 - self.alpha) * old + self.alpha * rate

    def bandwidth(self, address: str) -> float:
        return self.estimates.get(address, DEFAULT_BANDWIDTH)


@dataclass
class CodecPolicy:
    meter: BandwidthMeter = field(default_factory=BandwidthMeter)
    codec_gbps: dict[str, float] = field(default_factory=lambda: {c.name: c.gbps for c in codecs.REGISTRY.values()})

    def cost(self, codec: str, nbytes: int, bandwidth: float) -> float:
        wire_ratio = codecs.get(codec).wire_ratio()
        return nbytes * wire_ratio / bandwidth + nbytes / (self.codec_gbps[codec] * 1e9)

    def choose(self, role: str, configured: str, address: str, nbytes: int) -> str:
        """The configured codec, or for "auto" the cheapest candidate for ``role`` on this link."""
        if configured != codecs.AUTO:
            return configured
        bw = self.meter.bandwidth(address)
        return min(codecs.auto_candidates(role), key=lambda c: self.cost(c, nbytes, bw))

    def timed(self, address: str):
        """``with policy.timed(addr) as t: ...; t.nbytes = sent + received`` records one observation."""
        return _Timed(self.meter, address)


class _Timed:
    def __init__(self, meter: BandwidthMeter, address: str):
        self.meter, self.address, self.nbytes = meter, address, 0
        self.remote_seconds = 0.0  # of the call's time, spent at the other end (as it says): not the link's

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            total = time.perf_counter() - self.start
            # A peer's word about its own time is bounded by what we saw: at most 99 % of the call is excluded,
            # so a liar can make its link look 100x faster at most (and only its own: we compress less to it).
            remote = min(max(self.remote_seconds, 0.0), 0.99 * total)
            self.meter.observe(self.address, self.nbytes, total - remote)


class ErrorFeedback:
    """Per-key residuals of lossy encodings (bounded number of keys; oldest dropped first)."""

    def __init__(self, max_keys: int = 64):
        self.max_keys = max_keys
        self.residuals: dict[object, torch.Tensor] = {}

    def encode(self, key, t: torch.Tensor, codec: str):
        """Encode ``t`` plus the carried residual; keep what the codec lost for next time."""
        if not codecs.get(codec).lossy or not t.is_floating_point():
            self.residuals.pop(key, None)
            return encode(t, codec)
        target = t.float()
        carried = self.residuals.pop(key, None)
        if carried is not None and carried.shape == target.shape:
            target = target + carried
        msg = encode(target, codec)
        self.residuals[key] = target - decode(msg).float()
        while len(self.residuals) > self.max_keys:
            self.residuals.pop(next(iter(self.residuals)))
        return msg
