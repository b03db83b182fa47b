"""The decode budget (issue 41: --decode-step-target-ms): while requests decode, a step's prompt
tokens are only those that keep its expected time (the chunk policy's latency fit) within the
target, and at least --decode-step-min-prefill of them; with no decode, the whole chunked-prefill
budget. Exact step compositions, then greedy outputs that do not change by a token."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.chunking import ChunkPlanner, QuadraticLatency
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.pages import PageAllocator, PageTable
from kvbridge.engine.request import Request
from kvbridge.engine.scheduler import Scheduler
from tests.conftest import make_llm, make_prompts

PS = 16
# Powers of two: f(l) = 2^-20 l² + 2^-12 l + 2^-6 s. A decode at position 16 costs 2a 16 + b = 2^-15 + 2^-12 s,
# so 4 of them and the pass's fixed cost take 2^-6 + 2^-13 + 2^-10 = 16.7236328125 ms.
FIT = QuadraticLatency(a=2**-20, b=2**-12, c=2**-6)
CONTEXT = 4096


def scheduler(target_ms: float = 64.0, min_prefill: int = 32, fit=FIT, chunk: int = 512) -> Scheduler:
    config = EngineConfig(
        model="tiny-random",
        page_size=PS,
        chunked_prefill_size=chunk,
        decode_step_target_ms=target_ms,
        decode_step_min_prefill=min_prefill,
    )
    # smoothing 0: fixed chunks of `chunk` (a multiple of 64: today's chunks), the fit only prices steps
    policy = ChunkPlanner(chunk, PS, CONTEXT, fit, smoothing=0.0)
    return Scheduler(config, PageAllocator(1024), max_context=CONTEXT, chunk_policy=policy)


def request(rid: str, prompt_len: int, outputs: int = 64) -> Request:
    params = SamplingParams(max_new_tokens=outputs, ignore_eos=True)
    return Request(rid, [3 + i % 50 for i in range(prompt_len)], params, PageTable(PS))


def step(s: Scheduler, max_decodes: int | None = None) -> dict[str, int]:
    """One step: {rid: tokens it computes}, in batch order; every sampled row gets token 7."""
    st = s.schedule(max_decodes)
    assert st is not None
    s.postprocess(st, [7] * len(st.sampled))
    return dict(zip(st.batch.rids, st.batch.q_lens))


def decoding(s: Scheduler, n: int = 4) -> None:
    """n requests of 16 prompt tokens, prefilled in one step: each decodes from position 16 on."""
    for i in range(n):
        s.add(request(f"d{i}", 16))
    assert step(s) == {f"d{i}": 16 for i in range(n)}


def test_with_no_decode_a_prompt_takes_the_whole_chunk():
    s = scheduler()
    s.add(request("long", 2000, outputs=4))
    assert step(s) == {"long": 512}
    assert step(s) == {"long": 512}  # its own prompt is no decode


def test_decodes_running_bound_the_chunk_to_what_fits_the_target():
    s = scheduler(target_ms=64.0)
    decoding(s)
    s.add(request("long", 2000, outputs=4))
    # 64 ms - 16.72 ms (4 decodes at 16) leaves 47.28 ms: a x² + b x = 47.28 ms at x = 128.8 -> 128 (8 pages)
    assert step(s) == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "long": 128}
    # the decodes at 17 leave 47.27 ms; after 128 tokens a chunk costs a (256 x + x²) + b x: x = 83.3 -> 80
    assert step(s) == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "long": 80}
    assert step(s)["long"] == 64  # (after 208: x = 67.1)
    s.check_invariants()


def test_the_chunk_grows_back_to_the_whole_budget_once_no_request_decodes():
    s = scheduler(target_ms=64.0)
    for i in range(2):
        s.add(request(f"d{i}", 16, outputs=3))
    step(s)  # prefilled: token 1 of 3
    s.add(request("long", 2000, outputs=4))
    assert step(s) == {"d0": 1, "d1": 1, "long": 128}  # token 2 (x = 129.8 with 2 decodes)
    assert step(s) == {"d0": 1, "d1": 1, "long": 80}  # token 3: both end
    assert [r.rid for r in s.running] == ["long"]
    assert [step(s) for _ in range(4)] == [{"long": 512}] * 3 + [{"long": 2000 - 128 - 80 - 3 * 512}]


def test_a_step_over_its_target_still_takes_the_floor(caplog):
    s = scheduler(target_ms=10.0, min_prefill=32)  # under c alone: no time left for any prompt
    decoding(s)
    s.add(request("a", 300))
    s.add(request("b", 300))
    with caplog.at_level(logging.WARNING, logger="kvbridge.engine.scheduler"):
        assert step(s) == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "a": 32}
        assert [r.rid for r in s.waiting] == ["b"]  # the floor is the step's, not each prompt's
        assert step(s) == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "a": 32}
        assert [r.rid for r in s.waiting] == ["b"]
    [told] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]  # once
    assert told.startswith("a step of 4 decodes is priced at 16.7 ms, over --decode-step-target-ms 10: prompts get ")


def test_the_floor_is_shared_by_the_step_s_prompts_in_order():
    s = scheduler(target_ms=10.0, min_prefill=32)
    decoding(s)
    s.add(request("a", 20))
    s.add(request("b", 300))
    s.add(request("c", 300))
    assert step(s) == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "a": 20, "b": 12}
    assert [r.rid for r in s.waiting] == ["c"]


def test_every_prompt_finishes_while_decodes_run():
    s = scheduler(target_ms=10.0, min_prefill=32)
    decoding(s, 2)
    s.add(request("long", 200, outputs=1))
    chunks = []
    while any(r.rid == "long" for r in s.running + list(s.waiting)):
        chunks.append(step(s).get("long"))
    assert chunks == [32] * 6 + [8]  # 200 = 6 x 32 + 8, one chunk every step: never starved


def test_a_microbatch_without_decodes_is_bounded_while_others_decode():
    """Pipeline parallelism: decodes in flight in another microbatch wait behind this one's chunk too."""
    s = scheduler(target_ms=64.0)
    decoding(s)
    s.add(request("long", 2000, outputs=4))
    # no decode in this microbatch: 64 ms - c leaves 48.375 ms, x = 131.05 -> 128
    assert step(s, max_decodes=0) == {"long": 128}


def test_the_policy_s_chunk_and_the_token_budget_still_cap_it():
    s = scheduler(target_ms=1000.0, chunk=128)  # the target alone would allow 900-odd tokens
    decoding(s)
    s.add(request("long", 2000, outputs=4))
    assert step(s)["long"] == 128


def test_without_a_latency_fit_the_target_is_off_with_one_warning(caplog):
    s = scheduler(fit=None)
    decoding(s)
    s.add(request("long", 2000, outputs=4))
    with caplog.at_level(logging.WARNING, logger="kvbridge.engine.scheduler"):
        assert step(s)["long"] == 512
        assert step(s)["long"] == 512
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--decode-step-target-ms 64 is off" in warnings[0].getMessage()


def test_a_policy_set_after_start_up_prices_the_steps_from_then_on(caplog):
    """As LLM.enable_dynamic_chunking does: the profile's planner replaces the scheduler's policy."""
    s = scheduler(fit=None, min_prefill=16)
    decoding(s)
    s.add(request("long", 2000, outputs=4))
    with caplog.at_level(logging.ERROR):  # (its warning: the test above)
        assert step(s)["long"] == 512
    s.chunk_policy = ChunkPlanner(512, PS, CONTEXT, FIT, smoothing=0.0)
    assert step(s)["long"] == 32  # after 512, the decodes at 17: x = 37.6, 2 pages
    s.config = replace(s.config, decode_step_target_ms=0.0)
    assert step(s)["long"] == 512


def test_a_latency_fit_of_its_own_prices_steps_and_leaves_the_chunks_fixed():
    config = EngineConfig(model="tiny-random", page_size=PS, chunked_prefill_size=500, decode_step_target_ms=64.0)
    s = Scheduler(config, PageAllocator(1024), max_context=CONTEXT)  # no chunk policy: chunks of 500
    s.latency = FIT
    decoding(s)
    s.add(request("long", 2000, outputs=4))
    assert step(s)["long"] == 128
    for r in [r for r in s.running if r.rid != "long"]:
        s.finish(r, "abort")  # (the decodes end)
    assert step(s) == {"long": 500}


def test_target_zero_is_off():
    s = scheduler(target_ms=0.0)
    decoding(s)
    s.add(request("long", 2000, outputs=4))
    assert step(s)["long"] == 512
    assert s.decode_budget is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("decode_step_target_ms", -1.0, "decode_step_target_ms must be >= 0"),
        ("decode_step_target_ms", float("nan"), "decode_step_target_ms must be >= 0"),
        ("decode_step_target_ms", float("inf"), "decode_step_target_ms must be >= 0"),
        ("decode_step_min_prefill", 0, "decode_step_min_prefill must be >= 1"),
    ],
)
def test_bad_settings_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


# ---------------------------------------------------------------------------- outputs


TINY_FIT = QuadraticLatency(a=2**-22, b=2**-14, c=2**-9)  # at 6 ms, 4 decodes leave 48 tokens, then fewer
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


def run_mixed(llm, short: list[list[int]], long: list[int]) -> tuple[list[list[int]], list[int]]:
    """The short requests decode; after 3 steps the long prompt arrives. Returns every request's
    output ids, and the long prompt's chunk sizes step by step."""
    sched = llm.scheduler
    schedule, chunks = sched.schedule, []

    def recording(max_decodes=None):
        st = schedule(max_decodes)
        if st is not None and "long" in st.batch.rids:
            i = st.batch.rids.index("long")
            if st.batch.starts[i] < len(long):
                chunks.append(st.batch.q_lens[i])
        return st

    sched.schedule = recording
    reqs = [llm.add_request(p, GREEDY) for p in short]
    for _ in range(3):
        llm.step()
    reqs.append(llm.add_request(long, SamplingParams(max_new_tokens=12, ignore_eos=True), rid="long"))
    while sched.num_unfinished:
        llm.step()
    assert llm.allocator.num_used == 0
    return [r.output_ids for r in reqs], chunks


def test_a_long_prompt_arriving_while_others_decode_gives_the_tokens_each_gives_alone(tiny_model):
    vocab = tiny_model.config.vocab_size
    short = make_prompts(4, vocab, seed=5, min_len=5, max_len=30)
    [long] = make_prompts(1, vocab, seed=6, min_len=700, max_len=700)
    budgeted = make_llm(tiny_model, chunked_prefill_size=256, decode_step_target_ms=6.0, decode_step_min_prefill=8)
    budgeted.scheduler.chunk_policy = ChunkPlanner(256, 4, budgeted.max_context, TINY_FIT, smoothing=0.0)
    got, chunks = run_mixed(budgeted, short, long)
    # bounded while the short ones decode, shrinking as its history grows, never under the floor of 8;
    # the rest whole once they ended (256 allowed)
    assert chunks == [48, 40, 32, 28, 24, 24, *[20] * 3, *[16] * 7, *[12] * 13, *[8] * 8, 112]
    off, off_chunks = run_mixed(make_llm(tiny_model, chunked_prefill_size=256), short, long)
    assert off_chunks == [256, 256, 188]
    alone = [make_llm(tiny_model).generate([p], p_params)[0].output_ids for p, p_params in
             [*((p, GREEDY) for p in short), (long, SamplingParams(max_new_tokens=12, ignore_eos=True))]]  # fmt: skip
    assert got == off == alone
    assert len({tuple(o) for o in got}) == 5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--long-prompts", "0"], "--long-prompts must be >= 1, got 0"),
        (["--streams", "8,0"], "--streams must be counts >= 1, got [8, 0]"),
        (["--decode-step-target-ms", "-1"], "--long-interval-s, --decode-step-target-ms and --threads must be >= 0"),
    ],
)
def test_the_bench_refuses_a_bad_flag_in_one_line(argv, message, capsys):
    from kvbridge.bench import decode_budget  # (kvbridge/bench/decode_budget.py: before and after, one run)

    assert decode_budget.main(argv) == 2
    assert capsys.readouterr().err == f"kvbridge bench decode_budget: error: {message}\n"
