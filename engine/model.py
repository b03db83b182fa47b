"""A Llama-family decoder as pipeline stages over a paged KV pool.

A stage holds the layer range [start, end); the first stage also embeds tokens, the last
also applies the final norm and projects to logits. A full model is the composition of
its stages (stage_ranges() splits the layers). Inference only: plain tensors, no autograd.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvbridge.engine import kernels
from kvbridge.engine.batch import AttentionMetadata
from kvbridge.engine.config import ModelConfig
from kvbridge.engine.kv_pool import KVPool


def stage_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Split layers into contiguous [start, end) ranges, earlier stages taking the remainder."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for i in range(num_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with the config's theta and scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = config.rope_scaling
    if s.kind == "linear":
        inv_freq = inv_freq / s.factor
    elif s.kind == "llama3":
        low_wavelen = s.original_max_position / s.low_freq_factor
        high_wavelen = s.original_max_position / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, packed: bool = False) -> torch.Tensor:
    """packed (bf16 on an AVX2 or AVX-512 CPU): one pass of engine/kernels, rounded where this rounds."""
    if packed:
        return kernels.rms_norm_bf16(x, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim]; cos, sin: [N, 1, head_dim] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Linear:
    """y = x W^T (+ b). torch's matmul; or, for bfloat16 on an AVX2 or AVX-512 CPU (`packed`), the
    weights packed once for engine/kernels/linear_bf16.cpp (bf16 weights, float32 sums over pairs of k
    as AVX512-BF16's vdpbf16ps makes them, with it or with two FMAs, the same bits; the same for a row
    whatever it is batched with)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: bool = False):
        self.out_features = weight.shape[0]
        self.bias = bias
        self.packed = kernels.pack_bf16(weight) if packed else None
        self.weight = None if packed else weight

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads (the packed weights: padded to whole tiles)."""
        w = self.weight if self.packed is None else self.packed
        return w.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def __call__(self, x: torch.Tensor, out_float: bool = False) -> torch.Tensor:
        if self.packed is None:
            y = F.linear(x, self.weight, self.bias)
            return y.float() if out_float else y
        y = kernels.linear_bf16(x, self.packed, self.out_features, out_float)
        return y if self.bias is None else y + self.bias


class DecoderLayer:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, packed: bool = False):
        w = weights
        self.config = config
        self.packed = packed
        self.input_norm = w[f"{prefix}.input_layernorm.weight"]
        self.post_norm = w[f"{prefix}.post_attention_layernorm.weight"]
        # q, k, v fused into one matmul; gate and up fused into another.
        attn = f"{prefix}.self_attn"
        qkv_bias = torch.cat([w[f"{attn}.{n}_proj.bias"] for n in "qkv"]) if config.attention_bias else None
        self.qkv = Linear(torch.cat([w[f"{attn}.{n}_proj.weight"] for n in "qkv"]), qkv_bias, packed)
        self.o = Linear(w[f"{attn}.o_proj.weight"], packed=packed)
        gate_up = torch.cat([w[f"{prefix}.mlp.gate_proj.weight"], w[f"{prefix}.mlp.up_proj.weight"]])
        self.gate_up = Linear(gate_up, packed=packed)
        self.down = Linear(w[f"{prefix}.mlp.down_proj.weight"], packed=packed)

    def forward(self, layer: int, h: torch.Tensor, meta: AttentionMetadata, rope: tuple, kv: KVPool) -> torch.Tensor:
        c = self.config
        n = h.shape[0]
        x = rms_norm(h, self.input_norm, c.rms_norm_eps, self.packed)
        qkv = self.qkv(x)
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        # q and k heads side by side: [N, heads + kv_heads, head_dim], rotated in one go
        if self.packed and c.head_dim % 32 == 0:
            qk = kernels.rope_bf16(qkv, rope[0][:, 0], rope[1][:, 0], heads + kv_heads)
        else:
            qk = apply_rope(qkv[:, : (heads + kv_heads) * c.head_dim].view(n, heads + kv_heads, c.head_dim), *rope)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, (heads + kv_heads) * c.head_dim :].view(n, kv_heads, c.head_dim)
        kv.write_rows(layer, meta.slot_rows(kv), k, v)
        attn = paged_attention(q, layer, meta, kv, c)
        h = h + self.o(attn)
        x = rms_norm(h, self.post_norm, c.rms_norm_eps, self.packed)
        gate_up = self.gate_up(x)
        if self.packed:  # (one pass; torch's bf16 silu goes element by element)
            return h + self.down(kernels.silu_mul_bf16(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


def _kernel_takes(c: ModelConfig) -> bool:
    return kernels.supports(c.num_attention_heads, c.num_key_value_heads, c.head_dim) and kernels.available()


def paged_attention(q: torch.Tensor, layer: int, meta: AttentionMetadata, kv: KVPool, c: ModelConfig) -> torch.Tensor:
    """q: [N, heads, head_dim] -> [N, heads * head_dim], reading K/V through the page tables."""
    scale = 1.0 / math.sqrt(c.head_dim)
    if kv.buffer.device.type == "cpu" and _kernel_takes(c):
        # every row in place, each computed alike however its prompt was chunked or batched
        o = kernels.paged_attention(
            q.contiguous(), kv.buffer, meta.tables, meta.row_table, meta.row_ctx, layer - kv.layer_start, scale
        )
        return o.view(q.shape[0], -1)
    out = torch.empty(q.shape[0], c.num_attention_heads * c.head_dim, dtype=q.dtype, device=q.device)
    kvh, groups, hd = c.num_key_value_heads, c.num_query_groups, c.head_dim
    b = meta.decode_rows
    if b:
        # One query per request: batch them; query heads of a group share one K/V head.
        pages = kv.gather(layer, meta.decode_pages)  # [B, P, 2, page_size, kvh, hd]
        keys = pages[:, :, 0].reshape(b, -1, kvh, hd).transpose(1, 2)  # [B, kvh, T, hd]
        values = pages[:, :, 1].reshape(b, -1, kvh, hd).transpose(1, 2)
        qd = q[:b].view(b, kvh, groups, hd)
        o = F.scaled_dot_product_attention(qd, keys, values, attn_mask=meta.decode_mask, scale=scale)
        out[:b] = o.reshape(b, -1)
    for row, q_len, page_ids, mask in meta.prefill_chunks:
        ctx = q_len if mask is None else mask.shape[1]
        pages = kv.gather(layer, page_ids)  # [P, 2, page_size, kvh, hd]
        keys = pages[:, 0].reshape(-1, kvh, hd)[:ctx].transpose(0, 1)  # [kvh, T, hd]
        values = pages[:, 1].reshape(-1, kvh, hd)[:ctx].transpose(0, 1)
        keys = keys.repeat_interleave(groups, dim=0)  # [heads, T, hd]
        values = values.repeat_interleave(groups, dim=0)
        qp = q[row : row + q_len].transpose(0, 1)  # [heads, q_len, hd]
        if qp.dtype == torch.bfloat16 and qp.device.type == "cpu":  # (torch's bf16 flash kernel: 2x slower here)
            qp, keys, values = qp.float(), keys.float(), values.float()
        # 4-D inputs: torch's fused CPU kernel takes them; 3-D ones fall back to plain math
        o = F.scaled_dot_product_attention(
            qp[None], keys[None], values[None], attn_mask=mask, is_causal=mask is None, scale=scale
        )
        out[row : row + q_len] = o[0].transpose(0, 1).reshape(q_len, -1)
    return out


class ModelStage:
    """Layers [start, end) of the model; embeds if first, norms and projects if last."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        layer_range: tuple[int, int],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        start, end = layer_range
        if not 0 <= start < end <= config.num_hidden_layers:
            raise ValueError(f"bad layer range [{start}, {end}) for {config.num_hidden_layers} layers")
        self.config = config
        self.layer_range = layer_range
        self.is_first = start == 0
        self.is_last = end == config.num_hidden_layers
        self.device = torch.device(device)
        self.dtype = dtype

        def take(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype)

        needed = {k: take(k) for k in weights if _belongs(k, start, end, self.is_first, self.is_last, config)}
        self.packed = packed = (  # (the norm and activation kernels take whole vectors of 16)
            dtype == torch.bfloat16
            and self.device.type == "cpu"
            and config.hidden_size % 16 == 0
            and config.intermediate_size % 16 == 0
            and kernels.bf16_linear()
        )
        self.embed = needed.get("model.embed_tokens.weight") if self.is_first else None
        self.layers = [DecoderLayer(config, needed, f"model.layers.{i}", packed) for i in range(start, end)]
        # all the layers in one kernel call (decoder_bf16.cpp: the packed path of DecoderLayer.forward,
        # op for op), where every op of a layer takes the packed path
        self.fused = packed and config.head_dim % 32 == 0 and not config.attention_bias and _kernel_takes(config)
        self.fused_weights = [
            t
            for x in (self.layers if self.fused else ())
            for t in (x.input_norm, x.qkv.packed, x.o.packed, x.post_norm, x.gate_up.packed, x.down.packed)
        ]
        self.norm = needed["model.norm.weight"] if self.is_last else None
        if self.is_last:
            head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
            self.lm_head = Linear(needed[head] if head in needed else take(head), packed=packed)
        inv_freq = rope_inv_freq(config)
        freqs = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=self.device, dtype=dtype)
        self.sin = emb.sin().to(device=self.device, dtype=dtype)

    def new_kv_pool(self, num_pages: int, page_size: int) -> KVPool:
        c = self.config
        return KVPool(
            num_pages, self.layer_range, page_size, c.num_key_value_heads, c.head_dim, self.dtype, self.device
        )

    @torch.inference_mode()
    def forward(self, meta: AttentionMetadata, inputs: torch.Tensor, kv: KVPool) -> torch.Tensor:
        """inputs: token ids [N] (first stage) or hidden states [N, hidden].

        Returns hidden states [N, hidden], or float32 logits [S, vocab] for the sampled
        rows on the last stage.
        """
        h = F.embedding(inputs, self.embed) if self.is_first else inputs
        cos, sin = self.cos[meta.positions], self.sin[meta.positions]
        if self.fused:  # (packed: the stage and its pool are on the CPU)
            c = self.config
            shape = (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size)
            attention = (meta.tables, meta.row_table, meta.row_ctx)
            first = self.layer_range[0] - kv.layer_start
            h = kernels.decoder_bf16(
                h.contiguous(), self.fused_weights, shape, c.rms_norm_eps, 1.0 / math.sqrt(c.head_dim),
                cos, sin, kv.buffer, attention, meta.slot_rows(kv), first,
            )  # fmt: skip
        else:
            for i, layer in enumerate(self.layers):
                h = layer.forward(self.layer_range[0] + i, h, meta, (cos[:, None, :], sin[:, None, :]), kv)
        if not self.is_last:
            return h
        h = rms_norm(h[meta.sample_rows], self.norm, self.config.rms_norm_eps, self.packed)
        return self.lm_head(h, out_float=True)


def _belongs(name: str, start: int, end: int, first: bool, last: bool, config: ModelConfig) -> bool:
    if name.startswith("model.layers."):
        return start <= int(name.split(".")[2]) < end
    if name == "model.embed_tokens.weight":
        return first or (last and config.tie_word_embeddings)
    return last  # model.norm.weight, lm_head.weight
