"""The answer to one OpenAI request, built from the GenerateResponses of its routed requests as they
arrive: one routed request a prompt (a completion may list several), each streaming `n` choices
(GenerateResponse.index). Choice `prompt * n + index` of the answer is choice `index` of that prompt,
as vLLM numbers them.

Usage counts each prompt once and every choice's completion: prompt_tokens is the sum of the
prompts', completion_tokens of the choices', cached_tokens of the prompts' (choice 0 of each: the
other choices share its pages and report none).

A stream keeps nothing of what went out. A non-streamed answer is kept as the JSON text it will be
sent as (`AnswerBody`: each choice's escaped text and logprob entries, joined as they pile up, never
an object tree beside the text), and at most `max_bytes` of it: one response more is RouteError
INVALID_ARGUMENT naming the limit (the caller's answer is a 400 and its routed requests are
cancelled upstream).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from kvbridge.router.config import RouterConfig
from kvbridge.router.failures import RouteError
from kvbridge.router.openai_api import OpenAIRequest
from kvbridge.router.openai_fields import chat_logprobs, completion_logprobs, prompt_logprobs
from kvbridge.v1 import generation_pb2

JOIN_EVERY = 32  # pieces of a kept answer's list or text joined into one string at a time
CHAT_LOGPROBS = ("content",)  # the lists of a chat choice's logprobs object
COMPLETION_LOGPROBS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")  # of a completion choice's


@dataclass
class ReplyChoice:
    """One choice of the answer so far."""

    prompt: int  # the index of its prompt
    finish_reason: str = ""
    started: bool = False  # its first chunk went out (chat: with the role; completions with echo: the prompt)
    logprob_chars: int = 0  # completions: the characters of the tokens so far (text_offset)
    completion_tokens: int = 0  # from its last response


class Reply:
    def __init__(
        self,
        req: OpenAIRequest,
        rid: str,
        model: str,
        echo: list[str] | None = None,
        created=None,
        max_bytes: int = RouterConfig.max_answer_bytes,
    ):
        """`echo`: each prompt's text as completions' echo shows it (None without echo); `max_bytes`:
        the largest non-streamed answer (the router's --max-answer-bytes)."""
        self.req, self.rid, self.model = req, rid, model
        self.created = int(time.time()) if created is None else created
        self.n = req.request.sampling.n or 1
        self.echo = echo or [""] * len(req.prompts)
        self.choices = [ReplyChoice(i // self.n) for i in range(len(req.prompts) * self.n)]
        # each prompt's TokenLogprob (prompt_logprobs asked; of a non-streamed answer only with echo)
        self.prompt: list[list] = [[] for _ in req.prompts]
        self.prompt_bytes = [0] * len(req.prompts)  # the protobuf bytes of the responses that brought them
        self.prompt_tokens = [0] * len(req.prompts)
        self.cached_tokens = [0] * len(req.prompts)
        self.ended = 0  # choices whose last response came
        # a non-streamed answer's JSON so far (None for a stream)
        self.body = None if req.stream else AnswerBody(len(req.prompts), self.n, req.chat, max_bytes)

    @property
    def wants_logprobs(self) -> bool:
        return self.req.request.sampling.HasField("logprobs")

    @property
    def usage(self) -> dict | None:
        """The answer's usage, once every choice ended (None before)."""
        if self.ended < len(self.choices):
            return None
        prompt, completion = sum(self.prompt_tokens), sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)},
        }

    def _logprobs(self, logprobs, offset: int = 0) -> dict | None:
        """A choice's logprobs object for these tokens (None when the request asked for none);
        `offset`: the characters of the tokens before them (completions' text_offset)."""
        if not self.wants_logprobs:
            return None
        return chat_logprobs(logprobs) if self.req.chat else completion_logprobs(logprobs, offset)

    def _head(self, obj: str) -> dict:
        prefix = "chatcmpl-" if self.req.chat else "cmpl-"
        return {"id": prefix + self.rid, "object": obj, "created": self.created, "model": self.model}

    def cost(self, resp: generation_pb2.GenerateResponse, prompt: int = 0) -> int:
        """About the bytes that add(resp, prompt) makes JSON of: the response's (protobuf), and on a
        choice's first response the prompt's logprobs and echo it shows again (every choice shows
        them). What the caller decides by where to add it (router/answer.py)."""
        size = resp.ByteSize()
        if resp.index < self.n and not self.choices[prompt * self.n + resp.index].started:
            size += self.prompt_bytes[prompt] + len(self.echo[prompt])
        return size

    def add(self, resp: generation_pb2.GenerateResponse, prompt: int = 0) -> dict | None:
        """Record a response of prompt `prompt`'s routed request; returns the stream chunk it makes
        (None when it carries nothing, and for a non-streamed answer: kept in `body` instead)."""
        if not resp.index < self.n:  # (a broken node: the answer cannot be built)
            message = f"a node answered choice {resp.index} of a request of n={self.n}"
            raise RouteError(grpc.StatusCode.DATA_LOSS, message)
        index = prompt * self.n + resp.index
        c = self.choices[index]
        if self.body is None or self.req.echo:  # (what a stream's first chunks and echo show again)
            self.prompt[prompt] += resp.prompt_logprobs
            self.prompt_bytes[prompt] += resp.ByteSize() if resp.prompt_logprobs else 0
        if self.body is not None and self.req.prompt_logprobs and resp.prompt_logprobs:
            self.body.keep_prompt_logprobs(prompt, prompt_logprobs(resp.prompt_logprobs))
        text, logprobs = resp.text, list(resp.logprobs)
        first = not c.started
        if self.req.echo and first:  # (every choice starts with its prompt)
            text = self.echo[prompt] + text
            if self.wants_logprobs:
                logprobs = self.prompt[prompt] + logprobs
        offset, c.logprob_chars = c.logprob_chars, c.logprob_chars + sum(len(lp.token) for lp in logprobs)
        if resp.finish_reason:
            c.finish_reason = resp.finish_reason
            self.ended += 1
        if resp.HasField("usage"):
            u = resp.usage
            c.completion_tokens = u.completion_tokens
            self.prompt_tokens[prompt] = u.prompt_tokens
            if resp.index == 0:
                self.cached_tokens[prompt] = u.cached_tokens
        if not (text or logprobs or resp.prompt_logprobs or resp.finish_reason or (self.req.chat and first)):
            return None
        c.started = True
        if self.body is not None:
            self.body.keep(index, text, self._logprobs(logprobs, offset))
            return None
        finish = resp.finish_reason or None
        if self.req.chat:
            delta = {"content": text} if text or first else {}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": index, "delta": delta, "logprobs": self._logprobs(logprobs, offset)}
            chunk = {**self._head("chat.completion.chunk"), "choices": [{**choice, "finish_reason": finish}]}
        else:
            choice = {"index": index, "text": text, "logprobs": self._logprobs(logprobs, offset)}
            chunk = {**self._head("text_completion"), "choices": [{**choice, "finish_reason": finish}]}
        if self.req.prompt_logprobs and first and self.prompt[prompt]:  # (each choice's first chunk)
            chunk["choices"][0]["prompt_logprobs"] = prompt_logprobs(self.prompt[prompt])
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    def check_complete(self) -> None:
        """DATA_LOSS when the streams ended with a choice that never did (a node that ignored n)."""
        if self.ended < len(self.choices):
            missing = next(i for i, c in enumerate(self.choices) if not c.finish_reason)
            message = f"the nodes' streams ended without choice {missing} of {len(self.choices)}"
            raise RouteError(grpc.StatusCode.DATA_LOSS, message)

    def usage_chunk(self) -> dict | None:
        """The last chunk of a stream that asked for usage (stream_options.include_usage)."""
        if not self.req.include_usage:
            return None
        obj = "chat.completion.chunk" if self.req.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage}

    def final(self) -> Iterator[str]:
        """The whole answer of a non-streaming request, as pieces of its JSON text (ASCII)."""
        assert self.body is not None, "a stream has no whole answer"
        head = self._head("chat.completion" if self.req.chat else "text_completion")
        yield json.dumps(head)[:-1] + ', "choices": ['
        for index, c in enumerate(self.choices):
            if index:
                yield ", "
            yield from self.body.choice(index, c.prompt, c.finish_reason or None, self.wants_logprobs,
                                        self.req.prompt_logprobs)  # fmt: skip
        yield '], "usage": ' + json.dumps(self.usage) + "}"


class Joined:
    """Text kept in pieces while it grows, `sep` between them (", ": a JSON array's items), each run
    of JOIN_EVERY pieces joined into one string (a long one costs about its text, not an object a piece)."""

    def __init__(self, sep: str = ", "):
        self.sep = sep
        self.parts: list[str] = []  # pieces, and runs of them joined with sep
        self.loose = 0  # pieces at the end of parts not joined yet

    def add(self, piece: str) -> int:
        """Append a piece; returns the bytes the text grew by."""
        self.parts.append(piece)
        self.loose += 1
        if self.loose == JOIN_EVERY:
            self.parts[-JOIN_EVERY:] = [self.sep.join(self.parts[-JOIN_EVERY:])]
            self.loose = 0
        return len(piece) + len(self.sep)

    def pieces(self) -> Iterator[str]:
        for i, part in enumerate(self.parts):
            if i and self.sep:
                yield self.sep
            yield part  # (as kept: never copied)

    def array(self) -> Iterator[str]:
        """As a JSON array of the pieces (each an item's JSON)."""
        yield "["
        yield from self.pieces()
        yield "]"


class _KeptChoice:
    """A choice of a non-streamed answer as JSON: its text (escaped, without quotes) and logprobs."""

    def __init__(self, chat: bool):
        self.text = Joined("")
        # chat: "content"; completions: the four parallel lists of their logprobs
        self.logprobs = {k: Joined() for k in (CHAT_LOGPROBS if chat else COMPLETION_LOGPROBS)}


class AnswerBody:
    """A non-streamed answer's JSON text as the responses come (Reply.body), at most `max_bytes`."""

    def __init__(self, prompts: int, n: int, chat: bool, max_bytes: int):
        self.n, self.chat, self.max_bytes = n, chat, max_bytes
        self.choices = [_KeptChoice(chat) for _ in range(prompts * n)]
        self.prompts = [Joined() for _ in range(prompts)]  # each prompt's prompt_logprobs entries
        self.size = 0  # bytes of the answer's JSON kept so far (about: its fixed frame is not counted)

    def keep(self, index: int, text: str, logprobs: dict | None) -> None:
        """Keep a response of choice `index`: its text, and its logprobs object (chat_logprobs or
        completion_logprobs of its tokens; None when none were asked for)."""
        c, grew = self.choices[index], 0
        if text:
            grew += c.text.add(json.dumps(text)[1:-1])
        for name, items in (logprobs or {}).items():
            if name in c.logprobs:
                grew += sum(c.logprobs[name].add(json.dumps(item)) for item in items)
        self._grew(grew)

    def keep_prompt_logprobs(self, prompt: int, entries: list) -> None:
        """Keep prompt_logprobs entries of `prompt` (every one of its n choices shows them)."""
        self._grew(self.n * sum(self.prompts[prompt].add(json.dumps(e)) for e in entries))

    def choice(self, index: int, prompt: int, finish: str | None, logprobs: bool, prompt_logprobs: bool):
        """The JSON text of choice `index`, in pieces."""
        c = self.choices[index]
        yield f'{{"index": {index}, ' + ('"message": {"role": "assistant", "content": "' if self.chat else '"text": "')
        yield from c.text.pieces()
        yield ('"}' if self.chat else '"') + ', "logprobs": '
        if not logprobs:
            yield "null"
        else:
            for i, (name, items) in enumerate(c.logprobs.items()):
                yield ("{" if i == 0 else ", ") + json.dumps(name) + ": "
                yield from items.array()
            yield ', "refusal": null}' if self.chat else "}"
        yield ', "finish_reason": ' + json.dumps(finish)
        if prompt_logprobs:
            yield ', "prompt_logprobs": '
            yield from self.prompts[prompt].array()
        yield "}"

    def _grew(self, grew: int) -> None:
        self.size += grew
        if self.size > self.max_bytes:
            self.choices, self.prompts = [], []  # (freed now: the answer is not going out)
            message = (
                f"the answer exceeds --max-answer-bytes ({self.max_bytes} bytes) of a non-streamed answer; "
                'ask for it with "stream": true'
            )
            raise RouteError(grpc.StatusCode.INVALID_ARGUMENT, message)
