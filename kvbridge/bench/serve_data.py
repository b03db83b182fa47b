"""bench serve's workload: datasets and arrival times, all drawn from the seed (no I/O, no clock).

Datasets (every length is in tokens of the model's own tokenizer; `Sample.prompt_len` is the
measured length of what the server prefills, template included):

- `random` (vLLM's random dataset): input and output lengths independent, each uniform over the
  integers [floor(len * (1 - range_ratio)), ceil(len * (1 + range_ratio))] (output at least 1).
  /v1/completions gets a list of token ids drawn uniformly from the non-special ids;
  /v1/chat/completions gets one user message of random common words whose chat-templated prompt
  tokenizes to the nearest length reachable by whole words (a few tokens either side).
- `conversation`: multi-turn chats. One system prompt of `system_len` tokens, shared by every
  conversation; turns per conversation uniform over [1, max_turns]; each user message and each
  reply uniform over [len * (1 - range_ratio), len * (1 + range_ratio)] (user_len, output_len).
  Turn k resends the system prompt and turns 1..k-1, the earlier replies as words of their drawn
  output length (not the model's actual reply, so the workload is fixed by the seed), and asks
  for reply k. Turns are separate requests in one arrival schedule: a conversation's turns keep
  their order but do not wait for the previous reply; conversations interleave at random.
  /v1/completions gets the templated conversation as token ids.

Arrivals (vLLM's get_request): with rate R and burstiness B, intervals are gamma(shape B, scale
1/(R*B)) (B = 1: a Poisson process; B = inf: evenly spaced), then scaled so that the last arrival is at n/R (vLLM does
the same, so runs at one rate offer the same load whatever the seed); R = inf: all at t = 0.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

# common English words: a few tokens each in any tokenizer (one letter per token in a byte-level one)
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very "
    "after thing our just name good sentence man think say great where help through much before line right"
)
WORDS = tuple(_WORDS.split())


@dataclass(frozen=True)
class Sample:
    """One request of a dataset."""

    prompt: list  # token ids (/v1/completions) or chat messages [{"role", "content"}] (/v1/chat/completions)
    prompt_len: int  # tokens the server prefills: the ids, or the templated messages as tokenized here
    output_len: int  # max_tokens (and min_tokens): with ignore_eos, exactly the tokens generated
    conversation: int = -1  # conversation dataset: which conversation (-1: none)
    turn: int = 0  # conversation dataset: 1-based turn index


@dataclass(frozen=True)
class RandomSpec:
    input_len: int
    output_len: int
    range_ratio: float  # in [0, 1)

    @property
    def input_range(self) -> tuple[int, int]:
        return len_range(self.input_len, self.range_ratio)

    @property
    def output_range(self) -> tuple[int, int]:
        return len_range(self.output_len, self.range_ratio)

    def describe(self) -> dict:
        return {
            "name": "random",
            "input_len": self.input_len,
            "output_len": self.output_len,
            "range_ratio": self.range_ratio,
            "input_range": list(self.input_range),
            "output_range": list(self.output_range),
            "distribution": "input and output lengths independent, each uniform over the integers in its range",
        }


@dataclass(frozen=True)
class ConversationSpec:
    system_len: int  # tokens of the shared system prompt
    max_turns: int  # turns per conversation: uniform over [1, max_turns]
    user_len: int  # tokens per user message, around
    output_len: int  # tokens per reply, around
    range_ratio: float  # user and reply lengths uniform over [len*(1-r), len*(1+r)]

    def describe(self) -> dict:
        return {
            "name": "conversation",
            "system_len": self.system_len,
            "turns_range": [1, self.max_turns],
            "user_len_range": list(len_range(self.user_len, self.range_ratio)),
            "output_range": list(len_range(self.output_len, self.range_ratio)),
            "distribution": "one system prompt shared by all; turns per conversation, user message and reply "
            "lengths each uniform over the integers in its range; turn k resends the system prompt and turns "
            "1..k-1 (earlier replies as words of their drawn length); turns in order, conversations interleaved",
        }


def len_range(length: int, ratio: float) -> tuple[int, int]:
    """vLLM's bounds: [floor(len * (1 - ratio)), ceil(len * (1 + ratio))], at least 1."""
    return max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))


# ---------------------------------------------------------------------------- arrivals


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send offsets in seconds from the run's start, non-decreasing; see the module docstring."""
    assert n >= 1 and rate > 0 and burstiness > 0, (n, rate, burstiness)
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):  # the gamma's limit: evenly spaced
        return [(i + 1) / rate for i in range(n)]
    rng = np.random.default_rng(seed)
    intervals = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(intervals)
    times *= (n / rate) / times[-1]
    return [float(t) for t in times]


# ---------------------------------------------------------------------------- text of a token length


class Texts:
    """Words whose tokenized length hits a target: `words(rng, target, measure)` takes a prefix of a
    random word sequence and searches its length (token counts grow with the prefix)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def words(self, rng: random.Random, target: int, measure=None) -> tuple[str, int]:
        """(text, measure(text)) with measure(text) as near `target` as whole words allow."""
        measure = measure or self.tokens
        seq: list[str] = []

        def text(k: int) -> str:
            while len(seq) < k:
                seq.append(rng.choice(WORDS))
            return " ".join(seq[:k])

        lo, hi = 1, max(1, target)
        while measure(text(hi)) < target:  # grow the bracket: some tokenizers fit several words in a token
            lo, hi = hi, hi * 2
        while lo < hi:  # the shortest prefix reaching the target
            mid = (lo + hi) // 2
            if measure(text(mid)) >= target:
                hi = mid
            else:
                lo = mid + 1
        over = measure(text(lo))
        if lo > 1 and target - measure(text(lo - 1)) < over - target:
            lo -= 1
        return text(lo), measure(text(lo))


def _special_ids(tokenizer) -> set[int]:
    return set(tokenizer.backend.get_added_tokens_decoder())


def token_pool(tokenizer, vocab_size: int) -> list[int]:
    """Ids a random prompt draws from: the tokenizer's ids below the model's vocab, specials excluded."""
    specials = _special_ids(tokenizer)
    return [i for i in range(min(vocab_size, tokenizer.vocab_size)) if i not in specials]


# ---------------------------------------------------------------------------- datasets


def random_dataset(spec: RandomSpec, n: int, seed: int, chat: bool, tokenizer, vocab_size: int) -> list[Sample]:
    rng = random.Random(seed)
    (ilo, ihi), (olo, ohi) = spec.input_range, spec.output_range
    input_lens = [rng.randint(ilo, ihi) for _ in range(n)]
    output_lens = [rng.randint(olo, ohi) for _ in range(n)]
    out = []
    if not chat:
        pool = token_pool(tokenizer, vocab_size)
        for il, ol in zip(input_lens, output_lens):
            out.append(Sample([rng.choice(pool) for _ in range(il)], il, ol))
        return out
    texts = Texts(tokenizer)
    for il, ol in zip(input_lens, output_lens):

        def measure(content: str) -> int:
            return texts.tokens(tokenizer.apply_chat_template([{"role": "user", "content": content}]))

        content, length = texts.words(rng, il, measure)
        out.append(Sample([{"role": "user", "content": content}], length, ol))
    return out


def conversation_dataset(spec: ConversationSpec, n: int, seed: int, chat: bool, tokenizer) -> list[Sample]:
    rng = random.Random(seed)
    texts = Texts(tokenizer)
    system, _ = texts.words(rng, spec.system_len)
    ulo, uhi = len_range(spec.user_len, spec.range_ratio)
    olo, ohi = len_range(spec.output_len, spec.range_ratio)
    conversations: list[list[Sample]] = []
    total = 0
    while total < n:
        c = len(conversations)
        turns = min(rng.randint(1, spec.max_turns), n - total)
        messages = [{"role": "system", "content": system}]
        samples = []
        for k in range(1, turns + 1):
            user, _ = texts.words(rng, rng.randint(ulo, uhi))
            messages = [*messages, {"role": "user", "content": user}]
            reply_len = rng.randint(olo, ohi)
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
            samples.append(Sample(list(messages) if chat else ids, len(ids), reply_len, c, k))
            reply, _ = texts.words(rng, reply_len)
            messages = [*messages, {"role": "assistant", "content": reply}]
        conversations.append(samples)
        total += turns
    # a uniformly random interleaving that keeps each conversation's turns in order
    slots = [c for c, s in enumerate(conversations) for _ in s]
    rng.shuffle(slots)
    nexts = [iter(s) for s in conversations]
    return [next(nexts[c]) for c in slots]
