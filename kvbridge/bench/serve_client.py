"""bench serve's load generator: asyncio + httpx against the router's OpenAI HTTP endpoint.

Every request is streamed (server-sent events) with `ignore_eos`, `max_tokens` (and `min_tokens`
when the server accepts it) set to the sample's output length, temperature 0, and
`stream_options.include_usage`, so the final chunk carries the token counts. Timings are taken
here, on the client, as `vllm bench serve` takes them: TTFT at the first chunk with content, ITL
between content chunks, E2EL at the end of the stream.

`run_load` (a sweep run) and `run_interference` are synchronous entry points meant for a child
process of their own (kvbridge/bench/serve.py runs them in one), so that the router and node fronts in the
bench's process do not share an interpreter lock with the timing loop. Progress goes to stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass

import httpx

from kvbridge.bench.serve_data import Sample
from kvbridge.bench.serve_metrics import RequestRecord

PROGRESS_EVERY_S = 5.0
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True)
class HttpTarget:
    """Where and how requests are sent."""

    base_url: str  # http://host:port of the router
    endpoint: str  # "chat" | "completions"
    model: str  # the model name put in each body
    min_tokens: bool  # send min_tokens = max_tokens too
    timeout_s: float  # a request not finished this long after its send fails ("timeout")


def body(target: HttpTarget, sample: Sample) -> dict:
    out: dict = {"model": target.model, "max_tokens": sample.output_len, "ignore_eos": True, "temperature": 0.0}
    out |= {"stream": True, "stream_options": {"include_usage": True}}
    if target.min_tokens:
        out["min_tokens"] = sample.output_len
    out["messages" if target.endpoint == "chat" else "prompt"] = sample.prompt
    return out


def _error_code(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"].get("code") or "")
    except (ValueError, KeyError, TypeError, AttributeError):
        return ""


async def send(
    client: httpx.AsyncClient, target: HttpTarget, sample: Sample, t0: float, on_first=None
) -> RequestRecord:
    """One streamed request; never raises (a failure is a record with its reason). `t0`: the run's
    start (perf_counter), the origin of `start` and `chunk_times`."""
    rec = RequestRecord(ok=False, prompt_len=sample.prompt_len, expected_output_len=sample.output_len)
    st = time.perf_counter()
    rec.start = st - t0
    try:
        await asyncio.wait_for(_stream(client, target, sample, rec, st, t0, on_first), target.timeout_s)
    except asyncio.TimeoutError:
        rec.error = "timeout"
    except httpx.HTTPError as e:
        rec.error = type(e).__name__
    except ValueError as e:  # a chunk that is not JSON
        rec.error = f"bad_chunk:{str(e)[:80]}"
    rec.latency = time.perf_counter() - st
    rec.ok = not rec.error
    return rec


async def _stream(
    client, target: HttpTarget, sample: Sample, rec: RequestRecord, st: float, t0: float, on_first
) -> None:
    done = usage = False
    last = None
    async with client.stream("POST", target.base_url + PATHS[target.endpoint], json=body(target, sample)) as resp:
        if resp.status_code != 200:
            code = _error_code(await resp.aread())
            rec.error = f"http_{resp.status_code}" + (f":{code}" if code else "")
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                rec.error = f"stream_error:{_error_code(data.encode()) or 'unknown'}"
                return
            for choice in chunk.get("choices") or []:
                text = choice.get("text") if target.endpoint == "completions" else (choice.get("delta") or {})
                text = text if isinstance(text, str) else (text.get("content") or "")
                if not text:
                    continue
                now = time.perf_counter()
                if last is None:
                    rec.ttft = now - st
                    if on_first is not None:
                        on_first()
                else:
                    rec.itl.append(now - last)
                last = now
                rec.chunk_times.append(now - t0)
            if chunk.get("usage"):
                usage = True
                rec.output_len = chunk["usage"].get("completion_tokens", 0)
                rec.prompt_len = chunk["usage"].get("prompt_tokens", rec.prompt_len)
    if not done:
        rec.error = "stream_ended_early"
    elif rec.ttft is None:
        rec.error = "no_content"
    elif not usage:
        rec.error = "no_usage"


def _client(connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=30.0))


class RequestProgress:
    """A stderr line every PROGRESS_EVERY_S while a run goes: done/total, failures, in flight."""

    def __init__(self, label: str, total: int):
        self.label, self.total = label, total
        self.sent = self.done = self.failed = 0

    def record(self, rec: RequestRecord) -> RequestRecord:
        self.done += 1
        self.failed += not rec.ok
        return rec

    async def report(self) -> None:
        t0 = time.perf_counter()
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            print(
                f"bench serve: {self.label} {time.perf_counter() - t0:5.0f}s {self.done}/{self.total} done, "
                f"{self.failed} failed, {self.sent - self.done} in flight",
                file=sys.stderr,
                flush=True,
            )


async def warm_up(client: httpx.AsyncClient, target: HttpTarget, samples: list[Sample]) -> list[RequestRecord]:
    """Requests before a run, not counted: the samples with at most 8 output tokens, all at once."""
    t0 = time.perf_counter()
    short = [Sample(s.prompt, s.prompt_len, min(8, s.output_len)) for s in samples]
    return list(await asyncio.gather(*(send(client, target, s, t0) for s in short)))


async def _load(target, samples, arrivals, max_concurrency, warmups, label):
    connections = max_concurrency or len(samples)
    async with _client(max(connections, warmups, 1)) as client:
        bad = [r.error for r in await warm_up(client, target, samples[:warmups]) if not r.ok]
        if bad:
            print(f"bench serve: {label}: {len(bad)} warmup requests failed: {bad[0]}", file=sys.stderr, flush=True)
        progress = RequestProgress(label, len(samples))
        reporter = asyncio.create_task(progress.report())
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

        async def one(sample: Sample) -> RequestRecord:
            async with gate:
                return progress.record(await send(client, target, sample, t0))

        tasks = []
        t0 = time.perf_counter()
        for sample, at in zip(samples, arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(sample)))
            progress.sent += 1
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        reporter.cancel()
        return records, duration


def run_load(
    target: HttpTarget,
    samples: list[Sample],
    arrivals: list[float],
    max_concurrency: int | None,
    warmups: int,
    label: str,
) -> tuple[list[RequestRecord], float]:
    """Warm up, then send samples[i] at arrivals[i] (seconds after the start; behind a semaphore of
    max_concurrency when given). Returns the records in sample order and the run's duration."""
    return asyncio.run(_load(target, samples, arrivals, max_concurrency, warmups, label))


async def _pairs(targets: list[HttpTarget], samples: list[Sample], warmups: int) -> list[list[RequestRecord]]:
    out: list[list[RequestRecord]] = [[] for _ in targets]
    async with _client(2) as client:
        for target in targets:
            await warm_up(client, target, samples[:warmups])
        progress = RequestProgress("handoff", len(samples))
        reporter = asyncio.create_task(progress.report())
        t0 = time.perf_counter()
        for sample in samples:
            progress.sent += 1
            for records, target in zip(out, targets):  # one request in flight at any time
                records.append(await send(client, target, sample, t0))
            progress.done += 1
            progress.failed += sum(not records[-1].ok for records in out)
        reporter.cancel()
    return out


def run_pairs(targets: list[HttpTarget], samples: list[Sample], warmups: int) -> list[list[RequestRecord]]:
    """Each sample to every target in turn, one request at a time; the records per target, in order."""
    return asyncio.run(_pairs(targets, samples, warmups))


# ---------------------------------------------------------------------------- interference


@dataclass
class InterferenceResult:
    streams: list[RequestRecord]  # the decode streams' requests, every one
    longs: list[RequestRecord]  # the long prompts, in sample order
    quiet: tuple[float, float]  # [start, end) s after t0: every stream decoding, no long prompt sent yet
    loaded: tuple[float, float]  # [start, end] s after t0: first long prompt sent .. last one finished


async def _interference(target, streams, longs, arrivals, quiet_s, warmups, label) -> InterferenceResult:
    async with _client(len(streams) + len(longs) + warmups) as client:
        await warm_up(client, target, [longs[0], *streams[0]][:warmups])
        t0 = time.perf_counter()
        stop = asyncio.Event()
        started = [asyncio.Event() for _ in streams]
        stream_records: list[RequestRecord] = []

        async def stream(i: int) -> None:
            k = 0
            while not stop.is_set():
                rec = await send(client, target, streams[i][k % len(streams[i])], t0, started[i].set)
                stream_records.append(rec)
                k += 1
                if not rec.ok:
                    started[i].set()  # a stream that cannot start must not hold the run up
                    await asyncio.sleep(0.1)

        workers = [asyncio.create_task(stream(i)) for i in range(len(streams))]
        await asyncio.gather(*(e.wait() for e in started))
        quiet_start = time.perf_counter() - t0
        await asyncio.sleep(quiet_s)
        t_load = time.perf_counter()
        progress = RequestProgress(label, len(longs))
        reporter = asyncio.create_task(progress.report())

        async def long(sample: Sample, at: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, t_load + at - time.perf_counter()))
            progress.sent += 1
            return progress.record(await send(client, target, sample, t0))

        long_records = list(await asyncio.gather(*(long(s, at) for s, at in zip(longs, arrivals))))
        loaded = (t_load - t0, time.perf_counter() - t0)
        reporter.cancel()
        stop.set()
        await asyncio.gather(*workers)
        return InterferenceResult(stream_records, long_records, (quiet_start, t_load - t0), loaded)


def run_interference(
    target: HttpTarget,
    streams: list[list[Sample]],
    longs: list[Sample],
    arrivals: list[float],
    quiet_s: float,
    warmups: int,
    label: str,
) -> InterferenceResult:
    """len(streams) closed-loop decode streams (each sends its samples in turn, one at a time, until
    the end); once every stream has its first token, quiet_s of streams alone; then longs[i] at
    arrivals[i] after that. Ends when the last long prompt finished and the streams' requests in
    flight finished."""
    assert streams and longs and not any(math.isinf(a) for a in arrivals)
    return asyncio.run(_interference(target, streams, longs, arrivals, quiet_s, warmups, label))


def gaps_in(records: list[RequestRecord], window: tuple[float, float]) -> list[float]:
    """Inter-chunk gaps of the records that ended inside [start, end] (times after t0)."""
    start, end = window
    return [g for r in records if r.ok for g, t in zip(r.itl, r.chunk_times[1:]) if start <= t <= end]
