"""Streaming detokenization in O(1) per token, and stop strings found on the new text only.

    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.push(t) for t in ids)  # == tokenizer.decode(ids)

- `IncrementalDetokenizer`: one request's output, token by token, with prefix/read offsets as
  vLLM does. Each push decodes a short window only: the tokens of the last piece it returned
  (the decoder's left context) plus the tokens not returned yet. A piece is returned once the
  window's text grew and no longer ends in U+FFFD (a multi-byte character split across
  tokens is still incomplete). The window is bounded: after MAX_PENDING tokens without a
  complete character (invalid bytes, not a split character) it cuts where the text is final
  and keeps the last KEEP tokens back. `tokens_decoded` counts the ids passed to the
  tokenizer's decode, at most MAX_WORK_PER_TOKEN per push whatever the output length.
- `StopMatcher`: stop strings in a growing text, found by an automaton that reads each new
  character once (Aho-Corasick), so a stop string split across tokens is found when its last
  character arrives and a token costs the same whatever the stop strings' number and length;
  `num_held()` is how much of the text could still become the start of a stop string.
- `StopChecker`: both, for rank 0's scheduler (one per request with stop strings): where
  the output text ends and that text, cut before the stop string (or right after it).
- `TextStream`: the front's interface (serving.front.TextStream: `push(token)` the text
  safe to send now, `finish(final_text)` the rest) on top of a StopChecker.

The request's detokenization options, as vLLM has them (common.sampling.SamplingParams):
- skip_special_tokens (default): special tokens leave no text. Off, their text appears, and
  stop strings are matched on that text.
- include_stop_str_in_output: a stop string that ends the request stays in the text, which
  ends right after it (text after it in the same token is still cut); nothing is held back
  then, as the text before the end of a stop string goes out whether it completes or not.
  Off (default), the text ends before it. Likewise the stop token that ends a request (an EOS
  unless ignore_eos, or one of stop_token_ids) leaves no text unless it is on: its text is
  neither in the output nor searched for stop strings (`stop_text_ids`).

Special tokens are dropped before decoding when they are skipped (as `tokenizers` itself does
with skip_special_tokens), so they never widen the window.
"""

from __future__ import annotations

import weakref

from kvbridge.common.sampling import SamplingParams
from kvbridge.common.text.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what an incomplete (or invalid) UTF-8 sequence decodes to
MAX_PENDING = 8  # tokens waiting for a character to complete before the window is cut by force
KEEP = 3  # tokens kept back at a forced cut: an incomplete UTF-8 character spans at most 3 bytes
# ids passed to decode by one push, at most: the window (context and pending tokens, each at most
# MAX_PENDING + 1 long), then at a forced cut up to MAX_PENDING + 2 - KEEP trial decodes of it, then
# the new context
MAX_WORK_PER_TOKEN = 2 * (MAX_PENDING + 1) * (MAX_PENDING + 3 - KEEP) + (MAX_PENDING + 1)

_SPECIAL_IDS: weakref.WeakKeyDictionary[Tokenizer, frozenset[int]] = weakref.WeakKeyDictionary()


def special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids decode(skip_special_tokens=True) drops (computed once per tokenizer)."""
    ids = _SPECIAL_IDS.get(tokenizer)
    if ids is None:
        added = tokenizer.backend.get_added_tokens_decoder()
        ids = _SPECIAL_IDS[tokenizer] = frozenset(i for i, tok in added.items() if tok.special)
    return ids


def stop_text_ids(tokenizer: Tokenizer | None, params: SamplingParams, eos_token_ids=()) -> frozenset[int]:
    """The stop tokens whose text must not go out before the request is known to go on: those that
    end it when sampled (stop_token_ids; the EOS ids unless ignore_eos) and leave no text then
    (include_stop_str_in_output off), less those that have no text anyway (special ones, skipped)."""
    if params.include_stop_str_in_output or tokenizer is None:
        return frozenset()
    ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    return frozenset(ids - special_ids(tokenizer) if params.skip_special_tokens else ids)


class IncrementalDetokenizer:
    """One request's output text, token by token: `push` returns the new final text."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._backend = tokenizer.backend
        self._skip = skip_special_tokens
        self._dropped = special_ids(tokenizer) if skip_special_tokens else frozenset()
        self._context: list[int] = []  # the tokens of the last piece returned: left context for the decoder
        self._context_text = ""  # their text, decoded alone
        self._pending: list[int] = []  # tokens whose text was not returned yet
        self.num_tokens = 0  # tokens pushed
        self.tokens_decoded = 0  # ids passed to the tokenizer's decode so far (the work done)

    def push(self, token: int) -> str:
        self.num_tokens += 1
        if token in self._dropped:
            return ""  # decode would drop it too: it changes no text
        self._pending.append(token)
        text = self._decode(self._context + self._pending)
        if len(text) > len(self._context_text) and not text.endswith(REPLACEMENT):
            return self._show(len(self._pending), text)
        if len(self._pending) > MAX_PENDING:
            return self._force(text)
        return ""

    def flush(self) -> str:
        """The text of the tokens still held back, as decode gives it (U+FFFD for an unfinished
        character): the output ended. The concatenation of every push and this is decode(ids)."""
        if not self._pending:
            return ""
        return self._show(len(self._pending), self._decode(self._context + self._pending))

    def _decode(self, ids: list[int]) -> str:
        self.tokens_decoded += len(ids)
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def _show(self, n: int, text: str) -> str:
        """Return the text of the first n pending tokens; `text` is the decode of context + them."""
        piece = text[len(self._context_text) :]
        self._context, self._pending = self._pending[:n], self._pending[n:]
        self._context_text = self._decode(self._context)
        return piece

    def _force(self, text: str) -> str:
        """Too many tokens wait without completing a character (invalid bytes): return the text
        before the last KEEP of them, cut after the last token whose text the newer tokens did not
        change (with KEEP tokens after it, any character it started has completed or failed)."""
        for n in range(len(self._pending) - KEEP, 0, -1):
            head = self._decode(self._context + self._pending[:n])
            if text.startswith(head) and len(head) >= len(self._context_text):
                return self._show(n, head)
        # every cut splits a character that later tokens completed: not seen from a real model
        n = len(self._pending) - KEEP
        return self._show(n, self._decode(self._context + self._pending[:n]))


class StopMatcher:
    """Finds stop strings in a growing text: an Aho-Corasick automaton over the stop strings, one
    step a character, so a token's cost is its new characters' (amortized), whatever the stop
    strings' number and length. Its state is the longest end of the text that begins a stop string."""

    def __init__(self, stops: tuple[str, ...], include: bool = False):
        assert all(stops), "empty stop strings are refused by SamplingParams"
        self.stops = tuple(stops)
        self.include = include  # the text ends right after the stop string, not before it
        self.max_len = max(map(len, self.stops), default=0)
        self.num_chars = 0  # characters seen so far
        self.moves = 0  # automaton moves so far (the work done): at most 2 a character
        self._state = 0
        # the trie of the stop strings, state 0 its root; per state: its children, its failure link
        # (the state of its longest proper suffix in the trie), `longest`: the length of the longest
        # stop string that ends it (0: none), and `held`: the length of its longest suffix that is a
        # proper prefix of a stop string (a state with children is one)
        self._next: list[dict[str, int]] = [{}]
        self._depth = [0]
        whole = [False]  # the state spells a stop string
        for stop in self.stops:
            state = 0
            for ch in stop:
                if ch not in self._next[state]:
                    self._next[state][ch] = len(self._next)
                    self._next.append({})
                    self._depth.append(self._depth[state] + 1)
                    whole.append(False)
                state = self._next[state][ch]
            whole[state] = True
        self._fail = [0] * len(self._next)
        self._longest = [0] * len(self._next)
        self._held = [0] * len(self._next)
        order = list(self._next[0].values())  # breadth first: a state's failure link is shallower
        for state in order:
            for ch, child in self._next[state].items():
                self._fail[child] = self._step(self._fail[state], ch)
                order.append(child)
        for state in order:
            fail = self._fail[state]
            self._longest[state] = self._depth[state] if whole[state] else self._longest[fail]
            self._held[state] = self._depth[state] if self._next[state] else self._held[fail]

    def _step(self, state: int, ch: str) -> int:
        while state and ch not in self._next[state]:
            state = self._fail[state]
        return self._next[state].get(ch, 0)

    def push(self, new: str, match: bool = True) -> int | None:
        """Take the next piece of text. Returns where, in the whole text, the text ends by a stop
        string that ends inside `new`: where the earliest starting one starts, or with `include`
        where the earliest ending one ends; None if none does. match=False only remembers the
        piece (before min_tokens no stop string may end the request)."""
        state, cut = self._state, None
        for end, ch in enumerate(new, start=self.num_chars + 1):
            while state and ch not in self._next[state]:  # (each such move shortens the state: amortized O(1))
                state = self._fail[state]
                self.moves += 1
            state = self._next[state].get(ch, 0)
            self.moves += 1
            if match and self._longest[state]:
                # the longest stop string ending here starts first; with `include` the first end wins
                at = end if self.include else end - self._longest[state]
                cut = at if cut is None else min(cut, at)
        self._state, self.num_chars = state, self.num_chars + len(new)
        return cut

    def num_held(self) -> int:
        """Characters at the end of the text that are the start of a stop string (not sendable yet;
        with `include` none: that text is in the output whether the stop string completes or not)."""
        return 0 if self.include else self._held[self._state]


class StopChecker:
    """One request's text and the stop string that ends it (rank 0 keeps one per request with
    stop strings). The text is kept in pieces and joined once, at the end."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stops: tuple[str, ...],
        skip_special_tokens: bool = True,
        include_stop_str: bool = False,
    ):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.matcher = StopMatcher(stops, include_stop_str)
        self.pieces: list[str] = []
        self.cut: int | None = None  # where the output text ends (before the stop string, or after it), once found

    @classmethod
    def for_params(cls, tokenizer: Tokenizer, params: SamplingParams) -> StopChecker:
        return cls(tokenizer, params.stop, params.skip_special_tokens, params.include_stop_str_in_output)

    def push(self, token: int, match: bool = True) -> str:
        """The token's new text; sets `cut` when a stop string ends in it (and `match`)."""
        new = self.detok.push(token)
        if new:
            self.pieces.append(new)
        cut = self.matcher.push(new, match)
        if cut is not None and self.cut is None:
            self.cut = cut
        return new

    def text(self) -> str:
        """The output text: cut at the stop string when one was found (O(length), once)."""
        return "".join(self.pieces)[: self.cut]


class TextStream:
    """Incremental detokenization of one request's output for streaming: serving.front's
    TextStream interface, O(1) per token. Text that could still become a stop string is held
    back; once a stop string is found (after min_tokens tokens), nothing past the output's end is
    sent. A token of `stop_ids` (stop_text_ids: it may end the request and then leave no text)
    is pushed only when the next token shows the request went on."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        stop: tuple[str, ...] = (),
        min_tokens: int = 0,
        *,
        skip_special_tokens: bool = True,
        include_stop_str: bool = False,
        stop_ids: frozenset[int] = frozenset(),
    ):
        self.checker = (
            StopChecker(tokenizer, stop, skip_special_tokens, include_stop_str) if tokenizer is not None else None
        )
        self.min_tokens = min_tokens  # the request's: stop strings count only once this many tokens are out
        self.stop_ids = stop_ids
        self._deferred: int | None = None  # a token of stop_ids not pushed yet
        self._unsent = ""  # final text not handed out yet (what might become a stop string)
        self._sent: list[str] = []  # text handed out, in pieces

    @classmethod
    def for_params(cls, tokenizer: Tokenizer | None, params: SamplingParams, eos_token_ids=()) -> TextStream:
        """The stream of a request with these params, on a model with these EOS ids."""
        return cls(
            tokenizer,
            params.stop,
            params.min_tokens,
            skip_special_tokens=params.skip_special_tokens,
            include_stop_str=params.include_stop_str_in_output,
            stop_ids=stop_text_ids(tokenizer, params, eos_token_ids),
        )

    def push(self, token: int) -> str:
        """The text that is safe to send now (possibly "")."""
        out = ""
        if self._deferred is not None:  # the request went on past it: not its last token
            out, self._deferred = self._push(self._deferred), None
        if token in self.stop_ids:
            self._deferred = token
            return out
        return out + self._push(token)

    def _push(self, token: int) -> str:
        c = self.checker
        if c is None or c.cut is not None:
            return ""
        new = c.push(token, match=c.detok.num_tokens + 1 >= self.min_tokens)
        pending = self._unsent + new
        start = c.matcher.num_chars - len(pending)  # offset of pending[0] in the whole text
        end = c.cut - start if c.cut is not None else len(pending) - c.matcher.num_held()
        out, self._unsent = pending[: max(end, 0)], pending[max(end, 0) :]
        if out:
            self._sent.append(out)
        return out

    def finish(self, final_text: str) -> str:
        """The rest of the final text (stop strings and the stop token already cut off by the engine)."""
        sent = "".join(self._sent)
        rest = final_text[len(sent) :] if final_text.startswith(sent) else ""
        self._sent, self._unsent, self._deferred = [final_text], "", None
        return rest
