"""swarmpipe.peer.transport.codec_policy: codec choice follows measured bandwidth; error feedback removes the bias of 8-bit gradients."""

from __future__ import annotations

import pytest
import torch

from swarmpipe.peer.transport.codec_policy import BandwidthMeter, CodecPolicy, ErrorFeedback
from swarmpipe.peer.transport.wire import decode, encode

pytestmark = pytest.mark.unit


def test_meter_ewma_and_small_calls_ignored() -> None:
    m = BandwidthMeter(alpha=0.5)
    m.observe("a", 100, 1.0)  # too small: latency, not bandwidth
    assert "a" not in m.estimates
    m.observe("a", 1 << 20, 1.0)
    m.observe("a", 3 << 20, 1.0)
    assert m.bandwidth("a") == pytest.approx(2 << 20)


def test_slow_links_get_8bit_fast_links_get_cheap_codecs() -> None:
    p = CodecPolicy()
    p.meter.observe("slow", 10 << 20, 10 * 8 * (10 << 20) / 50e6)  # 50 Mbit/s
    p.meter.observe("fast", 1 << 30, 1.0)  # ~1 GB/s loopback
    assert p.choose("activations", "auto", "slow", 4 << 20) == "blockwise8"
    assert p.choose("activations", "auto", "fast", 4 << 20) in ("fp16", "none")
    assert p.choose("gradients", "fp16", "slow", 4 << 20) == "fp16"  # a fixed codec stays fixed


def test_timed_records_real_transfers() -> None:
    p = CodecPolicy()
    with p.timed("x") as t:
        t.nbytes = 1 << 20
    assert p.meter.bandwidth("x") > 0 and "x" in p.meter.estimates


def test_timed_leaves_out_the_far_ends_own_time_within_bounds(monkeypatch) -> None:
    """A chained call's time holds the next hop's compute and every later hop: the next hop says how long it held
    the call, and the link is timed without it; a peer claiming more than the whole call is capped (99 %)."""
    clock = iter([10.0, 12.0] * 3)
    monkeypatch.setattr("swarmpipe.peer.transport.codec_policy.time.perf_counter", lambda: next(clock))
    rates = {}
    for address, remote in (("whole", 0.0), ("link", 1.5), ("liar", 1e9)):
        p = CodecPolicy()
        with p.timed(address) as t:
            t.nbytes = 8 << 20
            t.remote_seconds = remote
        rates[address] = p.meter.bandwidth(address)
    assert rates["whole"] == pytest.approx((8 << 20) / 2.0)
    assert rates["link"] == pytest.approx((8 << 20) / 0.5)  # 2 s call, 1.5 s of them at the far end
    assert rates["liar"] == pytest.approx((8 << 20) / 0.02)  # at most 100x the whole call's rate


@pytest.mark.parametrize("codec", ["uint8", "blockwise8", "fp16", "bf16"])
def test_error_feedback_unbiases_repeated_gradients(codec: str) -> None:
    g = torch.randn(4096) * 1e-3 + 3e-4  # small, with a mean the quantizer would round away
    ef = ErrorFeedback()
    sent_ef = sum(decode(ef.encode("k", g, codec)).float() for _ in range(50))
    sent_plain = sum(decode(encode(g, codec)).float() for _ in range(50))
    err_ef = (sent_ef - 50 * g).norm() / (50 * g).norm()
    err_plain = (sent_plain - 50 * g).norm() / (50 * g).norm()
    assert err_ef <= err_plain + 1e-9
    assert err_ef < 0.02  # accumulated residual stays bounded: at most one step's error


def test_error_feedback_lossless_and_shape_change() -> None:
    ef = ErrorFeedback(max_keys=2)
    x = torch.randn(10)
    assert torch.equal(decode(ef.encode("k", x, "none")), x)
    ef.encode("a", torch.randn(8), "uint8")
    ef.encode("a", torch.randn(3), "uint8")  # new shape: old residual ignored
    ef.encode("b", torch.randn(3), "uint8")
    ef.encode("c", torch.randn(3), "uint8")
    assert len(ef.residuals) == 2
