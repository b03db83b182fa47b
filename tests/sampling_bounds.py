"""The sizes a client chooses in its sampling parameters (common/sampling.py check_sizes), one case
over each limit, for the router's and the nodes' tests: the OpenAI body's fields, the same as a
kvbridge.v1 message, and the refusal every boundary gives (a node's status puts "sampling." first)."""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.common.sampling import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_CHARS,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from kvbridge.v1 import common_pb2


@dataclass(frozen=True)
class OverLimit:
    name: str  # the case's id
    fields: dict  # the OpenAI body's sampling fields (JSON)
    problem: str  # the refusal (HTTP: the message; gRPC: "sampling." + it)
    field: str  # the field it names (HTTP: error.param)

    def sampling(self, max_new_tokens: int = 4) -> common_pb2.SamplingParams:
        return sampling_of(self.fields, max_new_tokens)


def sampling_of(fields: dict, max_new_tokens: int = 4) -> common_pb2.SamplingParams:
    """The wire's SamplingParams of an OpenAI body's sampling fields (greedy, ignore_eos)."""
    msg = common_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    msg.stop.extend(fields.get("stop", []))
    msg.bad_words.extend(fields.get("bad_words", []))
    msg.stop_token_ids.extend(fields.get("stop_token_ids", []))
    msg.allowed_token_ids.extend(fields.get("allowed_token_ids", []))
    msg.logit_bias.update({int(k): float(v) for k, v in fields.get("logit_bias", {}).items()})
    return msg


def _words(n: int, length: int) -> list[str]:
    return [f"{i:04d}".rjust(length, "w") for i in range(n)]


OVER_LIMITS = [
    OverLimit(
        "stop-count",
        {"stop": _words(MAX_STOP_STRINGS + 1, 4)},
        f"stop has {MAX_STOP_STRINGS + 1} strings; at most {MAX_STOP_STRINGS}",
        "stop",
    ),
    OverLimit(
        "stop-length",
        {"stop": ["ok", "s" * (MAX_STOP_STRING_CHARS + 1)]},
        f"stop[1] is {MAX_STOP_STRING_CHARS + 1} characters; at most {MAX_STOP_STRING_CHARS}",
        "stop",
    ),
    OverLimit(
        "stop-total",
        {"stop": _words(5, MAX_STOP_CHARS // 4)},
        f"stop: total length {5 * (MAX_STOP_CHARS // 4)} characters; at most {MAX_STOP_CHARS}",
        "stop",
    ),
    OverLimit(
        "stop_token_ids-count",
        {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))},
        f"stop_token_ids has {MAX_STOP_TOKEN_IDS + 1} ids; at most {MAX_STOP_TOKEN_IDS}",
        "stop_token_ids",
    ),
    OverLimit(
        "bad_words-count",
        {"bad_words": _words(MAX_BAD_WORDS + 1, 4)},
        f"bad_words has {MAX_BAD_WORDS + 1} words; at most {MAX_BAD_WORDS}",
        "bad_words",
    ),
    OverLimit(
        "bad_words-length",
        {"bad_words": ["b" * (MAX_BAD_WORD_CHARS + 1)]},
        f"bad_words[0] is {MAX_BAD_WORD_CHARS + 1} characters; at most {MAX_BAD_WORD_CHARS}",
        "bad_words",
    ),
    OverLimit(
        "bad_words-total",
        {"bad_words": _words(MAX_BAD_WORDS_CHARS // MAX_BAD_WORD_CHARS + 1, MAX_BAD_WORD_CHARS)},
        f"bad_words: total length {MAX_BAD_WORDS_CHARS + MAX_BAD_WORD_CHARS} characters; at most {MAX_BAD_WORDS_CHARS}",
        "bad_words",
    ),
    OverLimit(
        "logit_bias-count",
        {"logit_bias": {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}},
        f"logit_bias has {MAX_LOGIT_BIAS + 1} entries; at most {MAX_LOGIT_BIAS}",
        "logit_bias",
    ),
    OverLimit(
        "allowed_token_ids-count",
        {"allowed_token_ids": [i % 100 for i in range(MAX_ALLOWED_TOKEN_IDS + 1)]},  # (repeats count)
        f"allowed_token_ids has {MAX_ALLOWED_TOKEN_IDS + 1} ids; at most {MAX_ALLOWED_TOKEN_IDS}",
        "allowed_token_ids",
    ),
]


def at_the_limits(vocab: int) -> dict:
    """An OpenAI body's sampling fields with every size at its limit (token ids inside `vocab`)."""
    per_stop, per_word = MAX_STOP_CHARS // MAX_STOP_STRINGS, MAX_BAD_WORDS_CHARS // MAX_BAD_WORDS
    return {
        "stop": ["Q" * (per_stop - 4) + f"{i:04d}" for i in range(MAX_STOP_STRINGS)],
        "bad_words": ["Z" * (per_word - 4) + f"{i:04d}" for i in range(MAX_BAD_WORDS)],
        "stop_token_ids": [vocab + i for i in range(MAX_STOP_TOKEN_IDS)],  # (never sampled)
        "logit_bias": {str(t): (t % 7 - 3) / 2 for t in range(min(vocab, MAX_LOGIT_BIAS))},
        "allowed_token_ids": [i % vocab for i in range(MAX_ALLOWED_TOKEN_IDS)],
    }
