"""Weight sources: GGUF in every supported type (against transformers' own GGUF loader),
the dequantized cache (read instead of the GGUF; a damaged one rebuilt with a warning, never
served; written atomically; one that cannot be written costs a warning, never a load), and the
fingerprint."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors import SafetensorError

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
        raise OSError(errno.ENOSPC, "disk full")

    monkeypatch.setattr(kvbridge.engine.weights, "save_file", dies)
    model, warnings = load_logged(path, caplog)  # (served from memory: the cache could not be written)
    assert len(warnings) == 1 and "cannot be written (OSError: [Errno 28] disk full)" in warnings[0]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("KVBRIDGE_CACHE", str(tmp_path / "cache"))
    again, warnings = load_logged(path, caplog)
    assert warnings == [] and len(list((tmp_path / "cache").glob("*.safetensors"))) == 1
    assert_same_model(model, again)


# ---------------------------------------------------------------- a cache that cannot be written


def unwritable(cache, kind: str, monkeypatch) -> str:
    """Make `cache` (KVBRIDGE_CACHE) unwritable as `kind` says; returns the error the warning names."""
    if kind == "a file where the directory should be":
        cache.write_text("not a directory")  # (root ignores file modes: this stops root too)
        return f"FileExistsError: [Errno 17] File exists: '{cache}'"
    if kind == "disk full writing the weights":  # as safetensors reports it

        def full(weights, filename, metadata=None):
            with open(filename, "wb") as f:
                f.write(b"half a file")
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr(kvbridge.engine.weights, "save_file", full)
        return "SafetensorError: Error while serializing: I/O error: No space left on device (os error 28)"
    write = kvbridge.engine.weights._write_atomically

    def full_for_the_sidecar(path, data):
        if path.suffix == ".json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        write(path, data)

    monkeypatch.setattr(kvbridge.engine.weights, "_write_atomically", full_for_the_sidecar)
    return f"OSError: [Errno 28] No space left on device: '{cache}/"


@pytest.mark.parametrize(
    "kind", ["a file where the directory should be", "disk full writing the weights", "disk full writing the sidecar"]
)
def test_a_cache_that_cannot_be_written_costs_one_warning_and_the_model_is_served_from_memory(
    tmp_path, monkeypatch, hf_llama, caplog, kind
):
    path = tmp_path / "m.gguf"
    write_gguf(path, hf_llama, "Q8_0")
    monkeypatch.setenv("KVBRIDGE_CACHE", str(tmp_path / "elsewhere"))
    uncached = load_model(str(path), progress=False)  # (a first load: its cache is written elsewhere)
    [name] = [p.name for p in (tmp_path / "elsewhere").glob("*.safetensors")]
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVBRIDGE_CACHE", str(cache))
    error = unwritable(cache, kind, monkeypatch)
    model, warnings = load_logged(path, caplog)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"weight cache {cache / name} cannot be written ({error}")
    assert warnings[0].endswith(f"): serving {path} from memory")
    assert_same_model(uncached, model)
    prompts = make_prompts(2, 256, seed=5)
    assert greedy(model, prompts) == greedy(uncached, prompts)
    assert not (cache / name).with_suffix(".json").exists()  # (nothing that a later load would take)


@pytest.mark.parametrize("damage", ["truncated", "a file where the cache directory should be"])
def test_a_fingerprint_memo_that_cannot_be_read_or_written_costs_no_load(
    tmp_path, monkeypatch, hf_llama, caplog, damage
):
    """A Hugging Face directory's fingerprint is remembered in the cache (fingerprints.json): one
    cut short (it was not written atomically) was a JSONDecodeError at every load."""
    hf, cache = tmp_path / "hf", tmp_path / "cache"
    hf_llama.save_pretrained(hf)
    monkeypatch.setenv("KVBRIDGE_CACHE", str(cache))
    first, warnings = load_logged(hf, caplog)
    memo = cache / "fingerprints.json"
    assert warnings == [] and list(json.loads(memo.read_text()).values()) == [first.fingerprint]
    if damage == "truncated":
        memo.write_text(memo.read_text()[:-7])
    else:
        shutil.rmtree(cache)
        cache.write_text("not a directory")
    model, warnings = load_logged(hf, caplog)
    assert_same_model(first, model)
    if damage == "truncated":  # computed again, and written whole
        assert warnings == [] and list(json.loads(memo.read_text()).values()) == [first.fingerprint]
    else:
        assert warnings == [
            f"fingerprint memo {memo} cannot be written (FileExistsError: [Errno 17] File exists: '{cache}'): "
            f"{hf} is hashed again at every load"
        ]


def weights_digest(model) -> str:
    """The SHA-256 of a model's tensors (names and bytes), as READ_ONLY_LOADS computes it."""
    h = hashlib.sha256()
    for name, w in sorted(model.weights.items()):
        h.update(name.encode() + w.contiguous().numpy().tobytes())
    return h.hexdigest()


READ_ONLY_LOADS = """
import hashlib, json, logging, sys
from kvbridge.engine.weights import load_model
said = []
handler = logging.Handler()
handler.emit = lambda record: said.append(record.getMessage())
logging.getLogger("kvbridge.weights").addHandler(handler)
out = []
for spec in sys.argv[1:]:
    model = load_model(spec, progress=False)
    h = hashlib.sha256()
    for name, w in sorted(model.weights.items()):
        h.update(name.encode() + w.contiguous().numpy().tobytes())
    out.append([model.fingerprint, h.hexdigest(), said[:]])
    said.clear()
print(json.dumps(out))
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_a_read_only_cache_serves_what_it_holds_and_a_model_it_lacks_from_memory(built, tmp_path, hf_llama):
    """KVBRIDGE_CACHE mounted read-only in a mount namespace of the loads' own (root ignores file
    modes): the model it holds is served from it, checked but not stamped; one it lacks is served
    from memory. One warning each."""
    path, cache, fresh = built  # (the cache holds it, never stamped: the next load hashes it)
    lacking = tmp_path / "q4.gguf"
    write_gguf(lacking, hf_llama, "Q4_0")
    mount = 'mount --bind -o ro "$0" "$0" && exec "$1" -c "$2" "$3" "$4"'
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, str(cache), sys.executable,
            READ_ONLY_LOADS, str(path), str(lacking)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode and "Operation not permitted" in done.stderr and "Traceback" not in done.stderr:
        pytest.skip("no mount namespace here: " + done.stderr.strip())
    assert done.returncode == 0, done.stderr
    [(held, held_digest, held_said), (lack, lack_digest, lack_said)] = json.loads(done.stdout)
    [weights] = cache.glob("*.safetensors")
    stamp = weights.with_suffix(".verified")
    assert (held, held_digest) == (fresh.fingerprint, weights_digest(fresh))
    assert len(held_said) == 1, held_said
    assert held_said[0].startswith(f"weight cache {stamp} cannot be written (OSError: [Errno 30] Read-only file system")
    assert held_said[0].endswith(f"): {weights} is hashed again at every load")
    assert not stamp.exists()
    uncached = load_model(str(lacking), progress=False)  # (outside the namespace: its cache is written)
    [lacking_cached] = set(cache.glob("*.safetensors")) - {weights}
    assert (lack, lack_digest) == (uncached.fingerprint, weights_digest(uncached))
    assert len(lack_said) == 1, lack_said
    assert lack_said[0].startswith(f"weight cache {lacking_cached} cannot be written (SafetensorError: ")
    assert "Read-only file system (os error 30)" in lack_said[0]  # (safetensors' own words for EROFS)
    assert lack_said[0].endswith(f"): serving {lacking} from memory")


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
