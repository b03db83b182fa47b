"""The answer to one OpenAI request, built from the GenerateResponses of its routed requests as they
arrive: one routed request a prompt (a completion may list several), each streaming `n` choices
(GenerateResponse.index). Choice `prompt * n + index` of the answer is choice `index` of that prompt,
as vLLM numbers them.

Usage counts each prompt once and every choice's completion: prompt_tokens is the sum of the
prompts', completion_tokens of the choices', cached_tokens of the prompts' (choice 0 of each: the
other choices share its pages and report none).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from kvbridge.v1 import generation_pb2
from router.failures import RouteError
from router.openai_api import OpenAIRequest
from router.openai_fields import chat_logprobs, completion_logprobs, prompt_logprobs


@dataclass
class ReplyChoice:
    """One choice of the answer so far."""

    prompt: int  # the index of its prompt
    text: list[str] = field(default_factory=list)  # deltas so far
    finish_reason: str = ""
    started: bool = False  # its first chunk went out (chat: with the role; completions with echo: the prompt)
    logprobs: list = field(default_factory=list)  # kvbridge.v1.TokenLogprob of every token so far
    logprob_chars: int = 0  # completions: the characters of the tokens so far (text_offset)
    completion_tokens: int = 0  # from its last response


class Reply:
    def __init__(self, req: OpenAIRequest, rid: str, model: str, echo: list[str] | None = None, created=None):
        """`echo`: each prompt's text as completions' echo shows it (None without echo)."""
        self.req, self.rid, self.model = req, rid, model
        self.created = int(time.time()) if created is None else created
        self.n = req.request.sampling.n or 1
        self.echo = echo or [""] * len(req.prompts)
        self.choices = [ReplyChoice(i // self.n) for i in range(len(req.prompts) * self.n)]
        self.prompt: list[list] = [[] for _ in req.prompts]  # each prompt's TokenLogprob (prompt_logprobs asked)
        self.prompt_tokens = [0] * len(req.prompts)
        self.cached_tokens = [0] * len(req.prompts)
        self.ended = 0  # choices whose last response came

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

    def add(self, resp: generation_pb2.GenerateResponse, prompt: int = 0) -> dict | None:
        """Record a response of prompt `prompt`'s routed request; returns the stream chunk it makes
        (None when it carries nothing)."""
        if not resp.index < self.n:  # (a broken node: the answer cannot be built)
            message = f"a node answered choice {resp.index} of a request of n={self.n}"
            raise RouteError(grpc.StatusCode.DATA_LOSS, message)
        index = prompt * self.n + resp.index
        c = self.choices[index]
        self.prompt[prompt] += resp.prompt_logprobs
        text, logprobs = resp.text, list(resp.logprobs)
        first = not c.started
        if self.req.echo and first:  # (every choice starts with its prompt)
            text = self.echo[prompt] + text
            if self.wants_logprobs:
                logprobs = self.prompt[prompt] + logprobs
        c.text.append(text)
        c.logprobs += logprobs
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

    def final(self) -> dict:
        """The whole answer of a non-streaming request."""
        choices = []
        for index, c in enumerate(self.choices):
            text, finish, logprobs = "".join(c.text), c.finish_reason or None, self._logprobs(c.logprobs)
            if self.req.chat:
                message = {"role": "assistant", "content": text}
                choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if self.req.prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs(self.prompt[c.prompt])
            choices.append(choice)
        head = self._head("chat.completion" if self.req.chat else "text_completion")
        return {**head, "choices": choices, "usage": self.usage}
