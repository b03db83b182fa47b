"""Weight sources: GGUF in every supported type (against transformers' own GGUF loader),
the dequantized cache (read instead of the GGUF; a damaged one rebuilt with a warning, never
served; written atomically), and the fingerprint."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

import kvbridge.engine.weights
from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.llm import LLM
from kvbridge.engine.weights import _unpermute, load_model
from tests.conftest import make_prompts

transformers = pytest.importorskip("transformers")

GGUF_TYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"]


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert script: rotate-half rows -> interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, hf_model, qtype: str) -> None:
    """Write an HF Llama as llama.cpp would: GGUF names, permuted Q/K, quantized 2-D weights."""
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(c.vocab_size)
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    q = getattr(gguf.GGMLQuantizationType, qtype)
    for name, t in hf_model.state_dict().items():
        arr = t.float().numpy()
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            kind = names[".".join(rest[:-1])]
            gname = f"blk.{i}.{kind}.weight"
            if kind == "attn_q":
                arr = _permute(arr, c.num_attention_heads)
            elif kind == "attn_k":
                arr = _permute(arr, c.num_key_value_heads)
        else:
            gname = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        if arr.ndim == 1 or qtype == "F32":
            w.add_tensor(gname, arr.astype(np.float32))
        elif qtype == "F16":
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def hf_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.15,
    )
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_gguf_types_equal_transformers_gguf_loader(tmp_path, monkeypatch, hf_llama, qtype):
    monkeypatch.setenv("KVBRIDGE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / f"m-{qtype}.gguf"
    write_gguf(path, hf_llama, qtype)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    model = load_model(str(path), progress=False)
    ref_state = ref.state_dict()
    for name in (
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "lm_head.weight",
    ):
        torch.testing.assert_close(model.weights[name], ref_state[name], atol=0, rtol=0)
    if qtype == "F32":  # lossless: the permutation was undone exactly
        torch.testing.assert_close(
            model.weights["model.layers.0.self_attn.q_proj.weight"],
            hf_llama.state_dict()["model.layers.0.self_attn.q_proj.weight"],
            atol=0,
            rtol=0,
        )
    llm = LLM(EngineConfig(dtype="float32", page_size=4), model=model, progress=False)
    for prompt in make_prompts(3, 256, seed=2):
        [c] = llm.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert c.output_ids == out[0, len(prompt) :].tolist()


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(24, 5)
    assert np.array_equal(_unpermute(_permute(w, 3), 3), w)
    assert not np.array_equal(_permute(w, 3), w)


def test_second_load_reads_the_cache_not_the_gguf(tmp_path, monkeypatch, hf_llama):
    monkeypatch.setenv("KVBRIDGE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_gguf(path, hf_llama, "Q8_0")
    first = load_model(str(path), progress=False)
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 1

    def no_dequantize(*_):
        raise AssertionError("dequantized again instead of reading the cache")

    monkeypatch.setattr(gguf.quants, "dequantize", no_dequantize)
    monkeypatch.setattr(gguf, "GGUFReader", no_dequantize)
    second = load_model(str(path), progress=False)
    assert second.fingerprint == first.fingerprint and second.config == first.config
    for name, w in first.weights.items():
        assert torch.equal(second.weights[name], w), name


def test_fingerprint_tells_models_apart(tmp_path, monkeypatch, hf_llama):
    monkeypatch.setenv("KVBRIDGE_CACHE", str(tmp_path / "cache"))
    write_gguf(tmp_path / "a.gguf", hf_llama, "F16")
    write_gguf(tmp_path / "b.gguf", hf_llama, "Q8_0")
    a, b = load_model(str(tmp_path / "a.gguf"), progress=False), load_model(str(tmp_path / "b.gguf"), progress=False)
    assert len(a.fingerprint) == 32 and a.fingerprint != b.fingerprint


def test_bad_model_spec_names_the_value(tmp_path):
    with pytest.raises(ValueError, match=r"'/no/such/model\.gguf' is not a preset"):
        load_model("/no/such/model.gguf")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_model(str(tmp_path))


# ---------------------------------------------------------------- the cache's checks


def cached_files(cache) -> tuple:
    [weights] = cache.glob("*.safetensors")
    return weights, weights.with_suffix(".json")


def greedy(model, prompts) -> list[list[int]]:
    llm = LLM(EngineConfig(dtype="float32", page_size=4), model=model, progress=False)
    return [c.output_ids for c in llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))]


@pytest.fixture
def built(tmp_path, monkeypatch, hf_llama):
    """A Q8_0 GGUF of hf_llama, loaded once into a fresh KVBRIDGE_CACHE: (gguf path, cache dir, model)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVBRIDGE_CACHE", str(cache))
    path = tmp_path / "m.gguf"
    write_gguf(path, hf_llama, "Q8_0")
    return path, cache, load_model(str(path), progress=False)


def load_logged(path, caplog) -> tuple:
    """load_model(path), and the warnings it logged."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvbridge.weights"):
        model = load_model(str(path), progress=False)
    return model, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def assert_same_model(a, b) -> None:
    assert (a.fingerprint, a.config) == (b.fingerprint, b.config) and a.weights.keys() == b.weights.keys()
    for name, w in a.weights.items():
        assert torch.equal(b.weights[name], w), name


def test_a_flipped_byte_in_the_cache_is_rebuilt_with_a_warning_and_answers_as_fresh(built, caplog):
    """One flipped byte used to be served: the node started, reported the GGUF's fingerprint and
    answered garbage. Now the digest recorded at write time catches it."""
    path, cache, fresh = built
    weights, _ = cached_files(cache)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x40  # (inside a tensor: the header is at the start)
    weights.write_bytes(bytes(data))
    model, warnings = load_logged(path, caplog)
    assert len(warnings) == 1 and f"weight cache {weights} does not match the digest recorded" in warnings[0]
    assert warnings[0].endswith(f": rebuilding it from {path}")
    assert_same_model(fresh, model)
    prompts = make_prompts(2, 256, seed=3)
    assert greedy(model, prompts) == greedy(fresh, prompts)
    again, warnings = load_logged(path, caplog)  # the rebuilt file passes
    assert warnings == [] and weights.read_bytes() != bytes(data)
    assert_same_model(fresh, again)


def test_a_truncated_cache_is_rebuilt_not_a_traceback(built, caplog):
    path, cache, fresh = built
    weights, _ = cached_files(cache)
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 3)
    model, warnings = load_logged(path, caplog)
    assert warnings == [f"weight cache {weights} is {size // 3} bytes; {size} were written: rebuilding it from {path}"]
    assert_same_model(fresh, model)
    assert weights.stat().st_size == size


@pytest.mark.parametrize("damage", ["tokenizer-or-config", "not-json", "older-kvbridge", "gone", "weights-gone"])
def test_a_bad_or_missing_sidecar_is_rebuilt(built, caplog, damage):
    path, cache, fresh = built
    weights, sidecar = cached_files(cache)
    info = json.loads(sidecar.read_text())
    if damage == "tokenizer-or-config":
        info["config"] = info["config"].replace('"hidden_size": 64', '"hidden_size": 65')
        sidecar.write_text(json.dumps(info))
        says = "has a sidecar whose config or tokenizer is not what was written"
    elif damage == "not-json":
        sidecar.write_text(sidecar.read_text()[:-10])
        says = "has an unreadable sidecar (JSONDecodeError: "
    elif damage == "older-kvbridge":  # (what the code before this check wrote: config and tokenizer alone)
        sidecar.write_text(json.dumps({"config": info["config"], "tokenizer": info["tokenizer"]}))
        says = "has no digest in its sidecar (an older kvbridge wrote it)"
    elif damage == "gone":
        sidecar.unlink()
        says = "has no sidecar"
    else:
        weights.unlink()
        says = "is missing (its sidecar is there)"
    model, warnings = load_logged(path, caplog)
    assert len(warnings) == 1 and warnings[0].startswith(f"weight cache {weights} {says}"), warnings
    assert_same_model(fresh, model)
    assert load_logged(path, caplog)[1] == []


def test_a_checked_file_is_hashed_again_only_after_a_write(built, caplog, monkeypatch):
    """The stamp beside a checked file spares the ranks of a node (and later starts) hashing it again
    while its inode, size, mtime and ctime are unchanged; any write changes its ctime."""
    path, cache, fresh = built
    weights, _ = cached_files(cache)
    hashed = []
    real = kvbridge.engine.weights._sha256
    monkeypatch.setattr(kvbridge.engine.weights, "_sha256", lambda fh, *a: hashed.append(1) or real(fh, *a))
    load_logged(path, caplog)
    assert hashed == [1] and weights.with_suffix(".verified").exists()  # (the first load after the build)
    load_logged(path, caplog)
    assert hashed == [1]
    weights.write_bytes(weights.read_bytes())  # the same bytes, written again: checked again
    model, warnings = load_logged(path, caplog)
    assert hashed == [1, 1] and warnings == []
    assert_same_model(fresh, model)


def test_a_build_that_dies_mid_write_leaves_nothing_that_looks_valid(tmp_path, monkeypatch, hf_llama, caplog):
    monkeypatch.setenv("KVBRIDGE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_gguf(path, hf_llama, "Q8_0")

    def dies(weights, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(kvbridge.engine.weights, "save_file", dies)
    with pytest.raises(OSError, match="disk full"):
        load_model(str(path), progress=False)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("KVBRIDGE_CACHE", str(tmp_path / "cache"))
    _, warnings = load_logged(path, caplog)
    assert warnings == [] and len(list((tmp_path / "cache").glob("*.safetensors"))) == 1


def test_two_processes_building_at_once_leave_one_good_cache(tmp_path, monkeypatch, hf_llama, caplog):
    """Each build writes its own temporary file and renames it into place."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVBRIDGE_CACHE", str(cache))
    path = tmp_path / "m.gguf"
    write_gguf(path, hf_llama, "Q8_0")
    script = (
        f"from kvbridge.engine.weights import load_model; print(load_model({str(path)!r}, progress=False).fingerprint)"
    )
    env = {**os.environ, "KVBRIDGE_CACHE": str(cache)}
    children = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE) for _ in range(2)]
    prints = {child.communicate(timeout=600)[0].strip() for child in children}
    assert [child.returncode for child in children] == [0, 0]
    model, warnings = load_logged(path, caplog)
    assert warnings == [] and prints == {model.fingerprint.encode()}
    assert sorted(p.suffix for p in cache.iterdir()) == [".json", ".safetensors", ".verified"]
