"""The compute RPCs of the ``Stage`` service: ``Forward``, ``Backward`` and ``ForwardBackward``.

Each validates its request (header, draining, tensors, reply codec) before any work, then runs on the compute
thread through the serving core's batching. With ``evaluate``, Forward / ForwardBackward validate on the live
weights: no batching, nothing kept (a Backward for that id is NOT_FOUND), nothing stepped.
"""

from __future__ import annotations

import grpc

from swarmpipe.peer.stage.request_checks import (
    RequestError,
    check_header,
    check_logits_size,
    decode_grad_output,
    decode_stage_input,
    pending_key,
    reply_codec,
)
from swarmpipe.peer.stage.service.core import ServingCore
from swarmpipe.peer.swarm.records import PeerState
from swarmpipe.peer.transport.error_contract import caller_key
from swarmpipe.peer.transport.wire import decode, is_empty
from swarmpipe.protos import swarm_pb2


class ComputeService:
    """``Forward``, ``Backward``, ``ForwardBackward`` on the runtime the core serves."""

    def __init__(self, core: ServingCore):
        self.core = core

    async def Forward(
        self, request: swarm_pb2.ForwardRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.ForwardResponse:
        core = self.core

        async def handle() -> swarm_pb2.ForwardResponse:
            runtime, spec = core.runtime, core.spec
            check_header(spec, runtime.stage, request.run_id, request.stage, request.microbatch_id)
            core.require_accepting()
            if runtime.is_last and not request.evaluate:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT, "the last stage takes ForwardBackward, not Forward"
                )
            reply = reply_codec(request.reply_codec, spec.compression.activations)
            core.count_bytes(request.input, incoming=True)
            x = decode_stage_input(spec, runtime.is_first, request.input)
            mb = pending_key(caller_key(context.peer() or ""), request.microbatch_id, request.ticket)
            if runtime.is_last:  # the logits (inference through the swarm): bounded like any tensor
                check_logits_size(spec, x)
            if request.evaluate:  # forward-only on the live weights, nothing kept for a backward
                out = await core.compute("evaluate", lambda: core.runtime.evaluate(x))
            else:
                out, siblings = await core.queued(
                    "forward", lambda: core.forwards.submit((mb, x), key=(tuple(x.shape[1:]), x.dtype))
                )
                core.siblings.remember(mb, siblings)
            output = core.encode(out, reply, sink, "output")
            return swarm_pb2.ForwardResponse(output=output, version=core.runtime.version)

        return await core.serve("evaluate" if request.evaluate else "forward", context, handle)

    async def Backward(
        self, request: swarm_pb2.BackwardRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.BackwardResponse:
        core = self.core

        async def handle() -> swarm_pb2.BackwardResponse:
            runtime, spec = core.runtime, core.spec
            check_header(spec, runtime.stage, request.run_id, request.stage, request.microbatch_id)
            if runtime.is_last:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT, "the last stage takes ForwardBackward, not Backward"
                )
            reply = reply_codec(request.reply_codec, spec.compression.gradients)
            core.count_bytes(request.grad_output, incoming=True)
            grad = decode_grad_output(spec, runtime.is_last, request.grad_output)
            if request.replay:
                if core.state is PeerState.DRAINING:  # a replay is new work
                    core.require_accepting()
                if is_empty(request.input):
                    raise RequestError(
                        grpc.StatusCode.INVALID_ARGUMENT, "a replayed backward must carry the stage input"
                    )
                x = decode_stage_input(spec, runtime.is_first, request.input)
                result = await core.compute("backward", lambda: core.runtime.replay_backward(x, grad))
            else:
                mb = pending_key(caller_key(context.peer() or ""), request.microbatch_id, request.ticket)
                await core.siblings.wait(mb)
                result = await core.queued("backward", lambda: core.backwards.submit((mb, grad)))
            core.after_backward(result)
            response = swarm_pb2.BackwardResponse(
                version=core.runtime.version,
                delay=result.delay,
                applied=result.applied,
                dropped_reason=result.dropped_reason,
            )
            if result.grad_input is not None:
                response.grad_input.CopyFrom(core.encode(result.grad_input, reply, sink, "grad_input"))
            return response

        return await core.serve("backward", context, handle)

    async def ForwardBackward(
        self, request: swarm_pb2.ForwardBackwardRequest, context: grpc.aio.ServicerContext, sink: dict | None = None
    ) -> swarm_pb2.ForwardBackwardResponse:
        core = self.core

        async def handle() -> swarm_pb2.ForwardBackwardResponse:
            runtime, spec = core.runtime, core.spec
            check_header(spec, runtime.stage, request.run_id, request.stage, request.microbatch_id)
            core.require_accepting()
            if not runtime.is_last:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"ForwardBackward is for the last stage; this peer serves stage {runtime.stage}",
                )
            reply = reply_codec(request.reply_codec, spec.compression.gradients)
            core.count_bytes(request.input, incoming=True)
            x = decode_stage_input(spec, runtime.is_first, request.input)
            targets = decode(
                request.targets,
                max_elements=spec.limits.max_tensor_elements,
                allowed_dtypes=("int64",),
                expect_shape=tuple(x.shape[:2]),
                what="targets",
            )
            if request.evaluate:  # validation: the loss only; no gradient, no step, no optimizer state touched
                loss = await core.compute("evaluate", lambda: core.runtime.evaluate(x, targets))
                return swarm_pb2.ForwardBackwardResponse(
                    loss=float(loss), version=core.runtime.version, applied=False, dropped_reason=""
                )
            result = await core.queued(
                "forward_backward",
                lambda: core.forward_backwards.submit((x, targets), key=(tuple(x.shape[1:]), x.dtype)),
            )
            core.after_backward(result)
            response = swarm_pb2.ForwardBackwardResponse(
                loss=result.loss or 0.0,
                version=core.runtime.version,
                applied=result.applied,
                dropped_reason=result.dropped_reason,
            )
            if result.grad_input is not None:
                response.grad_input.CopyFrom(core.encode(result.grad_input, reply, sink, "grad_input"))
            return response

        return await core.serve("evaluate" if request.evaluate else "forward_backward", context, handle)
