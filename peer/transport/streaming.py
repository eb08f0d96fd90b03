"""Chunked streaming of large stage requests and responses (``rpc Stream``).

A message whose tensors exceed the streaming threshold travels as frames: a first frame with
the method, the message without its tensors' bytes, each tensor's byte length, and the first
chunk of bytes; then the rest in chunks of ``chunk_bytes``, so no single gRPC message approaches
the cap and every buffer stays small. (Every gRPC message is one more round through both event
loops; a 1 MiB tensor goes in a single frame.) The receiver checks the total against
``max_total_bytes``, keeps a tensor that came whole in one frame as a view of it, copies one
spread over several frames into a buffer of its own, and decodes without a further copy
(``swarmpipe.peer.transport.wire.decode`` reads a :class:`TensorView` like a ``swarm_pb2.Tensor``).
A stream that ends early, overruns, or lies about its sizes raises :class:`WireError`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass

import grpc

from swarmpipe.peer.transport.wire import WireError, echo
from swarmpipe.protos import swarm_pb2

# method -> (request class, response class, request tensor fields, response tensor fields)
METHODS = {
    "Forward": (swarm_pb2.ForwardRequest, swarm_pb2.ForwardResponse, ("input",), ("output",)),
    "Backward": (swarm_pb2.BackwardRequest, swarm_pb2.BackwardResponse, ("grad_output", "input"), ("grad_input",)),
    "ForwardBackward": (
        swarm_pb2.ForwardBackwardRequest,
        swarm_pb2.ForwardBackwardResponse,
        ("input", "targets"),
        ("grad_input",),
    ),
    "Chain": (swarm_pb2.ChainRequest, swarm_pb2.ChainResponse, ("input", "targets"), ("grad_input",)),  # chain_rpc.py
    "ChainHandover": (swarm_pb2.HandoverRequest, swarm_pb2.HandoverResponse, (), ("output",)),
    "ChainResume": (swarm_pb2.ResumeRequest, swarm_pb2.ResumeResponse, ("grad_output",), ()),
}
MB = 1 << 20
DEFAULT_CHUNK = 1 * MB
DEFAULT_THRESHOLD = 1 * MB
MAX_HEADER = 64 * 1024


@dataclass
class TensorView:
    """A received tensor: the ``swarm_pb2.Tensor`` fields, with ``data`` a buffer we own (no copy)."""

    shape: list
    dtype: str
    codec: str
    data: bytearray | bytes | memoryview


class Reassembled:
    """A streamed message: attributes read from its header, tensor fields as :class:`TensorView`."""

    def __init__(self, header, tensors: dict[str, TensorView]):
        self._header = header
        self._tensors = tensors

    def __getattr__(self, name: str):
        tensors = self.__dict__.get("_tensors", {})
        if name in tensors:
            return tensors[name]
        return getattr(self.__dict__["_header"], name)

    def ByteSize(self) -> int:
        return self._header.ByteSize() + sum(len(t.data) for t in self._tensors.values())


# ------------------------------------------------------------------ sending


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def data_frame_bytes(chunk: memoryview, prefix: bytes = b"") -> bytes:
    """A serialized ``Frame{data: chunk}`` built with one copy (field 4, wire type 2), after ``prefix``
    (other serialized Frame fields: a serialized message is its fields concatenated)."""
    return b"".join((prefix, b"\x22", _varint(len(chunk)), chunk))


def _split_payloads(msg, fields: Iterable[str], payloads: list | None):
    """(header message with empty tensor data, [memoryview of each tensor's bytes])."""
    header = type(msg)()
    header.CopyFrom(msg)
    views = []
    for i, name in enumerate(fields):
        if payloads is not None and payloads[i] is not None:
            views.append(memoryview(payloads[i]).cast("B"))
        else:
            views.append(memoryview(getattr(msg, name).data))  # one copy out of the protobuf
        if header.HasField(name):
            getattr(header, name).data = b""
    return header, views


def frames(
    msg, fields: Iterable[str], *, method: str = "", chunk_bytes: int = DEFAULT_CHUNK, payloads: list | None = None
) -> Iterator[bytes]:
    """Serialized frames for ``msg``. ``payloads[i]`` (optional) gives field i's bytes directly, e.g. a
    memoryview over tensor storage, so the data is copied only into the frames themselves."""
    fields = tuple(fields)
    header, views = _split_payloads(msg, fields, payloads)
    first = swarm_pb2.Frame(
        method=method, header=header.SerializeToString(), data_bytes=[len(v) for v in views]
    ).SerializeToString()
    chunks = (v[start : start + chunk_bytes] for v in views for start in range(0, len(v), chunk_bytes))
    chunk = next(chunks, None)
    yield first if chunk is None else data_frame_bytes(chunk, prefix=first)  # the first chunk rides along
    for chunk in chunks:
        yield data_frame_bytes(chunk)


# ------------------------------------------------------------------ receiving


def _parse_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(buf) and shift < 64:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
    raise WireError("malformed frame: bad length prefix")


def _field_value(buf, pos: int, wire_type: int) -> tuple[int, int]:
    """(start, end) of the value of a field whose tag ends at ``pos``."""
    if wire_type == 0:
        return pos, _parse_varint(buf, pos)[1]
    if wire_type == 1:
        return pos, pos + 8
    if wire_type == 2:
        length, start = _parse_varint(buf, pos)
        return start, start + length
    if wire_type == 5:
        return pos, pos + 4
    raise WireError(f"malformed frame: wire type {wire_type}")


def _first_frame(raw) -> tuple[swarm_pb2.Frame, memoryview | bytes]:
    """A first frame: (its small fields, parsed; its ``data`` as a view of ``raw``, not a copy)."""
    if isinstance(raw, swarm_pb2.Frame):
        return raw, raw.data
    buf = memoryview(raw)
    pos, data, rest = 0, memoryview(b""), []
    while pos < len(buf):
        start = pos
        tag, pos = _parse_varint(buf, pos)
        value, end = _field_value(buf, pos, tag & 7)
        if end > len(buf):
            raise WireError("malformed frame: a field runs past its end")
        if tag == 0x22:  # field 4 (data), length-delimited
            data = buf[value:end]
        else:
            rest.append(buf[start:end])
        pos = end
    return _frame(b"".join(rest)), data


def _frame(raw) -> swarm_pb2.Frame:
    """A first frame: parsed as a protobuf (it is small)."""
    if isinstance(raw, swarm_pb2.Frame):
        return raw
    try:
        return swarm_pb2.Frame.FromString(raw)
    except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError subclasses
        raise WireError(f"malformed frame: {e}") from None


def _frame_data(raw) -> memoryview | bytes:
    """A data frame's bytes. Raw frames (no protobuf deserializer on the call) of the exact form
    ``Frame{data}`` are sliced without a copy; anything else goes through protobuf."""
    if isinstance(raw, swarm_pb2.Frame):
        return raw.data
    if raw[:1] == b"\x22":
        length, start = _parse_varint(raw, 1)
        if start + length == len(raw):
            return memoryview(raw)[start:]
    return _frame(raw).data


async def reassemble(
    stream: AsyncIterator[swarm_pb2.Frame | bytes],
    *,
    max_total_bytes: int,
    expect_method: str | None = None,
    what: str = "stream",
) -> tuple[str, Reassembled]:
    """Read a whole framed message; ``expect_method`` None means it is a request (method in frame 1).
    Frames may be ``Frame`` messages or their raw serialized bytes (the fast path: no protobuf copies)."""
    first = None
    async for first in stream:  # noqa: B007 - only the first frame is read here
        break
    if first is None:
        raise WireError(f"{what}: ended before its first frame")
    first, first_chunk = _first_frame(first)
    method = expect_method or first.method
    if method not in METHODS:
        raise WireError(f"{what}: unknown method {echo(first.method)}; expected one of {', '.join(METHODS)}")
    req_cls, resp_cls, req_fields, resp_fields = METHODS[method]
    cls, fields = (resp_cls, resp_fields) if expect_method else (req_cls, req_fields)
    sizes = list(first.data_bytes)
    if len(sizes) != len(fields):
        raise WireError(f"{what}: {len(sizes)} tensor sizes given, {method} has {len(fields)} tensor fields")
    if any(s < 0 for s in sizes):
        raise WireError(f"{what}: negative tensor size")
    total = sum(sizes)
    if total > max_total_bytes:
        raise WireError(f"{what}: {total} bytes exceed the stream cap of {max_total_bytes}")
    if len(first.header) > MAX_HEADER:
        raise WireError(f"{what}: header of {len(first.header)} bytes exceeds {MAX_HEADER}")
    try:
        header = cls.FromString(first.header)
    except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError subclasses
        raise WireError(f"{what}: malformed header: {e}") from None
    # A tensor that arrives whole in one frame is kept as a view of that frame (no copy); one spread
    # over several frames is copied into a buffer of its own as its pieces come. The buffer grows with
    # the bytes that arrived, never to the declared size up front: a caller that declares a gigabyte and
    # sends a byte costs a byte.
    buffers: list[bytearray | memoryview | None] = [None] * len(sizes)
    index, filled, received = 0, 0, 0

    def take(chunk: memoryview) -> None:
        nonlocal index, filled, received
        pos = 0
        while pos < len(chunk):
            while index < len(sizes) and filled == sizes[index]:
                index, filled = index + 1, 0
            if index == len(sizes):
                raise WireError(f"{what}: more bytes than the {total} announced")
            n = min(len(chunk) - pos, sizes[index] - filled)
            if filled == 0 and n == sizes[index]:
                buffers[index] = chunk[pos : pos + n]
            else:
                if buffers[index] is None:
                    buffers[index] = bytearray()
                buffers[index] += chunk[pos : pos + n]
            filled += n
            pos += n
        received += len(chunk)

    take(memoryview(first_chunk))
    async for frame in stream:
        take(memoryview(_frame_data(frame)))
    if received != total:
        raise WireError(f"{what}: stream ended after {received} of {total} bytes")
    buffers = [b"" if b is None else b for b in buffers]
    tensors = {}
    for name, buf in zip(fields, buffers):
        if header.HasField(name) or buf:
            t = getattr(header, name)
            tensors[name] = TensorView(shape=list(t.shape), dtype=t.dtype, codec=t.codec, data=buf)
        else:
            tensors[name] = TensorView(shape=[], dtype="", codec="", data=b"")
    return method, Reassembled(header, tensors)


# ------------------------------------------------------------------ client


class StreamingCaller:
    """Calls a stage method unary when small, as a frame stream when large."""

    def __init__(
        self, threshold_bytes: int = DEFAULT_THRESHOLD, chunk_bytes: int = DEFAULT_CHUNK, max_total_bytes: int = 1 << 30
    ):
        self.threshold_bytes = threshold_bytes
        self.chunk_bytes = chunk_bytes
        self.max_total_bytes = max_total_bytes

    async def call(
        self,
        channel: grpc.aio.Channel,
        stub,
        method: str,
        request,
        *,
        timeout: float | None,
        payloads: list | None = None,
        expected_bytes: int | None = None,
    ):
        """``payloads``: optional raw bytes per tensor field (then the request's tensor data may be empty).
        ``expected_bytes``: size of the reply, when the caller knows it is larger than the request."""
        fields = METHODS[method][2]
        size = request.ByteSize() + sum(memoryview(p).nbytes for p in payloads or () if p is not None)
        if max(size, expected_bytes or 0) <= self.threshold_bytes:
            for name, p in zip(fields, payloads or ()):
                if p is not None:
                    getattr(request, name).data = memoryview(p).cast("B").tobytes()
            return await getattr(stub, method)(request, timeout=timeout)
        # Raw bytes both ways: frames are built and read without protobuf copies of the payload.
        call = channel.stream_stream("/swarmpipe.Stage/Stream", request_serializer=None, response_deserializer=None)(
            frames(request, fields, method=method, chunk_bytes=self.chunk_bytes, payloads=payloads), timeout=timeout
        )
        _, response = await reassemble(
            call.__aiter__(), max_total_bytes=self.max_total_bytes, expect_method=method, what=f"{method} reply"
        )
        return response
