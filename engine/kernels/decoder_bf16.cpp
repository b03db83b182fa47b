// A rank's decoder layers in one call (bfloat16, packed weights): engine/model.py's
// DecoderLayer.forward, op for op and in the same order (the same bits), without a trip through
// Python and torch's dispatcher for each of its ~20 ops. At batch 1 those trips cost more than the
// layer's attention: ~600 of them a step.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace kvbridge_kernels {

// hidden [N, H] bf16 through the layers whose weights `weights` holds, six per layer in this order:
// input norm [H], qkv packed (n = (heads + 2 kv_heads) D), o packed (n = H), post-attention norm
// [H], gate_up packed (n = 2 intermediate), down packed (n = H). Each layer stores its new tokens'
// K and V in the pool at token row slots[i] + layer * 2 page_size (V: + page_size) of the pool seen
// as [rows, kv_heads D] (engine/kv_pool.py token_rows), then attends as kvbridge::paged_attention
// (tables, rows, ctx_lens as there). first_layer: the pool's index of the first of these layers.
// cos, sin: [N, D] bf16, each row's position looked up.
at::Tensor decoder_bf16(const at::Tensor& hidden, at::TensorList weights, int64_t heads, int64_t kv_heads,
                        int64_t intermediate, double eps, double scale, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& pool, const at::Tensor& tables, const at::Tensor& rows,
                        const at::Tensor& ctx_lens, const at::Tensor& slots, int64_t first_layer) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kBFloat16 && hidden.is_contiguous(),
              "hidden must be a contiguous bfloat16 [N, H] tensor");
  TORCH_CHECK(weights.size() % 6 == 0, "weights must hold six tensors a layer, got ", weights.size());
  TORCH_CHECK(pool.dim() == 6 && pool.is_contiguous() && pool.scalar_type() == at::kBFloat16,
              "pool must be a contiguous bfloat16 6-d tensor");
  TORCH_CHECK(pool.size(4) == kv_heads && kv_heads > 0 && heads % kv_heads == 0, "head counts do not match the pool");
  const int64_t N = hidden.size(0), H = hidden.size(1), D = pool.size(5), layers = weights.size() / 6;
  const int64_t ps = pool.size(3), width = kv_heads * D, pool_rows = pool.numel() / width;
  TORCH_CHECK(0 <= first_layer && first_layer + layers <= pool.size(1), "the layers do not lie in the pool");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.numel() == N && slots.is_contiguous(),
              "slots must be a contiguous int64 [N] tensor");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)  // every layer's K and V rows of token i lie in the pool
    TORCH_CHECK(0 <= slot[i] && slot[i] + (2 * (first_layer + layers) - 1) * ps < pool_rows, "slot row out of range");
  uint16_t* kv_rows = reinterpret_cast<uint16_t*>(pool.data_ptr<at::BFloat16>());

  at::Tensor h = hidden;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = &weights[6 * l];
    const at::Tensor x = rms_norm_bf16(h, w[0], eps);
    const at::Tensor qkv = linear_bf16(x, w[1], (heads + 2 * kv_heads) * D, false);
    const at::Tensor qk = rope_bf16(qkv, cos, sin, heads + kv_heads);  // [N, heads + kv_heads, D]
    const uint16_t* k = reinterpret_cast<const uint16_t*>(qk.data_ptr<at::BFloat16>()) + heads * D;
    const uint16_t* v = reinterpret_cast<const uint16_t*>(qkv.data_ptr<at::BFloat16>()) + (heads + kv_heads) * D;
    const int64_t layer_row = (first_layer + l) * 2 * ps;
    for (int64_t i = 0; i < N; ++i) {
      std::memcpy(kv_rows + (slot[i] + layer_row) * width, k + i * (heads + kv_heads) * D, width * sizeof(uint16_t));
      std::memcpy(kv_rows + (slot[i] + layer_row + ps) * width, v + i * qkv.size(1), width * sizeof(uint16_t));
    }
    const at::Tensor q = qk.narrow(1, 0, heads).contiguous();
    const at::Tensor attn = paged_attention(q, pool, tables, rows, ctx_lens, first_layer + l, scale).view({N, heads * D});
    h = at::add(h, linear_bf16(attn, w[2], H, false));
    const at::Tensor gate_up = linear_bf16(rms_norm_bf16(h, w[3], eps), w[4], 2 * intermediate, false);
    h = at::add(h, linear_bf16(silu_mul_bf16(gate_up), w[5], H, false));
  }
  return h;
}

}  // namespace kvbridge_kernels

TORCH_LIBRARY_FRAGMENT(kvbridge, m) {
  m.def(
      "decoder_bf16(Tensor hidden, Tensor[] weights, int heads, int kv_heads, int intermediate, float eps, "
      "float scale, Tensor cos, Tensor sin, Tensor pool, Tensor tables, Tensor rows, Tensor ctx_lens, Tensor slots, "
      "int first_layer) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvbridge, CPU, m) { m.impl("decoder_bf16", kvbridge_kernels::decoder_bf16); }
