"""The colocated engine on tiny-random: batching, chunking, stages and preemption never change outputs."""

from __future__ import annotations

import pytest
import torch

from kvbridge.common.sampling import SamplingParams
from tests.conftest import make_llm, make_prompts

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def outputs(llm, prompts, params=GREEDY):
    return [c.output_ids for c in llm.generate(prompts, params)]


def test_chunked_prefill_equals_unchunked(tiny_model):
    prompts = make_prompts(6, tiny_model.config.vocab_size, min_len=40, max_len=200)
    unchunked = outputs(make_llm(tiny_model, chunked_prefill_size=0), prompts)
    for chunk in (7, 64):
        assert outputs(make_llm(tiny_model, chunked_prefill_size=chunk), prompts) == unchunked


def test_request_alone_equals_inside_a_batch_of_16_mixed_lengths(tiny_model):
    prompts = make_prompts(16, tiny_model.config.vocab_size, seed=1, min_len=1, max_len=150)
    llm = make_llm(tiny_model, chunked_prefill_size=64)
    batched = outputs(llm, prompts)
    alone = [outputs(make_llm(tiny_model), [p])[0] for p in prompts]
    assert batched == alone
    assert len({tuple(o) for o in batched}) > 8  # the prompts really differ


def test_requests_join_and_leave_every_step(tiny_model):
    llm = make_llm(tiny_model, chunked_prefill_size=16)
    prompts = make_prompts(6, tiny_model.config.vocab_size, seed=2)
    lens = [3, 9, 1, 17, 5, 11]
    reqs, max_batch = [], 0
    for p, n in zip(prompts, lens):  # a new request arrives every step
        reqs.append(llm.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)))
        llm.step()
    while llm.scheduler.num_unfinished:
        max_batch = max(max_batch, len(llm.scheduler.running))
        llm.step()
    assert [len(r.output_ids) for r in reqs] == lens
    assert max_batch >= 3
    expected = [
        outputs(make_llm(tiny_model), [p], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
        for p, n in zip(prompts, lens)
    ]
    assert [r.output_ids for r in reqs] == expected
    assert llm.allocator.num_used == 0


def test_stage_composition_equals_full_model(tiny_model):
    prompts = make_prompts(5, tiny_model.config.vocab_size, seed=3)
    full = make_llm(tiny_model)
    staged = make_llm(tiny_model, num_stages=3)
    assert [s.layer_range for s in staged.stages] == [(0, 2), (2, 4), (4, 6)]
    assert outputs(staged, prompts) == outputs(full, prompts)
    seq = prompts[0] + prompts[1]
    torch.testing.assert_close(staged.score(seq), full.score(seq), atol=1e-5, rtol=1e-5)


def test_preemption_under_page_pressure_keeps_outputs_and_frees_every_page(tiny_model):
    prompts = make_prompts(8, tiny_model.config.vocab_size, seed=4, min_len=20, max_len=40)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    roomy = outputs(make_llm(tiny_model), prompts, params)
    tight = make_llm(tiny_model, page_size=4, num_pages=48)  # room for about two requests
    preempted = []
    original = tight.scheduler.preempt
    tight.scheduler.preempt = lambda req: (preempted.append(req.rid), original(req))
    assert outputs(tight, prompts, params) == roomy
    assert preempted, "the pool was meant to be too small for all requests at once"
    tight.check_invariants()
    assert tight.allocator.num_used == 0


def test_abort_frees_pages_and_other_requests_finish(tiny_model):
    llm = make_llm(tiny_model, chunked_prefill_size=8)
    prompts = make_prompts(3, tiny_model.config.vocab_size, seed=5, min_len=30, max_len=30)
    reqs = [llm.add_request(p, GREEDY) for p in prompts]
    llm.step()
    llm.step()
    assert llm.allocator.num_used > 0
    llm.abort(reqs[1].rid)
    while llm.scheduler.num_unfinished:
        llm.step()
    assert reqs[1].finish_reason == "abort" and reqs[0].finish_reason == reqs[2].finish_reason == "length"
    assert [reqs[0].output_ids, reqs[2].output_ids] == outputs(make_llm(tiny_model), [prompts[0], prompts[2]])
    llm.check_invariants()
    assert llm.allocator.num_used == 0


def test_seeded_sampling_is_reproducible_alone_and_batched(tiny_model):
    prompts = make_prompts(4, tiny_model.config.vocab_size, seed=6)
    params = [
        SamplingParams(max_new_tokens=16, temperature=1.3, top_p=0.9, top_k=50, seed=i, ignore_eos=True)
        for i in range(4)
    ]
    batched = [c.output_ids for c in make_llm(tiny_model).generate(prompts, params)]
    alone = [make_llm(tiny_model).generate([p], sp)[0].output_ids for p, sp in zip(prompts, params)]
    assert batched == alone
    greedy = outputs(make_llm(tiny_model), prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert batched != greedy  # sampling really sampled
    top1 = [SamplingParams(max_new_tokens=16, temperature=2.0, top_k=1, ignore_eos=True)] * 4
    assert [c.output_ids for c in make_llm(tiny_model).generate(prompts, top1)] == greedy


def test_top_p_keeps_only_the_nucleus(tiny_model):
    from kvbridge.engine.request import Request
    from kvbridge.engine.sampler import sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    req = Request("r", [1], SamplingParams(temperature=1.0, top_p=0.7, seed=0), None)
    drawn = {sample(logits, [req])[0][0] for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 < 0.7 needs the second token; the third is never reached


def test_stop_token_ids_and_stop_strings_end_generation(tiny_model):
    llm = make_llm(tiny_model)
    prompt = make_prompts(1, tiny_model.config.vocab_size, seed=7)[0]
    free_run = outputs(llm, [prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    stop_tok = free_run[5]
    first = free_run.index(stop_tok)
    [c] = llm.generate([prompt], SamplingParams(max_new_tokens=20, stop_token_ids=(stop_tok,), ignore_eos=True))
    assert c.output_ids == free_run[: first + 1] and c.finish_reason == "stop"
    full_text = llm.tokenizer.decode(free_run)
    needle = full_text[len(full_text) // 2 : len(full_text) // 2 + 2]
    [c] = llm.generate([prompt], SamplingParams(max_new_tokens=20, stop=(needle,), ignore_eos=True))
    assert c.finish_reason == "stop" and c.text == full_text[: full_text.index(needle)]


def test_bad_requests_are_refused_with_the_bad_value(tiny_model):
    llm = make_llm(tiny_model, max_context=64)
    with pytest.raises(ValueError, match="64"):
        llm.add_request([5] * 64, GREEDY)
    with pytest.raises(ValueError, match="token id 999"):
        llm.add_request([5, 999], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.add_request([], GREEDY)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0)
    small = make_llm(tiny_model, num_pages=2, page_size=4)
    with pytest.raises(ValueError, match="needs 7 KV pages; the pool has 2"):
        small.add_request([5] * 4, SamplingParams(max_new_tokens=24))
    assert llm.scheduler.num_unfinished == 0 and small.scheduler.num_unfinished == 0


def test_bfloat16_runs_with_a_bfloat16_pool_and_logits_near_float32(tiny_model):
    bf16 = make_llm(tiny_model, dtype="bfloat16")
    assert bf16.pools[0].buffer.dtype == torch.bfloat16
    seq = make_prompts(1, tiny_model.config.vocab_size, seed=8)[0]
    ref = make_llm(tiny_model).score(seq)
    got = bf16.score(seq)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert ((got - ref).abs().mean() / ref.abs().mean()).item() < 0.03  # bf16 keeps ~3 significant digits
    assert len(bf16.generate([seq], GREEDY)[0].output_ids) == GREEDY.max_new_tokens
