"""Thin adapters between the wire (kvbridge.v1 messages) and the core's dataclasses.

Every function raises ValueError naming the bad field and value; services turn that into
INVALID_ARGUMENT.
"""

from __future__ import annotations

from google.protobuf import json_format

from engine.request import SamplingParams
from engine.tokenizer import Tokenizer
from kv_transfer import wire as kv_wire
from kv_transfer.layout import NodeLayout
from kvbridge.v1 import common_pb2, prefill_pb2

DEFAULT_MAX_NEW_TOKENS = 128


def sampling_params(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=msg.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
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
        raise ValueError(f"chat message role must be system, user or assistant, got {bad[0]!r}")
    if not messages:
        raise ValueError("prompt.chat has no messages")
    return tokenizer.encode(tokenizer.apply_chat_template(messages))


# ---------------------------------------------------------------- KV layouts

layout_to_proto = kv_wire.layout_to_proto


def layout_from_proto(msg: prefill_pb2.KVLayout) -> NodeLayout:
    """A peer's layout, checked: its ranks must tile the model's layers. ValueError otherwise."""
    expected = 0
    for i, r in enumerate(msg.ranks):
        if r.rank != i or r.layer_start != expected or r.layer_end <= r.layer_start:
            raise ValueError(
                f"layout rank {i} has layers [{r.layer_start}, {r.layer_end}), expected to start at {expected}"
            )
        expected = r.layer_end
    if not msg.ranks or expected != msg.num_layers:
        raise ValueError(f"layout ranks cover {expected} layers of {msg.num_layers}")
    if not msg.page_size or not msg.num_pages:
        raise ValueError(f"layout page_size {msg.page_size} and num_pages {msg.num_pages} must be > 0")
    return kv_wire.layout_from_proto(msg)


def layout_to_dict(layout: NodeLayout) -> dict:
    """JSON-safe form, for decisions sent down a pipeline."""
    return json_format.MessageToDict(kv_wire.layout_to_proto(layout), preserving_proto_field_name=True)


def layout_from_dict(d: dict) -> NodeLayout:
    return layout_from_proto(json_format.ParseDict(d, prefill_pb2.KVLayout()))
