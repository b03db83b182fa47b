// The kernels' entry points, for the ops that compose them (decoder_bf16.cpp). Each is also a
// torch op (kvbridge::<name>); the comments at their definitions say what they compute.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace kvbridge_kernels {

at::Tensor pack_bf16(const at::Tensor& w);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool out_float);
at::Tensor silu_mul_bf16(const at::Tensor& gate_up);
at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rope_bf16(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t rotated_heads);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& tables,
                           const at::Tensor& rows, const at::Tensor& ctx_lens, int64_t layer, double scale);

}  // namespace kvbridge_kernels
