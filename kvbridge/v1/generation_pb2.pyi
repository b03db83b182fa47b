from kvbridge.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRoute(_message.Message):
    __slots__ = ("room", "prefill_addr", "proof", "local")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDR_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    room: int
    prefill_addr: str
    proof: bytes
    local: bool
    def __init__(self, room: _Optional[int] = ..., prefill_addr: _Optional[str] = ..., proof: _Optional[bytes] = ..., local: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("rid", "prompt", "sampling", "prefill", "cache_salt", "resume_ids")
    RID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESUME_IDS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    prompt: _common_pb2.Prompt
    sampling: _common_pb2.SamplingParams
    prefill: PrefillRoute
    cache_salt: str
    resume_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rid: _Optional[str] = ..., prompt: _Optional[_Union[_common_pb2.Prompt, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prefill: _Optional[_Union[PrefillRoute, _Mapping]] = ..., cache_salt: _Optional[str] = ..., resume_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("rid", "token_ids", "text", "finish_reason", "usage", "transfer", "logprobs", "prompt_logprobs", "index")
    RID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    rid: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: _common_pb2.Usage
    transfer: TransferStats
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    index: int
    def __init__(self, rid: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., transfer: _Optional[_Union[TransferStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("backend", "kv_bytes", "seconds", "pages_skipped")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAGES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    backend: str
    kv_bytes: int
    seconds: float
    pages_skipped: int
    def __init__(self, backend: _Optional[str] = ..., kv_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., pages_skipped: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "fingerprint", "max_context", "role", "elastic", "role_epoch")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_FIELD_NUMBER: _ClassVar[int]
    ROLE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    model: str
    fingerprint: str
    max_context: int
    role: str
    elastic: bool
    role_epoch: int
    def __init__(self, model: _Optional[str] = ..., fingerprint: _Optional[str] = ..., max_context: _Optional[int] = ..., role: _Optional[str] = ..., elastic: _Optional[bool] = ..., role_epoch: _Optional[int] = ...) -> None: ...
