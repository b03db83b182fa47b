"""Thin adapters between the wire (kvbridge.v1 messages) and the core's dataclasses.

Every function raises ValueError naming the bad field and value; services turn that into
INVALID_ARGUMENT.

Tokenizing a prompt (`prompt_ids`) is the one adapter whose work grows with the client's input: its
size is checked first (common/limits.py: the chat's message count, its bytes, the rendered chat's
bytes, against the context), and an event loop runs it through `tokenized`: in one of
TOKENIZE_THREADS worker threads, so that a long prompt neither stalls the loop nor has every
client's prompt expanding at once.
"""

from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor

from kvbridge.common.heap import release_freed_heap
from kvbridge.common.limits import prompt_size_problem, rendered_size_problem
from kvbridge.common.rpc import shown
from kvbridge.common.text.tokenizer import TEMPLATE_VARIABLES, Tokenizer
from kvbridge.v1 import common_pb2

CHAT_ROLES = ("system", "user", "assistant")  # a wire chat message's roles (OpenAI's developer: system)
MAX_TEMPLATE_KWARGS_BYTES = 8 << 10  # prompt.chat.chat_template_kwargs, as UTF-8
TOKENIZE_THREADS = min(4, os.cpu_count() or 1)  # prompts tokenized at once in one process (router or node front)
# after a prompt of at least this many tokens, freed heap goes back to the system (malloc_trim): the
# tokenizers library's transient ~200 bytes a token stay in glibc's free lists otherwise
TRIM_AFTER_TOKENS = 1 << 16
_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="kvbridge-tokenize")


async def tokenized(prompt: common_pb2.Prompt, tokenizer: Tokenizer | None, max_context: int | None) -> list[int]:
    """prompt_ids in a worker thread, at most TOKENIZE_THREADS at once (the others queue); the size
    checks that need no tokenizer come first, on the caller's loop, so a refusal waits for no one."""
    if problem := prompt_size_problem(prompt, max_context):
        raise ValueError(problem)
    if prompt.WhichOneof("kind") in ("token_ids", None):
        return _ids(prompt, tokenizer, max_context)
    return await in_worker(_ids, prompt, tokenizer, max_context)


async def in_worker(fn, *args):
    """fn(*args) in one of the TOKENIZE_THREADS worker threads (tokenizing, detokenizing)."""
    return await asyncio.get_running_loop().run_in_executor(_pool, fn, *args)


def prompt_ids(prompt: common_pb2.Prompt, tokenizer: Tokenizer | None, max_context: int | None = None) -> list[int]:
    """The prompt's token ids: text is tokenized, chat goes through the model's chat template.
    With `max_context`, a prompt that cannot fit it by its size (common/limits.py) is refused before
    the template or the tokenizer runs; without, only a chat's message count is bounded."""
    if problem := prompt_size_problem(prompt, max_context):
        raise ValueError(problem)
    return _ids(prompt, tokenizer, max_context)


def _ids(prompt: common_pb2.Prompt, tokenizer: Tokenizer | None, max_context: int | None) -> list[int]:
    """prompt_ids past the size checks of the prompt itself."""
    kind = prompt.WhichOneof("kind")
    if kind == "token_ids":
        return list(prompt.token_ids.ids)
    if kind is None:
        raise ValueError("prompt is empty: set one of text, chat, token_ids")
    if tokenizer is None:
        raise ValueError(f"this model has no tokenizer; send prompt.token_ids instead of prompt.{kind}")
    if kind == "text":
        return encode(tokenizer, prompt.text)
    text = chat_text(prompt.chat, tokenizer)
    if problem := rendered_size_problem(text, max_context):
        raise ValueError(problem)
    return encode(tokenizer, text)


def encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """tokenizer.encode, and the heap a long text's tokenizing took given back after it."""
    ids = tokenizer.encode(text, add_special_tokens)
    if len(ids) >= TRIM_AFTER_TOKENS:
        release_freed_heap()
    return ids


def chat_text(chat: common_pb2.ChatMessages, tokenizer: Tokenizer) -> str:
    """The chat rendered by the model's template, with the chat's template options."""
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    bad = [m["role"] for m in messages if m["role"] not in CHAT_ROLES]
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
