"""Dynamic chunked prefill: the latency fit, the chunk sizes it gives, and the fallbacks; the decode
budget's measured step costs."""

from __future__ import annotations

import itertools
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.engine.chunking import (
    ChunkPlanner,
    DecodeBudget,
    QuadraticLatency,
    StepCosts,
    default_profile_lengths,
    fit_quadratic,
    profile_prefill,
)

# Powers of two keep the hand-computed roots exact in floating point.
PURE_QUADRATIC = QuadraticLatency(a=2**-30, b=0.0, c=2**-7)  # T = a 2048² = 2^-8 s for base 2048
WITH_LINEAR = QuadraticLatency(a=2**-30, b=2**-20, c=2**-7)


def make_planner(fit=PURE_QUADRATIC, base=2048, page_size=16, context_len=131072, smoothing=0.75) -> ChunkPlanner:
    return ChunkPlanner(base, page_size, context_len, fit, smoothing)


def make_profile(latency, base=512, context_len=4096, warmup_s=10.0) -> tuple[list[int], list[float]]:
    """Exact samples of `latency` at the default lengths; the warm-up sample is far off."""
    lengths = default_profile_lengths(base, context_len)
    return lengths, [warmup_s] + [latency(n) for n in lengths[1:]]


def test_default_profile_lengths_start_with_the_longest_as_warmup_then_spread():
    assert default_profile_lengths(512, 4096) == [2048, 186, 372, 558, 744, 930, 1117, 1303, 1489, 1675, 1861, 2048]
    assert default_profile_lengths(512, 1000) == [1000, 90, 181, 272, 363, 454, 545, 636, 727, 818, 909, 1000]


def test_fit_recovers_coefficients_and_ignores_the_warmup_sample():
    truth = QuadraticLatency(a=3e-9, b=2e-5, c=4e-3)
    fit = fit_quadratic(*make_profile(truth))
    assert fit.a == pytest.approx(truth.a, rel=1e-9)
    assert fit.b == pytest.approx(truth.b, rel=1e-9)
    assert fit.c == pytest.approx(truth.c, rel=1e-9)


def test_fit_clamps_negative_linear_coefficient_to_zero(caplog):
    fit = fit_quadratic(*make_profile(QuadraticLatency(a=3e-9, b=-1e-6, c=4e-3)))
    assert fit.a == pytest.approx(3e-9, rel=1e-9)
    assert fit.b == 0.0
    assert "b=-1.000e-06" in caplog.text


@pytest.mark.parametrize(
    ("lengths", "latencies", "reason"),
    [
        (list(range(100, 900, 100)), [0.1] * 8, "too few profile samples: 7"),
        ([512] * 10, [0.1] * 10, "cannot determine a quadratic"),
        (*make_profile(lambda n: 1e-3 + 2e-6 * n), "is not positive"),  # linear
        (*make_profile(lambda n: 0.05 - 3e-6 * n), "is not positive"),  # decreasing
        (*make_profile(lambda n: 1e-3 + 2e-6 * n - 1e-10 * n * n), "is not positive"),  # concave
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], [0.1] * 8 + [float("nan")], "bad profile samples"),
    ],
)
def test_bad_profile_falls_back_to_fixed_chunks_with_a_warning(lengths, latencies, reason, caplog):
    with pytest.raises(ValueError, match=reason):
        fit_quadratic(lengths, latencies)
    caplog.clear()
    planner = ChunkPlanner.from_profile(lengths, latencies, base=512, page_size=16, context_len=8192)
    assert planner.fit is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "dynamic chunking off, fixed chunks of 512 tokens" in caplog.text and reason in caplog.text
    assert planner.chunks(1300, history_len=4000) == [512, 512, 276]


def test_good_profile_gives_dynamic_chunks_without_warning(caplog):
    planner = ChunkPlanner.from_profile(*make_profile(WITH_LINEAR), base=2048, page_size=16, context_len=131072)
    assert planner.fit is not None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert planner.next_chunk(0, 10000) == 2048
    assert planner.next_chunk(2048, 10000) < 2048


@pytest.mark.parametrize(
    ("history_len", "smoothing", "chunk"),
    [
        # x* from the 3-4-5 / 8-15-17-style triples: L² + 2048² is a square, x* = sqrt(.) - L
        (0, 0.75, 2048),  # x* = 2048 = base
        (1536, 0.75, 1280),  # x* = 1024: 2048 - 0.75 * 1024 = 1280
        (3840, 0.75, 896),  # x* = 512: 2048 - 0.75 * 1536 = 896
        (16320, 0.75, 576),  # x* = 128: 2048 - 0.75 * 1920 = 608, aligned down to 576
        (65520, 0.75, 512),  # x* = 32: 2048 - 0.75 * 2016 = 536, aligned down to 512
        (1536, 1.0, 1024),  # unsmoothed: x* itself
        (16320, 1.0, 512),  # x* = 128 is under the floor 2048 // 4
        (1536, 0.0, 2048),  # smoothing 0: fixed base chunks
    ],
)
def test_next_chunk_hand_computed(history_len, smoothing, chunk):
    assert make_planner(smoothing=smoothing).next_chunk(history_len, 10000) == chunk


def test_chunks_align_to_max_of_page_size_and_64():
    assert make_planner(base=1000, page_size=16).next_chunk(0, 4000) == 960  # 15 x 64
    assert make_planner(base=1000, page_size=128).next_chunk(0, 4000) == 896  # 7 x 128


def test_unsmoothed_chunks_shrink_and_each_costs_the_target_within_one_alignment_unit():
    planner = make_planner(fit=WITH_LINEAR, smoothing=1.0)
    fit, unit = planner.fit, planner.alignment
    plan = planner.chunks(20000)
    assert plan[:6] == [2048, 1024, 768, 640, 576, 512]
    assert all(x >= y for x, y in itertools.pairwise(plan[:-1]))  # the last piece is the remainder
    above_floor = 0
    history = 0
    for chunk in plan[:-1]:
        if chunk > planner.floor:  # the floor makes a chunk cost more than the target
            assert fit.chunk_cost(history, chunk) <= planner.target < fit.chunk_cost(history, chunk + unit)
            above_floor += 1
        history += chunk
    assert above_floor == 5
    assert sum(plan) == 20000


def test_last_piece_is_the_remainder_unaligned():
    # L = 2048: x* = 2048 (sqrt(2) - 1) = 848.3, smoothed 1148.2, aligned 1088
    assert make_planner().chunks(5000) == [2048, 1088, 960, 832, 72]
    assert make_planner().next_chunk(0, 100) == 100


def test_chunks_never_cross_the_context_end():
    planner = make_planner(context_len=4096)
    assert planner.chunks(4096) == [2048, 1088, 960]  # the last piece ends at the context end
    assert planner.chunks(96, history_len=4000) == [96]
    with pytest.raises(ValueError, match="history_len=4000 remaining=97"):
        planner.next_chunk(4000, 97)
    with pytest.raises(ValueError, match="history_len=4000 remaining=97"):
        make_planner(fit=None, context_len=4096).next_chunk(4000, 97)


def test_fixed_chunks_without_fit():
    assert make_planner(fit=None, base=512).chunks(1300) == [512, 512, 276]


def test_profile_prefill_runs_each_length_in_order_and_shows_progress(capsys):
    calls: list[int] = []

    def run(n: int) -> float:
        calls.append(n)
        return n / 1000

    assert profile_prefill(run, [300, 100, 200], progress=True) == [0.3, 0.1, 0.2]
    assert calls == [300, 100, 200]
    assert "profiling prefill latency: 3/3 (100%)" in capsys.readouterr().err
    assert profile_prefill(run, [5], progress=False) == [0.005]
    assert capsys.readouterr().err == ""


fits = st.one_of(
    st.none(),
    st.builds(QuadraticLatency, a=st.floats(1e-12, 1e-6), b=st.floats(0.0, 1e-3), c=st.floats(0.0, 0.1)),
)


@settings(max_examples=300, deadline=None)
@given(
    fit=fits,
    base=st.integers(1, 4096),
    page_size=st.sampled_from([1, 16, 64, 128, 256]),
    smoothing=st.floats(0.0, 1.0),
    history_len=st.integers(0, 30000),
    prompt_len=st.integers(1, 5000),
)
def test_every_chunk_is_in_range_and_the_plan_covers_the_prompt(
    fit, base, page_size, smoothing, history_len, prompt_len
):
    planner = ChunkPlanner(base, page_size, history_len + prompt_len, fit, smoothing)
    assert 1 <= planner.next_chunk(history_len, prompt_len) <= prompt_len
    plan = planner.chunks(prompt_len, history_len)
    assert all(chunk >= 1 for chunk in plan)
    assert sum(plan) == prompt_len


# ---------------------------------------------------------------------------- the decode budget


def test_step_costs_learn_a_decode_step_and_a_prompt_token_from_measured_steps():
    costs = StepCosts()
    costs.observe(decodes=4, prompt_tokens=0, seconds=2**-6)  # a step of decodes alone
    assert (costs.decode_s, costs.token_s) == (2**-6, None)
    costs.observe(decodes=0, prompt_tokens=512, seconds=2**-2)  # prompts alone: fixed cost spread over them
    assert costs.token_s == 2**-11
    costs.observe(decodes=4, prompt_tokens=128, seconds=2**-6 + 2**-3)  # beyond decode_s: 2^-3 / 128 = 2^-10
    assert costs.token_s == 2**-11 + (2**-10 - 2**-11) / 4  # a quarter of the way to the newest
    costs.observe(decodes=4, prompt_tokens=0, seconds=2**-5)
    assert costs.decode_s == 2**-6 + (2**-5 - 2**-6) / 4


def test_a_mixed_step_before_any_decode_step_measures_the_decodes_from_the_token_cost():
    costs = StepCosts()
    costs.observe(decodes=2, prompt_tokens=64, seconds=1.0)  # nothing known: nothing learned
    assert (costs.decode_s, costs.token_s) == (None, None)
    costs.observe(decodes=0, prompt_tokens=64, seconds=2**-4)  # token_s = 2^-10
    costs.observe(decodes=2, prompt_tokens=64, seconds=2**-4 + 2**-7)
    assert (costs.decode_s, costs.token_s) == (2**-7, 2**-10)
    costs.observe(decodes=2, prompt_tokens=64, seconds=2**-8)  # faster than decode_s alone: token cost 0
    assert costs.token_s == 2**-10 * 3 / 4
    costs.observe(decodes=2, prompt_tokens=0, seconds=-1.0)  # a clock that went back
    assert costs.decode_s == 2**-7


@pytest.mark.parametrize(
    ("token_s", "seconds", "page_size", "tokens"),
    [
        (2**-12, 2**-4, 16, 256),
        (2**-12, 2**-4 * 0.999, 16, 240),  # 255.7: 15 pages
        (2**-12, 2**-8, 64, 0),  # 16 tokens are not a page of 64
        (2**-12, 0.0, 16, 0),
        (2**-12, -1.0, 16, 0),  # over the target already
        (None, 1.0, 16, 0),  # no prompt token measured yet: only the floor
        (0.0, 2**-4, 16, (1 << 62) // 16 * 16),  # free (the chunk sizes cap it)
    ],
)
def test_tokens_within_is_the_most_whole_pages_the_time_pays_for(token_s, seconds, page_size, tokens):
    budget = DecodeBudget(StepCosts(token_s=token_s), target_s=1.0, min_tokens=1, page_size=page_size)
    assert budget.tokens_within(seconds) == tokens


def test_a_step_s_allowance_is_the_target_less_the_decodes_and_spends_the_tokens():
    costs = StepCosts(decode_s=2**-6, token_s=2**-12)
    budget = DecodeBudget(costs, target_s=2**-4, min_tokens=96, page_size=16)
    step = budget.allowance(decodes=8)  # 2^-4 - 2^-6 = 3 x 2^-6 s: 192 tokens
    assert step.allowed() == 192
    step.spend(100)
    assert step.taken == 100
    assert step.allowed() == 80  # 92 tokens' time: 5 pages
    step.spend(80)
    assert step.allowed() == 0  # 12 left: not a page, and the floor of 96 is taken
    assert budget.allowance(decodes=0).allowed() == 256  # a microbatch with no decode: the whole target
    assert DecodeBudget(StepCosts(token_s=2**-12), 2**-4, 96, 16).allowance(4).allowed() == 256  # decodes unmeasured


def test_a_step_over_its_target_allows_the_rest_of_its_floor():
    budget = DecodeBudget(StepCosts(decode_s=2**-3, token_s=2**-12), target_s=2**-4, min_tokens=96, page_size=16)
    step = budget.allowance(decodes=2)
    assert step.left_s < 0
    assert step.allowed() == 96
    step.spend(40)
    assert step.allowed() == 56
    step.spend(56)
    assert step.allowed() == 0


def test_bad_budgets_are_refused():
    for target, floor, page in ((0.0, 1, 16), (float("nan"), 1, 16), (1.0, 0, 16), (1.0, 1, 0)):
        with pytest.raises(ValueError, match="bad budget"):
            DecodeBudget(StepCosts(), target, floor, page)
