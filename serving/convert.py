"""Thin adapters between the wire (kvbridge.v1 messages) and the core's dataclasses.

Every function raises ValueError naming the bad field and value; services turn that into
INVALID_ARGUMENT.
"""

from __future__ import annotations

import json

from common.rpc import shown
from engine.tokenizer import TEMPLATE_VARIABLES, Tokenizer
from kvbridge.v1 import common_pb2

MAX_TEMPLATE_KWARGS_BYTES = 8 << 10  # prompt.chat.chat_template_kwargs, as UTF-8


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
    return tokenizer.encode(chat_text(prompt.chat, tokenizer))


def chat_text(chat: common_pb2.ChatMessages, tokenizer: Tokenizer) -> str:
    """The chat rendered by the model's template, with the chat's template options."""
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    bad = [m["role"] for m in messages if m["role"] not in ("system", "user", "assistant")]
    if bad:
        raise ValueError(f"chat message role must be system, user or assistant, got {shown(bad[0])}")
    if not messages:
        raise ValueError("prompt.chat has no messages")
    add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    if chat.continue_final_message:
        if chat.HasField("add_generation_prompt") and chat.add_generation_prompt:
            raise ValueError(
                "prompt.chat.continue_final_message needs add_generation_prompt false (or unset), got true"
            )
        if messages[-1]["role"] != "assistant":
            raise ValueError(
                "prompt.chat.continue_final_message needs the last message's role to be assistant, "
                f"got {shown(messages[-1]['role'])}"
            )
        add_generation_prompt = False
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt, chat.continue_final_message, template_kwargs(chat.chat_template_kwargs)
    )


def template_kwargs(text: str) -> dict:
    """prompt.chat.chat_template_kwargs ("" = none): a JSON object, its keys not the template's own variables."""
    if not text:
        return {}
    size = len(text.encode())
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise ValueError(f"prompt.chat.chat_template_kwargs has {size} bytes; at most {MAX_TEMPLATE_KWARGS_BYTES}")
    try:
        kwargs = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"prompt.chat.chat_template_kwargs is not JSON ({e}): {shown(text)}") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"prompt.chat.chat_template_kwargs must be a JSON object, got {shown(text)}")
    if taken := [k for k in TEMPLATE_VARIABLES if k in kwargs]:
        raise ValueError(
            f"prompt.chat.chat_template_kwargs cannot set {shown(taken[0])}: the template gets it from the request"
        )
    return kwargs
