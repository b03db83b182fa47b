"""engine/logits.py's per-request controls: bad_words as a trie walked from the newest output back
(the banned tokens equal a scan of every word; the walk reads no further back than the longest
word), and masks built once a request (Controls), giving the logits a per-step scan would."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.logits import BadWords, process
from kvbridge.engine.request import Request

VOCAB = 12
EOS = (11,)


def scanned(words: list[tuple[int, ...]], outputs: list[int], vocab: int) -> set[int]:
    """The last token of every word whose other tokens are the end of the outputs (every word looked at)."""
    out = set()
    for w in words:
        head = list(w[:-1])
        if not head or outputs[len(outputs) - len(head) :] == head:
            out.add(w[-1])
    return {t for t in out if t < vocab}


TOKENS = st.integers(0, 3)  # few tokens: the outputs often end like a word's head
WORDS = st.lists(st.lists(TOKENS, min_size=1, max_size=5).map(tuple), min_size=1, max_size=8)


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(words=WORDS, outputs=st.lists(TOKENS, max_size=12), vocab=st.sampled_from([3, 4]))
def test_the_trie_bans_what_a_scan_of_every_word_bans(words, outputs, vocab):
    assert set(BadWords(tuple(words), vocab).banned(reversed(outputs))) == scanned(words, outputs, vocab)


def test_the_walk_reads_at_most_the_longest_head_of_the_outputs():
    words = (*((7,) * n + (9,) for n in range(1, 6)), (3, 4))  # heads of up to 5 tokens
    read = []

    def newest_first():
        for t in [7] * 10_000:  # 10,000 outputs that all match the heads
            read.append(t)
            yield t

    assert sorted(set(BadWords(words, VOCAB).banned(newest_first()))) == [9]
    assert len(read) == 6  # the 5 tokens of the longest head, and one more that goes nowhere


def naive_row(row: torch.Tensor, p: SamplingParams, outputs: list[int], held: bool) -> torch.Tensor:
    """The masks written out per step: allowed ids, bias, bad words (a scan), stop tokens held back."""
    row = row.clone()
    if p.allowed_token_ids:
        keep = torch.full_like(row, -math.inf)
        ids = [t for t in p.allowed_token_ids if t < VOCAB]
        keep[ids] = row[ids]
        row = keep
    for t, b in p.logit_bias:
        row[t] += b
    banned = scanned(list(p.bad_words_ids), outputs, VOCAB)
    if held:
        banned |= {t for t in set(p.stop_token_ids) | set(EOS) if t < VOCAB}
    if banned:
        masked = row.clone()
        masked[sorted(banned)] = -math.inf
        row = masked if torch.isfinite(masked).any() else row
    return row


PARAMS = st.builds(
    lambda allowed, bias, words, stops, min_tokens: SamplingParams(
        allowed_token_ids=tuple(sorted(set(allowed))),
        logit_bias=tuple(sorted(bias.items())),
        bad_words_ids=tuple(dict.fromkeys(words)),
        stop_token_ids=tuple(stops),
        min_tokens=min_tokens,
    ),
    st.lists(st.integers(0, VOCAB + 3), max_size=6),
    st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-5, 5), max_size=4),
    st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3).map(tuple), max_size=4),
    st.lists(st.integers(0, VOCAB + 3), max_size=3),
    st.integers(0, 4),
)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(params=PARAMS, tokens=st.lists(st.integers(0, VOCAB - 1), min_size=6, max_size=6), seed=st.integers(0, 99))
def test_controls_built_once_give_the_rows_a_per_step_scan_gives(params, tokens, seed):
    req = Request("r", [1, 2], params, None)
    g = torch.Generator().manual_seed(seed)
    controls = None
    for step, token in enumerate(tokens):
        logits = torch.randn((1, VOCAB), generator=g)
        got = process(logits, [req], EOS)[0]
        want = naive_row(logits[0], params, req.output_ids, held=req.num_sampled < params.min_tokens)
        assert torch.equal(got, want), (step, got, want)
        controls = controls or req.controls
        assert req.controls is controls  # (None when nothing controls the request: no copy made)
        req.output_ids.append(token)
        req.num_sampled += 1
