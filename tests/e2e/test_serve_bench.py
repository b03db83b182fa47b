"""kvbridge/bench/serve.py: the serving benchmark end to end on tiny-random (both stacks, two rates), its bad
flags, and its pure parts: arrivals, datasets and the vLLM metric definitions on hand-made records."""

from __future__ import annotations

import json
import os
import statistics

import numpy as np
import pytest

from kvbridge.bench import serve, serve_client, serve_data, serve_metrics
from kvbridge.bench.serve_metrics import RequestRecord
from kvbridge.engine.weights import tiny_random

RUN_KEYS = {
    "bench", "mode", "stack", "model", "layout", "endpoint", "seed", "min_tokens", "dataset", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "goodput_slo_ms", "loadavg_1m", "completed", "failed",
    "failed_by_reason", "duration", "total_input_tokens", "total_output_tokens", "expected_output_tokens",
    "output_len_mismatches", "content_chunks", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
}  # fmt: skip
SUMMARY_KEYS = {
    "bench", "mode", "summary", "stacks", "request_rates", "max_concurrency", "ratio_of", "ratios",
    "low_load_request_rate", "low_load_ttft_overhead_ms",
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_random().tokenizer


def run_bench(capsys, argv: list[str]) -> list[dict]:
    assert serve.main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


# ---------------------------------------------------------------------------- end to end


@pytest.mark.long
def test_sweep_serves_every_prompt_at_its_exact_output_length_on_both_stacks(capsys, tokenizer):
    argv = ["--num-prompts", "8", "--request-rates", "4,inf", "--random-input-len", "48", "--random-output-len",
            "12", "--random-range-ratio", "0.5", "--goodput", "ttft:60000", "e2el:60000", "--warmups", "1",
            "--json"]  # fmt: skip
    rows = run_bench(capsys, argv)
    runs, summary = rows[:-1], rows[-1]
    assert [(r["stack"], r["request_rate"]) for r in runs] == [
        ("colocated", 4.0), ("disaggregated", 4.0), ("colocated", "inf"), ("disaggregated", "inf"),
    ]  # fmt: skip
    samples = serve_data.random_dataset(serve_data.RandomSpec(48, 12, 0.5), 8, 0, True, tokenizer, 320)
    for r in runs:
        assert set(r) == RUN_KEYS, set(r) ^ RUN_KEYS
        assert r["completed"] == 8 and r["failed"] == 0 and r["failed_by_reason"] == {}, r
        assert r["total_output_tokens"] == r["expected_output_tokens"] == sum(s.output_len for s in samples)
        assert r["output_len_mismatches"] == 0
        assert r["total_input_tokens"] == sum(s.prompt_len for s in samples)  # the server's usage agrees
        assert r["request_goodput"] == r["request_throughput"]  # SLOs of a minute: every request is good
        assert r["dataset"]["input_range"] == [24, 72] and r["dataset"]["output_range"] == [6, 18]
        assert all(r[f"{s}_{m}_ms"] > 0 for s in ("mean", "median", "p99") for m in ("ttft", "tpot", "itl", "e2el"))
    assert runs[0]["layout"] == {"pp": 1, "threads": 0}
    assert runs[1]["layout"] == {"prefill_pp": 1, "decode_pp": 1, "threads": 0}
    assert set(summary) == SUMMARY_KEYS and summary["summary"] is True
    assert summary["stacks"] == ["colocated", "disaggregated"] and summary["low_load_request_rate"] == 4.0
    assert [x["request_rate"] for x in summary["ratios"]] == [4.0, "inf"]
    assert summary["low_load_ttft_overhead_ms"] == pytest.approx(
        runs[1]["median_ttft_ms"] - runs[0]["median_ttft_ms"], abs=1e-3
    )


def test_conversation_dataset_through_completions_on_one_stack(capsys, tokenizer):
    argv = ["--stacks", "disaggregated", "--dataset", "conversation", "--endpoint", "completions", "--num-prompts",
            "6", "--conv-system-len", "40", "--conv-user-len", "16", "--conv-output-len", "8", "--max-concurrency",
            "2", "--warmups", "0", "--min-tokens", "off"]  # fmt: skip
    rows = run_bench(capsys, argv)
    [run], summary = rows[:-1], rows[-1]
    spec = serve_data.ConversationSpec(40, 4, 16, 8, 0.5)
    samples = serve_data.conversation_dataset(spec, 6, 0, False, tokenizer)
    assert run["completed"] == 6 and run["failed"] == 0 and run["min_tokens"] is False
    assert run["total_output_tokens"] == sum(s.output_len for s in samples) and run["output_len_mismatches"] == 0
    assert run["total_input_tokens"] == sum(s.prompt_len for s in samples)
    assert run["dataset"]["name"] == "conversation" and run["max_concurrency"] == 2
    assert summary["stacks"] == ["disaggregated"] and summary["ratios"] == []
    assert summary["low_load_ttft_overhead_ms"] is None


def test_base_url_drives_a_server_it_did_not_start(capsys, tokenizer):
    """How a peer (vLLM, llama-server) is measured by the same code: here a kvbridge colocated stack
    started beside the bench, named by its URL only."""
    from kvbridge.bench.serve_stacks import start_in_process, wait_healthy
    from kvbridge.engine.config import EngineConfig

    stack = start_in_process("colocated", EngineConfig(model="tiny-random"), 1, 1, 1, 60.0)
    try:
        wait_healthy(stack)
        argv = ["--base-url", stack.url + "/", "--label", "peer", "--served-model", "tiny-random", "--num-prompts",
                "5", "--random-input-len", "30", "--random-output-len", "7", "--warmups", "0", "--json"]  # fmt: skip
        rows = run_bench(capsys, argv)
    finally:
        stack.stop()
    [run], summary = rows[:-1], rows[-1]
    assert set(run) == RUN_KEYS and run["stack"] == "peer" and run["layout"] == {"base_url": stack.url}
    assert run["completed"] == 5 and run["failed"] == 0 and run["total_output_tokens"] == 35
    samples = serve_data.random_dataset(serve_data.RandomSpec(30, 7, 0.0), 5, 0, True, tokenizer, 320)
    assert run["total_input_tokens"] == sum(s.prompt_len for s in samples)
    assert summary["stacks"] == ["peer"] and summary["ratios"] == []


@pytest.mark.slow
def test_interference_mode_pins_the_nodes_and_reports_both_windows(capsys):
    argv = ["--mode", "interference", "--itf-streams", "2", "--itf-stream-output-len", "64", "--itf-long-prompts",
            "2", "--itf-long-input-len", "512", "--itf-long-rate", "2", "--itf-quiet-s", "1"]  # fmt: skip
    rows = run_bench(capsys, argv)
    runs, summary = rows[:-1], rows[-1]
    assert [r["stack"] for r in runs] == ["colocated", "disaggregated"]
    for r in runs:
        assert r["failed"] == 0 and r["long_completed"] == 2 and r["output_len_mismatches"] == 0, r
        assert r["quiet_itl_ms"]["n"] > 0 and r["loaded_itl_ms"]["n"] > 0 and r["long_ttft_ms"]["n"] == 2
    assert runs[1]["layout"]["prefill_cores"] == [0] and runs[1]["layout"]["decode_cores"] == [1]
    assert set(summary["ratios"]) == {
        f"{w}_{s}" for w in ("quiet_itl", "loaded_itl", "long_ttft") for s in ("median", "p99")
    }


@pytest.mark.long
def test_handoff_mode_pairs_each_prompt_across_both_stacks_of_child_processes(capsys):
    argv = ["--mode", "handoff", "--num-prompts", "6", "--random-input-len", "24", "--random-output-len", "3"]
    rows = run_bench(capsys, argv)
    runs, summary = rows[:-1], rows[-1]
    assert [r["stack"] for r in runs] == ["colocated", "disaggregated"]
    for r in runs:
        assert r["mode"] == "handoff" and r["num_prompts"] == 6 and r["failed"] == 0, r
        assert r["layout"]["processes"] == "kvbridge CLI children, unpinned" and r["median_ttft_ms"] > 0
    assert summary["summary"] is True and summary["pairs"] == 6
    assert isinstance(summary["ttft_overhead_ms"]["median"], float)
    assert summary["median_ttft_ms"] == {r["stack"]: r["median_ttft_ms"] for r in runs}


@pytest.mark.slow
@pytest.mark.long
def test_tracing_mode_serves_the_same_load_with_tracing_off_on_on_off(capsys):
    argv = ["--mode", "tracing", "--num-prompts", "6", "--random-input-len", "24", "--random-output-len", "4",
            "--warmups", "1", "--json"]  # fmt: skip
    rows = run_bench(capsys, argv)
    runs, summary = rows[:-1], rows[-1]
    assert [(r["tracing"], r["run"]) for r in runs] == [("off", 1), ("on", 2), ("on", 3), ("off", 4)]
    assert {r["stack"] for r in runs} == {"disaggregated"}
    for r in runs:
        assert r["completed"] == 6 and r["failed"] == 0 and r["total_output_tokens"] == 24, r
    # every request traced (the probe and the warm-up too: 8 traces), none while off; spans from every process
    assert [r["traces_received"] for r in runs] == [0, 8, 8, 0]
    assert all(r["spans_received"] >= 8 * 12 for r in runs if r["tracing"] == "on")
    on = statistics.fmean(r["output_throughput"] for r in runs if r["tracing"] == "on")
    off = statistics.fmean(r["output_throughput"] for r in runs if r["tracing"] == "off")
    assert summary["on_over_off"] == round(on / off, 4) and summary["every_request_traced"] is True
    assert summary["within_5_percent"] == (on / off >= 0.95)  # (the figure itself is bench/'s, not a test's)


@pytest.mark.long
def test_shift_mode_runs_every_static_split_and_the_planner_on_one_fleet(capsys):
    argv = ["--mode", "shift", "--shift-nodes", "3", "--shift-phase-s", "3", "--shift-prefill-heavy", "64,4,3",
            "--shift-decode-heavy", "16,12,3", "--shift-step-delay-ms", "5", "--endpoint", "completions",
            "--warmups", "1", "--json"]  # fmt: skip
    rows = run_bench(capsys, argv)
    runs, summary = rows[:-1], rows[-1]
    assert [(r["run"], r["split"]) for r in runs] == [("static", "1P:2D"), ("static", "2P:1D"), ("planner", "1P:2D")]
    for r in runs:  # 3 s of each phase at 3 requests/s: 9 + 9 + 9
        assert (r["completed"], r["failed"], r["total_output_tokens"]) == (27, 0, 9 * 4 + 9 * 12 + 9 * 4), r
        assert [p["requests"] for p in r["phases"]] == [9, 9, 9]
    static = {r["split"]: r["request_goodput"] for r in runs if r["run"] == "static"}
    assert summary["goodput"] == static | {"planner": runs[2]["request_goodput"]}
    assert summary["best_static"] == max(static, key=static.get)
    assert summary["worst_static"] == min(static, key=static.get)
    best = static[summary["best_static"]]
    assert summary["planner_over_best"] == (round(runs[2]["request_goodput"] / best, 3) if best else None)
    assert summary["planner_moves"] == runs[2]["moves"]


def test_pinned_nodes_and_their_ranks_run_on_their_cores():
    from kvbridge.bench.serve_stacks import start_pinned

    cores = sorted(os.sched_getaffinity(0))[:2]
    stack = start_pinned("disaggregated", ["--model", "tiny-random"], cores, 1, 2, 1, 60.0)
    try:
        prefill = next(n for n in stack.nodes if n.role == "prefill")
        decode = next(n for n in stack.nodes if n.role == "decode")
        assert os.sched_getaffinity(prefill.proc.pid) == {cores[0]}
        assert os.sched_getaffinity(decode.proc.pid) == {cores[1]}
        with open(f"/proc/{prefill.proc.pid}/task/{prefill.proc.pid}/children") as f:
            ranks = [int(p) for p in f.read().split()]
        assert ranks and all(os.sched_getaffinity(pid) == {cores[0]} for pid in ranks)
    finally:
        stack.stop()


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--request-rates", "1,x"], "'x'"),
        (["--request-rate", "0"], "'0'"),
        (["--stacks", "colocated,pd"], "'colocated,pd'"),
        (["--goodput", "ttft:abc"], "'abc'"),
        (["--goodput", "latency:5"], "'latency:5'"),
        (["--random-range-ratio", "1.5"], "1.5"),
        (["--mode", "shift", "--shift-nodes", "1"], "got 1"),
        (["--mode", "shift", "--shift-prefill-heavy", "512,8"], "'512,8'"),
        (["--num-prompts", "0"], "got 0"),
        (["--max-concurrency", "0"], "got 0"),
        (["--threads", "-1"], "got -1"),
        (["--burstiness", "-1"], "-1"),
        (["--model", "no-such-model"], "'no-such-model'"),
        (["--random-input-len", "5000", "--endpoint", "completions"], "5000 prompt"),
        (["--endpoint", "grpc"], "'grpc'"),
        (["--base-url", "localhost:8000"], "'localhost:8000'"),
        (["--base-url", "http://h:1", "--mode", "handoff"], "--mode handoff"),
    ],
)
def test_a_bad_flag_is_one_line_naming_the_value_and_exit_2(capsys, argv, named):
    assert serve.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvbridge bench serve: error:") and named in err[0], err


# ---------------------------------------------------------------------------- arrivals


def test_arrivals_are_reproducible_from_the_seed():
    a = serve_data.arrival_times(50, 4.0, 1.0, seed=7)
    assert a == serve_data.arrival_times(50, 4.0, 1.0, seed=7)
    assert a != serve_data.arrival_times(50, 4.0, 1.0, seed=8)
    assert a == sorted(a) and a[0] > 0


def test_arrivals_offer_exactly_the_rate_and_burstiness_sets_the_spread():
    n, rate = 20000, 8.0
    for burstiness, cv in ((1.0, 1.0), (4.0, 0.5), (0.25, 2.0)):  # gamma(k): coefficient of variation 1/sqrt(k)
        times = serve_data.arrival_times(n, rate, burstiness, seed=0)
        intervals = np.diff([0.0, *times])
        assert times[-1] == pytest.approx(n / rate, rel=1e-12)  # vLLM's normalization: the mean is 1/rate
        assert intervals.mean() == pytest.approx(1 / rate, rel=1e-12)
        assert intervals.std() / intervals.mean() == pytest.approx(cv, rel=0.05)


def test_infinite_rate_sends_everything_at_once_and_infinite_burstiness_evenly():
    assert serve_data.arrival_times(5, float("inf"), 1.0, seed=0) == [0.0] * 5
    assert serve_data.arrival_times(4, 2.0, float("inf"), seed=0) == [0.5, 1.0, 1.5, 2.0]


# ---------------------------------------------------------------------------- datasets


def test_random_dataset_lengths_are_uniform_over_vllms_bounds(tokenizer):
    spec = serve_data.RandomSpec(100, 20, 0.25)
    assert spec.input_range == (75, 125) and spec.output_range == (15, 25)
    samples = serve_data.random_dataset(spec, 400, 3, False, tokenizer, 320)
    assert samples == serve_data.random_dataset(spec, 400, 3, False, tokenizer, 320)
    assert all(s.prompt_len == len(s.prompt) and 75 <= s.prompt_len <= 125 for s in samples)
    assert {s.prompt_len for s in samples} >= {75, 125} and {s.output_len for s in samples} == set(range(15, 26))
    assert statistics.mean(s.prompt_len for s in samples) == pytest.approx(100, abs=3)
    specials = set(tokenizer.backend.get_added_tokens_decoder())
    assert not specials & {t for s in samples for t in s.prompt} and max(t for s in samples for t in s.prompt) < 259


def test_random_chat_prompts_tokenize_to_about_their_drawn_length(tokenizer):
    samples = serve_data.random_dataset(serve_data.RandomSpec(200, 8, 0.5), 30, 0, True, tokenizer, 320)
    lengths = serve_data.random_dataset(serve_data.RandomSpec(200, 8, 0.5), 30, 0, False, tokenizer, 320)
    for s, drawn in zip(samples, lengths):
        [message] = s.prompt
        assert message["role"] == "user"
        assert s.prompt_len == len(tokenizer.encode(tokenizer.apply_chat_template(s.prompt)))
        assert abs(s.prompt_len - drawn.prompt_len) <= 5  # whole words of at most 8 bytes: within half a word


def test_conversation_turns_resend_the_earlier_turns_and_keep_their_order(tokenizer):
    spec = serve_data.ConversationSpec(system_len=30, max_turns=4, user_len=12, output_len=10, range_ratio=0.5)
    samples = serve_data.conversation_dataset(spec, 40, 1, True, tokenizer)
    assert len(samples) == 40
    system = samples[0].prompt[0]
    assert system["role"] == "system" and all(s.prompt[0] == system for s in samples)
    seen: dict[int, list] = {}
    for s in samples:
        assert s.turn == len(seen.get(s.conversation, [])) + 1  # turns in order
        if s.turn > 1:
            prev = seen[s.conversation][-1]
            assert s.prompt[: len(prev.prompt)] == prev.prompt and s.prompt[len(prev.prompt)]["role"] == "assistant"
        assert len(s.prompt) == 2 * s.turn and 5 <= s.output_len <= 15
        seen.setdefault(s.conversation, []).append(s)
    assert max(s.turn for s in samples) > 1 and len(seen) > 1
    order = [s.conversation for s in samples]
    assert order != sorted(order)  # conversations interleave
    ids = serve_data.conversation_dataset(spec, 40, 1, False, tokenizer)
    assert [s.prompt_len for s in ids] == [s.prompt_len for s in samples]
    assert all(s.prompt == tokenizer.encode(tokenizer.apply_chat_template(c.prompt)) for s, c in zip(ids, samples))


# ---------------------------------------------------------------------------- metrics


def make_records() -> list[RequestRecord]:
    return [
        RequestRecord(True, prompt_len=10, expected_output_len=5, output_len=5, ttft=0.1, itl=[0.1] * 4, latency=0.5),
        RequestRecord(True, prompt_len=20, expected_output_len=3, output_len=3, ttft=0.3, itl=[0.2] * 2, latency=0.7),
        RequestRecord(True, prompt_len=5, expected_output_len=2, output_len=1, ttft=0.05, latency=0.05),
        RequestRecord(False, error="http_503", prompt_len=7, expected_output_len=4, latency=0.01),
    ]


def test_metrics_follow_vllms_definitions_exactly():
    m = serve_metrics.compute_metrics(make_records(), duration=2.0, slo_ms={})
    assert m["completed"] == 3 and m["failed"] == 1 and m["failed_by_reason"] == {"http_503": 1}
    assert m["total_input_tokens"] == 35 and m["total_output_tokens"] == 9 and m["expected_output_tokens"] == 10
    assert m["output_len_mismatches"] == 1 and m["content_chunks"] == 5 + 3 + 1
    assert m["request_throughput"] == 1.5 and m["output_throughput"] == 4.5 and m["total_token_throughput"] == 22.0
    assert m["request_goodput"] is None
    # TPOT = (e2el - ttft) / (output - 1): 0.4/4 and 0.4/2; the one-token answer has none
    assert (m["mean_tpot_ms"], m["median_tpot_ms"], m["p99_tpot_ms"]) == (150.0, 150.0, 199.0)
    assert (m["mean_ttft_ms"], m["median_ttft_ms"], m["p99_ttft_ms"]) == (150.0, 100.0, 296.0)
    assert (m["mean_itl_ms"], m["median_itl_ms"], m["p99_itl_ms"]) == (133.333, 100.0, 200.0)
    assert (m["mean_e2el_ms"], m["median_e2el_ms"], m["p99_e2el_ms"]) == (416.667, 500.0, 696.0)


def test_goodput_counts_requests_meeting_every_slo_per_second():
    records = make_records()
    # ttft <= 200 and tpot <= 150: the first (100, 100) and the one-token answer (50, tpot 0)
    assert serve_metrics.compute_metrics(records, 2.0, {"ttft": 200, "tpot": 150})["request_goodput"] == 1.0
    assert serve_metrics.compute_metrics(records, 2.0, {"e2el": 100})["request_goodput"] == 0.5
    assert serve_metrics.compute_metrics(records, 2.0, {"tpot": 99.9})["request_goodput"] == 0.5
    assert serve_metrics.compute_metrics(records, 2.0, {"ttft": 300, "e2el": 700})["request_goodput"] == 1.5


def test_no_values_give_none_not_zero():
    m = serve_metrics.compute_metrics([RequestRecord(False, error="timeout")], 1.0, {})
    assert m["completed"] == 0 and m["mean_ttft_ms"] is None and m["p99_itl_ms"] is None


def test_goodput_flags_parse_to_milliseconds():
    assert serve_metrics.parse_goodput(["ttft:500", "tpot:50.5", "e2el:9000"]) == {
        "ttft": 500.0, "tpot": 50.5, "e2el": 9000.0,
    }  # fmt: skip
    for bad in (["ttft"], ["ttft:0"], ["ttft:inf"], ["itl:5"], ["ttft:1", "ttft:2"]):
        with pytest.raises(ValueError):
            serve_metrics.parse_goodput(bad)


def test_interference_windows_take_the_gaps_that_end_inside_them():
    rec = RequestRecord(True, itl=[0.1, 0.2, 0.3], chunk_times=[1.0, 1.1, 1.3, 1.6])
    assert serve_client.gaps_in([rec], (1.05, 1.3)) == [0.1, 0.2]
    assert serve_client.gaps_in([rec], (1.31, 2.0)) == [0.3]
    assert serve_client.gaps_in([RequestRecord(False, itl=[0.1], chunk_times=[1.0, 1.1])], (0.0, 9.0)) == []


def test_the_ready_line_of_a_node_command_gives_its_address():
    from kvbridge.bench.serve_stacks import READY

    assert READY.search("kvbridge prefill: listening on 127.0.0.1:41234\n").group(1) == "127.0.0.1:41234"
    line = "kvbridge serve: listening on [::1]:5000, metrics on [::1]:9000"
    assert READY.search(line).group(1) == "[::1]:5000"
    assert READY.search("kvbridge decode: bound 127.0.0.1:1; loading") is None


class FakePool:
    """Answers each probe with the next outcome (an error string, or "" for success)."""

    def __init__(self, *outcomes: str):
        self.outcomes, self.sent = list(outcomes), []

    def submit(self, fn, target, samples, *rest):
        from concurrent.futures import Future

        self.sent.append((target.min_tokens, samples[0].output_len))
        error = self.outcomes.pop(0)
        done = Future()
        done.set_result(([RequestRecord(not error, error=error)], 0.1))
        return done


@pytest.mark.parametrize(
    "mode, outcomes, sent, result",
    [
        ("auto", ["", ""], [True], True),
        ("auto", ["http_400:invalid_argument", ""], [True, False], False),
        ("off", [""], [False], False),
        ("on", ["http_400:invalid_argument"], [True], None),
        ("auto", ["http_503:unavailable", "http_503:unavailable"], [True, False], None),
    ],
)
def test_the_probe_picks_min_tokens_or_calls_the_stack_broken(mode, outcomes, sent, result):
    args = serve.build_parser().parse_args(["--min-tokens", mode])
    pool = FakePool(*outcomes)
    sample = serve_data.Sample([1, 2, 3], 3, 64)
    if result is None:
        with pytest.raises(serve.StackBroken, match="http_"):
            serve.probe_min_tokens(pool, args, "http://127.0.0.1:1", sample)
    else:
        assert serve.probe_min_tokens(pool, args, "http://127.0.0.1:1", sample) is result
    assert pool.sent == [(m, 4) for m in sent]  # a short request: 4 output tokens
