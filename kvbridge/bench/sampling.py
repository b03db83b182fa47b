"""What the sampling controls cost: decode tokens/s and batch TTFT of each, beside plain greedy, same run.

A batch of --batch requests, each a 64-token prompt (seeded random ids) and --steps decode steps
after its first token (ignore_eos where allowed), runs through the one-process engine (engine/llm.py)
once per variant (VARIANTS): plain greedy and seeded sampling, then one sampling control each.
Per variant: decode tokens/s (the tokens after each request's first, summed over the batch, over the
time from the batch's last first token to its last token), the batch's time to first token (its
slowest request's), and both as a ratio to plain-greedy measured in the same run. The variants run
round-robin, --repeats times (medians), after one warm-up run of each (so a structured variant's
grammar is compiled, and cached, before it is timed: the steady state).

The prefix cache is off (every run prefills its prompts whole: prompt_logprobs' cost shows in TTFT)
and the prompts prefill in one step (no chunking). Structured output cannot ignore EOS: those
requests ask for min_tokens = max_new_tokens (EOS held back until the grammar allows nothing else);
json_schema's string field is long enough that the object cannot close within --steps tokens, and
each row reports the tokens actually generated (output_tokens) and the time per decode step.
One JSON object per line on stdout, a summary line last; progress on stderr.

    python -m kvbridge.bench.sampling [--model M] [--batch 16] [--steps 32] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

import torch

from kvbridge.common.progress import Progress
from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.llm import LLM, Completion
from kvbridge.engine.weights import load_model

PROMPT_TOKENS = 64
BASELINE = "plain-greedy"
NUM_BIASED, NUM_ALLOWED = 64, 1000  # logit_bias entries and allowed_token_ids (capped by the vocabulary)
BAD_WORDS = ("the", "and", "that", "with", "this", "from", "have", "they")
TOP_LOGPROBS, TOP_PROMPT_LOGPROBS = 20, 5
VARIANTS = (
    BASELINE,
    "plain-seeded",
    "penalties",
    "min_p",
    "logit_bias+allowed",
    "bad_words",
    "logprobs-20",
    "prompt_logprobs-5",
    "json_schema",
    "json_object",
)


def json_schema(steps: int) -> str:
    """A small object schema whose output cannot end within `steps` tokens: its first string field
    needs more characters than that many tokens hold (BPE tokens of the default model are short)."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 16 * (steps + 1)},
            "age": {"type": "integer"},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    return json.dumps(schema)


def text_vocab(llm: LLM) -> int:
    """Ids that are both the tokenizer's and the logits' (a model may pad its logits past its tokenizer)."""
    return min(llm.tokenizer.vocab_size, llm.model.config.vocab_size)


def variant_params(llm: LLM, steps: int) -> dict[str, list[SamplingParams]]:
    """Each variant's parameters, one per request slot (seeded variants: one seed per slot)."""
    vocab = text_vocab(llm)
    base = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)
    g = torch.Generator().manual_seed(1234)
    allowed = sorted(torch.randperm(vocab, generator=g)[: min(NUM_ALLOWED, vocab // 2)].tolist())
    biased = allowed[: min(NUM_BIASED, len(allowed) // 4)]
    bias = tuple((t, 5.0 if i % 2 else -5.0) for i, t in enumerate(biased))
    bad = replace(base, bad_words=BAD_WORDS).with_bad_words_ids(
        lambda t: llm.tokenizer.encode(t, add_special_tokens=False)
    )
    structured = replace(base, ignore_eos=False, min_tokens=steps + 1)
    one = {
        BASELINE: base,
        "penalties": replace(base, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5),
        "logit_bias+allowed": replace(base, allowed_token_ids=tuple(allowed), logit_bias=bias),
        "bad_words": bad,
        "logprobs-20": replace(base, logprobs=TOP_LOGPROBS),
        "prompt_logprobs-5": replace(base, prompt_logprobs=TOP_PROMPT_LOGPROBS),
        "json_schema": replace(structured, json_schema=json_schema(steps)),
        "json_object": replace(structured, json_object=True),
    }
    seeded = {
        "plain-seeded": replace(base, temperature=1.0),
        "min_p": replace(base, temperature=1.0, min_p=0.1),
    }
    return {v: [replace(seeded[v], seed=i) for i in range(64)] if v in seeded else [one[v]] * 64 for v in VARIANTS}


def make_prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    low = min(100, vocab // 4)  # past the special ids at the start of most vocabularies
    return torch.randint(low, vocab, (batch, PROMPT_TOKENS), generator=g).tolist()


def run_batch(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """One batch to completion: its timings (seconds) and token counts."""
    done: list[Completion] = llm.generate(prompts, [params[i % len(params)] for i in range(len(prompts))])
    first = max(c.ttft_s for c in done)  # the batch has all its first tokens
    last = max(c.e2e_s for c in done)
    decode_tokens = sum(len(c.output_ids) - 1 for c in done)
    steps = max(len(c.output_ids) - 1 for c in done)
    decode_s = last - first
    return {
        "ttft_s": first,
        "decode_s": decode_s,
        "output_tokens": sum(len(c.output_ids) for c in done),
        "decode_tokens": decode_tokens,
        "decode_steps": steps,
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
        "step_s": decode_s / steps if steps else 0.0,
    }


def rows_of(results: dict[str, list[dict]], header: dict) -> list[dict]:
    """One row per variant (medians over its runs), ratios to the baseline's medians."""
    med = {v: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for v, runs in results.items()}
    base = med[BASELINE]
    rows = []
    for v, m in med.items():
        rows.append(
            {
                **header,
                "variant": v,
                "output_tokens": int(m["output_tokens"]),
                "decode_tokens": int(m["decode_tokens"]),
                "decode_tok_s": round(m["decode_tok_s"], 1),
                "decode_step_ms": round(1e3 * m["step_s"], 2),
                "ttft_ms": round(1e3 * m["ttft_s"], 1),
                "ratio": round(m["decode_tok_s"] / base["decode_tok_s"], 3) if base["decode_tok_s"] else None,
                "ttft_ratio": round(m["ttft_s"] / base["ttft_s"], 3) if base["ttft_s"] else None,
            }
        )
    return rows


def summary_of(rows: list[dict], header: dict) -> dict:
    ratios = {r["variant"]: r["ratio"] for r in rows}
    controls = {v: x for v, x in ratios.items() if v != BASELINE and x is not None}
    return {
        **header,
        "summary": True,
        "baseline": BASELINE,
        "baseline_decode_tok_s": next(r["decode_tok_s"] for r in rows if r["variant"] == BASELINE),
        "baseline_ttft_ms": next(r["ttft_ms"] for r in rows if r["variant"] == BASELINE),
        "ratio": ratios,
        "ttft_ratio": {r["variant"]: r["ttft_ratio"] for r in rows},
        "slowest_decode": min(controls, key=controls.get) if controls else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge bench sampling", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=16, help="requests per run (at most 64)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps after each request's first token")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each variant (medians)")
    ap.add_argument("--json", action="store_true", help="JSON lines (the only output format; kept for symmetry)")
    args = ap.parse_args(argv)
    for name, lo, hi in (("batch", 1, 64), ("steps", 1, 1 << 20), ("repeats", 1, 1 << 20)):
        value = getattr(args, name)
        if not lo <= value <= hi:
            print(f"kvbridge bench sampling: error: --{name} must be in [{lo}, {hi}], got {value}", file=sys.stderr)
            return 2

    model = load_model(args.model)
    config = EngineConfig(model=args.model, chunked_prefill_size=0, disable_prefix_cache=True)
    llm = LLM(config, model=model, progress=False)
    params = variant_params(llm, args.steps)
    prompts = make_prompts(args.batch, text_vocab(llm))
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with Progress("bench sampling", (args.repeats + 1) * len(VARIANTS)) as bar:
        for v in VARIANTS:  # warm-up: kernels, and each grammar compiled (and cached) once
            run_batch(llm, prompts, params[v])
            bar.advance()
        for _ in range(args.repeats):  # round-robin, so drift on a shared machine hits every variant alike
            for v in VARIANTS:
                results[v].append(run_batch(llm, prompts, params[v]))
                bar.advance()
    header = {
        "bench": "sampling",
        "model": args.model,
        "device": str(llm.device),
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "prompt_tokens": PROMPT_TOKENS,
        "steps": args.steps,
        "repeats": args.repeats,
    }
    rows = rows_of(results, header)
    for row in rows:
        print(json.dumps(row))
    print(json.dumps(summary_of(rows, header)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
