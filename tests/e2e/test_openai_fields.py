"""The OpenAI surface with the official `openai` client, on the default model, through a router in
front of a colocated node and through one in front of a prefill node (pp 2) and a decode node
(pp 2): every field the router takes changes the answer exactly as the one-process engine says
(same params, token for token), on both paths; logprobs (generated and echoed prompt tokens) equal
transformers' log-softmax to 1e-4; unknown output-changing fields and bad schemas get 400s."""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import jsonschema
import openai
import pytest
import torch

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.config import EngineConfig, PPConfig
from kvbridge.engine.llm import LLM
from kvbridge.nodes import start_node
from kvbridge.router.config import RouterConfig
from kvbridge.router.server import start_router
from kvbridge.serving.config import NodeConfig
from tests.pd import start_nodes, stop_nodes, wait_idle

CONFIG = EngineConfig(dtype="float32", kv_cache_tokens=4096, chunked_prefill_size=64)  # (against HF fp32)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def fleet(hard_timeout):
    nodes = start_nodes({"p": ("prefill", 2), "d": ("decode", 2, "shm")}, config=CONFIG)
    nodes["c"] = start_node("colocated", NodeConfig(CONFIG, PPConfig()))
    routers = {
        "colocated": start_router(RouterConfig(port=0, http_port=0, colocated=(nodes["c"].address,))),
        "disaggregated": start_router(
            RouterConfig(port=0, http_port=0, prefill=(nodes["p"].address,), decode=(nodes["d"].address,))
        ),
    }
    yield nodes, routers
    for r in routers.values():
        r.stop(grace_s=0)
    stop_nodes(nodes)


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(CONFIG, model=default_model, progress=False)


@pytest.fixture(params=["colocated", "disaggregated"])
def client(request, fleet):
    nodes, routers = fleet
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{routers[request.param].http_port}/v1", api_key="x", max_retries=0)
    for node in nodes.values():
        assert all(r.kv_pages_used == 0 for r in wait_idle(node.address).ranks)


def chat_ids(llm, messages, **options) -> list[int]:
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template(messages, **options))


def test_logprobs_and_echoed_prompt_logprobs_equal_transformers(client, llm, hf_default):
    prompt = chat_ids(llm, QUESTION)
    out = client.completions.create(model="", prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=5)
    lp = out.choices[0].logprobs
    generated = llm.generate([prompt], SamplingParams(max_new_tokens=5))[0].output_ids
    seq = prompt + generated
    assert out.choices[0].text == llm.tokenizer.decode(prompt, skip_special_tokens=False) + llm.tokenizer.decode(
        generated
    )
    with torch.no_grad():
        table = torch.log_softmax(hf_default(torch.tensor([seq])).logits[0].float(), dim=-1)
    assert len(lp.token_logprobs) == len(seq) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(seq)):
        row = table[i - 1]
        assert lp.token_logprobs[i] == pytest.approx(row[seq[i]].item(), abs=1e-4), i
        want = row.topk(5).values.tolist()
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(
            want[: len(lp.top_logprobs[i])], abs=1e-4
        )
    assert lp.tokens[len(prompt)] == llm.tokenizer.decode([seq[len(prompt)]], skip_special_tokens=False)

    # vLLM's prompt_logprobs (no echo): each prompt token's logprob, rank and the 2 most likely
    out = client.completions.create(model="", prompt=prompt, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 2})  # fmt: skip
    shown = out.choices[0].model_extra["prompt_logprobs"]
    assert len(shown) == len(prompt) and shown[0] is None
    for i in range(1, len(prompt)):
        mine = shown[i][str(prompt[i])]
        assert mine["logprob"] == pytest.approx(table[i - 1, prompt[i]].item(), abs=1e-4), i
        assert mine["rank"] == int((table[i - 1] > table[i - 1, prompt[i]]).sum()) + 1, i
        assert {r["rank"] for t, r in shown[i].items() if t != str(prompt[i])} <= {1, 2}

    chat = client.chat.completions.create(model="", messages=QUESTION, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [table[len(prompt) + i - 1, seq[len(prompt) + i]].item() for i in range(4)], abs=1e-4
    )
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    assert content[0].bytes == list(content[0].token.encode())


def completion(client, prompt, **fields):
    extra = {k: fields.pop(k) for k in list(fields) if k not in ("presence_penalty", "frequency_penalty", "logit_bias",
                                                                 "seed", "stop", "temperature", "top_p")}  # fmt: skip
    out = client.completions.create(model="", prompt=prompt, max_tokens=10, extra_body=extra or None, **fields)
    return out.choices[0].text, out.choices[0].finish_reason


def test_every_sampling_field_acts_as_the_engine_says(client, llm):
    prompt = chat_ids(llm, [{"role": "user", "content": "Count from 1 to 20, separated by commas."}])
    tok = llm.tokenizer
    base = SamplingParams(max_new_tokens=10, temperature=0)
    plain = llm.generate([prompt], base)[0]
    first = plain.output_ids[0]
    cases = [  # (OpenAI fields, the engine's params)
        ({"temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 1.0},
         replace(base, presence_penalty=1.5, frequency_penalty=1.0)),
        ({"temperature": 0, "repetition_penalty": 1.5}, replace(base, repetition_penalty=1.5)),
        ({"temperature": 0, "logit_bias": {str(first): -100}}, replace(base, logit_bias=((first, -100.0),))),
        ({"temperature": 0, "allowed_token_ids": list(range(28, 60))},
         replace(base, allowed_token_ids=tuple(range(28, 60)))),
        ({"temperature": 0, "bad_words": [tok.decode(plain.output_ids[:1]).strip()]},
         replace(base, bad_words=(tok.decode(plain.output_ids[:1]).strip(),))),
        ({"temperature": 2.0, "seed": 3, "min_p": 0.2, "top_k": 20}, SamplingParams(max_new_tokens=10, temperature=2.0,
                                                                                    seed=3, min_p=0.2, top_k=20)),
        ({"temperature": 0, "stop": ["\n"], "include_stop_str_in_output": True},
         replace(base, stop=("\n",), include_stop_str_in_output=True)),
        ({"temperature": 0, "stop": ["\n"], "min_tokens": 6}, replace(base, stop=("\n",), min_tokens=6)),
        ({"temperature": 0, "stop": ["\n"], "no_stop_trim": True},  # (SGLang's name for it)
         replace(base, stop=("\n",), include_stop_str_in_output=True)),
    ]  # fmt: skip
    baselines = {  # what a field is compared with, when not the plain run
        "min_p": lambda p: replace(p, min_p=0.0),
        "min_tokens": lambda p: replace(p, min_tokens=0),
    }
    for fields, params in cases:
        if params.bad_words:
            params = params.with_bad_words_ids(lambda t: tok.encode(t, add_special_tokens=False))
        want = llm.generate([prompt], params)[0]
        assert completion(client, prompt, **fields) == (want.text, want.finish_reason), fields
        # the field changed it (min_p, min_tokens: from the same params without it)
        field = next((f for f in baselines if f in fields), None)
        without = llm.generate([prompt], baselines[field](params))[0] if field else plain
        assert want.output_ids != without.output_ids or want.text != without.text, fields


def test_chat_template_fields_and_special_tokens(client, llm):
    partial = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    cont = client.chat.completions.create(
        model="", messages=partial, max_tokens=3, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    ids = chat_ids(llm, partial, add_generation_prompt=False, continue_final_message=True)
    assert cont.choices[0].message.content == llm.generate([ids], SamplingParams(max_new_tokens=3))[0].text
    assert "Paris" in cont.choices[0].message.content

    raw = client.chat.completions.create(
        model="", messages=QUESTION, max_tokens=12, temperature=0,
        extra_body={"add_generation_prompt": False, "skip_special_tokens": False, "chat_template_kwargs": {"x": 1}},
    )  # fmt: skip
    ids = chat_ids(llm, QUESTION, add_generation_prompt=False)
    want = llm.generate([ids], SamplingParams(max_new_tokens=12, skip_special_tokens=False))[0]
    assert raw.choices[0].message.content == want.text
    assert "<|im_start|>" in want.text  # (without the generation prompt the model opens a turn itself)
    assert raw.usage.prompt_tokens == len(ids) and raw.usage.prompt_tokens_details.cached_tokens >= 0


def test_json_schema_answers_parse_and_validate(client, llm):
    messages = [{"role": "user", "content": "Give the capital of France and its population as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        out = client.chat.completions.create(model="", messages=messages, max_tokens=60, temperature=0.7, seed=seed,
                                             response_format=fmt)  # fmt: skip
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
        want = llm.generate([chat_ids(llm, messages)], SamplingParams(max_new_tokens=60, temperature=0.7, seed=seed,
                                                                       json_schema=json.dumps(SCHEMA)))[0]  # fmt: skip
        assert out.choices[0].message.content == want.text
    ask = [
        {"role": "user", "content": 'Return a JSON object with one key "answer" whose value is the capital of France.'}
    ]
    obj = client.chat.completions.create(model="", messages=ask, max_tokens=150, temperature=0,
                                         response_format={"type": "json_object"})  # fmt: skip
    answer = obj.choices[0].message.content
    assert obj.choices[0].finish_reason == "stop" and "answer" in json.loads(answer) and "Paris" in answer

    with pytest.raises(openai.BadRequestError) as e:
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3,
                                                                                "maximum": 1}}}  # fmt: skip
        client.chat.completions.create(model="", messages=messages, response_format=bad)
    assert e.value.body["param"] == "response_format" and "Unsatisfiable schema" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="", prompt="hi", extra_body={"use_beam_search": True})
    assert e.value.body["message"] == "use_beam_search is not supported, got true"


def test_n_choices_and_a_list_of_prompts(client, llm):
    """Choice p * n + i answers prompt p sampled with seed + i: each equal to the engine's run of it
    alone; usage counts each prompt once and every choice's tokens."""
    prompts = [chat_ids(llm, QUESTION), chat_ids(llm, [{"role": "user", "content": "Name three colours."}])]
    out = client.completions.create(model="", prompt=prompts, n=3, seed=7, temperature=1.0, max_tokens=6)
    wants = [llm.generate([p], SamplingParams(max_new_tokens=6, temperature=1.0, seed=7 + i))[0]
             for p in prompts for i in range(3)]  # fmt: skip
    assert [c.index for c in out.choices] == list(range(6))
    assert [(c.text, c.finish_reason) for c in out.choices] == [(w.text, w.finish_reason) for w in wants]
    assert len({c.text for c in out.choices[:3]}) == 3  # seeded choices of one prompt differ
    assert out.usage.prompt_tokens == sum(map(len, prompts))
    assert out.usage.completion_tokens == sum(len(w.output_ids) for w in wants)

    chunks = client.chat.completions.create(model="", messages=QUESTION, n=2, seed=3, temperature=1.0, max_tokens=5,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    texts, finished, usage = ["", ""], [None, None], None
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finished[c.index] = c.finish_reason or finished[c.index]
        usage = chunk.usage or usage
    wants = [llm.generate([prompts[0]], SamplingParams(max_new_tokens=5, temperature=1.0, seed=3 + i))[0]
             for i in range(2)]  # fmt: skip
    assert texts == [w.text for w in wants] and finished == [w.finish_reason for w in wants]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompts[0]), sum(len(w.output_ids) for w in wants))

    echoed = client.completions.create(model="", prompt=["Paris is", "Rome is"], n=2, max_tokens=2, temperature=0,
                                       echo=True)  # fmt: skip
    assert [c.text.split(" is")[0] for c in echoed.choices] == ["Paris", "Paris", "Rome", "Rome"]
    assert echoed.choices[0].text == echoed.choices[1].text  # greedy: n equal choices


def test_tokenize_detokenize_version(fleet, llm):
    _, routers = fleet
    base = f"http://127.0.0.1:{routers['disaggregated'].http_port}"
    ids = chat_ids(llm, QUESTION)
    got = httpx.post(f"{base}/tokenize", json={"messages": QUESTION}, timeout=30).json()
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == 8192
    text = httpx.post(f"{base}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert text == llm.tokenizer.apply_chat_template(QUESTION)
    assert httpx.get(f"{base}/version", timeout=30).json()["version"]
