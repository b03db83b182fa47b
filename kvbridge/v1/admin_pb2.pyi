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
    __slots__ = ("role", "model_fingerprint", "pp_size", "ranks", "queues", "requests_served", "version", "uptime_s", "draining", "transfers_in_flight", "requests_in_flight", "model", "serving", "nodes", "prefix_cache", "elastic", "role_epoch", "switching_to", "planner_moves")
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
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_FIELD_NUMBER: _ClassVar[int]
    ROLE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SWITCHING_TO_FIELD_NUMBER: _ClassVar[int]
    PLANNER_MOVES_FIELD_NUMBER: _ClassVar[int]
    role: str
    model_fingerprint: str
    pp_size: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    queues: _containers.ScalarMap[str, int]
    requests_served: int
    version: str
    uptime_s: float
    draining: bool
    transfers_in_flight: int
    requests_in_flight: int
    model: str
    serving: bool
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    prefix_cache: PrefixCacheStatus
    elastic: bool
    role_epoch: int
    switching_to: str
    planner_moves: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, role: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., pp_size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., queues: _Optional[_Mapping[str, int]] = ..., requests_served: _Optional[int] = ..., version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., draining: _Optional[bool] = ..., transfers_in_flight: _Optional[int] = ..., requests_in_flight: _Optional[int] = ..., model: _Optional[str] = ..., serving: _Optional[bool] = ..., nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., prefix_cache: _Optional[_Union[PrefixCacheStatus, _Mapping]] = ..., elastic: _Optional[bool] = ..., role_epoch: _Optional[int] = ..., switching_to: _Optional[str] = ..., planner_moves: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefixCacheStatus(_message.Message):
    __slots__ = ("enabled", "cached_pages", "idle_pages", "hit_tokens", "query_tokens", "evicted_pages")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    IDLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    cached_pages: int
    idle_pages: int
    hit_tokens: int
    query_tokens: int
    evicted_pages: int
    def __init__(self, enabled: _Optional[bool] = ..., cached_pages: _Optional[int] = ..., idle_pages: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., query_tokens: _Optional[int] = ..., evicted_pages: _Optional[int] = ...) -> None: ...

class ClearPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearPrefixCacheResponse(_message.Message):
    __slots__ = ("pages_dropped",)
    PAGES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    pages_dropped: int
    def __init__(self, pages_dropped: _Optional[int] = ...) -> None: ...

class RequestInfo(_message.Message):
    __slots__ = ("rid", "room", "phase", "age_s", "kv_pages", "peer", "prompt_tokens", "output_tokens", "backend", "kv_pages_moved", "kv_bytes_moved", "handoff_s")
    RID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_MOVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_S_FIELD_NUMBER: _ClassVar[int]
    rid: str
    room: int
    phase: str
    age_s: float
    kv_pages: int
    peer: str
    prompt_tokens: int
    output_tokens: int
    backend: str
    kv_pages_moved: int
    kv_bytes_moved: int
    handoff_s: float
    def __init__(self, rid: _Optional[str] = ..., room: _Optional[int] = ..., phase: _Optional[str] = ..., age_s: _Optional[float] = ..., kv_pages: _Optional[int] = ..., peer: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., backend: _Optional[str] = ..., kv_pages_moved: _Optional[int] = ..., kv_bytes_moved: _Optional[int] = ..., handoff_s: _Optional[float] = ...) -> None: ...

class ListRequestsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "phase")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    phase: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., phase: _Optional[str] = ...) -> None: ...

class ListRequestsResponse(_message.Message):
    __slots__ = ("requests", "next_page_token", "total")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestInfo]
    next_page_token: str
    total: int
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., total: _Optional[int] = ...) -> None: ...

class AbortRequestRequest(_message.Message):
    __slots__ = ("rid",)
    RID_FIELD_NUMBER: _ClassVar[int]
    rid: str
    def __init__(self, rid: _Optional[str] = ...) -> None: ...

class AbortRequestResponse(_message.Message):
    __slots__ = ("rid", "phase")
    RID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    rid: str
    phase: str
    def __init__(self, rid: _Optional[str] = ..., phase: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("wait_s",)
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    wait_s: float
    def __init__(self, wait_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining", "requests_in_flight", "empty")
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    EMPTY_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    requests_in_flight: int
    empty: bool
    def __init__(self, draining: _Optional[bool] = ..., requests_in_flight: _Optional[int] = ..., empty: _Optional[bool] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Config(_message.Message):
    __slots__ = ("role", "version", "json")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    role: str
    version: str
    json: str
    def __init__(self, role: _Optional[str] = ..., version: _Optional[str] = ..., json: _Optional[str] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("role", "address", "healthy", "reported", "outstanding", "routed", "model", "elastic", "role_epoch", "switching_to")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    REPORTED_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_FIELD_NUMBER: _ClassVar[int]
    ROLE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SWITCHING_TO_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    healthy: bool
    reported: bool
    outstanding: int
    routed: int
    model: str
    elastic: bool
    role_epoch: int
    switching_to: str
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., reported: _Optional[bool] = ..., outstanding: _Optional[int] = ..., routed: _Optional[int] = ..., model: _Optional[str] = ..., elastic: _Optional[bool] = ..., role_epoch: _Optional[int] = ..., switching_to: _Optional[str] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class AddNodeRequest(_message.Message):
    __slots__ = ("role", "address")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class RemoveNodeRequest(_message.Message):
    __slots__ = ("address", "role")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: str
    def __init__(self, address: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role", "wait_s", "migrate", "node")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    MIGRATE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    role: str
    wait_s: float
    migrate: bool
    node: str
    def __init__(self, role: _Optional[str] = ..., wait_s: _Optional[float] = ..., migrate: _Optional[bool] = ..., node: _Optional[str] = ...) -> None: ...

class SetRoleResponse(_message.Message):
    __slots__ = ("old_role", "role", "role_epoch", "drain_s", "switch_s", "node")
    OLD_ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DRAIN_S_FIELD_NUMBER: _ClassVar[int]
    SWITCH_S_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    old_role: str
    role: str
    role_epoch: int
    drain_s: float
    switch_s: float
    node: str
    def __init__(self, old_role: _Optional[str] = ..., role: _Optional[str] = ..., role_epoch: _Optional[int] = ..., drain_s: _Optional[float] = ..., switch_s: _Optional[float] = ..., node: _Optional[str] = ...) -> None: ...
