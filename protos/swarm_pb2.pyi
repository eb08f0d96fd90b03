from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("shape", "dtype", "codec", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    codec: str
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., codec: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("run_id", "stage", "microbatch_id", "input", "reply_codec", "evaluate", "ticket")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    REPLY_CODEC_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    microbatch_id: str
    input: Tensor
    reply_codec: str
    evaluate: bool
    ticket: bytes
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., microbatch_id: _Optional[str] = ..., input: _Optional[_Union[Tensor, _Mapping]] = ..., reply_codec: _Optional[str] = ..., evaluate: _Optional[bool] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("output", "version")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    version: int
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., version: _Optional[int] = ...) -> None: ...

class BackwardRequest(_message.Message):
    __slots__ = ("run_id", "stage", "microbatch_id", "grad_output", "input", "replay", "reply_codec", "ticket")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_ID_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    REPLY_CODEC_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    microbatch_id: str
    grad_output: Tensor
    input: Tensor
    replay: bool
    reply_codec: str
    ticket: bytes
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., microbatch_id: _Optional[str] = ..., grad_output: _Optional[_Union[Tensor, _Mapping]] = ..., input: _Optional[_Union[Tensor, _Mapping]] = ..., replay: _Optional[bool] = ..., reply_codec: _Optional[str] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class BackwardResponse(_message.Message):
    __slots__ = ("grad_input", "version", "delay", "applied", "dropped_reason")
    GRAD_INPUT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DELAY_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_REASON_FIELD_NUMBER: _ClassVar[int]
    grad_input: Tensor
    version: int
    delay: int
    applied: bool
    dropped_reason: str
    def __init__(self, grad_input: _Optional[_Union[Tensor, _Mapping]] = ..., version: _Optional[int] = ..., delay: _Optional[int] = ..., applied: _Optional[bool] = ..., dropped_reason: _Optional[str] = ...) -> None: ...

class ForwardBackwardRequest(_message.Message):
    __slots__ = ("run_id", "stage", "microbatch_id", "input", "targets", "reply_codec", "evaluate")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    REPLY_CODEC_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    microbatch_id: str
    input: Tensor
    targets: Tensor
    reply_codec: str
    evaluate: bool
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., microbatch_id: _Optional[str] = ..., input: _Optional[_Union[Tensor, _Mapping]] = ..., targets: _Optional[_Union[Tensor, _Mapping]] = ..., reply_codec: _Optional[str] = ..., evaluate: _Optional[bool] = ...) -> None: ...

class ForwardBackwardResponse(_message.Message):
    __slots__ = ("loss", "grad_input", "version", "applied", "dropped_reason")
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_INPUT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_REASON_FIELD_NUMBER: _ClassVar[int]
    loss: float
    grad_input: Tensor
    version: int
    applied: bool
    dropped_reason: str
    def __init__(self, loss: _Optional[float] = ..., grad_input: _Optional[_Union[Tensor, _Mapping]] = ..., version: _Optional[int] = ..., applied: _Optional[bool] = ..., dropped_reason: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("peer_id", "stage", "version", "throughput", "queue", "state", "samples_processed", "dropped_stale", "busy_seconds", "cpu_seconds", "batches", "batched_microbatches", "protocol", "device", "device_memory_total", "device_memory_used", "stash_bytes")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    STASH_BYTES_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    stage: int
    version: int
    throughput: float
    queue: int
    state: str
    samples_processed: int
    dropped_stale: int
    busy_seconds: float
    cpu_seconds: float
    batches: int
    batched_microbatches: int
    protocol: int
    device: str
    device_memory_total: int
    device_memory_used: int
    stash_bytes: int
    def __init__(self, peer_id: _Optional[str] = ..., stage: _Optional[int] = ..., version: _Optional[int] = ..., throughput: _Optional[float] = ..., queue: _Optional[int] = ..., state: _Optional[str] = ..., samples_processed: _Optional[int] = ..., dropped_stale: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., cpu_seconds: _Optional[float] = ..., batches: _Optional[int] = ..., batched_microbatches: _Optional[int] = ..., protocol: _Optional[int] = ..., device: _Optional[str] = ..., device_memory_total: _Optional[int] = ..., device_memory_used: _Optional[int] = ..., stash_bytes: _Optional[int] = ...) -> None: ...

class DownloadStateRequest(_message.Message):
    __slots__ = ("run_id", "stage", "shard", "num_shards", "base", "params_only")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_ONLY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    shard: int
    num_shards: int
    base: bool
    params_only: bool
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., base: _Optional[bool] = ..., params_only: _Optional[bool] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("name", "tensor", "version", "metadata_json", "index", "total")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: Tensor
    version: int
    metadata_json: str
    index: int
    total: int
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ..., version: _Optional[int] = ..., metadata_json: _Optional[str] = ..., index: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class PushStateResponse(_message.Message):
    __slots__ = ("accepted", "detail", "version")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    detail: str
    version: int
    def __init__(self, accepted: _Optional[bool] = ..., detail: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("method", "header", "data_bytes", "data")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    method: str
    header: bytes
    data_bytes: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, method: _Optional[str] = ..., header: _Optional[bytes] = ..., data_bytes: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReachabilityRequest(_message.Message):
    __slots__ = ("address", "peer_id", "tls_cert")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    TLS_CERT_FIELD_NUMBER: _ClassVar[int]
    address: str
    peer_id: str
    tls_cert: str
    def __init__(self, address: _Optional[str] = ..., peer_id: _Optional[str] = ..., tls_cert: _Optional[str] = ...) -> None: ...

class ReachabilityResponse(_message.Message):
    __slots__ = ("outcome", "observed_host", "reachable_at", "detail", "checker_id")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_HOST_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_AT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    CHECKER_ID_FIELD_NUMBER: _ClassVar[int]
    outcome: str
    observed_host: str
    reachable_at: str
    detail: str
    checker_id: str
    def __init__(self, outcome: _Optional[str] = ..., observed_host: _Optional[str] = ..., reachable_at: _Optional[str] = ..., detail: _Optional[str] = ..., checker_id: _Optional[str] = ...) -> None: ...

class TunnelUp(_message.Message):
    __slots__ = ("peer_id", "heartbeat")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    heartbeat: bool
    def __init__(self, peer_id: _Optional[str] = ..., heartbeat: _Optional[bool] = ...) -> None: ...

class TunnelDown(_message.Message):
    __slots__ = ("address", "connection", "caller", "heartbeat")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONNECTION_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    address: str
    connection: int
    caller: str
    heartbeat: bool
    def __init__(self, address: _Optional[str] = ..., connection: _Optional[int] = ..., caller: _Optional[str] = ..., heartbeat: _Optional[bool] = ...) -> None: ...

class RelayChunk(_message.Message):
    __slots__ = ("connection", "data")
    CONNECTION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    connection: int
    data: bytes
    def __init__(self, connection: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ChainHop(_message.Message):
    __slots__ = ("peer_id", "address")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    address: str
    def __init__(self, peer_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class ChainCandidates(_message.Message):
    __slots__ = ("hops",)
    HOPS_FIELD_NUMBER: _ClassVar[int]
    hops: _containers.RepeatedCompositeFieldContainer[ChainHop]
    def __init__(self, hops: _Optional[_Iterable[_Union[ChainHop, _Mapping]]] = ...) -> None: ...

class ChainRequest(_message.Message):
    __slots__ = ("run_id", "stage", "microbatch_id", "input", "targets", "route", "ticket", "reply_codec", "hop_timeout_s", "segment_stages")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    REPLY_CODEC_FIELD_NUMBER: _ClassVar[int]
    HOP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_STAGES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    microbatch_id: str
    input: Tensor
    targets: Tensor
    route: _containers.RepeatedCompositeFieldContainer[ChainCandidates]
    ticket: bytes
    reply_codec: str
    hop_timeout_s: float
    segment_stages: int
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., microbatch_id: _Optional[str] = ..., input: _Optional[_Union[Tensor, _Mapping]] = ..., targets: _Optional[_Union[Tensor, _Mapping]] = ..., route: _Optional[_Iterable[_Union[ChainCandidates, _Mapping]]] = ..., ticket: _Optional[bytes] = ..., reply_codec: _Optional[str] = ..., hop_timeout_s: _Optional[float] = ..., segment_stages: _Optional[int] = ...) -> None: ...

class ChainStageResult(_message.Message):
    __slots__ = ("stage", "peer_id", "version", "applied", "dropped_reason", "retries")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_REASON_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    stage: int
    peer_id: str
    version: int
    applied: bool
    dropped_reason: str
    retries: int
    def __init__(self, stage: _Optional[int] = ..., peer_id: _Optional[str] = ..., version: _Optional[int] = ..., applied: _Optional[bool] = ..., dropped_reason: _Optional[str] = ..., retries: _Optional[int] = ...) -> None: ...

class ChainResponse(_message.Message):
    __slots__ = ("loss", "grad_input", "version", "stages", "handler_seconds")
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_INPUT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    HANDLER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    loss: float
    grad_input: Tensor
    version: int
    stages: _containers.RepeatedCompositeFieldContainer[ChainStageResult]
    handler_seconds: float
    def __init__(self, loss: _Optional[float] = ..., grad_input: _Optional[_Union[Tensor, _Mapping]] = ..., version: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[ChainStageResult, _Mapping]]] = ..., handler_seconds: _Optional[float] = ...) -> None: ...

class HandoverRequest(_message.Message):
    __slots__ = ("run_id", "stage", "microbatch_id", "ticket", "output_codec", "wait_s")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_CODEC_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    microbatch_id: str
    ticket: bytes
    output_codec: str
    wait_s: float
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., microbatch_id: _Optional[str] = ..., ticket: _Optional[bytes] = ..., output_codec: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class HandoverResponse(_message.Message):
    __slots__ = ("output", "version")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    version: int
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., version: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("run_id", "stage", "microbatch_id", "ticket", "grad_output", "abandon")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ABANDON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    microbatch_id: str
    ticket: bytes
    grad_output: Tensor
    abandon: bool
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., microbatch_id: _Optional[str] = ..., ticket: _Optional[bytes] = ..., grad_output: _Optional[_Union[Tensor, _Mapping]] = ..., abandon: _Optional[bool] = ...) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...
