"""OpenAI-compatible JSON <-> kvbridge.v1 messages: request parsing and validation, response and
error bodies. No I/O here (http.py does it).

Fields read: model, prompt (string, token-id list, or a list holding one of those), messages,
max_tokens / max_completion_tokens, temperature, top_p, seed, stop (string or list), n (only 1),
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
import math
import time
from dataclasses import dataclass, field

import grpc

from common.sampling import MAX_STOP_STRINGS
from kvbridge.v1 import common_pb2, generation_pb2
from router.checks import check_cache_salt, check_generate
from router.openai_fields import (
    BadRequest,
    chat_logprobs,
    chat_options,
    completion_logprobs,
    flag,
    prompt_logprobs,
    sampling_controls,
    show,
)

__all__ = ["BadRequest", "OpenAIRequest", "Reply", "error_body", "parse_request"]
_show = show  # (router/tokenize.py's name for it)

UINT32_MAX = (1 << 32) - 1
UINT64_MAX = (1 << 64) - 1
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

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
    """(HTTP status, OpenAI error object) for a gRPC status."""
    status, kind = HTTP_OF_CODE.get(code, (500, "server_error"))
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code.name.lower()}}


@dataclass(frozen=True)
class OpenAIRequest:
    chat: bool  # /v1/chat/completions (else /v1/completions)
    model: str  # as the client named it; "" when absent
    stream: bool  # answer as server-sent events
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    request: generation_pb2.GenerateRequest  # checked; rid unset (the router sets it)
    echo: bool = False  # completions: the answer starts with the prompt (and its logprobs, when asked for)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs asked for: choices[].prompt_logprobs


def _text(v: str, name: str, param: str | None = None) -> str:
    """A string bound for a protobuf field: it must be encodable as UTF-8 (JSON can carry lone surrogates)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = f"unpaired surrogate {v[e.start]!r} at index {e.start}"
        raise BadRequest(f"{name} is not valid Unicode: {bad}", param or name) from None
    return v


def _int(body: dict, name: str, low: int, high: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise BadRequest(f"{name} must be an integer in [{low}, {high}], got {show(v)}", name)
    return v


def _number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    if not (ok and (low < v if low_open else low <= v) and v <= high):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise BadRequest(f"{name} must be a number in {interval}, got {show(v)}", name)
    return float(v)


def _token_ids(v, name: str) -> list[int] | None:
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        bad = [t for t in v if not 0 <= t <= UINT32_MAX]
        if bad:
            raise BadRequest(f"{name} holds a token id out of range: {bad[0]}", name)
        return v
    return None


def _prompt(body: dict) -> common_pb2.Prompt:
    v = body.get("prompt")
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
        v = v[0]  # a batch of one
    if isinstance(v, str):
        if not v:
            raise BadRequest("prompt is empty", "prompt")
        return common_pb2.Prompt(text=_text(v, "prompt"))
    ids = _token_ids(v, "prompt")
    if ids is None:
        raise BadRequest(f"prompt must be a non-empty string or token-id list (one prompt), got {show(v)}", "prompt")
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
    if len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS}", "stop")
    return [_text(s, "stop") for s in stops]


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


def json_body(raw: bytes) -> dict:
    """An HTTP body that must be a JSON object; BadRequest when it is not."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {show(body)}")
    return body


def parse_request(raw: bytes, chat: bool) -> OpenAIRequest:
    """Validate an HTTP body and build the GenerateRequest; BadRequest names the bad field."""
    body = json_body(raw)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {show(model)}", "model")
    n = body.get("n")
    if n is not None and (n != 1 or isinstance(n, bool)):
        raise BadRequest(f"n must be 1 (one choice per request), got {show(n)}", "n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"stream must be a boolean, got {show(stream)}", "stream")
    options = body.get("stream_options")
    usage = options.get("include_usage") if isinstance(options, dict) else None
    if options is not None and not (isinstance(options, dict) and isinstance(usage, bool | None)):
        raise BadRequest(f'stream_options must be {{"include_usage": bool}}, got {show(options)}', "stream_options")
    _unsupported(body, chat)

    sampling = common_pb2.SamplingParams(stop=_stop(body))
    sampling_controls(body, chat, sampling)
    echo = not chat and bool(flag(body, "echo"))
    if echo and sampling.HasField("logprobs") and not sampling.HasField("prompt_logprobs"):
        sampling.prompt_logprobs = sampling.logprobs
    max_tokens = _int(body, "max_completion_tokens", 1, UINT32_MAX)
    max_tokens = max_tokens if max_tokens is not None else _int(body, "max_tokens", 1, UINT32_MAX)
    if max_tokens is not None:
        sampling.max_new_tokens = max_tokens
    t = _number(body, "temperature", 0, 2)
    sampling.temperature = 1.0 if t is None else t  # OpenAI's default: sampled, not greedy
    if (p := _number(body, "top_p", 0, 1, low_open=True)) is not None:
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

    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and salt):
        raise BadRequest(f"cache_salt must be a non-empty string, got {show(salt)}", "cache_salt")

    prompt = _messages(body) if chat else _prompt(body)
    if chat:
        chat_options(body, prompt.chat)
    salt = _text(salt or "", "cache_salt")
    request = generation_pb2.GenerateRequest(prompt=prompt, sampling=sampling, cache_salt=salt)
    try:
        check_cache_salt(request)
    except ValueError as e:
        raise BadRequest(str(e), "cache_salt") from None
    try:
        check_generate(request)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return OpenAIRequest(
        chat=chat,
        model=model or "",
        stream=bool(stream),
        include_usage=bool(usage),
        request=request,
        echo=echo,
        prompt_logprobs=body.get("prompt_logprobs") is not None,
    )


@dataclass
class Reply:
    """The answer to one OpenAI request, built from the GenerateResponses as they arrive."""

    req: OpenAIRequest
    rid: str
    model: str  # the model named in the answer
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)  # deltas so far
    finish_reason: str = ""
    usage: dict | None = None
    role_sent: bool = False  # chat streams announce the assistant role once
    echo: str = ""  # completions with echo: the prompt's text, sent before the first text
    logprobs: list = field(default_factory=list)  # kvbridge.v1.TokenLogprob of every token so far
    logprob_chars: int = 0  # completions: the characters of the tokens so far (text_offset)
    prompt: list = field(default_factory=list)  # the prompt's kvbridge.v1.TokenLogprob (prompt_logprobs asked)

    @property
    def wants_logprobs(self) -> bool:
        return self.req.request.sampling.HasField("logprobs")

    def _logprobs(self, logprobs, offset: int = 0) -> dict | None:
        """The choice's logprobs object for these tokens (None when the request asked for none);
        `offset`: the characters of the tokens before them (completions' text_offset)."""
        if not self.wants_logprobs:
            return None
        return chat_logprobs(logprobs) if self.req.chat else completion_logprobs(logprobs, offset)

    def _head(self, obj: str) -> dict:
        prefix = "chatcmpl-" if self.req.chat else "cmpl-"
        return {"id": prefix + self.rid, "object": obj, "created": self.created, "model": self.model}

    def add(self, resp: generation_pb2.GenerateResponse) -> dict | None:
        """Record a response; returns the stream chunk it makes (None when it carries nothing)."""
        text, logprobs = resp.text, list(resp.logprobs)
        if self.req.echo and not self.role_sent:  # (role_sent: here, that the prompt went out)
            self.role_sent = True
            text = self.echo + text
            if self.wants_logprobs:
                logprobs = list(resp.prompt_logprobs) + logprobs
        self.text.append(text)
        self.logprobs.extend(logprobs)
        self.prompt.extend(resp.prompt_logprobs)
        offset, self.logprob_chars = self.logprob_chars, self.logprob_chars + sum(len(lp.token) for lp in logprobs)
        if resp.finish_reason:
            self.finish_reason = resp.finish_reason
        if resp.HasField("usage"):
            u = resp.usage
            self.usage = {
                "prompt_tokens": u.prompt_tokens,
                "completion_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            }
        if not (
            text or logprobs or resp.prompt_logprobs or resp.finish_reason or (self.req.chat and not self.role_sent)
        ):
            return None
        finish = resp.finish_reason or None
        if self.req.chat:
            delta = {"content": text} if text or not self.role_sent else {}
            if not self.role_sent:
                delta, self.role_sent = {"role": "assistant", **delta}, True
            choice = {"index": 0, "delta": delta, "logprobs": self._logprobs(logprobs, offset), "finish_reason": finish}
            chunk = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs(logprobs, offset), "finish_reason": finish}
            chunk = {**self._head("text_completion"), "choices": [choice]}
        if self.req.prompt_logprobs and resp.prompt_logprobs:  # (the first chunk)
            choice["prompt_logprobs"] = prompt_logprobs(resp.prompt_logprobs)
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self) -> dict | None:
        """The last chunk of a stream that asked for usage (stream_options.include_usage)."""
        if not self.req.include_usage:
            return None
        obj = "chat.completion.chunk" if self.req.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage}

    def final(self) -> dict:
        """The whole answer of a non-streaming request."""
        text = "".join(self.text)
        finish = self.finish_reason or None
        if self.req.chat:
            message = {"role": "assistant", "content": text}
            logprobs = self._logprobs(self.logprobs)
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs(self.logprobs), "finish_reason": finish}
            head = self._head("text_completion")
        if self.req.prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprobs(self.prompt)
        return {**head, "choices": [choice], "usage": self.usage}
