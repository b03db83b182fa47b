"""Thin adapters between the wire (kvbridge.v1 messages) and the core's dataclasses.

Every function raises ValueError naming the bad field and value; services turn that into
INVALID_ARGUMENT.
"""

from __future__ import annotations

import math

from google.protobuf import json_format

from engine.request import SamplingParams
from engine.tokenizer import Tokenizer
from kv_transfer import adapters as kv_wire
from kv_transfer.layout import DTYPES, NodeLayout
from kvbridge.v1 import common_pb2, prefill_pb2

# Smallest non-greedy temperature: the sampler divides the logits by it, and below this a large
# logit overflows float32 (inf, then NaN probabilities). 0 is greedy.
MIN_TEMPERATURE = 1e-5


def _show(value: str, limit: int = 80) -> str:
    """A client's string for an error message: quoted and cut short (gRPC caps status messages)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def sampling_params(msg: common_pb2.SamplingParams) -> SamplingParams:
    t = msg.temperature  # negative and NaN: SamplingParams says so
    if t > 0 and not MIN_TEMPERATURE <= t < math.inf:
        raise ValueError(f"sampling.temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {t}")
    empty = [i for i, s in enumerate(msg.stop) if not s]
    if empty:
        raise ValueError(f"sampling.stop[{empty[0]}] is empty (it would match at once)")
    if msg.max_new_tokens and msg.min_tokens > msg.max_new_tokens:
        raise ValueError(f"sampling.min_tokens ({msg.min_tokens}) must be <= max_new_tokens ({msg.max_new_tokens})")
    return SamplingParams(
        max_new_tokens=msg.max_new_tokens,  # 0: unset, the node resolves it (SamplingParams.resolved)
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
    )


def sampling_message(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_new_tokens=p.max_new_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens,
    )
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def prompt_ids(prompt: common_pb2.Prompt, tokenizer: Tokenizer | None) -> list[int]:
    """The prompt's token ids: text is tokenized, chat goes through the model's chat template."""
    kind = prompt.WhichOneof("kind")
    if kind == "token_ids":
        return list(prompt.token_ids.ids)
    if kind is None:
        raise ValueError("prompt is empty: set one of text, chat, token_ids")
    if tokenizer is None:
        raise ValueError(f"this model has no tokenizer; send prompt.token_ids instead of prompt.{kind}")
    if kind == "text":
        return tokenizer.encode(prompt.text)
    messages = [{"role": m.role, "content": m.content} for m in prompt.chat.messages]
    bad = [m["role"] for m in messages if m["role"] not in ("system", "user", "assistant")]
    if bad:
        raise ValueError(f"chat message role must be system, user or assistant, got {_show(bad[0])}")
    if not messages:
        raise ValueError("prompt.chat has no messages")
    return tokenizer.encode(tokenizer.apply_chat_template(messages))


# ---------------------------------------------------------------- KV layouts

layout_to_proto = kv_wire.layout_to_proto


def layout_from_proto(msg: prefill_pb2.KVLayout) -> NodeLayout:
    """A peer's layout, checked: its ranks must tile the model's layers. ValueError otherwise."""
    expected = 0
    for i, r in enumerate(msg.ranks):
        if r.rank != i:
            raise ValueError(f"layout rank {i} says it is rank {r.rank}: ranks must be listed in order from 0")
        if r.layer_start != expected or r.layer_end <= r.layer_start:
            raise ValueError(
                f"layout rank {i} has layers [{r.layer_start}, {r.layer_end}), expected to start at {expected}"
            )
        expected = r.layer_end
    if not msg.ranks or expected != msg.num_layers:
        raise ValueError(f"layout ranks cover {expected} layers of {msg.num_layers}")
    if not msg.page_size or not msg.num_pages:
        raise ValueError(f"layout page_size {msg.page_size} and num_pages {msg.num_pages} must be > 0")
    if not msg.num_kv_heads or not msg.head_dim:
        raise ValueError(f"layout num_kv_heads {msg.num_kv_heads} and head_dim {msg.head_dim} must be > 0")
    if msg.dtype not in DTYPES:
        raise ValueError(f"layout dtype must be one of {', '.join(DTYPES)}, got {_show(msg.dtype)}")
    for r in msg.ranks:
        shm = r.shm_name
        if shm.startswith(kv_wire.CUDA_IPC_PREFIX):
            try:
                bytes.fromhex(shm[len(kv_wire.CUDA_IPC_PREFIX) :])
            except ValueError:
                raise ValueError(f"layout rank {r.rank}: shm_name {_show(shm)} holds no hex CUDA IPC handle") from None
    return kv_wire.layout_from_proto(msg)


def layout_to_dict(layout: NodeLayout) -> dict:
    """JSON-safe form, for decisions sent down a pipeline."""
    return json_format.MessageToDict(kv_wire.layout_to_proto(layout), preserving_proto_field_name=True)


def layout_from_dict(d: dict) -> NodeLayout:
    """ValueError for a dict that is not a layout."""
    try:
        return layout_from_proto(json_format.ParseDict(d, prefill_pb2.KVLayout()))
    except json_format.ParseError as e:
        raise ValueError(f"not a layout: {e}") from None
