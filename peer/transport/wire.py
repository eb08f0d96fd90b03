"""Tensors on the wire: codecs, encode/decode, and validation of untrusted input.

A tensor travels as (shape, dtype, codec, bytes). Nothing is pickled. The
receiver checks the dtype against an allow-list, the element count against a
cap, the byte length against what shape x codec implies, and (for floats)
that every value is finite; any failure raises :class:`WireError` with a
message that the server returns as INVALID_ARGUMENT.

The codecs are written here in vectorised torch rather than taken from
hivemind.compression: hivemind 1.1.12's 8-bit quantizers fail under numpy 2
and its blockwise codec needs bitsandbytes, which has no CPU wheel here.
"""
from __future__ import annotations

import math
import warnings

import torch

from swarmpipe.protos import swarm_pb2

# torch.frombuffer over an immutable ``bytes`` warns; decoded tensors are treated as read-only.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FLOAT_CODECS = ("fp16", "bf16", "uint8", "blockwise8")
BLOCK_SIZE = 1024
CHUNK = 1 << 18  # 8-bit codecs work through 1 MiB of float32 at a time: every pass stays in cache
FP16_MAX = 65504.0  # blockwise8: one absmax scale per block of this many values


class WireError(ValueError):
    """Input from the network that cannot be accepted."""


def raw_view(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor as a flat memoryview over its storage (no copy when contiguous)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def all_finite(t: torch.Tensor) -> bool:
    """True when no value is NaN or Inf: a finite sum proves it in one cheap pass (NaN/Inf propagate);
    only a non-finite sum (overflow, or a real NaN/Inf) pays for the exact element-wise check."""
    if not t.numel():
        return True
    if bool(torch.isfinite(t.sum(dtype=torch.float32))):  # overflow only costs the exact check below
        return True
    return bool(torch.isfinite(t).all())


def _from_raw(data: bytes | memoryview, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    if dtype == torch.bfloat16:
        return torch.frombuffer(data, dtype=torch.int16, count=count, offset=offset).view(torch.bfloat16)
    return torch.frombuffer(data, dtype=dtype, count=count, offset=offset)


def encoded_size(codec: str, dtype: torch.dtype, numel: int) -> int:
    """Exact byte length of ``numel`` values of ``dtype`` under ``codec``."""
    if codec == "none":
        return numel * dtype.itemsize
    if codec in ("fp16", "bf16"):
        return numel * 2
    if codec == "uint8":
        return 8 + numel
    if codec == "blockwise8":
        return 4 * math.ceil(numel / BLOCK_SIZE) + numel
    raise WireError(f"unknown codec {codec!r}")


def encode(t: torch.Tensor, codec: str = "none") -> swarm_pb2.Tensor:
    """Tensor -> message. Non-float tensors always go uncompressed."""
    header, payload = encode_parts(t, codec)
    header.data = payload if isinstance(payload, bytes) else bytes(payload)  # the one copy into the message
    return header


def encode_parts(t: torch.Tensor, codec: str = "none") -> tuple[swarm_pb2.Tensor, memoryview | bytearray | bytes]:
    """Tensor -> (message without its data, the data as a buffer). For ``none`` (and fp16/bf16) the
    buffer is a view of tensor storage: a streamed call frames it without ever copying it into a
    protobuf bytes field (each such copy, and each read back out of one, costs a pass over the data)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype not in DTYPE_NAMES:
        raise WireError(f"dtype {t.dtype} cannot be sent; allowed: {', '.join(DTYPES)}")
    if not t.is_floating_point():
        codec = "none"
    flat = t.reshape(-1)
    if codec == "none":
        data = raw_view(flat)
    elif codec == "fp16":  # saturate instead of overflowing to inf, which the receiver would reject
        if all_finite(flat):
            saturated = flat.clamp(-FP16_MAX, FP16_MAX)
        else:  # inf stays inf (and NaN NaN): the receiver rejects them
            saturated = torch.where(flat.isinf(), flat, flat.clamp(-FP16_MAX, FP16_MAX))
        data = raw_view(saturated.to(torch.float16))
    elif codec == "bf16":
        data = raw_view(flat.to(torch.bfloat16))
    elif codec == "uint8":
        data = _encode_uint8(flat.float())
    elif codec == "blockwise8":
        data = _encode_blockwise8(flat.float())
    else:
        raise WireError(f"unknown codec {codec!r}")
    return swarm_pb2.Tensor(shape=list(t.shape), dtype=DTYPE_NAMES[t.dtype], codec=codec), data


def _quantize(t: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """round(t / scale) saturated to ``dtype``'s range in one fused pass (torch's per-tensor quantizer)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fused per-tensor quantizer is deprecated upstream, still fastest
        return torch.quantize_per_tensor(t, scale, 0, dtype).int_repr()


def _encode_uint8(flat: torch.Tensor) -> bytes | bytearray:
    if flat.numel():
        lo_t, hi_t = torch.aminmax(flat)
        lo, hi = lo_t.item(), hi_t.item()
    else:
        lo = hi = 0.0
    if not (math.isfinite(lo) and math.isfinite(hi)):  # NaN/Inf: send the old slow way; the receiver rejects it
        scale = (hi - lo) / 255.0 or 1.0  # a NaN/Inf scale in the header makes the decoded tensor non-finite
        q = ((flat - lo) / scale).nan_to_num_(0.0).round_().clamp_(0, 255).to(torch.uint8)
        header = torch.tensor([lo, scale], dtype=torch.float32)
        return bytes(raw_view(header)) + bytes(raw_view(q))
    # float32 header: round the scale through float32 so sender and receiver use the same one
    scale = float(torch.tensor((hi - lo) / 255.0, dtype=torch.float32)) or 1.0
    lo = float(torch.tensor(lo, dtype=torch.float32))
    out = bytearray(8 + flat.numel())  # quantized straight into the message buffer, chunk by chunk
    torch.frombuffer(out, dtype=torch.float32, count=2).copy_(torch.tensor([lo, scale]))
    if flat.numel():
        q_out = torch.frombuffer(out, dtype=torch.uint8, offset=8)
        for i in range(0, flat.numel(), CHUNK):
            chunk = flat[i:i + CHUNK]
            q_out[i:i + chunk.numel()].copy_(_quantize(chunk - lo, scale, torch.quint8))
    return out


def _encode_blockwise8(flat: torch.Tensor) -> bytes | bytearray:
    """[absmax per block, float32][int8 values]. Full blocks are read in place; a ragged last block
    is quantized as one short row (its absmax over its own values equals that of a zero-padded
    block), so nothing is padded or copied."""
    n = flat.numel()
    if not n:
        return b""
    flat = flat.contiguous()
    blocks, full = math.ceil(n / BLOCK_SIZE), n // BLOCK_SIZE
    out = bytearray(4 * blocks + n)  # filled chunk by chunk
    absmax_out = torch.frombuffer(out, dtype=torch.float32, count=blocks)
    q_out = torch.frombuffer(out, dtype=torch.int8, offset=4 * blocks)
    body = flat[:full * BLOCK_SIZE].view(full, BLOCK_SIZE)
    rows_per_chunk = CHUNK // BLOCK_SIZE
    for b in range(0, full, rows_per_chunk):
        rows = body[b:b + rows_per_chunk]
        _quantize_rows(rows, absmax_out[b:b + rows.shape[0]], q_out[b * BLOCK_SIZE:(b + rows.shape[0]) * BLOCK_SIZE])
    if n > full * BLOCK_SIZE:
        _quantize_rows(flat[full * BLOCK_SIZE:].view(1, -1), absmax_out[full:], q_out[full * BLOCK_SIZE:])
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


def decode(
    msg: swarm_pb2.Tensor,
    *,
    max_elements: int = 1 << 26,
    allowed_dtypes: tuple[str, ...] | None = None,
    expect_shape: tuple[int | None, ...] | None = None,
    check_finite: bool = True,
    what: str = "tensor",
) -> torch.Tensor:
    """Message -> tensor, validating everything an untrusted sender controls."""
    if msg.dtype not in DTYPES:
        raise WireError(f"{what}: dtype {msg.dtype!r} is not allowed; allowed: {', '.join(DTYPES)}")
    if allowed_dtypes is not None and msg.dtype not in allowed_dtypes:
        raise WireError(f"{what}: dtype {msg.dtype} is not accepted here; expected one of {', '.join(allowed_dtypes)}")
    shape = tuple(int(d) for d in msg.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"{what}: negative dimension in shape {list(shape)}")
    numel = math.prod(shape)
    if numel > max_elements:
        raise WireError(f"{what}: {numel} elements exceed the cap of {max_elements}")
    if expect_shape is not None:
        if len(shape) != len(expect_shape) or any(e is not None and e != d for e, d in zip(expect_shape, shape)):
            pretty = ["*" if e is None else e for e in expect_shape]
            raise WireError(f"{what}: shape {list(shape)} does not match the expected {pretty}")
    dtype = DTYPES[msg.dtype]
    codec = msg.codec or "none"
    if codec != "none" and not dtype.is_floating_point:
        raise WireError(f"{what}: codec {codec} is only for floating-point tensors, got {msg.dtype}")
    expected = encoded_size(codec, dtype, numel)
    data = msg.data  # read once: each read of a protobuf bytes field copies it
    if len(data) != expected:
        raise WireError(f"{what}: {len(data)} bytes do not match shape {list(shape)} x {msg.dtype} under codec {codec} ({expected} bytes)")
    t = _decode_payload(data, codec, dtype, numel).view(shape)
    if check_finite and dtype.is_floating_point and numel and not all_finite(t):
        raise WireError(f"{what}: contains NaN or Inf values")
    return t


def _decode_payload(data: bytes, codec: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
    if codec == "none":
        return _from_raw(data, dtype, numel)
    if codec == "fp16":
        return _from_raw(data, torch.float16, numel).to(dtype)
    if codec == "bf16":
        return _from_raw(data, torch.bfloat16, numel).to(dtype)
    if codec == "uint8":
        lo, scale = _from_raw(data, torch.float32, 2).tolist()
        q = _from_raw(data, torch.uint8, numel, offset=8)
        out = torch.empty(numel, dtype=torch.float32)
        lo_t = torch.tensor(lo, dtype=torch.float32)
        for i in range(0, numel, CHUNK):  # lo + scale * q in one fused pass per cache-sized chunk
            torch.add(lo_t, q[i:i + CHUNK], alpha=scale, out=out[i:i + CHUNK])
        return out.to(dtype)
    if codec == "blockwise8":
        return _decode_blockwise8(data, numel).to(dtype)
    raise WireError(f"unknown codec {codec!r}")


def _decode_blockwise8(data: bytes, numel: int) -> torch.Tensor:
    blocks = math.ceil(numel / BLOCK_SIZE)
    out = torch.empty(numel, dtype=torch.float32)
    if not numel:
        return out
    scales = _from_raw(data, torch.float32, blocks) / 127.0
    q = _from_raw(data, torch.int8, numel, offset=4 * blocks)
    full = numel // BLOCK_SIZE
    rows_per_chunk = CHUNK // BLOCK_SIZE
    for b in range(0, full, rows_per_chunk):
        rows = min(rows_per_chunk, full - b)
        span = slice(b * BLOCK_SIZE, (b + rows) * BLOCK_SIZE)
        torch.mul(q[span].view(rows, BLOCK_SIZE), scales[b:b + rows, None], out=out[span].view(rows, BLOCK_SIZE))
    if numel > full * BLOCK_SIZE:  # the ragged last block
        torch.mul(q[full * BLOCK_SIZE:], scales[full], out=out[full * BLOCK_SIZE:])
    return out


def is_empty(msg: swarm_pb2.Tensor) -> bool:
    return not msg.dtype and not msg.shape and not msg.data
