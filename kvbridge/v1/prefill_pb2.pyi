from kvbridge.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("rid", "room", "prompt", "sampling", "cache_salt", "resume_ids")
    RID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESUME_IDS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    room: int
    prompt: _common_pb2.Prompt
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    resume_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rid: _Optional[str] = ..., room: _Optional[int] = ..., prompt: _Optional[_Union[_common_pb2.Prompt, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., resume_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("rid", "prompt_tokens", "first_token", "kv_bytes", "cached_tokens", "prompt_logprobs")
    RID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    prompt_tokens: int
    first_token: int
    kv_bytes: int
    cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, rid: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., first_token: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GetLayoutRequest(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    def __init__(self, nonce: _Optional[bytes] = ...) -> None: ...

class GetLayoutResponse(_message.Message):
    __slots__ = ("layout", "proof")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    proof: bytes
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., proof: _Optional[bytes] = ...) -> None: ...

class RankEndpoint(_message.Message):
    __slots__ = ("rank", "layer_start", "layer_end", "receiver_addr", "endpoints")
    class EndpointsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ADDR_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    layer_start: int
    layer_end: int
    receiver_addr: str
    endpoints: _containers.ScalarMap[str, bytes]
    def __init__(self, rank: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., receiver_addr: _Optional[str] = ..., endpoints: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("model_fingerprint", "num_layers", "page_size", "dtype", "num_kv_heads", "head_dim", "num_pages", "ranks", "backends", "host_id", "kvbridge_version", "model_revision")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    KVBRIDGE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    num_layers: int
    page_size: int
    dtype: str
    num_kv_heads: int
    head_dim: int
    num_pages: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankEndpoint]
    backends: _containers.RepeatedScalarFieldContainer[str]
    host_id: str
    kvbridge_version: str
    model_revision: str
    def __init__(self, model_fingerprint: _Optional[str] = ..., num_layers: _Optional[int] = ..., page_size: _Optional[int] = ..., dtype: _Optional[str] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., num_pages: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankEndpoint, _Mapping]]] = ..., backends: _Optional[_Iterable[str]] = ..., host_id: _Optional[str] = ..., kvbridge_version: _Optional[str] = ..., model_revision: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("rid", "room", "backend", "decode_layout", "page_ids", "decode_addr", "secret", "held_pages", "proof")
    RID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DECODE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDR_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    HELD_PAGES_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    rid: str
    room: int
    backend: str
    decode_layout: KVLayout
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    decode_addr: str
    secret: bytes
    held_pages: int
    proof: bytes
    def __init__(self, rid: _Optional[str] = ..., room: _Optional[int] = ..., backend: _Optional[str] = ..., decode_layout: _Optional[_Union[KVLayout, _Mapping]] = ..., page_ids: _Optional[_Iterable[int]] = ..., decode_addr: _Optional[str] = ..., secret: _Optional[bytes] = ..., held_pages: _Optional[int] = ..., proof: _Optional[bytes] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RevokeRequest(_message.Message):
    __slots__ = ("room", "proof")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    room: int
    proof: bytes
    def __init__(self, room: _Optional[int] = ..., proof: _Optional[bytes] = ...) -> None: ...

class RevokeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
