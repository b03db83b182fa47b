"""/tokenize, /detokenize and /version of the HTTP front, as vLLM serves them.

    POST /tokenize    {"model"?, "prompt": str, "add_special_tokens"?: bool (default true)}
                   or {"model"?, "messages": [...], "add_generation_prompt"?: bool (default true),
                       "continue_final_message"?: bool, "chat_template_kwargs"?: {...},
                       "add_special_tokens"?: false}
                      + "return_token_strs"?: bool
                   -> {"count": n, "max_model_len": the model's context, "tokens": [ids],
                       "token_strs": null, or the ids' vocabulary entries}
    POST /detokenize  {"model"?, "tokens": [ids]} -> {"prompt": text}   (special tokens kept)
    GET  /version     {"version": the package's version (kvbridge.__version__)}

The ids are those a generation of the same prompt uses: the router tokenizes with the nodes' own
tokenizer (router/prompts.py fetches it) and their own adapter (common/text/prompts.py prompt_ids), in a
worker thread. add_special_tokens false on a prompt leaves out the BOS the model would add (true on
messages is refused, as for chat completions: the template carries the special tokens).
Answers are (HTTP status, JSON body); errors in the OpenAI format: 400 naming the field, 404 for a
model not served, 503 while no node serves one or no tokenizer could be fetched yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kvbridge import __version__
from kvbridge.common.limits import prompt_size_problem
from kvbridge.common.shown import shown
from kvbridge.common.text.prompts import encode, in_worker, prompt_ids
from kvbridge.common.text.tokenizer import Tokenizer
from kvbridge.router.openai_api import BadRequest, OpenAIRequest, _messages, _show, _text, error_body
from kvbridge.router.openai_fields import chat_options
from kvbridge.router.pool import NodePool
from kvbridge.router.prompts import Prompts
from kvbridge.v1 import common_pb2, generation_pb2

# The chat-only fields whose error a ValueError of prompt_ids names, in the order they are looked for.
_CHAT_FIELDS = ("chat_template_kwargs", "continue_final_message", "add_generation_prompt")


class Refused(Exception):
    """An answer other than 400: the gRPC code it maps to, and why."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(frozen=True)
class TokenizeRequest:
    model: str  # "" when absent
    prompt: common_pb2.Prompt  # text or chat (with its template options)
    add_special_tokens: bool  # False: no BOS added by the encoder
    return_token_strs: bool


def version() -> dict:
    return {"version": __version__}


async def echo_texts(req: OpenAIRequest, pool: NodePool, prompts: Prompts) -> list[str] | None:
    """A completion's prompts as `echo` shows them (None without echo): text as sent, token ids
    decoded (special tokens kept). Refused (an answer other than 200) when one cannot be."""
    if not req.echo:
        return None
    texts, tokenizer = [], None
    for prompt in req.prompts:
        if prompt.WhichOneof("kind") == "text":
            texts.append(prompt.text)
            continue
        try:
            tokenizer = tokenizer or await _tokenizer(prompts, _served(pool, req.model))
            texts.append((await in_worker(_detokenized, list(prompt.token_ids.ids), tokenizer))["prompt"])
        except BadRequest as e:
            param = "prompt" if e.param == "tokens" else e.param
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e), param) from None
    return texts


async def tokenize(body: dict, pool: NodePool, prompts: Prompts) -> tuple[int, dict]:
    """The answer to POST /tokenize with `body` (the JSON object it carries)."""
    try:
        req = parse_tokenize(body)
        model = _served(pool, req.model)
        tokenizer = await _tokenizer(prompts, model)
        return 200, await in_worker(_tokenized, req, tokenizer, model.max_context)
    except BadRequest as e:
        return error_body(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.param)
    except Refused as e:
        return error_body(e.code, str(e), e.param)


async def detokenize(body: dict, pool: NodePool, prompts: Prompts) -> tuple[int, dict]:
    """The answer to POST /detokenize with `body` (the JSON object it carries)."""
    try:
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest(f"tokens must be a list of token ids, got {_show(ids)}", "tokens")
        tokenizer = await _tokenizer(prompts, _served(pool, _model(body)))
        return 200, await in_worker(_detokenized, ids, tokenizer)
    except BadRequest as e:
        return error_body(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.param)
    except Refused as e:
        return error_body(e.code, str(e), e.param)


# ------------------------------------------------------------------ parsing


def parse_tokenize(body: dict) -> TokenizeRequest:
    """Validate a /tokenize body; BadRequest names the bad field."""
    model = _model(body)
    special = _flag(body, "add_special_tokens")
    strs = bool(_flag(body, "return_token_strs"))
    if body.get("messages") is not None and body.get("prompt") is not None:
        raise BadRequest("give prompt or messages, not both", "messages")
    if body.get("messages") is None:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise BadRequest(f"prompt must be a string (or send messages), got {_show(text)}", "prompt")
        prompt = common_pb2.Prompt(text=_text(text, "prompt"))
        return TokenizeRequest(model, prompt, special is not False, strs)
    if special:
        raise BadRequest("add_special_tokens true is not supported with messages (the template carries them)",
                         "add_special_tokens")  # fmt: skip
    for name in ("chat_template", "tools", "documents"):
        if body.get(name) not in (None, "", [], {}):
            raise BadRequest(f"{name} is not supported, got {_show(body[name])}", name)
    prompt = _messages(body)
    chat_options(body, prompt.chat)
    return TokenizeRequest(model, prompt, True, strs)


def _model(body: dict) -> str:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {_show(model)}", "model")
    return model or ""


def _flag(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"{name} must be a boolean, got {_show(v)}", name)
    return v


# ------------------------------------------------------------------ answering


def _served(pool: NodePool, name: str) -> generation_pb2.ModelInfo:
    """The model named (or the one the nodes serve when none is named)."""
    served = pool.models()
    if not served:
        raise Refused(grpc.StatusCode.UNAVAILABLE, "no healthy node serves a model yet; retry later")
    if name:
        model = next((m for m in served if m.model == name), None)
        if model is None:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"model {shown(name)} is not served here", "model")
        return model
    model = pool.agreed_model() or (served[0] if len(served) == 1 else None)
    if model is None:
        names = ", ".join(sorted(m.model for m in served))
        raise BadRequest(f"the nodes serve several models ({names}): name one in model", "model")
    return model


async def _tokenizer(prompts: Prompts, model: generation_pb2.ModelInfo) -> Tokenizer:
    tokenizer = await prompts.tokenizer_of(model)
    if tokenizer is None:
        message = f"no tokenizer of model {model.model!r} at the router yet (none could be fetched from its nodes)"
        raise Refused(grpc.StatusCode.UNAVAILABLE, message + "; retry later")
    return tokenizer


def _tokenized(req: TokenizeRequest, tokenizer: Tokenizer, max_context: int) -> dict:
    """(in a worker thread)"""
    try:
        if req.add_special_tokens:
            ids = prompt_ids(req.prompt, tokenizer, max_context)  # exactly as the node (its size checks too)
        elif problem := prompt_size_problem(req.prompt, max_context):
            raise ValueError(problem)
        else:
            ids = encode(tokenizer, req.prompt.text, add_special_tokens=False)
    except ValueError as e:
        chat = req.prompt.WhichOneof("kind") == "chat"
        param = next((f for f in _CHAT_FIELDS if chat and f in str(e)), "messages" if chat else "prompt")
        raise BadRequest(str(e), param) from None
    strs = [tokenizer.backend.id_to_token(i) for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_context, "tokens": ids, "token_strs": strs}


def _detokenized(ids: list[int], tokenizer: Tokenizer) -> dict:
    """(in a worker thread)"""
    token = tokenizer.backend.id_to_token
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < tokenizer.vocab_size or token(t) is None), None)
    if bad is not None:
        raise BadRequest(
            f"tokens[{bad}] = {ids[bad]} is not in the vocabulary (ids 0..{tokenizer.vocab_size - 1})", "tokens"
        )
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
