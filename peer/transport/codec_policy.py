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

from swarmpipe.peer.transport.wire import decode, encode

# Bytes on the wire per float32 byte, and encode+decode speed (GB/s of float32 input) on one
# core, measured by bench/codecs.py on the development machine (conservative round numbers).
WIRE_RATIO = {"none": 1.0, "fp16": 0.5, "bf16": 0.5, "uint8": 0.25, "blockwise8": 0.25 + 1 / 1024}
CODEC_GBPS = {"none": 4.0, "fp16": 2.0, "bf16": 3.0, "uint8": 1.2, "blockwise8": 1.0}
ROLE_CANDIDATES = {
    "activations": ("fp16", "blockwise8", "none"),
    "gradients": ("fp16", "blockwise8", "none"),  # blockwise8 with error feedback
    "state": ("none", "fp16"),
}
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
    codec_gbps: dict[str, float] = field(default_factory=lambda: dict(CODEC_GBPS))

    def cost(self, codec: str, nbytes: int, bandwidth: float) -> float:
        return nbytes * WIRE_RATIO[codec] / bandwidth + nbytes / (self.codec_gbps[codec] * 1e9)

    def choose(self, role: str, configured: str, address: str, nbytes: int) -> str:
        if configured != "auto":
            return configured
        bw = self.meter.bandwidth(address)
        return min(ROLE_CANDIDATES[role], key=lambda c: self.cost(c, nbytes, bw))

    def timed(self, address: str):
        """``with policy.timed(addr) as t: ...; t.nbytes = sent + received`` records one observation."""
        return _Timed(self.meter, address)


class _Timed:
    def __init__(self, meter: BandwidthMeter, address: str):
        self.meter, self.address, self.nbytes = meter, address, 0

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.meter.observe(self.address, self.nbytes, time.perf_counter() - self.start)


class ErrorFeedback:
    """Per-key residuals of lossy encodings (bounded number of keys; oldest dropped first)."""

    LOSSLESS = ("none",)

    def __init__(self, max_keys: int = 64):
        self.max_keys = max_keys
        self.residuals: dict[object, torch.Tensor] = {}

    def encode(self, key, t: torch.Tensor, codec: str):
        """Encode ``t`` plus the carried residual; keep what the codec lost for next time."""
        if codec in self.LOSSLESS or not t.is_floating_point():
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
