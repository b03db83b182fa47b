"""Thin adapters between the wire (kvbridge.v1 messages) and the core's dataclasses.

Every function raises ValueError naming the bad field and value; services turn that into
INVALID_ARGUMENT.
"""

from __future__ import annotations

from common.rpc import shown
from engine.tokenizer import Tokenizer
from kvbridge.v1 import common_pb2


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
        raise ValueError(f"chat message role must be system, user or assistant, got {shown(bad[0])}")
    if not messages:
        raise ValueError("prompt.chat has no messages")
    return tokenizer.encode(tokenizer.apply_chat_template(messages))
