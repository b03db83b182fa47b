"""The OpenAI (and vLLM) request fields beyond the greedy core, read into kvbridge.v1 messages:
logprobs, penalties, token masks, detokenization options, structured output and the chat
template's options. Each function raises BadRequest naming the field and the bad value. The
sizes a client chooses (stop strings, bad words, logit_bias, token id lists) are checked once the
request is built, by the nodes' own rules (`check_sampling`: common/sampling.py), so what passes
here every node takes.

And the logprobs of a response as OpenAI shows them (`chat_logprobs`, `completion_logprobs`).
"""

from __future__ import annotations

import json

from kvbridge.common import sampling as rules
from kvbridge.common.sampling import MAX_SCHEMA_CHARS, MAX_TOP_LOGPROBS
from kvbridge.common.text.prompts import MAX_TEMPLATE_KWARGS_BYTES as MAX_TEMPLATE_KWARGS_CHARS  # (sent as ASCII JSON)
from kvbridge.v1 import common_pb2

UINT32_MAX = (1 << 32) - 1


class BadRequest(ValueError):
    """A bad request body: HTTP 400 naming the field (`param`) and the value."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def utf8_text(v: str, name: str, param: str | None = None) -> str:
    """A string bound for a protobuf field: it must be encodable as UTF-8 (JSON can carry lone surrogates)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = f"unpaired surrogate {v[e.start]!r} at index {e.start}"
        raise BadRequest(f"{name} is not valid Unicode: {bad}", param or name) from None
    return v


def show(value) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


TEMPERATURE = rules.Range(0, 2)  # OpenAI's (a node takes any finite temperature >= 0)


def number(body: dict, name: str, bounds: rules.Range | None = None) -> float | None:
    """body[name] as a float within `bounds` (default: the sampling rules' RANGES[name]); None if absent."""
    v = body.get(name)
    if v is None:
        return None
    bounds = bounds or rules.RANGES[name]
    if not (is_number(v) and bounds.holds(v)):
        raise BadRequest(f"{name} must be a number in {bounds}, got {show(v)}", name)
    return float(v)


def flag(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"{name} must be a boolean, got {show(v)}", name)
    return v


def _top(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {show(v)}", name)
    return v


def _logprobs(body: dict, chat: bool, sampling: common_pb2.SamplingParams) -> None:
    if chat:  # logprobs: bool; top_logprobs: the alternatives
        wanted, top = flag(body, "logprobs"), _top(body, "top_logprobs")
        if top and not wanted:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        if wanted:
            sampling.logprobs = top or 0
    else:  # completions: logprobs is the alternatives (0: the token's only)
        if body.get("top_logprobs") not in (None, 0):
            top = show(body["top_logprobs"])
            raise BadRequest(
                f"top_logprobs is not supported, got {top} (completions: logprobs: k asks for k)", "top_logprobs"
            )
        if (k := _top(body, "logprobs")) is not None:
            sampling.logprobs = k
    if (k := _top(body, "prompt_logprobs")) is not None:  # vLLM's
        sampling.prompt_logprobs = k


def _logit_bias(body: dict) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise BadRequest(f"logit_bias must be an object of token ids, got {show(v)}", "logit_bias")
    out = {}
    for key, bias in v.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token <= UINT32_MAX or str(token) != key.strip():
            raise BadRequest(f"logit_bias keys must be token ids, got {show(key)}", "logit_bias")
        if not (is_number(bias) and -100 <= bias <= 100):
            raise BadRequest(f"logit_bias[{key}] must be a number in [-100, 100], got {show(bias)}", "logit_bias")
        out[token] = float(bias)
    return out


def _strings(body: dict, name: str) -> list[str]:
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(s, str) and s.strip() for s in v):
        raise BadRequest(f"{name} must be a list of non-empty strings, got {show(v)}", name)
    return [utf8_text(s, f"{name}[{i}]", name) for i, s in enumerate(v)]


def _allowed(body: dict) -> list[int]:
    v = body.get("allowed_token_ids")
    if v is None:
        return []
    ok = isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
    if not ok or not all(0 <= t <= UINT32_MAX for t in v):
        raise BadRequest(f"allowed_token_ids must be a non-empty list of token ids, got {show(v)}", "allowed_token_ids")
    return v


def response_format(body: dict) -> common_pb2.StructuredOutput | None:
    """response_format: text (None), json_object, or json_schema with its schema checked (400 naming
    the problem: the grammar engine's own check, engine/grammar.py)."""
    v = body.get("response_format")
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise BadRequest(
            f"response_format.type must be text, json_object or json_schema, got {show(v)}", "response_format"
        )
    spec = v.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise BadRequest(f"response_format.json_schema.schema must be an object, got {show(spec)}", "response_format")
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(text) > MAX_SCHEMA_CHARS:
        raise BadRequest(f"response_format's schema is {len(text)} characters; at most {MAX_SCHEMA_CHARS}")
    from kvbridge.common.text.schema import schema_problem

    if problem := schema_problem(text):
        raise BadRequest(f"response_format.json_schema.schema: {problem}", "response_format")
    return common_pb2.StructuredOutput(json_schema=text)


def sampling_controls(body: dict, chat: bool, sampling: common_pb2.SamplingParams) -> None:
    """Everything beyond the greedy core into `sampling`."""
    _logprobs(body, chat, sampling)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        if (x := number(body, name)) is not None:
            setattr(sampling, name, x)
    sampling.logit_bias.update(_logit_bias(body))
    sampling.bad_words.extend(_strings(body, "bad_words"))
    sampling.allowed_token_ids.extend(_allowed(body))
    if (skip := flag(body, "skip_special_tokens")) is not None:
        sampling.skip_special_tokens = skip
    keep = [flag(body, "include_stop_str_in_output"), flag(body, "no_stop_trim")]  # (no_stop_trim: SGLang's)
    sampling.include_stop_str_in_output = any(keep)
    if (structured := response_format(body)) is not None:
        sampling.structured.CopyFrom(structured)


# SamplingParams' fields that OpenAI's API names otherwise
OPENAI_PARAMS = {"max_new_tokens": "max_tokens", "structured": "response_format"}


def check_sampling(sampling: common_pb2.SamplingParams) -> None:
    """The request's sampling parameters by the nodes' rules (common/sampling.py: the sizes a client
    chose, then every value): BadRequest naming the field and its limit."""
    try:
        rules.from_proto(sampling)
    except rules.SamplingError as e:
        raise BadRequest(e.problem, OPENAI_PARAMS.get(e.field, e.field)) from None


def chat_options(body: dict, chat: common_pb2.ChatMessages) -> None:
    """add_generation_prompt, continue_final_message, chat_template_kwargs (the template's)."""
    add, cont = flag(body, "add_generation_prompt"), flag(body, "continue_final_message")
    if cont and add:
        raise BadRequest("continue_final_message needs add_generation_prompt: false", "continue_final_message")
    if add is not None or cont:
        chat.add_generation_prompt = bool(add) and not cont
    chat.continue_final_message = bool(cont)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        text = json.dumps(kwargs) if isinstance(kwargs, dict) else ""  # (ASCII: lone surrogates stay escapes)
        if not text or len(text) > MAX_TEMPLATE_KWARGS_CHARS:
            raise BadRequest(
                f"chat_template_kwargs must be an object of at most {MAX_TEMPLATE_KWARGS_CHARS} characters, "
                f"got {show(kwargs)}",
                "chat_template_kwargs",
            )
        chat.chat_template_kwargs = text


# ---------------------------------------------------------------- logprobs out


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(logprobs) -> dict:
    """choices[].logprobs of a chat completion (or chunk): one entry a token."""
    content = []
    for lp in logprobs:
        top = [_entry(t, v) for t, v in zip(lp.top_tokens, lp.top_logprobs)]
        content.append({**_entry(lp.token, lp.logprob), "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(logprobs, offset: int) -> dict:
    """choices[].logprobs of a (legacy) completion: parallel lists; text_offset counts from `offset`
    (the characters of the text before these tokens)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in logprobs:
        out["tokens"].append(lp.token)
        out["token_logprobs"].append(lp.logprob if lp.HasField("logprob") else None)
        out["top_logprobs"].append(dict(zip(lp.top_tokens, lp.top_logprobs)) if lp.HasField("logprob") else None)
        out["text_offset"].append(offset)
        offset += len(lp.token)
    return out


def prompt_logprobs(logprobs) -> list:
    """choices[].prompt_logprobs as vLLM shows them: None for the first prompt token, then per
    token {id: {"logprob", "rank", "decoded_token"}} for it and the k most likely there."""
    out: list = []
    for lp in logprobs:
        if not lp.HasField("logprob"):
            out.append(None)
            continue
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.token}}
        for rank, (t, text, v) in enumerate(zip(lp.top_ids, lp.top_tokens, lp.top_logprobs), start=1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": text})
        out.append(entry)
    return out
