"""bench prefix's workload and its client (see kvbridge/bench/prefix.py).

The workload is drawn from the seed alone (`build_workload`, no I/O, no clock): one system prompt
shared by every conversation and each conversation's user messages, as words of the model's own
tokenizer (kvbridge/bench/serve_data.py `Texts`). The replies are the model's (greedy), so the
prompts of turns >= 2 are only known while the run goes.

`run_chats` (and `run_warmup`) are synchronous entry points meant for a child process of their own,
as bench serve's load generator: asyncio + grpc.aio against the router's Generation service. Every
conversation is one task sending its turns in order, each at its time on the schedule
(`ChatWorkload.sends` times `period_s`) or once the previous reply ended if later; each
turn's prompt is the conversation so far as chat messages (system, user, the replies as returned,
the next user). Timings are taken here: TTFT at the first response carrying tokens, ITL between
such responses, latency at the end of the stream. Usage (prompt, cached, completion tokens) comes
from the last response, TransferStats from the first of a disaggregated request.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field

from kvbridge.bench.serve_data import Texts

PROGRESS_EVERY_S = 5.0


@dataclass(frozen=True)
class ChatWorkload:
    """N conversations x T turns; every length in tokens of the model's tokenizer."""

    system: str  # the shared system prompt
    users: tuple[tuple[str, ...], ...]  # users[c][t]: conversation c's user message of turn t + 1
    output_tokens: int  # max_new_tokens of every reply (ignore_eos, greedy)
    system_tokens: int  # the system prompt's measured length
    user_tokens: tuple[tuple[int, ...], ...]  # each user message's measured length
    # sends[c][t]: when turn t + 1 of conversation c is due, in turn periods from the start: the
    # first in [0, 1), each next one a think time of 0.5 to 1.5 periods later (seeded: the same
    # schedule for every mode, no two conversations in step)
    sends: tuple[tuple[float, ...], ...] = ()

    @property
    def requests(self) -> int:
        return sum(len(u) for u in self.users)


def user_range(user_tokens: int) -> tuple[int, int]:
    """User messages are uniform over [2/3, 4/3] of --user-tokens (45: 30..60), at least 1."""
    return max(1, user_tokens * 2 // 3), max(1, user_tokens * 4 // 3)


def build_workload(
    tokenizer, conversations: int, turns: int, system_tokens: int, user_tokens: int, output_tokens: int, seed: int
) -> ChatWorkload:
    """The system prompt first, then conversation by conversation, turn by turn, from one seeded stream."""
    rng = random.Random(seed)
    texts = Texts(tokenizer)
    system, system_len = texts.words(rng, system_tokens)
    lo, hi = user_range(user_tokens)
    users, lens = [], []
    for _ in range(conversations):
        drawn = [texts.words(rng, rng.randint(lo, hi)) for _ in range(turns)]
        users.append(tuple(text for text, _ in drawn))
        lens.append(tuple(n for _, n in drawn))
    sends = []
    for _ in range(conversations):  # (drawn after the texts: the same seed gives the same texts)
        at = [rng.random()]
        for _ in range(turns - 1):
            at.append(at[-1] + rng.uniform(0.5, 1.5))
        sends.append(tuple(at))
    return ChatWorkload(system, tuple(users), output_tokens, system_len, tuple(lens), tuple(sends))


@dataclass
class TurnRecord:
    """One turn as the client saw it. Times in seconds."""

    conversation: int
    turn: int  # 1-based
    ok: bool = False  # streamed to its end with tokens and usage
    error: str = ""  # why not ok: a gRPC status code name ("unavailable"), "no_tokens", "no_usage"
    prompt_tokens: int = 0  # usage
    cached_tokens: int = 0  # usage: prompt tokens the prefill node found cached
    completion_tokens: int = 0  # usage
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    kv_bytes: int = 0  # TransferStats
    pages_skipped: int = 0  # TransferStats


def _request(messages: list[tuple[str, str]], max_tokens: int):
    from kvbridge.v1 import common_pb2, generation_pb2

    chat = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in messages])
    sampling = common_pb2.SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return generation_pb2.GenerateRequest(prompt=common_pb2.Prompt(chat=chat), sampling=sampling)


async def send_turn(stub, messages: list[tuple[str, str]], rec: TurnRecord, max_tokens: int, timeout_s: float) -> str:
    """Stream one turn into `rec` (never raises); returns the reply's text."""
    import grpc

    text: list[str] = []
    usage = False
    st = time.perf_counter()
    last = None
    try:
        async for resp in stub.Generate(_request(messages, max_tokens), timeout=timeout_s):
            if resp.token_ids:
                now = time.perf_counter()
                if last is None:
                    rec.ttft = now - st
                else:
                    rec.itl.append(now - last)
                last = now
            text.append(resp.text)
            if resp.HasField("transfer"):
                rec.kv_bytes, rec.pages_skipped = resp.transfer.kv_bytes, resp.transfer.pages_skipped
            if resp.HasField("usage"):
                usage = True
                u = resp.usage
                rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens = (
                    u.prompt_tokens, u.cached_tokens, u.completion_tokens,
                )  # fmt: skip
    except grpc.aio.AioRpcError as e:
        rec.error = e.code().name.lower()
    rec.latency = time.perf_counter() - st
    if not rec.error:
        rec.error = "no_tokens" if rec.ttft is None else "" if usage else "no_usage"
    rec.ok = not rec.error
    return "".join(text)


async def _conversation(
    stub, w: ChatWorkload, c: int, out: list[TurnRecord], timeout_s: float, period_s: float, t0: float
) -> None:
    messages = [("system", w.system)]
    for t, user in enumerate(w.users[c], 1):
        due = t0 + w.sends[c][t - 1] * period_s
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        messages.append(("user", user))
        rec = TurnRecord(c, t)
        reply = await send_turn(stub, messages, rec, w.output_tokens, timeout_s)
        out.append(rec)
        if not rec.ok:  # the rest of the conversation has no prompt: its turns are not sent
            return
        messages.append(("assistant", reply))


async def _progress(label: str, total: int, out: list[TurnRecord]) -> None:
    t0 = time.perf_counter()
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        failed = sum(not r.ok for r in out)
        line = f"bench prefix: {label} {time.perf_counter() - t0:5.0f}s {len(out)}/{total} turns, {failed} failed"
        print(line, file=sys.stderr, flush=True)


async def _chats(
    address: str, w: ChatWorkload, timeout_s: float, label: str, period_s: float
) -> tuple[list[TurnRecord], float]:
    from kvbridge.common import rpc
    from kvbridge.v1 import generation_pb2_grpc

    out: list[TurnRecord] = []
    async with rpc.make_aio_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        reporter = asyncio.create_task(_progress(label, w.requests, out))
        t0 = time.perf_counter()
        await asyncio.gather(*(_conversation(stub, w, c, out, timeout_s, period_s, t0) for c in range(len(w.users))))
        duration = time.perf_counter() - t0
        reporter.cancel()
    return sorted(out, key=lambda r: (r.conversation, r.turn)), duration


def run_chats(
    address: str, w: ChatWorkload, timeout_s: float, label: str, period_s: float = 0.0
) -> tuple[list[TurnRecord], float]:
    """Every conversation of `w` through the router at `address` (host:port of its gRPC Generation),
    on the schedule of `period_s` (0: each turn right after the previous reply). Returns the records
    by (conversation, turn) and the run's duration."""
    return asyncio.run(_chats(address, w, timeout_s, label, period_s))


async def _warmup(address: str, prompts: list[str], timeout_s: float) -> list[TurnRecord]:
    from kvbridge.common import rpc
    from kvbridge.v1 import generation_pb2_grpc

    async with rpc.make_aio_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        recs = [TurnRecord(-1, 0) for _ in prompts]
        await asyncio.gather(*(send_turn(stub, [("user", p)], r, 4, timeout_s) for p, r in zip(prompts, recs)))
    return recs


def run_warmup(address: str, prompts: list[str], timeout_s: float) -> list[str]:
    """One-message prompts at once, 4 tokens each (uncounted); the errors of those that failed."""
    return [r.error for r in asyncio.run(_warmup(address, prompts, timeout_s)) if not r.ok]
