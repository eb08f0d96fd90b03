"""Validation of a stage request before any work or side effect: the header (run, stage, micro-batch
id), the tensors a caller sends (dtype, shape, length, token range, finiteness) and the reply codec.

Each check raises :class:`RequestError` (with its gRPC status) or :class:`WireError`
(INVALID_ARGUMENT); the server maps them to the error contract in its docstring.
"""

from __future__ import annotations

import hashlib

import grpc
import torch

from swarmpipe.peer.spec import RunSpec
from swarmpipe.peer.transport import codecs
from swarmpipe.peer.transport.wire import FLOAT_DTYPES, WireError, decode, echo
from swarmpipe.protos import swarm_pb2

MAX_MICROBATCH_ID = 128


class RequestError(Exception):
    """A request this peer refuses, with the status code the caller gets."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


MAX_ROWS_PER_MICROBATCH = 2  # rows a request may carry, in micro-batches of the spec


def check_header(
    spec: RunSpec, stage: int, run_id: str, requested_stage: int, microbatch_id: str | None = None
) -> None:
    """The request is for the run and stage this peer serves, with a well-formed micro-batch id."""
    if run_id != spec.run_id:
        raise RequestError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"wrong run id {echo(run_id)}: this peer serves run {spec.run_id!r}",
        )
    if requested_stage != stage:
        raise RequestError(
            grpc.StatusCode.FAILED_PRECONDITION, f"wrong stage {requested_stage}: this peer serves stage {stage}"
        )
    if microbatch_id is not None and not 0 < len(microbatch_id) <= MAX_MICROBATCH_ID:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"microbatch_id must be 1..{MAX_MICROBATCH_ID} characters")


def decode_stage_input(spec: RunSpec, is_first: bool, msg: swarm_pb2.Tensor) -> torch.Tensor:
    """Token ids for the first stage, activations of width d_model for the others; sequences within
    the spec's length."""
    limits, model = spec.limits, spec.model
    if is_first:
        t = decode(
            msg,
            max_elements=limits.max_tensor_elements,
            allowed_dtypes=("int64",),
            expect_shape=(None, None),
            what="input",
        )
    else:
        t = decode(
            msg,
            max_elements=limits.max_tensor_elements,
            allowed_dtypes=FLOAT_DTYPES,
            expect_shape=(None, None, model.d_model),
            what="input",
        )
    if t.shape[1] > model.seq_len or t.shape[0] == 0 or t.shape[1] == 0:
        raise WireError(f"input: sequence length {t.shape[1]} must be 1..{model.seq_len}")
    max_rows = MAX_ROWS_PER_MICROBATCH * spec.microbatch_size
    if t.shape[0] > max_rows:  # one caller's request costs at most a few micro-batches of compute and memory
        raise WireError(f"input: {t.shape[0]} rows, more than {max_rows} ({MAX_ROWS_PER_MICROBATCH} x microbatch_size)")
    if is_first:
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= model.vocab_size):
            raise WireError(f"input: token ids must lie in [0, {model.vocab_size})")
        return t
    return t.float()


def decode_grad_output(spec: RunSpec, is_last: bool, msg: swarm_pb2.Tensor) -> torch.Tensor:
    """The gradient of the stage's output: logits width on the last stage, d_model elsewhere."""
    width = spec.model.vocab_size if is_last else spec.model.d_model
    return decode(
        msg,
        max_elements=spec.limits.max_tensor_elements,
        allowed_dtypes=FLOAT_DTYPES,
        expect_shape=(None, None, width),
        what="grad_output",
    ).float()


def check_logits_size(spec: RunSpec, x: torch.Tensor) -> None:
    """The last stage's logits for ``x`` (an evaluate Forward returns them) stay within the tensor bound."""
    logits = x.shape[0] * x.shape[1] * spec.model.vocab_size
    if logits > spec.limits.max_tensor_elements:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{logits} logits exceed max_tensor_elements {spec.limits.max_tensor_elements}",
        )


def reply_codec(requested: str, default: str) -> str:
    """The codec a reply goes out in, checked before any work: "" takes the stage's default, and
    "auto" (chosen per link by the caller; one that did not choose) becomes fp16."""
    try:
        return codecs.resolve(requested or default)
    except codecs.CodecError as e:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"reply_codec: {e}") from None


MIN_TICKET_BYTES, MAX_TICKET_BYTES = 16, 64


def pending_key(caller: str, microbatch_id: str, ticket: bytes) -> str:
    """The key a forward is kept under until its backward: the caller's address and a digest of its secret
    ticket come first, so nobody who merely knows (or guesses) a micro-batch id can send its backward, replace
    it with a forward of their own, or have it evicted by a flood of theirs (the runtime evicts the biggest
    caller's oldest forward first). No ticket: bound to the caller's address alone."""
    if ticket and not MIN_TICKET_BYTES <= len(ticket) <= MAX_TICKET_BYTES:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"a ticket is {MIN_TICKET_BYTES}..{MAX_TICKET_BYTES} bytes, got {len(ticket)}",
        )
    tag = hashlib.sha256(ticket).hexdigest()[:16] if ticket else "-"
    return f"{caller}|{tag}|{microbatch_id}"
