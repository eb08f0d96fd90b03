"""swarmpipe.peer.transport.wire: codec round trips with per-codec error bounds, and every validation error."""

from __future__ import annotations

import math

import pytest
import torch

from swarmpipe.peer.transport.codecs import LOWBIT_BLOCK, REGISTRY
from swarmpipe.peer.transport.wire import (
    BLOCK_SIZE,
    CHUNK,
    DTYPES,
    WireError,
    decode,
    encode,
    encoded_size,
    is_empty,
)
from swarmpipe.protos import swarm_pb2

pytestmark = pytest.mark.unit

CODECS = tuple(REGISTRY)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = [(0,), (2, 0, 3), (1,), (7,), (3, 5, 7), (BLOCK_SIZE,), (BLOCK_SIZE + 1,), (2, BLOCK_SIZE + 3), (3, 1000)]
# unit roundoff of each dtype (round to nearest): the decoded value is cast back to it
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 3).to(dtype)


def tolerance(codec: str, x: torch.Tensor) -> torch.Tensor:
    """Largest |decode(encode(x)) - x| each element may have under ``codec``."""
    xf = x.float()
    a = xf.abs()
    back = a * UNIT_ROUNDOFF[x.dtype] * 1.01  # final cast to x.dtype
    if codec == "none" or x.numel() == 0:
        return torch.zeros_like(xf)
    if codec == "fp16":
        return a * 2.0**-11 + 2.0**-25 + back  # 2**-25: half the fp16 subnormal spacing
    if codec == "bf16":
        return a * 2.0**-8 + back
    flat = xf.reshape(-1)
    if codec == "uint8":  # one (min, scale) for the tensor: half a step of (max - min) / 255
        step = (flat.max() - flat.min()).item() / 255.0
        return torch.full_like(xf, 0.5 * step * 1.001 + 1e-6) + back
    if codec == "blockwise8":  # one absmax per block of BLOCK_SIZE values: half a step of absmax / 127
        n = flat.numel()
        blocks = math.ceil(n / BLOCK_SIZE)
        padded = torch.nn.functional.pad(flat, (0, blocks * BLOCK_SIZE - n)).view(blocks, BLOCK_SIZE)
        step = padded.abs().amax(dim=1) / 127.0
        per_elem = step.repeat_interleave(BLOCK_SIZE)[:n].view(x.shape)
        return 0.5 * per_elem * 1.001 + 1e-7 + back
    if codec in ("blockwise4", "blockwise2"):  # absmax per LOWBIT_BLOCK, 2**bits levels: half a level's step
        levels = 16 if codec == "blockwise4" else 4
        n = flat.numel()
        blocks = math.ceil(n / LOWBIT_BLOCK)
        padded = torch.nn.functional.pad(flat, (0, blocks * LOWBIT_BLOCK - n)).view(blocks, LOWBIT_BLOCK)
        absmax = padded.abs().amax(dim=1).repeat_interleave(LOWBIT_BLOCK)[:n].view(x.shape)
        # a level can be far from the value (2 bits): the final cast rounds at the level's magnitude
        return absmax / (levels - 1) * 1.001 + 1e-7 + absmax * UNIT_ROUNDOFF[x.dtype] * 1.01
    raise AssertionError(codec)


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("codec", CODECS)
def test_float_round_trip_within_bounds(codec: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = sample(shape, dtype)
    msg = encode(x, codec)
    assert (
        msg.codec == codec
        and msg.dtype == {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    )
    assert list(msg.shape) == list(shape)
    assert len(msg.data) == encoded_size(codec, dtype, x.numel())
    y = decode(msg)
    assert y.dtype == dtype and y.shape == x.shape
    err = (y.float() - x.float()).abs()
    bound = tolerance(codec, x)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
    if codec == "none":
        assert torch.equal(y, x)


@pytest.mark.parametrize("codec", ["uint8", "blockwise8"])
@pytest.mark.parametrize("n", [5, 1000, BLOCK_SIZE * 3 + 17])
def test_8bit_relative_error(codec: str, n: int) -> None:
    """8-bit codecs: error relative to the tensor's range / absmax stays below half a quantisation step."""
    x = sample((n,), torch.float32, seed=n)
    y = decode(encode(x, codec))
    err = (y - x).abs().max().item()
    if codec == "uint8":
        rel = err / (x.max() - x.min()).item()
        assert rel <= 0.5 / 255 * 1.001 + 1e-6
    else:
        rel = err / x.abs().max().item()
        assert rel <= 0.5 / 127 * 1.001 + 1e-6
    # and it is not lossless, i.e. the codec really quantises
    assert err > 0


def test_blockwise8_scales_are_per_block() -> None:
    """A large value in one block does not wipe out small values in another."""
    x = torch.cat([torch.full((BLOCK_SIZE,), 1000.0), torch.linspace(-1e-3, 1e-3, BLOCK_SIZE)])
    y = decode(encode(x, "blockwise8"))
    small = x[BLOCK_SIZE:]
    assert (y[BLOCK_SIZE:] - small).abs().max().item() <= 0.5 * 1e-3 / 127 * 1.001 + 1e-9
    # the global-range uint8 codec cannot do that
    y8 = decode(encode(x, "uint8"))
    assert (y8[BLOCK_SIZE:] - small).abs().max().item() > 1e-3


def test_blockwise8_ragged_tail_across_chunks_keeps_its_own_scale() -> None:
    """Several encode chunks of full blocks, then a short last block holding the largest value:
    the tail is quantized as a short row with its own absmax, and every value stays in bound."""
    n = CHUNK + 2 * BLOCK_SIZE + 5
    x = sample((n,), torch.float32, seed=3)
    x[-2] = 500.0
    msg = encode(x, "blockwise8")
    blocks = math.ceil(n / BLOCK_SIZE)
    assert len(msg.data) == encoded_size("blockwise8", torch.float32, n) == 4 * blocks + n
    scales = torch.frombuffer(bytearray(msg.data[: 4 * blocks]), dtype=torch.float32)
    assert scales[-1].item() == 500.0
    assert torch.equal(scales[:-1], x[: (blocks - 1) * BLOCK_SIZE].view(-1, BLOCK_SIZE).abs().amax(dim=1))
    y = decode(msg)
    assert ((y - x).abs() <= tolerance("blockwise8", x)).all()


def test_blockwise8_of_a_strided_tensor() -> None:
    x = sample((BLOCK_SIZE + 9, 3), torch.float32, seed=4).t()  # not contiguous
    y = decode(encode(x, "blockwise8"))
    assert ((y - x).abs() <= tolerance("blockwise8", x)).all()


def test_constant_tensor_8bit_is_exact() -> None:
    x = torch.full((37,), 2.5)
    assert torch.equal(decode(encode(x, "uint8")), x)
    assert torch.equal(decode(encode(x, "blockwise8")), x)
    z = torch.zeros(BLOCK_SIZE + 5)
    assert torch.equal(decode(encode(z, "blockwise8")), z)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("shape", [(0,), (4, 0), (3,), (2, 9)], ids=str)
def test_int64_always_exact_and_uncompressed(codec: str, shape: tuple[int, ...]) -> None:
    x = torch.arange(math.prod(shape), dtype=torch.int64).view(shape) * (2**40) - 7
    msg = encode(x, codec)
    assert msg.codec == "none" and msg.dtype == "int64"
    assert len(msg.data) == 8 * x.numel()
    y = decode(msg)
    assert y.dtype == torch.int64 and torch.equal(y, x)


def test_int64_extremes() -> None:
    x = torch.tensor([torch.iinfo(torch.int64).min, -1, 0, torch.iinfo(torch.int64).max])
    assert torch.equal(decode(encode(x)), x)


def test_bfloat16_none_codec_is_bit_exact() -> None:
    x = torch.tensor([1.0, -0.0, 3.140625, 1e30, -1e-30], dtype=torch.bfloat16)
    y = decode(encode(x))
    assert torch.equal(y.view(torch.int16), x.view(torch.int16))


def test_non_contiguous_and_grad_tensors() -> None:
    base = sample((4, 6), torch.float32)
    x = base.t()
    assert not x.is_contiguous()
    assert torch.equal(decode(encode(x)), x)
    w = base.clone().requires_grad_(True)
    assert torch.equal(decode(encode(w * 2)), (base * 2))


def test_scalar_tensor() -> None:
    x = torch.tensor(4.25)
    msg = encode(x, "fp16")
    assert list(msg.shape) == []
    y = decode(msg)
    assert y.shape == () and y.item() == 4.25


def test_missing_codec_means_none() -> None:
    x = sample((3,), torch.float32)
    msg = encode(x)
    msg.codec = ""
    assert torch.equal(decode(msg), x)


@pytest.mark.parametrize("codec", CODECS)
def test_encoded_size(codec: str) -> None:
    for n in (0, 1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1):
        expected = {
            "none": 4 * n,
            "fp16": 2 * n,
            "bf16": 2 * n,
            "uint8": 8 + n,
            "blockwise8": 4 * math.ceil(n / BLOCK_SIZE) + n,
            "blockwise4": 4 * math.ceil(n / LOWBIT_BLOCK) + LOWBIT_BLOCK // 2 * math.ceil(n / LOWBIT_BLOCK),
            "blockwise2": 4 * math.ceil(n / LOWBIT_BLOCK) + LOWBIT_BLOCK // 4 * math.ceil(n / LOWBIT_BLOCK),
        }[codec]
        assert encoded_size(codec, torch.float32, n) == expected


def test_is_empty() -> None:
    assert is_empty(swarm_pb2.Tensor())
    assert not is_empty(encode(torch.zeros(0)))  # dtype is set
    assert not is_empty(encode(torch.zeros(1)))


def test_wire_error_is_value_error() -> None:
    assert issubclass(WireError, ValueError)


# ------------------------------------------------------------------ encode errors


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.uint8, torch.bool, torch.complex64])
def test_encode_rejects_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(WireError, match="cannot be sent; allowed: float32, float16, bfloat16, int64"):
        encode(torch.zeros(3, dtype=dtype))


def test_encode_rejects_unknown_codec() -> None:
    with pytest.raises(WireError, match="unknown codec 'zstd'"):
        encode(torch.zeros(3), "zstd")


# ------------------------------------------------------------------ decode errors


def raw(dtype: str = "float32", shape=(2, 3), codec: str = "none", data: bytes | None = None) -> swarm_pb2.Tensor:
    numel = math.prod(shape) if all(d >= 0 for d in shape) else 0
    if data is None:
        data = b"\x00" * encoded_size(codec, DTYPES.get(dtype, torch.float32), numel)
    return swarm_pb2.Tensor(shape=list(shape), dtype=dtype, codec=codec, data=data)


@pytest.mark.parametrize("dtype", ["float64", "int32", "object", "", "FLOAT32"])
def test_dtype_not_allowed(dtype: str) -> None:
    with pytest.raises(WireError) as info:
        decode(raw(dtype=dtype, data=b"\x00" * 48), what="activations")
    msg = str(info.value)
    assert msg.startswith("activations:")
    assert f"dtype {dtype!r} is not allowed" in msg and "float32" in msg


def test_dtype_not_accepted_here() -> None:
    msg = encode(torch.zeros(2, 3))
    with pytest.raises(WireError, match=r"tokens: dtype float32 is not accepted here; expected one of int64"):
        decode(msg, allowed_dtypes=("int64",), what="tokens")
    assert decode(msg, allowed_dtypes=("float32", "float16")).shape == (2, 3)


@pytest.mark.parametrize("shape", [(-1,), (2, -3), (-1, -1)])
def test_negative_dimension(shape) -> None:
    with pytest.raises(WireError, match="negative dimension in shape"):
        decode(swarm_pb2.Tensor(shape=list(shape), dtype="float32", codec="none", data=b"\x00" * 4))


def test_too_many_elements() -> None:
    with pytest.raises(WireError, match=r"12 elements exceed the cap of 10"):
        decode(raw(shape=(3, 4)), max_elements=10)
    assert decode(raw(shape=(3, 4)), max_elements=12).shape == (3, 4)


def test_huge_claimed_shape_rejected_before_allocation() -> None:
    msg = swarm_pb2.Tensor(shape=[2**31, 2**31], dtype="float32", codec="none", data=b"")
    with pytest.raises(WireError, match="exceed the cap"):
        decode(msg)


@pytest.mark.parametrize(
    "expect, ok",
    [
        ((2, 3), True),
        ((None, 3), True),
        ((None, None), True),
        ((2, 4), False),
        ((3, None), False),
        ((2, 3, 1), False),
        ((6,), False),
    ],
)
def test_expect_shape(expect, ok: bool) -> None:
    msg = encode(torch.zeros(2, 3))
    if ok:
        assert decode(msg, expect_shape=expect).shape == (2, 3)
    else:
        with pytest.raises(WireError) as info:
            decode(msg, expect_shape=expect, what="hidden")
        text = str(info.value)
        assert "hidden: shape [2, 3] does not match the expected" in text
        assert str(["*" if e is None else e for e in expect]) in text


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("delta", [-1, 1, -3])
def test_byte_length_mismatch(codec: str, delta: int) -> None:
    msg = encode(sample((5, 7), torch.float32), codec)
    good = len(msg.data)
    msg.data = msg.data[:delta] if delta < 0 else msg.data + b"\x00" * delta
    with pytest.raises(WireError) as info:
        decode(msg, what="grad")
    text = str(info.value)
    assert f"grad: {good + delta} bytes do not match shape [5, 7] x float32 under codec {codec} ({good} bytes)" == text


def test_empty_payload_for_nonempty_shape() -> None:
    with pytest.raises(WireError, match="0 bytes do not match"):
        decode(swarm_pb2.Tensor(shape=[4], dtype="float32", codec="none", data=b""))


@pytest.mark.parametrize("codec", ["fp16", "bf16", "uint8", "blockwise8", "blockwise4", "blockwise2"])
def test_codec_on_int_tensor(codec: str) -> None:
    msg = swarm_pb2.Tensor(shape=[4], dtype="int64", codec=codec, data=b"\x00" * 32)
    with pytest.raises(WireError, match=f"codec {codec} is only for floating-point tensors, got int64"):
        decode(msg)


def test_unknown_codec_in_message() -> None:
    msg = swarm_pb2.Tensor(shape=[4], dtype="float32", codec="zstd", data=b"\x00" * 16)
    with pytest.raises(WireError, match="unknown codec 'zstd'"):
        decode(msg)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("codec", CODECS)
def test_non_finite_rejected(codec: str, bad: float) -> None:
    x = torch.ones(BLOCK_SIZE + 3)
    x[BLOCK_SIZE + 1] = bad
    with pytest.raises(WireError, match="grad: contains NaN or Inf values"):
        decode(encode(x, codec), what="grad")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_non_finite_rejected_every_dtype(dtype: torch.dtype) -> None:
    x = torch.tensor([1.0, float("nan")], dtype=dtype)
    with pytest.raises(WireError, match="NaN or Inf"):
        decode(encode(x))


def test_check_finite_can_be_disabled() -> None:
    x = torch.tensor([1.0, float("nan"), float("inf")])
    y = decode(encode(x), check_finite=False)
    assert y[0] == 1 and math.isnan(y[1]) and math.isinf(y[2])


def test_forged_nan_bytes_rejected() -> None:
    """A sender that crafts the raw bytes (no encode) still cannot slip a NaN through."""
    nan_bits = b"\x00\x00\xc0\x7f"  # float32 quiet NaN, little endian
    msg = swarm_pb2.Tensor(shape=[2], dtype="float32", codec="none", data=b"\x00\x00\x80\x3f" + nan_bits)
    with pytest.raises(WireError, match="NaN or Inf"):
        decode(msg)


def test_forged_uint8_header_with_inf_scale_rejected() -> None:
    header = torch.tensor([0.0, float("inf")], dtype=torch.float32).numpy().tobytes()
    msg = swarm_pb2.Tensor(shape=[3], dtype="float32", codec="uint8", data=header + bytes([0, 1, 2]))
    with pytest.raises(WireError, match="NaN or Inf"):
        decode(msg)


@pytest.mark.parametrize("codec", ["blockwise4", "blockwise2"])
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf")])
def test_forged_lowbit_scale_rejected(codec: str, scale: float) -> None:
    n = LOWBIT_BLOCK + 5
    good = encode(torch.ones(n), codec).data
    forged = good[:4] + torch.tensor([scale], dtype=torch.float32).numpy().tobytes() + good[8:]
    msg = swarm_pb2.Tensor(shape=[n], dtype="float32", codec=codec, data=forged)
    with pytest.raises(WireError, match="NaN or Inf"):
        decode(msg)


@pytest.mark.parametrize("codec", ["blockwise4", "blockwise2"])
def test_any_lowbit_code_a_sender_writes_stays_within_its_blocks_scale(codec: str) -> None:
    """Every code is a level in [-absmax, absmax]: random bytes under finite scales decode to bounded values."""
    n = 3 * LOWBIT_BLOCK
    scales = torch.tensor([0.5, 2.0, 1e30], dtype=torch.float32)
    codes = torch.randint(0, 256, (len(encode(torch.ones(n), codec).data) - 12,), dtype=torch.uint8)
    msg = swarm_pb2.Tensor(
        shape=[n], dtype="float32", codec=codec, data=scales.numpy().tobytes() + codes.numpy().tobytes()
    )
    y = decode(msg).view(3, LOWBIT_BLOCK)
    assert bool((y.abs() <= scales[:, None] * 1.0001).all())


def test_int_tensor_not_checked_for_finiteness() -> None:
    x = torch.tensor([1, 2, 3])
    assert torch.equal(decode(encode(x), check_finite=True), x)


def test_fp16_codec_keeps_large_finite_values_finite() -> None:
    x = torch.tensor([1e5, -7e4, 1.0])
    try:
        msg = encode(x, "fp16")
    except WireError:
        return  # refusing at encode time with a clear error would also be acceptable
    y = decode(msg)
    assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize("n", [CHUNK - 1, CHUNK, 2 * CHUNK + 5, 3 * CHUNK + 2 * BLOCK_SIZE + 7])
def test_8bit_codecs_chunked_match_a_one_pass_reference(n: int) -> None:
    """The chunked encoders write exactly the bytes of a plain one-pass quantizer; the decoders invert them."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    lo, hi = float(x.min()), float(x.max())
    scale = float(torch.tensor((hi - lo) / 255.0, dtype=torch.float32))
    lo32 = float(torch.tensor(lo, dtype=torch.float32))
    q = ((x - lo32) / scale).round().clamp(0, 255).to(torch.uint8)
    msg = encode(x, "uint8")
    header = torch.frombuffer(bytearray(msg.data[:8]), dtype=torch.float32)
    assert header.tolist() == pytest.approx([lo32, scale])
    mismatched = (torch.frombuffer(bytearray(msg.data[8:]), dtype=torch.uint8).int() - q.int()).abs()
    assert int(mismatched.max()) <= 1 and float((mismatched > 0).float().mean()) < 1e-3  # round-half ties only
    assert float((decode(msg) - x).abs().max()) <= scale * 0.51

    blocks = math.ceil(n / BLOCK_SIZE)
    padded = torch.nn.functional.pad(x, (0, blocks * BLOCK_SIZE - n)).view(blocks, BLOCK_SIZE)
    absmax = padded.abs().amax(dim=1)
    msg = encode(x, "blockwise8")
    sent = torch.frombuffer(bytearray(msg.data[: 4 * blocks]), dtype=torch.float32)
    assert torch.equal(sent, absmax)
    decoded = decode(msg)
    bound = (absmax / 127.0).repeat_interleave(BLOCK_SIZE)[:n] * 0.51
    assert bool(((decoded - x).abs() <= bound).all())
