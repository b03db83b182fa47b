"""OpenAI-compatible JSON <-> kvbridge.v1 messages: request parsing and validation, response and
error bodies. No I/O here (http.py does it).

Fields read: model, prompt (a string or token-id list, or a list of up to MAX_PROMPTS of them: one
routed request each), messages, max_tokens / max_completion_tokens, temperature, top_p, seed, stop
(string or list), n (1..16 choices: one prefill, n decodes; choice i is sampled with seed + i),
stream, stream_options.include_usage; extensions as in vLLM: top_k (-1 or 0 = off),
stop_token_ids, ignore_eos, min_tokens, cache_salt (a non-empty string: requests share cached KV
only with equal salts); and (router/openai_fields.py) logprobs / top_logprobs, prompt_logprobs,
presence_penalty, frequency_penalty, repetition_penalty, min_p, logit_bias, bad_words,
allowed_token_ids, skip_special_tokens, include_stop_str_in_output (no_stop_trim),
response_format (text, json_object, json_schema) and, on chat, add_generation_prompt,
continue_final_message, chat_template_kwargs. Usage carries prompt_tokens_details.cached_tokens (prompt tokens the node
found in its prefix cache). Defaults as OpenAI documents them: temperature 1.0 (our
models carry no generation config that could set another); max_tokens omitted = the rest of the
context (sent as max_new_tokens 0: only the node knows the prompt length; it caps that at its
--max-default-tokens).

Every field of vLLM's chat and completion protocol that would change the output but is not
implemented is refused with a 400 naming it when it has a non-default value (`_unsupported`:
echo, best_of, beam search, vLLM's guided_* fields, tools, a chat_template of the client's...);
fields that do not change the output (user, metadata, store, service_tier, parallel_tool_calls,
priority...) and unknown fields are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import grpc

from kvbridge.common.limits import MAX_CHAT_MESSAGES, prompt_bytes_limit, text_size_problem
from kvbridge.common.sampling import MAX_CHOICES
from kvbridge.common.shown import MAX_SHOWN_CHARS, clipped
from kvbridge.common.text.prompts import CHAT_ROLES as WIRE_ROLES
from kvbridge.router.checks import check_cache_salt, check_prompt
from kvbridge.router.openai_fields import (
    TEMPERATURE,
    BadRequest,
    chat_options,
    check_sampling,
    flag,
    number,
    sampling_controls,
    show,
)
from kvbridge.router.openai_fields import utf8_text as _text
from kvbridge.v1 import common_pb2, generation_pb2

__all__ = ["BadRequest", "OpenAIRequest", "error_body", "parse_request"]
_show = show  # (router/tokenize.py's name for it)

UINT32_MAX = (1 << 32) - 1
UINT64_MAX = (1 << 64) - 1
MAX_PROMPTS = 64  # prompts of one completion request (each routed on its own, with its n choices)
MAX_ANSWER_CHOICES = 256  # prompts x n of one request: the sequences one HTTP request may start
CHAT_ROLES = {"developer": "system", **{role: role for role in WIRE_ROLES}}  # OpenAI's role -> ours

# gRPC status -> (HTTP status, OpenAI error type), as google.rpc maps codes to HTTP.
HTTP_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.ABORTED: (409, "server_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "server_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}


def error_body(code: grpc.StatusCode, message: str, param: str | None = None) -> tuple[int, dict]:
    """(HTTP status, OpenAI error object) for a gRPC status; the message clipped (common/shown.py:
    every HTTP error of the router is made here, so this is the backstop behind each `show`)."""
    status, kind = HTTP_OF_CODE.get(code, (500, "server_error"))
    param = param if param is None else clipped(param, MAX_SHOWN_CHARS)
    return status, {"error": {"message": clipped(message), "type": kind, "param": param, "code": code.name.lower()}}


@dataclass(frozen=True)
class OpenAIRequest:
    chat: bool  # /v1/chat/completions (else /v1/completions)
    model: str  # as the client named it; "" when absent
    stream: bool  # answer as server-sent events
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    request: generation_pb2.GenerateRequest  # checked, with the first prompt; rid unset (the router sets it)
    echo: bool = False  # completions: the answer starts with the prompt (and its logprobs, when asked for)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs asked for: choices[].prompt_logprobs
    prompts: tuple[common_pb2.Prompt, ...] = ()  # every prompt (a completion's list), the first `request`'s

    def requests(self) -> list[generation_pb2.GenerateRequest]:
        """One GenerateRequest a prompt."""
        out = []
        for prompt in self.prompts:
            req = generation_pb2.GenerateRequest()
            req.CopyFrom(self.request)
            req.prompt.CopyFrom(prompt)
            out.append(req)
        return out


def _int(body: dict, name: str, low: int, high: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise BadRequest(f"{name} must be an integer in [{low}, {high}], got {show(v)}", name)
    return v


def _token_ids(v, name: str) -> list[int] | None:
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        bad = [t for t in v if not 0 <= t <= UINT32_MAX]
        if bad:
            raise BadRequest(f"{name} holds a token id out of range: {bad[0]}", name)
        return v
    return None


def _prompts(body: dict, max_context: int | None) -> list[common_pb2.Prompt]:
    """A completion's prompts: one (a string or token-id list), or a list of them."""
    v = body.get("prompt")
    if isinstance(v, list) and v and all(isinstance(p, str | list) for p in v):
        if len(v) > MAX_PROMPTS:
            raise BadRequest(f"prompt lists {len(v)} prompts; at most {MAX_PROMPTS}", "prompt")
        return [_prompt(p, f"prompt[{i}]", max_context, len(v) > 1) for i, p in enumerate(v)]
    return [_prompt(v, "prompt", max_context)]


def _prompt(v, name: str, max_context: int | None = None, named: bool = False) -> common_pb2.Prompt:
    if isinstance(v, str):
        if not v:
            raise BadRequest(f"{name} is empty", "prompt")
        if max_context is not None and len(v) > prompt_bytes_limit(max_context):
            # more characters than it may have bytes: refused before the text is copied or checked
            raise BadRequest((f"{name}: " if named else "") + text_size_problem(v, max_context), "prompt")
        return common_pb2.Prompt(text=_text(v, name, "prompt"))
    ids = _token_ids(v, "prompt")
    if ids is None:
        raise BadRequest(
            f"{name} must be a non-empty string or token-id list (or a list of them), got {show(v)}", "prompt"
        )
    return common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=ids))


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return _text(c, f"messages[{i}].content", "messages")
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in c):
        texts = [p.get("text") for p in c]
        if all(isinstance(t, str) for t in texts):
            return _text("".join(texts), f"messages[{i}].content", "messages")
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts, got {show(c)}", "messages")


def _messages(body: dict) -> common_pb2.Prompt:
    v = body.get("messages")
    if not isinstance(v, list) or not v:
        raise BadRequest(f"messages must be a non-empty list, got {show(v)}", "messages")
    if len(v) > MAX_CHAT_MESSAGES:  # (before a message of them is looked at)
        raise BadRequest(f"messages lists {len(v)} messages; at most {MAX_CHAT_MESSAGES}", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object, got {show(m)}", "messages")
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise BadRequest(
                f"messages[{i}].role must be system, developer, user or assistant, got {show(role)}", "messages"
            )
        out.append(common_pb2.ChatMessage(role=CHAT_ROLES[role], content=_content(m, i)))
    return common_pb2.Prompt(chat=common_pb2.ChatMessages(messages=out))


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(f"stop must be a non-empty string or a list of them, got {show(v)}", "stop")
    return [_text(s, f"stop[{i}]" if isinstance(v, list) else "stop", "stop") for i, s in enumerate(stops)]


def _kind(v) -> str:
    """A JSON value's type, numbers as one (0 and 0.0 alike; true is not 1)."""
    return "number" if isinstance(v, int | float) and not isinstance(v, bool) else type(v).__name__


def _default(*values):
    """The field is off when absent, null or one of `values` (compared within its JSON type)."""
    return lambda v: v is None or any(_kind(v) == _kind(d) and v == d for d in values)


def _empty(v) -> bool:
    return v is None or (_kind(v) in ("str", "list", "dict") and not v)


# Fields of vLLM's protocol (vllm/entrypoints/openai/protocol.py; and a few of SGLang's) that change
# the output, and when they are off. Both endpoints unless _CHAT_ONLY / _COMPLETION_ONLY.
_OUTPUT_CHANGING = {
    "best_of": _default(1),
    "length_penalty": _default(1),
    "use_beam_search": _default(False),
    "top_a": _default(0),
    "typical_p": _default(1),
    "logits_processors": _empty,
    "guided_json": _empty,
    "guided_regex": _empty,
    "guided_choice": _empty,
    "guided_grammar": _empty,
    "guided_whitespace_pattern": _empty,
    "return_tokens_as_token_ids": _default(False),  # (logprobs' tokens as "token_id:N")
    "return_token_ids": _default(False),  # (adds token id fields a client would then rely on)
    "vllm_xargs": _empty,
    "structural_tag": _empty,
    "structured_outputs": _empty,
    "regex": _empty,  # SGLang
    "json_schema": _empty,  # SGLang
    "ebnf": _empty,  # SGLang
    "stop_regex": _empty,  # SGLang
    "tools": _empty,
    "tool_choice": _default("none", "auto"),  # "auto" without tools calls nothing
    "functions": _empty,
    "function_call": _default("none", "auto"),
    "suffix": _empty,
    "spaces_between_special_tokens": _default(True),
    "truncate_prompt_tokens": _default(),
    "prompt_embeds": _empty,
    "reasoning_effort": _default(),
    "verbosity": _default(),
    "audio": _default(),
    "modalities": lambda v: v is None or v == ["text"],
    "web_search_options": _default(),
}
_CHAT_ONLY = {
    "echo": _default(False),  # (vLLM's chat echo repeats the last message: not implemented)
    "add_special_tokens": _default(False),  # vLLM's chat default: the template carries BOS
    "chat_template": _empty,
    "documents": _empty,
}
_COMPLETION_ONLY = {
    "add_special_tokens": _default(True),
}


def _unsupported(body: dict, chat: bool) -> None:
    """400 for the first output-changing field we do not implement that is set to a non-default value."""
    for name, is_off in (_OUTPUT_CHANGING | (_CHAT_ONLY if chat else _COMPLETION_ONLY)).items():
        if not is_off(body.get(name)):
            raise BadRequest(f"{name} is not supported, got {show(body[name])}", name)


def _each_object(obj: dict) -> dict:
    return obj


def json_body(raw: bytes) -> dict:
    """An HTTP body that must be a JSON object; BadRequest when it is not. The router parses bodies in
    a worker thread: the Python call for each object parsed lets the event loop's thread take the GIL
    between them (json's C parser holds it from start to end otherwise: ~0.1 s for 4 MiB of objects)."""
    try:
        body = json.loads(raw, object_hook=_each_object)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {show(body)}")
    return body


def parse_request(raw: bytes, chat: bool, max_context: int | None = None) -> OpenAIRequest:
    """Validate an HTTP body and build the GenerateRequest; BadRequest names the bad field.
    `max_context` (the longest context a node serves, when known): a text prompt with more
    characters than such a context's prompt may have bytes is refused before it is copied."""
    body = json_body(raw)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {show(model)}", "model")
    n = _int(body, "n", 1, MAX_CHOICES) or 1
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"stream must be a boolean, got {show(stream)}", "stream")
    options = body.get("stream_options")
    usage = options.get("include_usage") if isinstance(options, dict) else None
    if options is not None and not (isinstance(options, dict) and isinstance(usage, bool | None)):
        raise BadRequest(f'stream_options must be {{"include_usage": bool}}, got {show(options)}', "stream_options")
    _unsupported(body, chat)

    sampling = common_pb2.SamplingParams(stop=_stop(body), n=n if n > 1 else 0)  # (0: unset, one)
    sampling_controls(body, chat, sampling)
    echo = not chat and bool(flag(body, "echo"))
    if echo and sampling.HasField("logprobs") and not sampling.HasField("prompt_logprobs"):
        sampling.prompt_logprobs = sampling.logprobs
    max_tokens = _int(body, "max_completion_tokens", 1, UINT32_MAX)
    max_tokens = max_tokens if max_tokens is not None else _int(body, "max_tokens", 1, UINT32_MAX)
    if max_tokens is not None:
        sampling.max_new_tokens = max_tokens
    t = number(body, "temperature", TEMPERATURE)
    sampling.temperature = 1.0 if t is None else t  # OpenAI's default: sampled, not greedy
    if (p := number(body, "top_p")) is not None:
        sampling.top_p = p
    if (k := _int(body, "top_k", -1, UINT32_MAX)) is not None:
        sampling.top_k = max(k, 0)
    if (seed := _int(body, "seed", 0, UINT64_MAX)) is not None:
        sampling.seed = seed
    if body.get("stop_token_ids") not in (None, []):
        ids = _token_ids(body["stop_token_ids"], "stop_token_ids")
        if ids is None:
            raise BadRequest(
                f"stop_token_ids must be a list of token ids, got {show(body['stop_token_ids'])}", "stop_token_ids"
            )
        sampling.stop_token_ids.extend(ids)
    if (m := _int(body, "min_tokens", 0, UINT32_MAX)) is not None:
        if max_tokens is not None and m > max_tokens:
            raise BadRequest(f"min_tokens ({m}) must be <= max_tokens ({max_tokens})", "min_tokens")
        sampling.min_tokens = m
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise BadRequest(f"ignore_eos must be a boolean, got {show(ignore_eos)}", "ignore_eos")
    sampling.ignore_eos = bool(ignore_eos)
    check_sampling(sampling)  # (the sizes chosen, every value: before the prompts are read)

    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and salt):
        raise BadRequest(f"cache_salt must be a non-empty string, got {show(salt)}", "cache_salt")

    prompts = [_messages(body)] if chat else _prompts(body, max_context)
    if len(prompts) * n > MAX_ANSWER_CHOICES:
        message = f"{len(prompts)} prompts x n={n} is {len(prompts) * n} choices; at most {MAX_ANSWER_CHOICES}"
        raise BadRequest(message, "n")
    prompt = prompts[0]
    if chat:
        chat_options(body, prompt.chat)
    salt = _text(salt or "", "cache_salt")
    request = generation_pb2.GenerateRequest(prompt=prompt, sampling=sampling, cache_salt=salt)
    try:
        check_cache_salt(request)
    except ValueError as e:
        raise BadRequest(str(e), "cache_salt") from None
    for p in prompts:  # (the sampling parameters and the salt are checked above, once)
        request.prompt.CopyFrom(p)
        try:
            check_prompt(request)
        except ValueError as e:
            raise BadRequest(str(e)) from None
    request.prompt.CopyFrom(prompt)
    return OpenAIRequest(
        chat=chat,
        model=model or "",
        stream=bool(stream),
        include_usage=bool(usage),
        request=request,
        echo=echo,
        prompt_logprobs=body.get("prompt_logprobs") is not None,
        prompts=tuple(prompts),
    )
