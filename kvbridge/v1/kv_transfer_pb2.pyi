from kvbridge.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PageChunk(_message.Message):
    __slots__ = ("room", "src_rank", "layer_start", "layer_end", "page_ids", "data", "secret")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    room: int
    src_rank: int
    layer_start: int
    layer_end: int
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    secret: bytes
    def __init__(self, room: _Optional[int] = ..., src_rank: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., page_ids: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., secret: _Optional[bytes] = ...) -> None: ...

class TransferNotice(_message.Message):
    __slots__ = ("room", "src_rank", "layer_start", "layer_end", "num_tokens", "bytes", "error", "first_token", "secret", "first_logprob", "push_seconds", "traceparent")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PUSH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    room: int
    src_rank: int
    layer_start: int
    layer_end: int
    num_tokens: int
    bytes: int
    error: str
    first_token: int
    secret: bytes
    first_logprob: _common_pb2.TokenLogprob
    push_seconds: float
    traceparent: str
    def __init__(self, room: _Optional[int] = ..., src_rank: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_tokens: _Optional[int] = ..., bytes: _Optional[int] = ..., error: _Optional[str] = ..., first_token: _Optional[int] = ..., secret: _Optional[bytes] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., push_seconds: _Optional[float] = ..., traceparent: _Optional[str] = ...) -> None: ...

class FirstTokenNotice(_message.Message):
    __slots__ = ("room", "token", "prompt_tokens", "secret", "logprob")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    room: int
    token: int
    prompt_tokens: int
    secret: bytes
    logprob: _common_pb2.TokenLogprob
    def __init__(self, room: _Optional[int] = ..., token: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., secret: _Optional[bytes] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class TransferAck(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...
