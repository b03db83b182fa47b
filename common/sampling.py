"""Sampling parameters: one dataclass, one set of rules (`SamplingParams.validate`), and the one
checked conversion from the wire (`from_proto`). The router and the nodes use the same, so a
request the router lets through is one every node takes."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

from kvbridge.v1 import common_pb2

# Smallest non-greedy temperature: the sampler divides the logits by it, and below this a large
# logit overflows float32 (inf, then NaN probabilities). 0 is greedy.
MIN_TEMPERATURE = 1e-5
MAX_TOP_LOGPROBS = 20  # alternatives returned per position (OpenAI's limit)
MAX_SCHEMA_CHARS = 64 * 1024
MAX_CHOICES = 16  # n: completions of one prompt, sampled apart and sharing its pages


@dataclass(frozen=True)
class Range:
    """A closed (or left-open) interval of a sampling number."""

    low: float
    high: float
    low_open: bool = False

    def holds(self, v: float) -> bool:  # (NaN: never)
        return (self.low < v if self.low_open else self.low <= v) and v <= self.high

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


# The bounded sampling numbers: checked here (validate) and by the router's OpenAI parsing alike.
RANGES = {
    "top_p": Range(0, 1, low_open=True),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "repetition_penalty": Range(0, 2, low_open=True),
    "min_p": Range(0, 1),
}

# The sizes a client chooses (`check_sizes`), refused before anything is built from them: at the
# router, and at each node (from_proto checks the wire's counts before it copies them). The work a
# token costs does not grow with them (stop strings: one automaton step a character, common/text/detok.py;
# bad words: a trie walk as deep as the longest word, masks built once a request, engine/logits.py);
# they bound what a request costs to check and to set up. Real clients stay far below (OpenAI allows
# 4 stop strings and 300 logit_bias entries).
MAX_STOP_STRINGS = 16  # stop strings of a request
MAX_STOP_STRING_CHARS = 1024  # one stop string
MAX_STOP_CHARS = 4096  # all of a request's stop strings together
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 128  # bad_words of a request
MAX_BAD_WORD_CHARS = 128  # one bad word
MAX_BAD_WORDS_CHARS = 2048  # all of a request's bad words together
# bad_words as the node's tokenizer encodes them (each word alone and after a space): a byte-level
# tokenizer (one token a UTF-8 byte, 4 a character) never reaches these
MAX_BAD_WORD_TOKENS = 4 * MAX_BAD_WORD_CHARS + 2  # one token sequence (the banned-token walk's depth)
MAX_BAD_WORDS_TOKENS = 2 * (4 * MAX_BAD_WORDS_CHARS + 2 * MAX_BAD_WORDS)  # all of them
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_ALLOWED_TOKEN_IDS = 65536  # allowed_token_ids (duplicates count)


class SamplingError(ValueError):
    """A bad sampling field: `field` is its name in SamplingParams (and on the wire), `problem` the
    message without the "sampling." a node's status puts before it (from_proto)."""

    def __init__(self, field: str, problem: str, prefix: str = ""):
        super().__init__(prefix + problem)
        self.field, self.problem = field, problem


def _utf8_problem(name: str, texts) -> str:
    """Why a text of `texts` cannot be sent as UTF-8 ("" when all can): JSON may carry lone surrogates."""
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"{name}[{i}] is not valid Unicode: unpaired surrogate {text[e.start]!r} at index {e.start}"
    return ""


def check_sizes(stop=(), stop_token_ids=(), bad_words=(), logit_bias=(), allowed_token_ids=()) -> None:
    """The sizes a client chose, within the limits above: SamplingError naming the field and the
    limit. Takes the wire's containers as well as tuples: counts come first (len only), then the
    lengths of at most MAX_STOP_STRINGS and MAX_BAD_WORDS strings."""
    counts = (
        ("stop", stop, "strings", MAX_STOP_STRINGS),
        ("stop_token_ids", stop_token_ids, "ids", MAX_STOP_TOKEN_IDS),
        ("bad_words", bad_words, "words", MAX_BAD_WORDS),
        ("logit_bias", logit_bias, "entries", MAX_LOGIT_BIAS),
        ("allowed_token_ids", allowed_token_ids, "ids", MAX_ALLOWED_TOKEN_IDS),
    )
    for name, values, unit, most in counts:
        if len(values) > most:
            raise SamplingError(name, f"{name} has {len(values)} {unit}; at most {most}")
    for name, texts, one, total in (
        ("stop", stop, MAX_STOP_STRING_CHARS, MAX_STOP_CHARS),
        ("bad_words", bad_words, MAX_BAD_WORD_CHARS, MAX_BAD_WORDS_CHARS),
    ):
        if odd := [i for i, t in enumerate(texts) if not isinstance(t, str)]:
            raise SamplingError(name, f"{name}[{odd[0]}] must be a string")
        lengths = [len(t) for t in texts]
        long = [i for i, n in enumerate(lengths) if n > one]
        if long:
            raise SamplingError(name, f"{name}[{long[0]}] is {lengths[long[0]]} characters; at most {one}")
        if sum(lengths) > total:
            raise SamplingError(name, f"{name}: total length {sum(lengths)} characters; at most {total}")
        if problem := _utf8_problem(name, texts):
            raise SamplingError(name, problem)


def check_bad_words_ids(seqs: tuple[tuple[int, ...], ...]) -> None:
    """bad_words' token sequences within their limits (the node's tokenizer made them)."""
    lengths = [len(s) for s in seqs]
    if len(seqs) > 2 * MAX_BAD_WORDS:
        raise SamplingError("bad_words", f"bad_words has {len(seqs)} token sequences; at most {2 * MAX_BAD_WORDS}")
    if max(lengths, default=0) > MAX_BAD_WORD_TOKENS:
        raise SamplingError("bad_words", f"bad_words: a word is {max(lengths)} tokens; at most {MAX_BAD_WORD_TOKENS}")
    if sum(lengths) > MAX_BAD_WORDS_TOKENS:
        raise SamplingError("bad_words", f"bad_words: {sum(lengths)} tokens in all; at most {MAX_BAD_WORDS_TOKENS}")
    if any(not s for s in seqs):
        raise SamplingError("bad_words", "bad_words holds an empty token sequence")


@dataclass(frozen=True)
class SamplingParams:
    # 0 = unset: the node makes it the rest of the context, at most EngineConfig.max_default_tokens (resolved())
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None  # same seed + same prompt = same output, alone or batched
    stop: tuple[str, ...] = ()  # generation ends when the text contains one of these (excluded)
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS tokens
    ignore_eos: bool = False
    # EOS and stop_token_ids cannot be sampled, and stop strings do not count, until this many tokens are out
    min_tokens: int = 0
    # logits processing (engine/logits.py), in the order it applies
    allowed_token_ids: tuple[int, ...] = ()  # non-empty: only these can be sampled
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids ascending
    bad_words: tuple[str, ...] = ()  # as the client wrote them
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # their token sequences: filled by the node (with_bad_words_ids)
    json_schema: str = ""  # structured output: the output is JSON valid under this schema (JSON text)
    json_object: bool = False  # structured output: any JSON object
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    # what comes back besides the tokens
    logprobs: int | None = None  # None: none; k: each sampled token's logprob and the k most likely
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob and the k most likely
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # choices of the prompt (`choice`): one prefill, n decodes, choice i sampled with seed + i
    n: int = 1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """SamplingError naming the first bad field and its value (sizes first: check_sizes)."""
        check_sizes(self.stop, self.stop_token_ids, self.bad_words, self.logit_bias, self.allowed_token_ids)
        check_bad_words_ids(self.bad_words_ids)
        if problem := self._problem():
            raise SamplingError(*problem)

    def _problem(self) -> tuple[str, str] | None:
        """(field, message) of the first bad value, or None."""
        if self.max_new_tokens < 0:
            return (
                "max_new_tokens",
                f"max_new_tokens must be >= 1 (or 0: the rest of the context), got {self.max_new_tokens}",
            )
        if self.min_tokens < 0 or (self.max_new_tokens and self.min_tokens > self.max_new_tokens):
            return (
                "min_tokens",
                f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}",
            )
        t = self.temperature
        if not t >= 0:  # (NaN too)
            return "temperature", f"temperature must be >= 0, got {t}"
        if t > 0 and not MIN_TEMPERATURE <= t < math.inf:
            return "temperature", f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {t}"
        if not RANGES["top_p"].holds(self.top_p):
            return "top_p", f"top_p must be in {RANGES['top_p']}, got {self.top_p}"
        if self.top_k < 0:
            return "top_k", f"top_k must be >= 0, got {self.top_k}"
        empty = [i for i, s in enumerate(self.stop) if not s]
        if empty:
            return "stop", f"stop[{empty[0]}] is empty (it would match at once)"
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            if not RANGES[name].holds(getattr(self, name)):
                return name, f"{name} must be in {RANGES[name]}, got {getattr(self, name)}"
        for token, bias in self.logit_bias:
            if not -100 <= bias <= 100:  # (NaN too)
                return "logit_bias", f"logit_bias[{token}] must be in [-100, 100], got {bias}"
        if any(not w.strip() for w in self.bad_words):
            return "bad_words", "bad_words holds an empty word"
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                return name, f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {k}"
        if not 1 <= self.n <= MAX_CHOICES:
            return "n", f"n must be in [1, {MAX_CHOICES}], got {self.n}"
        if self.json_schema and self.json_object:
            return "structured", "json_schema and json_object are exclusive"
        if self.structured and self.ignore_eos:
            return "ignore_eos", "ignore_eos cannot be combined with structured output (it ends with EOS)"
        if len(self.json_schema) > MAX_SCHEMA_CHARS:
            return "structured", f"json_schema is {len(self.json_schema)} characters; at most {MAX_SCHEMA_CHARS}"
        return None

    @cached_property
    def stop_token_set(self) -> frozenset[int]:
        """stop_token_ids as a set (made once: a sampled token is looked up in it)."""
        return frozenset(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def structured(self) -> bool:
        return bool(self.json_schema) or self.json_object

    @property
    def needs_history(self) -> bool:
        """The sampling rank needs the request's tokens (prompt and outputs) to process its logits."""
        penalized = self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
        return bool(penalized or self.bad_words_ids or self.structured or self.prompt_logprobs is not None)

    def choice(self, i: int) -> SamplingParams:
        """The params of choice i of n: one choice each, seed + i (mod 2**64: the wire's uint64), and
        the prompt's logprobs on choice 0 only (the prompt is one)."""
        seed = None if self.seed is None else (self.seed + i) % (1 << 64)
        return replace(self, n=1, seed=seed, prompt_logprobs=self.prompt_logprobs if i == 0 else None)

    def with_bad_words_ids(self, encode) -> SamplingParams:
        """bad_words as token sequences, as vLLM makes them: each word alone and after a space.
        SamplingError ("sampling.bad_words: ...") when they pass their token limits."""
        seqs: dict[tuple[int, ...], None] = {}  # (ordered, without repeats)
        for word in self.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                if ids := tuple(encode(text)):
                    seqs[ids] = None
        try:
            return replace(self, bad_words_ids=tuple(seqs))
        except SamplingError as e:
            raise SamplingError(e.field, e.problem, "sampling.") from None

    def resolved(self, prompt_tokens: int, max_context: int, max_default_tokens: int) -> SamplingParams:
        """With max_new_tokens unset (0): the rest of the context after the prompt, at most
        max_default_tokens (0: no cap), at least min_tokens. Set: unchanged."""
        if self.max_new_tokens:
            return self
        n = max(max_context - prompt_tokens, 1)
        if max_default_tokens:
            n = min(n, max_default_tokens)
        return replace(self, max_new_tokens=max(n, self.min_tokens))


def from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """The wire's sampling parameters, checked; SamplingError names the field ("sampling.top_p ...").
    The sizes a client chose are checked on the message itself, before anything is copied out of it."""
    try:
        check_sizes(msg.stop, msg.stop_token_ids, msg.bad_words, msg.logit_bias, msg.allowed_token_ids)
        return SamplingParams(
            max_new_tokens=msg.max_new_tokens,  # 0: unset, the node resolves it (SamplingParams.resolved)
            temperature=msg.temperature,
            top_p=msg.top_p or 1.0,  # 0: unset
            top_k=msg.top_k,
            seed=msg.seed if msg.HasField("seed") else None,
            stop=tuple(msg.stop),
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            min_tokens=msg.min_tokens,
            allowed_token_ids=tuple(sorted(set(msg.allowed_token_ids))),
            logit_bias=tuple(sorted(msg.logit_bias.items())),
            bad_words=tuple(msg.bad_words),
            json_schema=msg.structured.json_schema,
            json_object=msg.structured.json_object,
            presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            repetition_penalty=msg.repetition_penalty or 1.0,  # 0: unset
            min_p=msg.min_p,
            logprobs=msg.logprobs if msg.HasField("logprobs") else None,
            prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
            skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
            include_stop_str_in_output=msg.include_stop_str_in_output,
            n=msg.n or 1,  # 0: unset
        )
    except SamplingError as e:
        raise SamplingError(e.field, e.problem, "sampling.") from None


def to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_new_tokens=p.max_new_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens,
        allowed_token_ids=list(p.allowed_token_ids),
        logit_bias=dict(p.logit_bias),
        bad_words=list(p.bad_words),
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        min_p=p.min_p,
        skip_special_tokens=p.skip_special_tokens,
        include_stop_str_in_output=p.include_stop_str_in_output,
        n=p.n,
    )
    if p.json_schema:
        msg.structured.json_schema = p.json_schema
    elif p.json_object:
        msg.structured.json_object = True
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    return msg
