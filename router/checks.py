"""Validation of a GenerateRequest at the router, before any node sees it.

The nodes check everything again (token ids against the vocabulary, prompt length against the
context); the router rejects what it can tell is wrong without the model, so that a bad request
costs no upstream call. Each check raises ValueError naming the field and the bad value.
"""

from __future__ import annotations

from kvbridge.common import sampling
from kvbridge.common.blocks import salt_problem
from kvbridge.common.limits import MAX_CLIENT_RID_CHARS, prompt_size_problem, rid_problem
from kvbridge.common.shown import shown
from kvbridge.common.text.prompts import CHAT_ROLES
from kvbridge.v1 import generation_pb2


def check_generate(req: generation_pb2.GenerateRequest) -> None:
    if req.rid and (problem := rid_problem(req.rid, MAX_CLIENT_RID_CHARS)):
        raise ValueError(problem)
    if req.HasField("prefill"):
        raise ValueError("prefill is set by the router; leave it unset")
    check_prompt(req)
    check_sampling(req)
    check_cache_salt(req)


def check_prompt(req: generation_pb2.GenerateRequest) -> None:
    prompt = req.prompt
    kind = prompt.WhichOneof("kind")
    if kind is None:
        raise ValueError("prompt is empty: set one of text, chat, token_ids")
    if kind == "text" and not prompt.text:
        raise ValueError("prompt.text is empty")
    if kind == "token_ids" and not prompt.token_ids.ids:
        raise ValueError("prompt.token_ids is empty")
    if kind == "chat":
        if not prompt.chat.messages:
            raise ValueError("prompt.chat has no messages")
        if problem := prompt_size_problem(prompt, None):  # (the message count: its bytes need the context)
            raise ValueError(problem)
        for i, m in enumerate(prompt.chat.messages):
            if m.role not in CHAT_ROLES:
                why = f"prompt.chat.messages[{i}].role must be system, user or assistant, got {shown(m.role)}"
                raise ValueError(why)


def check_sampling(req: generation_pb2.GenerateRequest) -> None:
    params = sampling.from_proto(req.sampling)  # the nodes' own rules (common/sampling.py)
    if params.json_schema:  # as the HTTP API checks response_format: no node sees a schema it would refuse
        from kvbridge.common.text.schema import schema_problem  # (deferred: llguidance loads on the first schema)

        if problem := schema_problem(params.json_schema):
            raise ValueError(f"sampling.structured.json_schema: {problem}")


def check_cache_salt(req: generation_pb2.GenerateRequest) -> None:
    if problem := salt_problem(req.cache_salt):
        raise ValueError(problem)
