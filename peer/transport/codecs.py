"""The codec registry: every tensor codec the swarm speaks, in one place.

One :class:`Codec` record per codec holds everything the rest of the code asks about it: its bytes per
value, whether it is lossy, whether it is only for floating-point tensors, how fast it encodes and
decodes, which roles ``auto`` may pick it for, and its encoder, decoder and exact encoded size. Spec
validation, the wire format, the per-link codec policy, error feedback, the trainer's calls and the
stage server all read this table: a new codec is one new record here.

The 8-bit codecs are written here in vectorised torch rather than taken from hivemind.compression:
hivemind 1.1.12's 8-bit quantizers fail under numpy 2 and its blockwise codec needs bitsandbytes,
which has no CPU wheel here. Encoders take a flat CPU tensor and return a buffer; decoders take the
buffer and return a flat tensor of the requested dtype.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

# torch.frombuffer over an immutable ``bytes`` warns; decoded tensors are treated as read-only.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

AUTO = "auto"  # not a codec: "choose one per link from the bandwidth measured to it"
ROLES = ("activations", "gradients", "state")
AUTO_ROLES = ("activations", "gradients")  # state moves once per join: a fixed codec, chosen in the spec
BLOCK_SIZE = 1024  # blockwise8: one absmax scale per block of this many values
CHUNK = 1 << 18  # 8-bit codecs work through 1 MiB of float32 at a time: every pass stays in cache
MAX_ECHOED = 64  # characters of a caller's string that an error message repeats (see echo)
FP16_MAX = 65504.0

Buffer = memoryview | bytearray | bytes


class CodecError(ValueError):
    """An unknown codec name, or a codec used where it does not apply."""


@dataclass(frozen=True)
class Codec:
    name: str
    bytes_per_value: float  # on the wire, for large tensors (headers and scales amortised)
    lossy: bool
    float_only: bool  # integer tensors always travel as "none"
    gbps: float  # encode + decode speed on one core, GB/s of float32 input (bench/codecs.py, rounded down)
    auto_roles: tuple[str, ...]  # roles for which "auto" may choose this codec
    encode: Callable[[torch.Tensor], Buffer]
    decode: Callable[[Buffer, torch.dtype, int], torch.Tensor]
    size: Callable[[torch.dtype, int], int]  # exact byte length of numel values of dtype
    # gradients sent in this codec carry what it lost into the next one (the sender keeps the residual)
    error_feedback: bool = False

    def wire_ratio(self) -> float:
        """Bytes on the wire per byte of float32 input."""
        return self.bytes_per_value / 4


# ---------------------------------------------------------------- raw buffers
def raw_view(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor as a flat memoryview over its storage (no copy when contiguous)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def from_raw(data: Buffer, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    if dtype == torch.bfloat16:
        return torch.frombuffer(data, dtype=torch.int16, count=count, offset=offset).view(torch.bfloat16)
    return torch.frombuffer(data, dtype=dtype, count=count, offset=offset)


def all_finite(t: torch.Tensor) -> bool:
    """True when no value is NaN or Inf: a finite sum proves it in one cheap pass (NaN/Inf propagate);
    only a non-finite sum (overflow, or a real NaN/Inf) pays for the exact element-wise check."""
    if not t.numel():
        return True
    if bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(t).all())


# ---------------------------------------------------------------- 16-bit
def _encode_fp16(flat: torch.Tensor) -> Buffer:
    """Saturate instead of overflowing to inf, which the receiver would reject; inf and NaN stay."""
    if all_finite(flat):
        saturated = flat.clamp(-FP16_MAX, FP16_MAX)
    else:
        saturated = torch.where(flat.isinf(), flat, flat.clamp(-FP16_MAX, FP16_MAX))
    return raw_view(saturated.to(torch.float16))


# ---------------------------------------------------------------- uint8: per-tensor min and scale
def _quantize(t: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """round(t / scale) saturated to ``dtype``'s range in one fused pass (torch's per-tensor quantizer)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fused per-tensor quantizer is deprecated upstream, still fastest
        return torch.quantize_per_tensor(t, scale, 0, dtype).int_repr()


def _encode_uint8(flat: torch.Tensor) -> Buffer:
    flat = flat.float()
    if flat.numel():
        lo_t, hi_t = torch.aminmax(flat)
        lo, hi = lo_t.item(), hi_t.item()
    else:
        lo = hi = 0.0
    if not (math.isfinite(lo) and math.isfinite(hi)):  # NaN/Inf: the slow way; the receiver rejects it
        scale = (hi - lo) / 255.0 or 1.0  # a NaN/Inf scale in the header makes the decoded tensor non-finite
        q = ((flat - lo) / scale).nan_to_num_(0.0).round_().clamp_(0, 255).to(torch.uint8)
        return bytes(raw_view(torch.tensor([lo, scale], dtype=torch.float32))) + bytes(raw_view(q))
    # float32 header: round the scale through float32 so sender and receiver use the same one
    scale = float(torch.tensor((hi - lo) / 255.0, dtype=torch.float32)) or 1.0
    lo = float(torch.tensor(lo, dtype=torch.float32))
    out = bytearray(8 + flat.numel())  # quantized straight into the message buffer, chunk by chunk
    torch.frombuffer(out, dtype=torch.float32, count=2).copy_(torch.tensor([lo, scale]))
    if flat.numel():
        q_out = torch.frombuffer(out, dtype=torch.uint8, offset=8)
        for i in range(0, flat.numel(), CHUNK):
            chunk = flat[i : i + CHUNK]
            q_out[i : i + chunk.numel()].copy_(_quantize(chunk - lo, scale, torch.quint8))
    return out


def _decode_uint8(data: Buffer, dtype: torch.dtype, numel: int) -> torch.Tensor:
    lo, scale = from_raw(data, torch.float32, 2).tolist()
    q = from_raw(data, torch.uint8, numel, offset=8)
    out = torch.empty(numel, dtype=torch.float32)
    lo_t = torch.tensor(lo, dtype=torch.float32)
    for i in range(0, numel, CHUNK):  # lo + scale * q in one fused pass per cache-sized chunk
        torch.add(lo_t, q[i : i + CHUNK], alpha=scale, out=out[i : i + CHUNK])
    return out.to(dtype)


# ---------------------------------------------------------------- blockwise8: absmax per block
def _encode_blockwise8(flat: torch.Tensor) -> Buffer:
    """[absmax per block, float32][int8 values]. Full blocks are read in place; a ragged last block
    is quantized as one short row (its absmax over its own values equals that of a zero-padded
    block), so nothing is padded or copied."""
    n = flat.numel()
    if not n:
        return b""
    flat = flat.float().contiguous()
    blocks, full = math.ceil(n / BLOCK_SIZE), n // BLOCK_SIZE
    out = bytearray(4 * blocks + n)  # filled chunk by chunk
    absmax_out = torch.frombuffer(out, dtype=torch.float32, count=blocks)
    q_out = torch.frombuffer(out, dtype=torch.int8, offset=4 * blocks)
    body = flat[: full * BLOCK_SIZE].view(full, BLOCK_SIZE)
    rows_per_chunk = CHUNK // BLOCK_SIZE
    for b in range(0, full, rows_per_chunk):
        rows = body[b : b + rows_per_chunk]
        _quantize_rows(
            rows, absmax_out[b : b + rows.shape[0]], q_out[b * BLOCK_SIZE : (b + rows.shape[0]) * BLOCK_SIZE]
        )
    if n > full * BLOCK_SIZE:
        _quantize_rows(flat[full * BLOCK_SIZE :].view(1, -1), absmax_out[full:], q_out[full * BLOCK_SIZE :])
    return out


def _quantize_rows(rows: torch.Tensor, absmax_out: torch.Tensor, q_out: torch.Tensor) -> None:
    """One absmax scale per row into ``absmax_out``; the row's values as int8 into ``q_out``."""
    absmax = rows.abs().amax(dim=1).clamp_(min=1e-12)
    absmax_out.copy_(absmax)
    if all_finite(absmax):
        # |x| / absmax * 127 lies in [-127, 127]: the fused quantizer rounds and casts in one pass
        q = _quantize(rows * (127.0 / absmax)[:, None], 1.0, torch.qint8).view(torch.int8)
    else:  # NaN/Inf go as they are (the receiver rejects them)
        q = (rows / absmax[:, None] * 127.0).round_().clamp_(-127, 127).to(torch.int8)
    q_out.copy_(q.reshape(-1))


def _decode_blockwise8(data: Buffer, dtype: torch.dtype, numel: int) -> torch.Tensor:
    blocks = math.ceil(numel / BLOCK_SIZE)
    out = torch.empty(numel, dtype=torch.float32)
    if not numel:
        return out.to(dtype)
    scales = from_raw(data, torch.float32, blocks) / 127.0
    q = from_raw(data, torch.int8, numel, offset=4 * blocks)
    full = numel // BLOCK_SIZE
    rows_per_chunk = CHUNK // BLOCK_SIZE
    for b in range(0, full, rows_per_chunk):
        rows = min(rows_per_chunk, full - b)
        span = slice(b * BLOCK_SIZE, (b + rows) * BLOCK_SIZE)
        torch.mul(q[span].view(rows, BLOCK_SIZE), scales[b : b + rows, None], out=out[span].view(rows, BLOCK_SIZE))
    if numel > full * BLOCK_SIZE:  # the ragged last block
        torch.mul(q[full * BLOCK_SIZE :], scales[full], out=out[full * BLOCK_SIZE :])
    return out.to(dtype)


# ---------------------------------------------------------------- blockwise4 / blockwise2: packed low-bit codes
LOWBIT_BLOCK = 128  # one float32 absmax per 128 values: 0.25 bits of scale per value


def _lowbit_size(bits: int, numel: int) -> int:
    blocks = math.ceil(numel / LOWBIT_BLOCK)
    return 4 * blocks + blocks * LOWBIT_BLOCK * bits // 8


def _encode_lowbit(flat: torch.Tensor, bits: int) -> Buffer:
    """[absmax per block, float32][codes, ``8 // bits`` per byte, low bits first]. Code c stands for
    ``absmax * (c - h) / h`` with ``h = (2**bits - 1) / 2``: the 2**bits levels are spread evenly over
    [-absmax, absmax] and every code a sender can write is a valid level (no code to reject, no zero level:
    error feedback carries the rounding away on gradients). A ragged last block is padded with zeros."""
    n = flat.numel()
    if not n:
        return b""
    blocks = math.ceil(n / LOWBIT_BLOCK)
    x = torch.zeros(blocks * LOWBIT_BLOCK, dtype=torch.float32)
    x[:n] = flat.float()
    x = x.view(blocks, LOWBIT_BLOCK)
    absmax = x.abs().amax(dim=1).clamp_(min=1e-12)
    half = (2**bits - 1) / 2
    # NaN/Inf make a non-finite absmax, which goes as it is: the receiver's finiteness check rejects it
    codes = (x / absmax[:, None] * half + half).round_().clamp_(0, 2**bits - 1).to(torch.uint8)
    per_byte = 8 // bits
    codes = codes.view(-1, per_byte)
    packed = codes[:, 0].clone()
    for i in range(1, per_byte):
        packed |= codes[:, i] << (bits * i)
    out = bytearray(_lowbit_size(bits, n))
    torch.frombuffer(out, dtype=torch.float32, count=blocks).copy_(absmax)
    torch.frombuffer(out, dtype=torch.uint8, offset=4 * blocks).copy_(packed)
    return out


def _decode_lowbit(data: Buffer, dtype: torch.dtype, numel: int, bits: int) -> torch.Tensor:
    if not numel:
        return torch.empty(0, dtype=dtype)
    blocks = math.ceil(numel / LOWBIT_BLOCK)
    per_byte = 8 // bits
    scales = from_raw(data, torch.float32, blocks)
    packed = from_raw(data, torch.uint8, blocks * LOWBIT_BLOCK // per_byte, offset=4 * blocks)
    mask = 2**bits - 1
    codes = torch.stack([(packed >> (bits * i)) & mask for i in range(per_byte)], dim=1).view(blocks, LOWBIT_BLOCK)
    half = mask / 2
    values = (codes.float() - half) * (scales / half)[:, None]
    return values.view(-1)[:numel].to(dtype)


def _lowbit_codec(bits: int) -> Codec:
    return Codec(
        f"blockwise{bits}",
        _lowbit_size(bits, LOWBIT_BLOCK) / LOWBIT_BLOCK,
        lossy=True,
        float_only=True,
        gbps=0.3,
        auto_roles=(),
        encode=lambda flat: _encode_lowbit(flat, bits),
        decode=lambda data, dtype, n: _decode_lowbit(data, dtype, n, bits),
        size=lambda dtype, n: _lowbit_size(bits, n),
        error_feedback=True,
    )


# ---------------------------------------------------------------- the registry
REGISTRY: dict[str, Codec] = {
    c.name: c
    for c in (
        Codec(
            "none",
            4.0,
            lossy=False,
            float_only=False,
            gbps=4.0,
            auto_roles=("activations", "gradients", "state"),
            encode=raw_view,
            decode=lambda data, dtype, n: from_raw(data, dtype, n),
            size=lambda dtype, n: n * dtype.itemsize,
        ),
        Codec(
            "fp16",
            2.0,
            lossy=True,
            float_only=True,
            gbps=2.0,
            auto_roles=("activations", "gradients", "state"),
            encode=_encode_fp16,
            decode=lambda data, dtype, n: from_raw(data, torch.float16, n).to(dtype),
            size=lambda dtype, n: 2 * n,
        ),
        Codec(
            "bf16",
            2.0,
            lossy=True,
            float_only=True,
            gbps=3.0,
            auto_roles=(),
            encode=lambda flat: raw_view(flat.to(torch.bfloat16)),
            decode=lambda data, dtype, n: from_raw(data, torch.bfloat16, n).to(dtype),
            size=lambda dtype, n: 2 * n,
        ),
        Codec(
            "uint8",
            1.0,
            lossy=True,
            float_only=True,
            gbps=1.2,
            auto_roles=(),
            encode=_encode_uint8,
            decode=_decode_uint8,
            size=lambda dtype, n: 8 + n,
            error_feedback=True,
        ),
        # error feedback (peer/transport/codec_policy.py) removes its bias on gradients
        Codec(
            "blockwise8",
            1.0 + 4 / BLOCK_SIZE,
            lossy=True,
            float_only=True,
            gbps=1.0,
            auto_roles=("activations", "gradients"),
            encode=_encode_blockwise8,
            decode=_decode_blockwise8,
            size=lambda dtype, n: 4 * math.ceil(n / BLOCK_SIZE) + n,
            error_feedback=True,
        ),
        # 4 and 2 bits a value (plus a scale per 128): for the slowest links, and gradients under error feedback;
        # not among auto's choices (their loss is measured in bench/codecs.py, not yet weighed per link)
        _lowbit_codec(4),
        _lowbit_codec(2),
    )
}


def echo(value: str) -> str:
    """A caller's string as an error message repeats it: its repr, cut to about ``MAX_ECHOED`` characters
    (a 10 kB dtype string must not come back 10 kB, nor its escapes blow a short one up)."""
    text = repr(value[: MAX_ECHOED + 1])
    if len(value) <= MAX_ECHOED and len(text) <= MAX_ECHOED + 2:
        return text
    return f"{text[:MAX_ECHOED]}... ({len(value)} characters)"


def get(name: str) -> Codec:
    """The codec called ``name``; an unknown name raises :class:`CodecError` (a ValueError)."""
    codec = REGISTRY.get(name)
    if codec is None:
        raise CodecError(f"unknown codec {echo(name)}; known: {', '.join(REGISTRY)}")
    return codec


def allowed_in_spec(role: str) -> tuple[str, ...]:
    """What ``[compression] <role>`` may name: every codec, and "auto" where a link chooses per call."""
    return tuple(REGISTRY) + ((AUTO,) if role in AUTO_ROLES else ())


def auto_candidates(role: str) -> tuple[str, ...]:
    """The codecs ``auto`` chooses among for ``role``."""
    return tuple(c.name for c in REGISTRY.values() if role in c.auto_roles)


def resolve(name: str, fallback: str = "fp16") -> str:
    """A concrete codec for an encoder: "" and "auto" (a caller that did not choose) become ``fallback``."""
    return fallback if name in ("", AUTO) else get(name).name
