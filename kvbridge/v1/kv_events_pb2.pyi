from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchKVEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("kind", "block_hashes")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[KVEvent.Kind]
        STORED: _ClassVar[KVEvent.Kind]
        REMOVED: _ClassVar[KVEvent.Kind]
        CLEARED: _ClassVar[KVEvent.Kind]
    KIND_UNSPECIFIED: KVEvent.Kind
    STORED: KVEvent.Kind
    REMOVED: KVEvent.Kind
    CLEARED: KVEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    kind: KVEvent.Kind
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Union[KVEvent.Kind, str]] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("seq", "snapshot", "events", "page_size", "role")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    snapshot: bool
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    page_size: int
    role: str
    def __init__(self, seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., page_size: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerInfo(_message.Message):
    __slots__ = ("tokenizer_json", "model_fingerprint", "page_size", "max_context")
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    tokenizer_json: str
    model_fingerprint: str
    page_size: int
    max_context: int
    def __init__(self, tokenizer_json: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., page_size: _Optional[int] = ..., max_context: _Optional[int] = ...) -> None: ...
