"""Tensors on the wire: encode/decode, and validation of untrusted input.

A tensor travels as (shape, dtype, codec, bytes). Nothing is pickled. The
receiver checks the dtype against an allow-list, the codec against the
registry (:mod:`swarmpipe.peer.transport.codecs`), the element count against
a cap, the byte length against what shape x codec implies, and (for floats)
that every value is finite; any failure raises :class:`WireError` with a
message that the server returns as INVALID_ARGUMENT.
"""

from __future__ import annotations

import math

import torch

from swarmpipe.peer.transport import codecs
from swarmpipe.peer.transport.codecs import (  # noqa: F401 (re-exported)
    BLOCK_SIZE,
    CHUNK,
    MAX_ECHOED,
    all_finite,
    echo,
    raw_view,
)
from swarmpipe.protos import swarm_pb2

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")  # activations and gradients; tokens travel as int64


class WireError(ValueError):
    """Input from the network that cannot be accepted."""


def _codec(name: str) -> codecs.Codec:
    try:
        return codecs.get(name)
    except codecs.CodecError as e:
        raise WireError(str(e)) from None


def encoded_size(codec: str, dtype: torch.dtype, numel: int) -> int:
    """Exact byte length of ``numel`` values of ``dtype`` under ``codec``."""
    return _codec(codec).size(dtype, numel)


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
    chosen = _codec(codec)
    if chosen.float_only and not t.is_floating_point():
        chosen = codecs.REGISTRY["none"]
    data = chosen.encode(t.reshape(-1))
    return swarm_pb2.Tensor(shape=list(t.shape), dtype=DTYPE_NAMES[t.dtype], codec=chosen.name), data


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
        raise WireError(f"{what}: dtype {echo(msg.dtype)} is not allowed; allowed: {', '.join(DTYPES)}")
    if allowed_dtypes is not None and msg.dtype not in allowed_dtypes:
        raise WireError(f"{what}: dtype {msg.dtype} is not accepted here; expected one of {', '.join(allowed_dtypes)}")
    if len(msg.shape) > 8:
        raise WireError(f"{what}: {len(msg.shape)} dimensions; at most 8")
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
    codec = _codec(msg.codec or "none")
    if codec.float_only and not dtype.is_floating_point:
        raise WireError(f"{what}: codec {codec.name} is only for floating-point tensors, got {msg.dtype}")
    expected = codec.size(dtype, numel)
    data = msg.data  # read once: each read of a protobuf bytes field copies it
    if len(data) != expected:
        raise WireError(
            f"{what}: {len(data)} bytes do not match shape {list(shape)} x {msg.dtype} "
            f"under codec {codec.name} ({expected} bytes)"
        )
    t = codec.decode(data, dtype, numel).view(shape)
    if check_finite and dtype.is_floating_point and numel and not all_finite(t):
        raise WireError(f"{what}: contains NaN or Inf values")
    return t


def is_empty(msg: swarm_pb2.Tensor) -> bool:
    return not msg.dtype and not msg.shape and not msg.data
