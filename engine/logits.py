"""Logits processing at the sampling rank, and the logprobs that come back with a token.

A request's logits go through its sampling controls, each only when set (masks commute; the
penalties come after them, as in vLLM):

1. structured output: the tokens the request's grammar does not allow next to -inf;
2. allowed_token_ids: every other token to -inf;
3. logit_bias: added;
4. bad_words: for each banned sequence whose first tokens end the output so far, its last token
   to -inf (a one-token word always); and min_tokens: EOS and stop tokens to -inf until
   min_tokens are out (`held_back`). When these two leave no token at all (the grammar allows
   only EOS, say), they are undone for that step: the grammar wins;
5. penalties on the request's own tokens: repetition (prompt and outputs: a positive logit
   divided by it, a negative one multiplied), frequency (times each token's count in the
   outputs) and presence (once per token in the outputs), both subtracted.

The sampler then takes the argmax (greedy) or applies temperature, min_p, top_k and top_p and
draws. Logprobs are the model's own: the log-softmax of the logits before any of this, as
vLLM returns by default and as a reference forward computes them.

"The outputs" are an earlier attempt's (resumed) and this one's: req.resumed_ids + req.output_ids,
the tokens before the one being sampled; "the prompt" is the client's. Rank 0 keeps these in the
Request; a pipeline's last rank keeps its own copy (pipeline/stage.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.batch import ForwardBatch, logit_rows
from kvbridge.engine.request import Request
from kvbridge.v1 import common_pb2


@dataclass(frozen=True)
class Logprob:
    """A position's logprobs: of its token, and of the `k` most likely tokens there (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 1  # 1 + the number of tokens more likely than it


def logprobs_of(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[Logprob]:
    """Logprobs of `tokens` under `logits` ([R, vocab], one row per token) with ks[i] alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    kmax = max(ks, default=0)
    top_v, top_i = lp.topk(kmax, dim=-1) if kmax else (None, None)
    out = []
    for r, (token, k) in enumerate(zip(tokens, ks)):
        top = tuple(zip(top_i[r, :k].tolist(), top_v[r, :k].tolist())) if k else ()
        out.append(Logprob(token, chosen[r], top, ranks[r]))
    return out


# ---------------------------------------------------------------- prompt logprobs


def split_logits(batch: ForwardBatch, logits: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The sampled requests' rows of a step's logits, and each scored request's rows (batch.scored)."""
    _, sampled_at, scored_at = logit_rows(batch)
    sampled = logits if sampled_at is None else logits[sampled_at]
    return sampled, [logits[first : first + n] for _, first, n in scored_at]


def prompt_spans(batch: ForwardBatch, requests: list[Request]) -> list[tuple[int, int, int]]:
    """(index in the batch, first prompt token scored, count) of each scored request of the step:
    the rows of its chunk at positions p with p + 1 a prompt token (of the client's prompt)."""
    spans = []
    for i, _, _ in logit_rows(batch)[2]:
        start, req = batch.starts[i], requests[i]
        n = min(batch.q_lens[i], req.num_prompt_tokens - 1 - start)
        if n > 0:
            spans.append((i, start + 1, n))
    return spans


def prompt_logprobs(batch: ForwardBatch, scored: list[torch.Tensor], requests: list[Request]) -> list[Logprob]:
    """The logprobs of the prompt tokens the step's scored rows predict, in prompt_spans order."""
    out = []
    for (i, first, n), rows in zip(prompt_spans(batch, requests), scored):
        req = requests[i]
        out += logprobs_of(rows[:n], req.prompt_ids[first : first + n], [req.params.prompt_logprobs] * n)
    return out


# ---------------------------------------------------------------- the last rank -> rank 0


def logprob_width(ks: list[int | None]) -> int:
    """Columns of the logprob rows a last rank returns (0: none asked): the token's logprob and
    rank, then k alternative ids, then their logprobs, k the largest of `ks` (None: not asked)."""
    asked = [k for k in ks if k is not None]
    return 2 + 2 * max(asked) if asked else 0


def pack_logprobs(logprobs: list[Logprob | None], width: int) -> torch.Tensor:
    """[S, width] float64 (token ids are exact in it); rows of requests that asked for none are 0."""
    rows = torch.zeros((len(logprobs), width), dtype=torch.float64)
    k = (width - 2) // 2
    for i, lp in enumerate(logprobs):
        if lp is not None:
            rows[i, 0], rows[i, 1] = lp.logprob, lp.rank
            for j, (token, value) in enumerate(lp.top):
                rows[i, 2 + j], rows[i, 2 + k + j] = token, value
    return rows


def unpack_logprobs(rows: torch.Tensor, tokens: list[int], ks: list[int | None]) -> list[Logprob | None]:
    k_max = (rows.shape[1] - 2) // 2
    out: list[Logprob | None] = []
    for row, token, k in zip(rows.tolist(), tokens, ks):
        if k is None:
            out.append(None)
            continue
        top = tuple((int(row[2 + j]), row[2 + k_max + j]) for j in range(k))
        out.append(Logprob(token, row[0], top, int(row[1])))
    return out


def logprob_to_proto(lp: Logprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token,
        logprob=lp.logprob,
        top_ids=[t for t, _ in lp.top],
        top_logprobs=[v for _, v in lp.top],
        rank=lp.rank,
    )


def logprob_from_proto(msg: common_pb2.TokenLogprob, vocab_size: int, k: int | None) -> Logprob:
    """A peer's TokenLogprob, checked: ValueError naming what is wrong (ids outside the vocabulary,
    not the k alternatives the request asked for, a logprob that is not a number <= 0)."""
    values = [msg.logprob, *msg.top_logprobs]
    if not msg.HasField("logprob") or not all(-math.inf <= v <= 0 for v in values):
        raise ValueError(f"logprobs must be numbers <= 0, got {values[:4]}")
    if len(msg.top_ids) != len(msg.top_logprobs) or len(msg.top_ids) != (k or 0):
        raise ValueError(f"{len(msg.top_ids)} alternatives with {len(msg.top_logprobs)} logprobs; {k} asked for")
    bad = [t for t in (msg.token_id, *msg.top_ids) if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return Logprob(msg.token_id, msg.logprob, tuple(zip(msg.top_ids, msg.top_logprobs)), msg.rank)


def outputs_of(req: Request) -> list[int]:
    return req.resumed_ids + req.output_ids if req.resumed else req.output_ids


def process(logits: torch.Tensor, requests: list[Request], eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """The logits to sample from: [S, vocab], a copy where any request's controls change a row."""
    rows = [(i, req) for i, req in enumerate(requests) if _controlled(req)]
    if not rows:
        return logits
    logits = logits.clone()  # (the model's output may be an inference-mode tensor: no in-place writes)
    for i, req in rows:
        p, row = req.params, logits[i]
        if req.controls is None:
            req.controls = Controls(p, eos_token_ids, row)
        c = req.controls
        if req.grammar is not None:
            req.grammar.mask(row)
        if c.disallowed is not None:
            row.masked_fill_(c.disallowed, float("-inf"))
        if c.bias_ids is not None:
            row.index_add_(0, c.bias_ids, c.bias_values)
        bans = []
        if c.bad_words is not None and (words := c.bad_words.banned(_recent(req))):
            bans.append(torch.tensor(words, dtype=torch.long, device=row.device))
        if c.held_back is not None and req.num_sampled < p.min_tokens:
            bans.append(c.held_back)
        if bans:
            banned = torch.cat(bans)
            kept = row[banned].clone()
            row[banned] = float("-inf")
            if not torch.isfinite(row).any():  # they leave nothing (e.g. the grammar allows only EOS): undone
                row[banned] = kept
        if p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty:
            _penalize(row, req)
    return logits


class Controls:
    """A request's masks as the sampling rank applies them, built once (its first step there), so a
    step's work does not grow with the sizes the client chose: `disallowed` ([vocab] bool: the ids
    outside allowed_token_ids), logit_bias as ids and values, the stop tokens min_tokens holds back
    (ids), and bad_words as a trie (BadWords); tensors on the device and in the dtype of `row` (a
    row of the request's logits). Ids outside the vocabulary are dropped (a node refuses them in
    allowed_token_ids and logit_bias; stop_token_ids come unchecked)."""

    def __init__(self, p: SamplingParams, eos_token_ids: tuple[int, ...], row: torch.Tensor):
        vocab, device = row.shape[-1], row.device
        self.disallowed: torch.Tensor | None = None
        if p.allowed_token_ids:
            allowed = torch.tensor(p.allowed_token_ids, dtype=torch.long)
            self.disallowed = torch.ones(vocab, dtype=torch.bool).index_fill_(0, allowed[allowed < vocab], False)
            self.disallowed = self.disallowed.to(device)
        biased = [(t, b) for t, b in p.logit_bias if t < vocab]
        self.bias_ids = torch.tensor([t for t, _ in biased], dtype=torch.long, device=device) if biased else None
        self.bias_values = torch.tensor([b for _, b in biased], dtype=row.dtype, device=device) if biased else None
        held = held_back_ids(p, eos_token_ids, vocab)
        self.held_back = torch.tensor(held, dtype=torch.long, device=device) if held else None
        self.bad_words = BadWords(p.bad_words_ids, vocab) if p.bad_words_ids else None


def _controlled(req: Request) -> bool:
    p = req.params
    return bool(
        p.allowed_token_ids
        or p.logit_bias
        or p.bad_words_ids
        or req.num_sampled < p.min_tokens
        or req.grammar is not None
        or p.repetition_penalty != 1
        or p.frequency_penalty
        or p.presence_penalty
    )


def held_back_ids(p: SamplingParams, eos_token_ids: tuple[int, ...], vocab_size: int) -> list[int]:
    """The ids a request may not sample before min_tokens are out: its stop tokens (and EOS unless ignore_eos)."""
    ids = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids).union(eos_token_ids)
    ids = sorted(t for t in ids if 0 <= t < vocab_size)  # stop_token_ids come from clients, unchecked
    return ids if len(ids) < vocab_size else []  # (all of them: nothing could be sampled; they stop it at once)


def held_back(req: Request, eos_token_ids: tuple[int, ...], vocab_size: int) -> list[int]:
    """The ids `req` may not sample as its next token: its stop tokens, before min_tokens are out."""
    return held_back_ids(req.params, eos_token_ids, vocab_size) if req.num_sampled < req.params.min_tokens else []


class BadWords:
    """bad_words_ids as a trie of each word's head (its tokens but the last) read backwards, each
    node holding the last tokens of the words whose head it spells: the banned next tokens are found
    by walking it from the newest output token back, at most as deep as the longest word."""

    def __init__(self, words: tuple[tuple[int, ...], ...], vocab: int):
        self.root: _Trie = ({}, [])
        for word in words:
            if word[-1] >= vocab:
                continue  # (no row to ban)
            node = self.root
            for token in reversed(word[:-1]):
                node = node[0].setdefault(token, ({}, []))
            node[1].append(word[-1])

    def banned(self, recent) -> list[int]:
        """The banned next tokens after outputs whose newest tokens, newest first, are `recent`."""
        node, out = self.root, list(self.root[1])
        for token in recent:
            node = node[0].get(token)
            if node is None:
                break
            out += node[1]
        return out


_Trie = tuple[dict, list]  # (children by token, last tokens of the words whose head ends here)


def _recent(req: Request):
    """The request's outputs (resumed ones too: outputs_of), newest first, without copying them."""
    yield from reversed(req.output_ids)
    if req.resumed:
        ids = req.prompt_ids
        yield from (ids[i] for i in range(len(ids) - 1, len(ids) - 1 - req.resumed, -1))


def _penalize(row: torch.Tensor, req: Request) -> None:
    p, vocab = req.params, row.shape[-1]
    outputs = torch.tensor([t for t in outputs_of(req) if t < vocab], dtype=torch.long)
    counts = torch.bincount(outputs, minlength=vocab)[:vocab].to(row.dtype)
    if p.repetition_penalty != 1:
        prompt = torch.tensor(req.prompt_ids[: req.num_prompt_tokens], dtype=torch.long)
        seen = counts > 0
        seen[prompt[prompt < vocab]] = True
        scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(seen, scaled, row))
    if p.frequency_penalty:
        row.sub_(p.frequency_penalty * counts)
    if p.presence_penalty:
        row.sub_(p.presence_penalty * (counts > 0).to(row.dtype))
