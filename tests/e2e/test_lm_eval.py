"""EleutherAI's lm-evaluation-harness (`local-completions`, token-id prompts, batch size 1) against
a router in front of a colocated node serving the default model, on two small local tasks
(tests/e2e/lm_eval_tasks/): every log-likelihood lm-eval reads off the echoed prompt logprobs
equals the one-process engine's teacher-forced sum to 1e-4 (and its is-greedy flag the engine's
argmax), so the choices picked are the engine's; every generation equals the engine's greedy
output cut at the first newline. lm-eval is the optional `eval` extra: `pip install -e '.[eval]'`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.config import EngineConfig, PPConfig
from kvbridge.engine.llm import LLM
from kvbridge.nodes import start_node
from kvbridge.router.config import RouterConfig
from kvbridge.router.server import start_router
from kvbridge.serving.config import NodeConfig

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TASKS = Path(__file__).with_name("lm_eval_tasks")  # data_files there are relative to ROOT
CONFIG = EngineConfig(kv_cache_tokens=4096, chunked_prefill_size=64)
MAX_GEN_TOKS = 16  # kvbridge_arithmetic.yaml's generation_kwargs.max_gen_toks
HARD_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def served(hard_timeout):
    """(completions URL, served model name) of a router in front of a colocated node."""
    import httpx

    node = start_node("colocated", NodeConfig(CONFIG, PPConfig()))
    router = start_router(RouterConfig(port=0, http_port=0, colocated=(node.address,)))
    base = f"http://127.0.0.1:{router.http_port}/v1"
    (card,) = httpx.get(f"{base}/models").json()["data"]
    yield f"{base}/completions", card["id"]
    router.stop(grace_s=0)
    node.stop()


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(CONFIG, model=default_model, progress=False)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The default model's tokenizer as a transformers directory (lm-eval's huggingface backend
    loads it by path; it passes no gguf_file, so it is read out of the GGUF file here first)."""
    transformers = pytest.importorskip("transformers")
    from kvbridge.engine.weights import smollm2_path

    path, out = smollm2_path(), tmp_path_factory.mktemp("tokenizer")
    transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def results(served, tokenizer_dir, monkeypatch_module):
    """lm-eval's results on both tasks, with the per-item samples."""
    url, model = served
    monkeypatch_module.chdir(ROOT)  # (the tasks' data_files)
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")  # (before datasets is imported)
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    # (imported here, not at collection: 2 s, and a default run deselects this file without it)
    lm_eval = pytest.importorskip("lm_eval", reason="the eval extra: pip install -e '.[eval]'")
    pytest.importorskip("tenacity", reason="local-completions needs lm-eval[api]: pip install -e '.[eval]'")
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": url,
            "model": model,
            "tokenizer": str(tokenizer_dir),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,  # token-id prompts
            "batch_size": 1,  # (the router takes one prompt a request)
            "num_concurrent": 1,
            "max_retries": 1,  # an error status fails the run
        },
        tasks=["kvbridge_facts", "kvbridge_arithmetic"],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        log_samples=True,
    )


def samples(results, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def engine_loglikelihood(llm, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's split (the whole text encoded, the context's tokens first), scored by the engine:
    the continuation tokens' log-softmax sum, and whether each is the argmax."""
    tok = llm.tokenizer
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    assert whole[: len(ctx)] == ctx and len(whole) > len(ctx)
    logp = torch.log_softmax(llm.score(whole).double(), dim=-1)
    rows = range(len(ctx) - 1, len(whole) - 1)  # row t predicts token t + 1
    return (
        sum(logp[t, whole[t + 1]].item() for t in rows),
        all(logp[t].argmax().item() == whole[t + 1] for t in rows),
    )


def test_loglikelihood_task_equals_the_engine(results, llm):
    got = samples(results, "kvbridge_facts")
    assert [s["doc"]["context"] for s in got] == [
        "The capital of France is",
        "The Eiffel Tower is in",
        "The first president of the United States was",
        "The opposite of hot is",
    ]
    picked, tokens = [], []
    for s in got:
        doc = s["doc"]
        assert [tuple(a) for a in s["arguments"]] == [(doc["context"], " " + c) for c in doc["choices"]]
        lls, greedies = [], []
        for (context, continuation), ((ll, greedy),) in zip(s["arguments"], s["resps"], strict=True):
            want_ll, want_greedy = engine_loglikelihood(llm, context, continuation)
            assert math.isclose(ll, want_ll, abs_tol=1e-4), (context, continuation, ll, want_ll)
            assert greedy == want_greedy, (context, continuation)
            lls.append(want_ll)
            greedies.append(greedy)
        tok = llm.tokenizer
        tokens.append(
            [len(tok.encode(doc["context"] + " " + c)) - len(tok.encode(doc["context"])) for c in doc["choices"]]
        )
        best = max(range(len(lls)), key=lls.__getitem__)
        best_norm = max(range(len(lls)), key=lambda i: lls[i] / len(doc["choices"][i]))  # (per character)
        assert (s["acc"], s["acc_norm"]) == (float(best == doc["answer"]), float(best_norm == doc["answer"]))
        picked.append((doc["choices"][best], greedies[best]))
    assert tokens == [[1, 1, 1], [3, 3, 3], [2, 2, 2], [2, 2, 1]]  # (the sums over several tokens are checked)
    # the engine's picks are lm-eval's: three right, each its greedy continuation; Lincoln, not greedy
    assert picked == [("Paris", True), ("Paris, France", True), ("Abraham Lincoln", False), ("cold", True)]
    assert results["results"]["kvbridge_facts"]["acc,none"] == 0.75
    assert results["results"]["kvbridge_facts"]["acc_norm,none"] == 0.75


def test_generate_until_task_equals_the_engine(results, llm):
    got = samples(results, "kvbridge_arithmetic")
    tok = llm.tokenizer
    outputs = []
    for s in got:
        ((context, gen_kwargs),) = s["arguments"]
        assert gen_kwargs["until"] == ["\n"] and gen_kwargs["max_gen_toks"] == MAX_GEN_TOKS
        greedy = llm.generate([tok.encode(context)], SamplingParams(max_new_tokens=MAX_GEN_TOKS))[0]
        assert "\n" in greedy.text  # (so the cut, not the length, ends it)
        ((text,),) = s["resps"]
        assert text == greedy.text.split("\n")[0], context
        assert s["exact_match"] == float(text == s["target"])
        outputs.append(text)
    # the model gets 2+2 and 3+5 right and says 2 to 10-7
    assert outputs == [" 4", " 8", " 2"]
    assert [s["target"] for s in got] == [" 4", " 8", " 3"]
    assert results["results"]["kvbridge_arithmetic"]["exact_match,none"] == pytest.approx(2 / 3)
