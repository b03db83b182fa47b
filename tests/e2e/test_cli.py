"""`kvbridge generate` as a user runs it: a real subprocess, JSON out, exit 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvbridge.common.sampling import SamplingParams
from tests.conftest import make_llm


def kvbridge(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbridge", *args], capture_output=True, text=True, timeout=timeout)


def test_generate_json_matches_the_engine(tiny_model):
    r = kvbridge(
        "generate",
        "--model",
        "tiny-random",
        "--prompt-ids",
        "5,6,7,8",
        "--prompt-ids",
        "9,10",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
        "--json",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    objs = [json.loads(line) for line in r.stdout.splitlines()]
    expected = make_llm(tiny_model).generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [o["output_ids"] for o in objs] == [c.output_ids for c in expected]
    assert [o["prompt_tokens"] for o in objs] == [4, 2]
    for o in objs:
        assert set(o) >= {"output_ids", "text", "prompt_tokens", "ttft_s", "tokens_per_s"}
        assert o["ttft_s"] > 0 and o["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/no/such/file.gguf", "--prompt", "hi"], "'/no/such/file.gguf'"),
        (["--model", "tiny-random", "--prompt", "hi", "--temperature", "-1"], "temperature must be >= 0, got -1.0"),
        (["--model", "tiny-random", "--prompt", "hi", "--top-k", "x"], "invalid int value: 'x'"),
        (["--model", "tiny-random", "--prompt-ids", "1,a"], "'1,a'"),
        (["--model", "tiny-random", "--prompt", "hi", "--page-size", "0"], "page_size must be >= 1, got 0"),
        (["--model", "tiny-random", "--prompt", "x" * 80, "--max-context", "64"], "80 tokens; the context holds 64"),
        (["--model", "tiny-random", "--prompt-ids", "1,400"], "token id 400 is out of range"),
        (["--model", "tiny-random"], "at least one of --prompt"),
        (["--model", "tiny-random", "--prompt", "hi", "--device", "tpu"], "'tpu'"),
    ],
)
def test_bad_input_is_one_line_naming_the_value_and_exit_2(args, message):
    r = kvbridge("generate", "--quiet", *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.long
def test_chat_on_the_default_model_answers_in_english():
    r = kvbridge("generate", "--chat", "What is the capital of France?", "--max-new-tokens", "24", "--json")
    assert r.returncode == 0, r.stderr
    [obj] = [json.loads(line) for line in r.stdout.splitlines()]
    assert "Paris" in obj["text"] and obj["finish_reason"] == "stop"
    # nothing on stderr but progress (dequantizing a cold cache, checking a cache file not checked before)
    assert [line for line in r.stderr.splitlines() if not line.startswith(("dequantizing ", "checking "))] == []


@pytest.mark.parametrize(
    "pp_flags",
    [["--pp-size", "2"], pytest.param(["--pp-size", "3", "--enable-dynamic-chunking"], marks=pytest.mark.long)],
)
def test_generate_on_pipeline_ranks_equals_one_process(pp_flags):
    args = ["generate", "--chat", "Name a fruit.", "--chat", "What is 2+2?", "--max-new-tokens", "16", "--json"]
    args += ["--chunked-prefill-size", "16", "--quiet"]
    one = kvbridge(*args)
    many = kvbridge(*args, *pp_flags)
    assert one.returncode == 0 and many.returncode == 0, one.stderr + many.stderr
    ids = [[json.loads(line)["output_ids"] for line in r.stdout.splitlines()] for r in (one, many)]
    assert ids[0] == ids[1] and len(ids[0]) == 2 and all(ids[0])
