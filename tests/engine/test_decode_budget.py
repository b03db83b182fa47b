"""The decode budget (issue 41: --decode-step-target-ms): while requests decode, a step's prompt
tokens are only those that keep its time within the target, priced by what the scheduler's steps
measurably took (engine/chunking.py StepCosts), and at least --decode-step-min-prefill of them; with
no decode, the whole chunked-prefill budget. Exact step compositions under a modelled clock, then
greedy outputs that do not change by a token."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.chunking import StepCosts
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.pages import PageAllocator, PageTable
from kvbridge.engine.request import Request
from kvbridge.engine.scheduler import ScheduledStep, Scheduler
from tests.conftest import make_llm, make_prompts

PS = 16
CONTEXT = 4096
# The modelled clock: a step with decodes costs 2^-7 s for them, and every prompt token 2^-12 s. So a
# target of 2^-4 s (62.5 ms) leaves 7 x 2^-7 s beside decodes: 224 prompt tokens.
DECODE_S, TOKEN_S = 2**-7, 2**-12
TARGET_MS = 62.5


def modelled(st: ScheduledStep, decode_s: float = DECODE_S, token_s: float = TOKEN_S) -> float:
    return (decode_s if st.decodes else 0.0) + st.prompt_tokens * token_s


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler(target_ms: float = TARGET_MS, min_prefill: int = 32, chunk: int = 512) -> Scheduler:
    config = EngineConfig(
        model="tiny-random",
        page_size=PS,
        chunked_prefill_size=chunk,
        decode_step_target_ms=target_ms,
        decode_step_min_prefill=min_prefill,
    )
    s = Scheduler(config, PageAllocator(1024), max_context=CONTEXT)
    s.clock = Clock()
    return s


def request(rid: str, prompt_len: int, outputs: int = 64) -> Request:
    params = SamplingParams(max_new_tokens=outputs, ignore_eos=True)
    return Request(rid, [3 + i % 50 for i in range(prompt_len)], params, PageTable(PS))


def step(s: Scheduler, max_decodes: int | None = None, seconds: float | None = None) -> dict[str, int]:
    """One step taking `seconds` (default: the modelled ones): {rid: tokens it computes}, in batch
    order; every sampled row gets token 7."""
    st = s.schedule(max_decodes)
    assert st is not None
    s.clock.now += modelled(st) if seconds is None else seconds
    s.postprocess(st, [7] * len(st.sampled))
    return dict(zip(st.batch.rids, st.batch.q_lens))


def decoding(s: Scheduler, n: int = 4) -> None:
    """n requests of 16 prompt tokens, prefilled in one step (a prompt token's cost measured), then
    one step of them decoding alone (a decode step's)."""
    for i in range(n):
        s.add(request(f"d{i}", 16))
    assert step(s) == {f"d{i}": 16 for i in range(n)}
    assert step(s) == {f"d{i}": 1 for i in range(n)}
    assert (s.step_costs.decode_s, s.step_costs.token_s) == (DECODE_S, TOKEN_S)


def test_with_no_decode_a_prompt_takes_the_whole_chunk():
    s = scheduler()
    s.add(request("long", 2000, outputs=4))
    assert step(s) == {"long": 512}
    assert step(s) == {"long": 512}  # its own prompt is no decode


def test_decodes_running_bound_the_chunk_to_what_the_measured_costs_fit_in_the_target():
    s = scheduler()
    decoding(s)
    s.add(request("long", 2000, outputs=4))
    # 62.5 ms less a decode step's 7.8 ms: 7 x 2^-7 s, at 2^-12 s a token: 224 (14 pages)
    assert step(s) == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "long": 224}
    assert step(s)["long"] == 224  # the costs as measured: the step took its target
    s.check_invariants()


def test_a_step_that_overran_raises_the_token_cost_for_the_next():
    s = scheduler()
    decoding(s)
    s.add(request("long", 2000, outputs=4))
    assert step(s, seconds=DECODE_S + 224 * 2**-11)["long"] == 224  # its tokens cost twice the estimate
    assert s.step_costs.token_s == 5 * 2**-14  # 2^-12 a quarter of the way to 2^-11
    assert step(s)["long"] == 176  # 7 x 2^-7 / (5 x 2^-14) = 179.2: 11 pages


def test_the_chunk_grows_back_to_the_whole_budget_once_no_request_decodes():
    s = scheduler()
    for i in range(2):
        s.add(request(f"d{i}", 16, outputs=3))
    step(s)  # prefilled: token 1 of 3
    s.add(request("long", 2000, outputs=4))
    # token 2: no decode step measured yet, so the decodes are priced at 0: the whole target, 256
    assert step(s) == {"d0": 1, "d1": 1, "long": 256}
    assert s.step_costs.decode_s == DECODE_S  # (the mixed step measured them beyond the tokens)
    assert step(s) == {"d0": 1, "d1": 1, "long": 224}  # token 3: both end
    assert [r.rid for r in s.running] == ["long"]
    assert [step(s) for _ in range(3)] == [{"long": 512}] * 2 + [{"long": 2000 - 256 - 224 - 2 * 512}]


def test_before_any_prompt_token_is_measured_a_step_takes_the_floor():
    """A decode node whose first requests arrive with their KV: no prompt was ever computed here."""
    s = scheduler(min_prefill=32)
    for i in range(2):
        s.add(request(f"d{i}", 16))
    step(s)
    s.step_costs = StepCosts(decode_s=DECODE_S)  # what a decode node has measured
    s.add(request("long", 2000, outputs=4))
    assert step(s) == {"d0": 1, "d1": 1, "long": 32}
    assert s.step_costs.token_s == TOKEN_S  # the floor's step measured it
    assert step(s)["long"] == 224


def test_a_step_over_its_target_still_takes_the_floor(caplog):
    s = scheduler(min_prefill=32)
    decoding(s)
    s.step_costs.decode_s = 2**-3  # the decodes alone take 125 ms: no time left for any prompt
    s.add(request("a", 300))
    s.add(request("b", 300))
    with caplog.at_level(logging.WARNING, logger="kvbridge.engine.scheduler"):
        assert step(s, seconds=2**-3 + 32 * TOKEN_S) == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "a": 32}
        assert [r.rid for r in s.waiting] == ["b"]  # the floor is the step's, not each prompt's
        assert step(s, seconds=2**-3 + 32 * TOKEN_S) == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "a": 32}
        assert [r.rid for r in s.waiting] == ["b"]
    [told] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]  # once
    assert told.startswith("a step of decodes alone takes 125.0 ms, over --decode-step-target-ms 62.5: prompts get ")


def test_the_floor_is_shared_by_the_step_s_prompts_in_order():
    s = scheduler(min_prefill=32)
    decoding(s)
    s.step_costs.decode_s = 2**-3
    s.add(request("a", 20))
    s.add(request("b", 300))
    s.add(request("c", 300))
    assert step(s) == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "a": 20, "b": 12}
    assert [r.rid for r in s.waiting] == ["c"]


def test_every_prompt_finishes_while_decodes_run():
    s = scheduler(target_ms=1.0, min_prefill=32)  # under a decode step: the floor every step
    decoding(s, 2)
    s.add(request("long", 200, outputs=1))
    chunks = []
    while any(r.rid == "long" for r in s.running + list(s.waiting)):
        chunks.append(step(s).get("long"))
    assert chunks == [32] * 6 + [8]  # 200 = 6 x 32 + 8, one chunk every step: never starved


def test_a_microbatch_without_decodes_is_bounded_while_others_decode():
    """Pipeline parallelism: decodes in flight in another microbatch wait behind this one's chunk too."""
    s = scheduler()
    decoding(s)
    s.add(request("long", 2000, outputs=4))
    assert step(s, max_decodes=0) == {"long": 256}  # no decode in it: the whole 62.5 ms, 256 tokens


def test_the_chunked_prefill_size_still_caps_it():
    s = scheduler(target_ms=1000.0, chunk=128)  # the target alone would allow 4,000-odd tokens
    decoding(s)
    s.add(request("long", 2000, outputs=4))
    assert step(s)["long"] == 128


def test_target_zero_is_off_and_the_costs_are_measured_all_the_same():
    s = scheduler(target_ms=0.0)
    decoding(s)
    s.add(request("long", 2000, outputs=4))
    assert step(s)["long"] == 512
    assert s.decode_budget is None
    s.config = replace(s.config, decode_step_target_ms=TARGET_MS)  # on: priced from the steps already seen
    assert step(s)["long"] == 224


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


GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


def run_mixed(llm, short: list[list[int]], long: list[int]) -> tuple[list[list[int]], list[int]]:
    """The short requests decode; after 3 steps the long prompt arrives. Returns every request's
    output ids, and the long prompt's chunk sizes step by step. The scheduler's clock is modelled:
    a step with decodes 2^-9 s for them, every prompt token 2^-14 s."""
    sched = llm.scheduler
    schedule, chunks, clock = sched.schedule, [], Clock()

    def recording(max_decodes=None):
        st = schedule(max_decodes)
        if st is not None:
            clock.now += modelled(st, decode_s=2**-9, token_s=2**-14)
            if "long" in st.batch.rids:
                i = st.batch.rids.index("long")
                if st.batch.starts[i] < len(long):
                    chunks.append(st.batch.q_lens[i])
        return st

    sched.schedule, sched.clock = recording, clock
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
    got, chunks = run_mixed(budgeted, short, long)
    # 6 ms less the decodes' 2^-9 s leaves 66.3 tokens' time: 64 a step (pages of 4) while they decode
    assert chunks == [64] * 10 + [60]
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
