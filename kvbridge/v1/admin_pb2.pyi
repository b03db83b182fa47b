from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "alive", "kv_pages_used", "kv_pages_total")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alive: bool
    kv_pages_used: int
    kv_pages_total: int
    def __init__(self, rank: _Optional[int] = ..., alive: _Optional[bool] = ..., kv_pages_used: _Optional[int] = ..., kv_pages_total: _Optional[int] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("role", "model_fingerprint", "pp_size", "ranks", "queues", "requests_served", "version", "uptime_s")
    class QueuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    role: str
    model_fingerprint: str
    pp_size: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    queues: _containers.ScalarMap[str, int]
    requests_served: int
    version: str
    uptime_s: float
    def __init__(self, role: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., pp_size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., queues: _Optional[_Mapping[str, int]] = ..., requests_served: _Optional[int] = ..., version: _Optional[str] = ..., uptime_s: _Optional[float] = ...) -> None: ...
