"""Engine throughput beside Hugging Face transformers, same weights, same run.

Prefill tokens/s at batch 1 (256 and 2,048 tokens) and 16 (128 each), decode tokens/s at
batch 1, 16 and 32, on the default model, in the engine's dtype (--dtype, default auto) with
transformers in the same dtype. The prefix cache is off: a repeat computes its prompt again (a
cache hit would measure the cache, not the prefill). Each decode is also a fraction of the
weight-streaming limit: a decode step reads every weight once, so at best it takes
weight_bytes / memcpy traffic (2 x bytes copied per second, measured after each repeat: a repeat's
decode is a fraction of its own repeat's limit, and the row gives the median).
One JSON object per line on stdout, each naming the kernels' ISA level (engine/kernels isa(),
KVBRIDGE_ISA=avx2 forces the AVX2 one) and which kernels the engine runs; progress on stderr.
--phases and --decode-batches pick fewer cases (a short run).

    python -m kvbridge.bench.engine [--model M] [--dtype D] [--repeats 3] [--phases prefill,decode]
        [--decode-batches 1,16,32] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kvbridge.common.progress import Progress
from kvbridge.common.sampling import SamplingParams
from kvbridge.engine import kernels
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.llm import LLM
from kvbridge.engine.weights import load_model, smollm2_path

PREFILL = [(1, 256), (1, 2048), (16, 128)]  # (batch, prompt tokens per request)
DECODE_BATCHES, DECODE_PROMPT, DECODE_STEPS = (1, 16, 32), 64, 32


def bandwidth_gbps(nbytes: int = 1 << 28, repeats: int = 5) -> tuple[float, float]:
    """(memcpy: bytes copied per second, read: bytes summed per second), best of `repeats`.

    A copy reads and writes every byte, so its memory traffic is twice the bytes copied;
    a decode step only reads its weights."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    copy = read = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        t1 = time.perf_counter()
        src.sum()
        t2 = time.perf_counter()
        copy, read = min(copy, t1 - t0), min(read, t2 - t1)
    return nbytes / copy / 1e9, nbytes / read / 1e9


def weight_bytes_per_step(llm: LLM) -> int:
    """Bytes a decode step reads: every layer's weights, the final norm and the LM head."""
    stage = llm.stages[0]
    total = stage.norm.nbytes + stage.lm_head.nbytes
    for layer in stage.layers:
        total += sum(
            t.nbytes for t in (layer.qkv, layer.o, layer.gate_up, layer.down, layer.input_norm, layer.post_norm)
        )
    return total


def kernels_in_use(llm: LLM) -> dict:
    """The ISA level the kernels are built for and which of them this engine runs."""
    stage = llm.stages[0]
    c = stage.config
    heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    return {
        "isa": kernels.isa(),
        "bf16_dot_instruction": kernels.bf16_dot_instruction(),  # vdpbf16ps (else two FMAs: the same bits)
        "attention_kernel": stage.device.type == "cpu" and kernels.supports(*heads) and kernels.available(),
        "bf16_kernels": stage.packed,  # the packed matmuls, norms, silu and rope
        "fused_decoder": stage.fused,  # a stage's layers in one call
    }


def batches(text: str) -> list[int]:
    return [int(b) for b in text.split(",")]


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (batch, length), generator=g).tolist()


def ours_prefill(llm: LLM, batch: list[list[int]]) -> float:
    reqs = [llm.add_request(p, SamplingParams(max_new_tokens=1)) for p in batch]
    t0 = time.perf_counter()
    while llm.scheduler.num_unfinished:
        llm.step()
    assert all(r.finish_reason == "length" for r in reqs)
    return sum(map(len, batch)) / (time.perf_counter() - t0)


def ours_decode(llm: LLM, batch: list[list[int]]) -> float:
    params = SamplingParams(max_new_tokens=DECODE_STEPS + 1, ignore_eos=True)
    for p in batch:
        llm.add_request(p, params)
    while any(not r.output_ids for r in llm.requests.values()):  # prefill and first token
        llm.step()
    t0, steps = time.perf_counter(), 0
    while llm.scheduler.num_unfinished:
        llm.step()
        steps += 1
    assert steps == DECODE_STEPS
    return len(batch) * DECODE_STEPS / (time.perf_counter() - t0)


@torch.inference_mode()
def hf_prefill(hf, batch: list[list[int]]) -> float:
    ids = torch.tensor(batch)
    t0 = time.perf_counter()
    hf(ids, use_cache=False, logits_to_keep=1)
    return ids.numel() / (time.perf_counter() - t0)


@torch.inference_mode()
def hf_decode(hf, batch: list[list[int]]) -> float:
    out = hf(torch.tensor(batch), use_cache=True, logits_to_keep=1)
    cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for _ in range(DECODE_STEPS):
        out = hf(tok, past_key_values=cache, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return len(batch) * DECODE_STEPS / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge bench engine", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--phases", default="prefill,decode", help="comma-separated: prefill, decode or both")
    ap.add_argument("--decode-batches", type=batches, default=list(DECODE_BATCHES), help="comma-separated batch sizes")
    ap.add_argument("--json", action="store_true", help="JSON lines (the only output format; kept for symmetry)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        print(f"bench engine: error: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    phases = set(args.phases.split(","))
    if not phases or phases - {"prefill", "decode"} or min(args.decode_batches) < 1:
        print("bench engine: error: --phases takes prefill and decode, --decode-batches sizes >= 1", file=sys.stderr)
        return 2

    from transformers import AutoModelForCausalLM

    model = load_model(args.model)
    config = EngineConfig(model=args.model, dtype=args.dtype, chunked_prefill_size=0, disable_prefix_cache=True)
    llm = LLM(config, model=model, progress=False)
    gguf = smollm2_path() if args.model == "smollm2-135m-instruct" else None
    if gguf is None:
        print("bench engine: the transformers baseline needs the default model's GGUF", file=sys.stderr)
        return 2
    print("loading the transformers baseline ...", file=sys.stderr)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    hf = hf.to(llm.dtype).eval()

    vocab = model.config.vocab_size
    cases = [("prefill", b, prompts(b, n, vocab, seed=b + n)) for b, n in PREFILL if "prefill" in phases]
    if "decode" in phases:
        cases += [("decode", b, prompts(b, DECODE_PROMPT, vocab, seed=100 + b)) for b in args.decode_batches]
    runners = {"prefill": (ours_prefill, hf_prefill), "decode": (ours_decode, hf_decode)}
    ours_prefill(llm, prompts(1, 32, vocab, 0))  # warm-up both
    hf_prefill(hf, prompts(1, 32, vocab, 0))
    results, bandwidth = {}, []
    with Progress("bench engine", args.repeats * len(cases)) as bar:
        for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both sides
            for phase, b, batch in cases:
                ours_fn, hf_fn = runners[phase]
                r = results.setdefault((phase, b, len(batch[0])), ([], []))
                r[0].append(ours_fn(llm, batch))
                r[1].append(hf_fn(hf, batch))
                bar.advance()
            bandwidth.append(bandwidth_gbps())  # each repeat's limit beside it (this host's drifts by 20%+)
    copies = [c for c, _ in bandwidth]
    copy_gbps, read_gbps = statistics.median(copies), statistics.median(r for _, r in bandwidth)
    wbytes = weight_bytes_per_step(llm)
    # the limit: weights streamed at the memory traffic a memcpy sustains (read + write)
    limits = [2 * c * 1e9 / wbytes for c in copies]
    limit_steps = statistics.median(limits)
    in_use = kernels_in_use(llm)
    header = {
        "bench": "engine",
        "model": args.model,
        "dtype": str(llm.dtype).removeprefix("torch."),
        "prefix_cache": False,
        **in_use,
        "threads": torch.get_num_threads(),
        "memcpy_gbps": round(copy_gbps, 2),
        "memcpy_gbps_per_repeat": [round(c, 2) for c in copies],
        "memcpy_traffic_gbps": round(2 * copy_gbps, 2),
        "read_gbps": round(read_gbps, 2),
        "weight_bytes_per_step": wbytes,
        "weight_streaming_limit_steps_per_s": round(limit_steps, 2),
    }
    print(json.dumps(header))
    for (phase, b, n), (ours, theirs) in results.items():
        o, t = statistics.median(ours), statistics.median(theirs)
        row = {
            "bench": "engine",
            "phase": phase,
            "batch": b,
            "prompt_tokens": n,
            "ours_tok_s": round(o, 1),
            "hf_tok_s": round(t, 1),
            "ratio": round(o / t, 3),
            "dtype": header["dtype"],
            **in_use,
        }
        if phase == "decode":
            row["limit_tok_s"] = round(limit_steps * b, 1)
            # each repeat against the limit measured after it, then the median
            fractions = [x / (lim * b) for x, lim in zip(ours, limits)]
            row["fraction_of_limit"] = round(statistics.median(fractions), 3)
            row["fraction_per_repeat"] = [round(f, 3) for f in fractions]
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
