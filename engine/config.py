"""Model and engine configuration: frozen dataclasses, derived values as properties."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields

from kvbridge.common.flags import setting


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as Hugging Face configs spell it (`rope_scaling`)."""

    kind: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 only

    @staticmethod
    def from_hf(raw: dict | None) -> RopeScaling:
        if not raw:
            return RopeScaling()
        kind = raw.get("rope_type", raw.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_scaling type {kind!r}")
        return RopeScaling(
            kind=kind,
            factor=float(raw.get("factor", 1.0)),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position=int(raw.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder. Field names follow Hugging Face's LlamaConfig."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2-style)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @staticmethod
    def from_hf(raw: dict) -> ModelConfig:
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if raw.get("model_type") not in (None, "llama", "qwen2", "mistral") and "Llama" not in arch:
            raise ValueError(f"unsupported model_type {raw.get('model_type')!r} (Llama family only)")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in raw]
        if missing:
            raise ValueError(f"model config lacks {', '.join(missing)}")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return ModelConfig(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            # transformers >= 5 writes both under `rope_parameters`
            rope_theta=float(raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=RopeScaling.from_hf(raw.get("rope_scaling") or raw.get("rope_parameters")),
            attention_bias=bool(raw.get("attention_bias", raw.get("model_type") == "qwen2")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_json(self) -> str:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["rope_scaling"] = {f.name: getattr(self.rope_scaling, f.name) for f in fields(RopeScaling)}
        return json.dumps(d, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> ModelConfig:
        d = json.loads(text)
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        return ModelConfig(**d)


@dataclass(frozen=True)
class EngineConfig:
    """How one node runs a model: device, precision, KV pool and batching limits."""

    model: str = setting(
        "smollm2-135m-instruct",
        "preset (smollm2-135m-instruct, tiny-random), .gguf file, or Hugging Face directory",
    )
    device: str = setting("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = setting(
        "auto", "auto (bfloat16 on CUDA and AVX2/AVX-512 CPUs; else float32) | float32 | float16 | bfloat16"
    )
    page_size: int = setting(16, "tokens per KV page")
    num_pages: int = setting(0, "KV pool size in pages (0: from --kv-cache-tokens)")
    kv_cache_tokens: int = setting(65536, "KV pool capacity in tokens when --num-pages is 0")
    chunked_prefill_size: int = setting(512, "max prompt tokens per step (0: no chunking)")
    # Issue 41: a long prompt's chunk batched with running decodes stalls every one of them for the chunk.
    decode_step_target_ms: float = setting(
        0.0,
        "while requests decode, a step takes only the prompt tokens that keep its time within this, ms, priced "
        "by what the node's steps measurably took (decodes alone, a prompt token beside them); with no decode, "
        "the whole --chunked-prefill-size (0: off)",
    )
    decode_step_min_prefill: int = setting(
        64, "with --decode-step-target-ms: prompt tokens a step takes at least, so that a prompt always progresses"
    )
    disable_prefix_cache: bool = setting(False, "keep no prefix cache: every prompt is computed (and moved) whole")
    max_running_requests: int = setting(64, "decode batch size cap")
    max_context: int = setting(0, "context length cap (0: the model's)")
    max_default_tokens: int = setting(
        128,
        "a request without max_new_tokens (OpenAI: no max_tokens) gets the rest "
        "of the context, at most this many tokens (0: no cap)",
    )
    threads: int = setting(0, "torch CPU threads per rank (0: the host's cores over the kvbridge ranks on it)")
    max_pending_requests: int = setting(
        1024,
        "requests a node holds at once, every phase; more are refused (RESOURCE_EXHAUSTED)",
    )
    # The hand-off timeouts count time spent queued behind other requests too (a decode node reserves a
    # request's pages, then waits for the prefill node to get to it), so they are set to bound a hang,
    # not a burst: dead peers are found sooner by health streams and keepalive (seconds).
    bootstrap_timeout_s: float = setting(
        300.0,
        "prefill node: fail a request whose decode node has not registered after this, seconds",
    )
    # A decode node registers a room once it has reserved the room's pages: under load that is when one
    # of its running requests ends (seconds). A prefilled request still unregistered after a minute
    # fails, and the router tries another pair without that decode node (P's DEADLINE_EXCEEDED).
    unregistered_timeout_s: float = setting(
        60.0,
        "prefill node: fail a prefilled request whose decode node has not registered this long after its "
        "first token, seconds (within --bootstrap-timeout-s of its arrival)",
    )
    # Half the pool: the other half stays for requests whose decode node registered, and for other callers.
    unregistered_page_share: float = setting(
        0.5,
        "prefill node: the share of the KV pool that one caller's (peer host's) prefilled requests without "
        "a registration may hold; past it, its further unregistered requests wait unprefilled",
    )
    prealloc_timeout_s: float = setting(300.0, "decode node: fail a request that got no KV pages within this, seconds")
    transfer_timeout_s: float = setting(
        300.0,
        "fail a KV hand-off not done this long after the decode pages were reserved, seconds",
    )
    kv_stream_idle_s: float = setting(
        10.0,
        "decode node: end a KV page stream (grpc engine) whose first or next chunk is this late, seconds",
    )
    fault_inject: str = setting(
        "",
        "tests and drills: faults such as transfer_fail=0.05,rank1:step_delay_ms=50 (engine/faults.py)",
    )

    def __post_init__(self) -> None:
        from kvbridge.engine.faults import parse

        parse(self.fault_inject, 0)  # raises on a bad spec, naming the item
        timeouts = ("bootstrap_timeout_s", "unregistered_timeout_s", "prealloc_timeout_s", "transfer_timeout_s")
        for name in (*timeouts, "kv_stream_idle_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_default_tokens < 0:
            raise ValueError(f"max_default_tokens must be >= 0 (0: no cap), got {self.max_default_tokens}")
        if not 0 < self.unregistered_page_share <= 1:
            raise ValueError(f"unregistered_page_share must be in (0, 1], got {self.unregistered_page_share}")
        if self.max_pending_requests < 1:
            raise ValueError(f"max_pending_requests must be >= 1, got {self.max_pending_requests}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages < 0 or self.kv_cache_tokens < 1:
            raise ValueError(f"bad KV pool size: num_pages={self.num_pages} kv_cache_tokens={self.kv_cache_tokens}")
        if self.chunked_prefill_size < 0:
            raise ValueError(f"chunked_prefill_size must be >= 0, got {self.chunked_prefill_size}")
        if not self.decode_step_target_ms >= 0 or self.decode_step_target_ms == float("inf"):
            raise ValueError(f"decode_step_target_ms must be >= 0 (0: off), got {self.decode_step_target_ms}")
        if self.decode_step_min_prefill < 1:
            raise ValueError(f"decode_step_min_prefill must be >= 1, got {self.decode_step_min_prefill}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto|cpu|cuda|cuda:N, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto|float32|float16|bfloat16, got {self.dtype!r}")

    @property
    def total_pages(self) -> int:
        return self.num_pages or -(-self.kv_cache_tokens // self.page_size)


@dataclass(frozen=True)
class PPConfig:
    """How a node spreads its layers over rank processes."""

    pp_size: int = setting(1, "pipeline-parallel rank processes (each holds a layer range)")
    async_batch_depth: int = setting(0, "microbatches in flight beyond pp_size")
    enable_dynamic_chunking: bool = setting(False, "size prompt chunks from a start-up prefill latency profile")
    num_hosts: int = setting(1, "hosts the pipeline ranks are spread over")
    host_rank: int = setting(0, "this host's index in [0, num_hosts)")
    dist_init_addr: str = setting("", "host:port of the torch.distributed rendezvous (required with --num-hosts > 1)")

    def __post_init__(self) -> None:
        if self.pp_size < 1:
            raise ValueError(f"pp_size must be >= 1, got {self.pp_size}")
        if self.async_batch_depth < 0:
            raise ValueError(f"async_batch_depth must be >= 0, got {self.async_batch_depth}")
        if self.num_hosts < 1 or self.pp_size % self.num_hosts:
            raise ValueError(f"pp_size={self.pp_size} must be a multiple of num_hosts={self.num_hosts}")
        if not 0 <= self.host_rank < self.num_hosts:
            raise ValueError(f"host_rank must be in [0, {self.num_hosts}), got {self.host_rank}")
        if self.num_hosts > 1 and not self.dist_init_addr:
            raise ValueError("--dist-init-addr host:port is required with num_hosts > 1")

    @property
    def pp_loop_size(self) -> int:
        """Microbatch slots in flight: one per stage keeps every stage busy, plus the async depth."""
        return self.pp_size + self.async_batch_depth

    @property
    def ranks_per_host(self) -> int:
        return self.pp_size // self.num_hosts

    @property
    def local_ranks(self) -> range:
        return range(self.host_rank * self.ranks_per_host, (self.host_rank + 1) * self.ranks_per_host)
