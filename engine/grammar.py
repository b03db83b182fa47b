"""Structured output: JSON-constrained decoding with llguidance.

OpenAI's `response_format` {"type": "json_object"} (SamplingParams.json_object) and {"type":
"json_schema", ...} (SamplingParams.json_schema, the schema as JSON text) constrain each sampled
token to keep the output a prefix of JSON the schema accepts: before a structured request samples,
the ids its grammar does not allow next get -inf logits; after, the grammar takes the chosen token.

    (schema_problem, the check before a request is admitted: common/text/schema.py)
    GrammarCompiler(tokenizer, vocab_size, eos_token_ids)    one per sampling rank
        .compile(params) -> Future               off the hot loop: a small thread pool, LRU-cached
        .matcher(params, prior_tokens=()) -> Matcher    waits for the compile; replays prior_tokens
        .mask_rows(logits [S, vocab], matchers)  the masks of several requests at once
    Matcher: .mask(logits_row), .allowed(), .accept(token), .done, .accepting, .error

A decode node, which gets a request after its first token was sampled elsewhere, rebuilds the
state with `matcher(params, prior_tokens=outputs so far)`: the grammar is deterministic, so the
replayed matcher masks exactly as the original would have.

Vocabulary: the model's vocab_size (the logits' width) may exceed the tokenizer's (padding rows):
the extra ids are never allowed. Special tokens other than EOS are never allowed either.

EOS: the EOS ids are the model's eos_token_ids (the tokenizer's EOS token when there are none).
They are allowed exactly when the output so far is complete JSON the schema accepts. When the
JSON cannot go on (the top-level object closed) EOS is the only id allowed (`done` is true), so
the request stops there with finish_reason "stop" (a sampler may also stop at `done` at once).
A token the grammar does not allow makes `accept` raise ValueError, and leaves the matcher as it
was. If llguidance itself fails mid-run (a resource limit), the matcher allows EOS alone.

Whitespace (JSON_OPTIONS): llguidance's default allows any run of JSON whitespace (space, \\n, \\r,
\\t) between tokens, so a model (or random logits) can emit whitespace forever and never finish
the object. We keep the same places and characters but bound each run to MAX_WHITESPACE
characters: pretty-printed JSON still passes (a newline and an indent of up to 19 columns), and
the whitespace an output can hold is bounded by its structure. Strings are not bounded: their
length is the schema's (maxLength) or the model's to choose; max_new_tokens caps the rest.

Schemas: llguidance's JSON Schema support (Draft 2020-12, less a few keywords: `not`,
`if`/`then`/`else`, `uniqueItems`, `contains`, ...). A keyword it does not implement is an error,
not ignored ("lenient" off), so an output always validates under the schema as written. Object
properties come out in the order of `properties`. The JSON text is capped at MAX_SCHEMA_CHARS and
its nesting at serde's recursion limit (128); its subschemas, their depth with $refs followed and
the options one allOf combines are bounded before llguidance sees it (common/text/schema_bounds.py:
llguidance compiles on the caller's stack, and a long $ref chain overflowed it).

Threads: compiles run in the compiler's pool (llguidance drops the GIL there); a Matcher belongs
to one request and must be used by one thread at a time (the sampling loop's).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer

from kvbridge.common.sampling import SamplingParams
from kvbridge.common.text.schema import ANY_OBJECT, grammar_of, one_line, unbounded
from kvbridge.common.text.tokenizer import Tokenizer

CACHE_SIZE = 256  # compiled grammars kept per compiler
COMPILE_THREADS = 2

_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


def _key(params: SamplingParams) -> tuple[str, str]:
    if params.json_schema:
        return ("json_schema", params.json_schema)
    if params.json_object:
        return ("json_object", ANY_OBJECT)
    raise ValueError("these sampling params ask for no structured output")


def _unpack(bitmask: np.ndarray, width: int) -> np.ndarray:
    """bool [rows, width] from int32 [rows, words], bit i of word w = id 32w + i (x86 and ARM are
    little-endian: the bytes of a word are in bit order)."""
    return np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :width].view(np.bool_)


def _fill(logits: torch.Tensor, disallowed: np.ndarray) -> None:
    """logits[..., disallowed] = -inf in place. A CPU tensor numpy can hold is written by numpy: no
    torch op, so no intra-op thread pool (whose wake-ups cost milliseconds on a busy host)."""
    numpy_ok = logits.device.type == "cpu" and logits.dtype in _NUMPY_FLOATS and not logits.requires_grad
    if numpy_ok and not (logits.is_inference() and not torch.is_inference_mode_enabled()):
        array = logits.numpy()
        if array.shape == disallowed.shape:
            np.putmask(array, disallowed, -np.inf)
        else:
            array[..., disallowed] = -np.inf
    else:  # (on an accelerator, bfloat16; or where torch refuses the write: an inference tensor)
        logits.masked_fill_(torch.from_numpy(disallowed).to(logits.device, non_blocking=True), float("-inf"))


class Matcher:
    """One request's grammar state. Not thread-safe: one thread at a time."""

    def __init__(self, ll: llguidance.LLMatcher, vocab_size: int, words: int, eos_token_ids: tuple[int, ...]):
        self._ll = ll
        self.vocab_size = vocab_size  # the logits' width
        self._eos = frozenset(eos_token_ids)
        self._bitmask = np.empty((1, words), dtype=np.int32)  # one bit per id, llguidance's layout

    def _bits(self, allowed: bool) -> np.ndarray:
        """bool [vocab_size]: True where the next id is allowed (allowed=True) or not (False)."""
        row = self._bitmask[0]
        self._ll.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return _unpack(self._bitmask if allowed else np.invert(self._bitmask), self.vocab_size)[0]

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: the ids the grammar allows next (EOS among them when the JSON is complete)."""
        return torch.from_numpy(self._bits(allowed=True))

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits of the ids not allowed next to -inf, in place. logits: [vocab_size] (or
        [..., vocab_size]: each row gets the same mask), any float dtype and device; it must be
        writable (the model's inference-mode output is not: clone it)."""
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} columns; this matcher's vocabulary is {self.vocab_size}")
        _fill(logits, self._bits(allowed=False))

    def accept(self, token: int) -> None:
        """Advance by the sampled `token`. ValueError (the state unchanged) if the grammar does not allow it."""
        token = int(token)
        if token in self._eos and self._ll.is_stopped():
            self._ll.consume_token(token)  # (EOS after the end: allowed; a failed matcher stays failed)
        elif not 0 <= token < self.vocab_size or self._ll.validate_tokens([token]) != 1:
            raise ValueError(f"token {token} is not allowed by the grammar here{self._why()}")
        elif not self._ll.consume_token(token):  # (validated: only an llguidance failure gets here)
            raise ValueError(f"token {token} failed in the grammar: {one_line(self._ll.get_error())}")

    def accept_all(self, tokens: Sequence[int]) -> None:
        """accept() each token in turn, the runs between EOS ids at once. ValueError naming the first
        one not allowed (the tokens before it are taken)."""
        tokens = [int(t) for t in tokens]
        i = 0
        while i < len(tokens):
            j = next((k for k in range(i, len(tokens)) if tokens[k] in self._eos), len(tokens))
            ok = (
                self._ll.validate_tokens(tokens[i:j])
                if j > i and all(0 <= t < self.vocab_size for t in tokens[i:j])
                else 0
            )
            if ok:
                self._ll.consume_tokens(tokens[i : i + ok])
            if i + ok < j:
                raise ValueError(f"token {tokens[i + ok]} (#{i + ok}) is not allowed by the grammar here{self._why()}")
            if j < len(tokens):
                try:
                    self.accept(tokens[j])
                except ValueError as e:
                    raise ValueError(f"#{j}: {e}") from None
            i = j + 1

    def _why(self) -> str:
        if self._ll.is_error():
            return f" (grammar failed: {one_line(self._ll.get_error())})"
        return " (the output is complete: only EOS may follow)" if self._ll.is_stopped() else ""

    @property
    def done(self) -> bool:
        """The output is complete (or EOS was taken, or llguidance failed): EOS is the only id allowed."""
        return self._ll.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far is complete JSON the schema accepts: EOS is allowed now."""
        return self._ll.is_accepting()

    @property
    def error(self) -> str | None:
        """llguidance's failure, if it failed (then only EOS is allowed); None otherwise."""
        return one_line(self._ll.get_error()) if self._ll.is_error() else None


class _Compiled:
    """A schema's compiled grammar: a matcher in its start state, copied for each request."""

    def __init__(self, ll: llguidance.LLMatcher):
        self._ll, self._lock = ll, threading.Lock()

    def fork(self) -> llguidance.LLMatcher:
        with self._lock:  # (copies share the compiled grammar: microseconds)
            return self._ll.deep_copy()


class GrammarCompiler:
    """A sampling rank's grammars: compiled once per (kind, schema text), in a small thread pool, kept
    in an LRU of CACHE_SIZE. Thread-safe.

    tokenizer: the model's; vocab_size: the logits' width (may exceed the tokenizer's: those ids are
    never allowed); eos_token_ids: the model's EOS ids (empty: the tokenizer's EOS token)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: tuple[int, ...] = (),
        *,
        cache_size: int = CACHE_SIZE,
        threads: int = COMPILE_THREADS,
    ):
        eos = list(eos_token_ids)
        if not eos and tokenizer.eos_token is not None and tokenizer.token_id(tokenizer.eos_token) is not None:
            eos = [tokenizer.token_id(tokenizer.eos_token)]
        if not eos:
            raise ValueError("structured output needs an EOS token: the model has no eos_token_ids, the tokenizer none")
        if any(not 0 <= t < vocab_size for t in eos):
            raise ValueError(f"EOS ids {eos} must be in [0, vocab_size={vocab_size})")
        backend = HFTokenizer.from_str(tokenizer.backend.to_str())  # (a copy: padding and truncation off)
        backend.no_padding()
        backend.no_truncation()
        n_vocab = max(vocab_size, tokenizer.vocab_size)
        self.lltokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(eos)
        self._words = (n_vocab + 31) // 32  # int32 words of one bitmask row
        self.compiles = 0  # grammars built (cache misses)
        self._cache: OrderedDict[tuple[str, str], Future[_Compiled]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, params: SamplingParams) -> Future[_Compiled]:
        """The grammar of a structured request, compiling in the background (or cached). The future
        raises ValueError for a schema llguidance rejects (schema_problem names it first)."""
        key = _key(params)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            self.compiles += 1
            future = self._cache[key] = self._pool.submit(self._build, key[1])
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return future

    def _build(self, schema_text: str) -> _Compiled:
        if (problem := unbounded(schema_text)) is not None:  # (the fronts refused it already: defence in depth)
            raise ValueError(problem)
        ll = llguidance.LLMatcher(self.lltokenizer, grammar_of(schema_text), log_level=0)
        if ll.is_error():
            raise ValueError(f"json_schema: {one_line(ll.get_error())}")
        return _Compiled(ll)

    def matcher(
        self, params: SamplingParams, prior_tokens: Sequence[int] = (), timeout: float | None = None
    ) -> Matcher:
        """A fresh matcher for `params`, past `prior_tokens` (the request's outputs so far). Blocks on
        the compile (TimeoutError past `timeout` s). ValueError: the schema is rejected, or a prior
        token is not allowed by the grammar."""
        m = Matcher(self.compile(params).result(timeout).fork(), self.vocab_size, self._words, self.eos_token_ids)
        if prior_tokens:
            m.accept_all(prior_tokens)
        return m

    def mask_rows(self, logits: torch.Tensor, matchers: Sequence[Matcher | None]) -> None:
        """Matcher.mask for each row of logits [S, vocab_size] whose matcher is not None (a matcher in
        one row at most), in one pass: the masks computed in parallel (llguidance's executor), then
        written at once."""
        if logits.dim() != 2 or logits.shape[0] != len(matchers) or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits {tuple(logits.shape)} for {len(matchers)} matchers, vocabulary {self.vocab_size}")
        rows = [(i, m) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        if len({id(m) for _, m in rows}) < len(rows):
            raise ValueError("a matcher appears in two rows (each row is one request's)")
        bitmask = np.full((len(matchers), self._words), -1, dtype=np.int32)  # -1: all allowed
        self._executor.unsafe_compute_mask_ptr(
            [(m._ll, i) for i, m in rows], bitmask.ctypes.data, self._words * 4, len(matchers)
        )
        _fill(logits, _unpack(np.invert(bitmask), self.vocab_size))

    def close(self) -> None:
        """Stop the compile threads (pending compiles are cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
