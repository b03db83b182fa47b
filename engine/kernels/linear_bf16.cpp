// bfloat16 linear layers on x86 CPUs (AVX2 or AVX-512: vec.h): y = x W^T with the weights packed once.
//
// torch's bf16 matmul on a CPU without AMX tiles is slower than its fp32 one (a Xeon with
// AVX512-BF16, 256x576 by 576x3072: 6.0 ms against 3.7 ms): vdpbf16ps issues at half the rate of
// fp32 FMAs there. So weights stay bf16 in memory (half the bytes to stream: what decode waits
// for) and are widened to fp32 in registers for fp32 FMAs (what prefill waits for). Packed as
// [N/32][K][32] with the two halves of a 32-bit lane holding outputs j and j + 16, widening is one
// shift (outputs 0-15) and one mask (16-31). A tile of up to 12 rows (2 on AVX2) x 32 outputs
// accumulates in registers over k in order.
//
// Every output is the same sequence of operations whatever M is and wherever its row sits in
// the batch (k in order, float32 sums, one rounding at the end): a request's numbers do not
// depend on what it is batched with.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <utility>

#include "kernels.h"
#include "vec.h"

namespace {

constexpr int64_t kBlock = 16, kTile = 32;

}  // namespace

#if defined(KVBRIDGE_VEC)
namespace {

using namespace kvbridge_vec;

constexpr int64_t kAhead = 16;  // decode tiles: weights prefetched this many k ahead (1 KiB a tile)
// Rows a tile takes: as many accumulators as the registers hold (a row's tile is 2 F32x16: 2
// registers of AVX-512's 32, 4 of AVX2's 16). At 3 rows on AVX2 one accumulator lives on the
// stack, its chain waiting on a store and a load every k (measured the slowest of 2, 3, 4 and 6);
// 2 rows spill nothing. The numbers do not depend on it: each output is the same FMAs in k order.
constexpr int64_t kRows = kRegisters == 32 ? 12 : 2;

// rows [0, R) of x (fp32, leading dimension ldx) times one packed tile -> 32 outputs per row
template <int R>
inline void tile(const float* x, int64_t ldx, const uint16_t* wt, int64_t K, float* out, int64_t ldo,
                 int64_t n_valid) {
  F32x16 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = zero();
  for (int64_t k = 0; k < K; ++k) {
    F32x16 w0, w1;  // outputs 0-15, 16-31
    load_pairs(wt + k * kTile, w0, w1);
    for (int r = 0; r < R; ++r) {
      const F32x16 xb = set1(x[r * ldx + k]);
      acc[r][0] = fmadd(xb, w0, acc[r][0]);
      acc[r][1] = fmadd(xb, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (n_valid >= kTile) {
      store(out + r * ldo, acc[r][0]);
      store(out + r * ldo + kBlock, acc[r][1]);
    } else {
      float buf[kTile];
      store(buf, acc[r][0]);
      store(buf + kBlock, acc[r][1]);
      std::memcpy(out + r * ldo, buf, n_valid * sizeof(float));
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, float*, int64_t, int64_t);
template <size_t... R>
constexpr std::array<TileFn, sizeof...(R) + 1> tile_table(std::index_sequence<R...>) {
  return {nullptr, tile<R + 1>...};
}
constexpr auto kTiles = tile_table(std::make_index_sequence<kRows>());  // kTiles[rows]

// A decode has one row (or a few): tile<1> keeps two accumulator chains, and each FMA waits on
// the one before it in its chain, so the FMA units idle and the weights stream at half the memory
// speed. tiles<R, T> walks T full tiles at once (2RT chains), prefetching each tile's weights
// ahead. Each output is still the same FMAs in the same order as in tile<R>: the numbers do not
// change, only their overlap.
template <int R, int T>
inline void tiles(const float* x, int64_t ldx, const uint16_t* wt, int64_t K, float* out, int64_t ldo) {
  F32x16 acc[T][R][2];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r][0] = acc[t][r][1] = zero();
  for (int64_t k = 0; k < K; ++k) {
    F32x16 xb[R];
    for (int r = 0; r < R; ++r) xb[r] = set1(x[r * ldx + k]);
    for (int t = 0; t < T; ++t) {
      _mm_prefetch(reinterpret_cast<const char*>(wt + (t * K + k + kAhead) * kTile), _MM_HINT_T0);
      F32x16 w0, w1;
      load_pairs(wt + (t * K + k) * kTile, w0, w1);
      for (int r = 0; r < R; ++r) {
        acc[t][r][0] = fmadd(xb[r], w0, acc[t][r][0]);
        acc[t][r][1] = fmadd(xb[r], w1, acc[t][r][1]);
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) {
      store(out + r * ldo + t * kTile, acc[t][r][0]);
      store(out + r * ldo + t * kTile + kBlock, acc[t][r][1]);
    }
}

using TilesFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, float*, int64_t);
// by rows (1-3): the most tiles at once; kMulti[rows][tiles] (fewer for a thread's last tiles)
constexpr int64_t kTilesAtOnce[4] = {0, 4, 2, 2};
constexpr TilesFn kMulti[4][5] = {{},
                                  {nullptr, tiles<1, 1>, tiles<1, 2>, tiles<1, 3>, tiles<1, 4>},
                                  {nullptr, tiles<2, 1>, tiles<2, 2>},
                                  {nullptr, tiles<3, 1>, tiles<3, 2>}};

}  // namespace
#endif

namespace kvbridge_kernels {

// w [N, K] (bf16) -> packed [ceil(N/32)][K][32] bf16: at k, lane j holds outputs (j, j + 16) of
// the tile; zero past N
at::Tensor pack_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w must be a 2-d bfloat16 tensor");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), tiles = (N + kTile - 1) / kTile;
  at::Tensor packed = at::zeros({tiles, K, kTile}, wc.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t o = 0; o < kTile && t * kTile + o < N; ++o) {
        const uint16_t* row = src + (t * kTile + o) * K;
        const int64_t slot = o < kBlock ? 2 * o : 2 * (o - kBlock) + 1;
        for (int64_t k = 0; k < K; ++k) dst[(t * K + k) * kTile + slot] = row[k];
      }
  });
  return packed;
}

// x [M, K] bf16, packed from pack_bf16, n = N -> [M, N] float32 (out_float) or bf16
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool out_float) {
#if defined(KVBRIDGE_VEC)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be a 2-d bfloat16 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kTile && packed.is_contiguous(), "packed must come from pack_bf16");
  TORCH_CHECK(x.size(1) == packed.size(1), "x has ", x.size(1), " columns; the weights ", packed.size(1));
  TORCH_CHECK(0 < n && n <= packed.size(0) * kTile && n > (packed.size(0) - 1) * kTile, "n does not match the weights");
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0);
  // x widened to float32 (exact); a decode's rows here, without a torch op (a layer makes four calls)
  at::Tensor xf;
  if (M < 4 && x.is_contiguous()) {
    xf = at::empty({M, K}, x.options().dtype(at::kFloat));
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    float* xw = xf.data_ptr<float>();
    for (int64_t i = 0; i < M * K; ++i) {
      const uint32_t bits = static_cast<uint32_t>(xb[i]) << 16;
      std::memcpy(xw + i, &bits, sizeof(float));
    }
  } else {
    xf = x.to(at::kFloat).contiguous();
  }
  at::Tensor acc = at::empty({M, n}, xf.options());
  at::Tensor out = out_float ? acc : at::empty({M, n}, x.options());
  const float* xp = xf.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* op = acc.data_ptr<float>();
  uint16_t* ob = out_float ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // each thread takes whole tiles (a tile's weights stay in its cache while every row passes)
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end;) {
      const uint16_t* wt = wp + t * K * kTile;
      const int64_t full = std::min(end, n / kTile) - t;  // full tiles left to this thread
      if (0 < M && M < 4 && full > 0) {
        const int64_t at_once = std::min(kTilesAtOnce[M], full);
        kMulti[M][at_once](xp, K, wt, K, op + t * kTile, n);
        t += at_once;
        continue;
      }
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int64_t rows = std::min(kRows, M - m0);
        kTiles[rows](xp + m0 * K, K, wt, K, op + m0 * n + t * kTile, n, std::min(kTile, n - t * kTile));
      }
      ++t;
    }
    if (ob == nullptr) return;
    // this thread's outputs rounded to bf16 (to nearest even, as torch's conversion)
    const int64_t c0 = begin * kTile, c1 = std::min(n, end * kTile);
    for (int64_t m = 0; m < M; ++m) {
      int64_t c = c0;
      for (; c + kBlock <= c1; c += kBlock) store_bf16(ob + m * n + c, load(op + m * n + c));
      if (c < c1) store_bf16_n(ob + m * n + c, load_n(op + m * n + c, c1 - c), c1 - c);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "this build has neither AVX2 nor AVX-512");
#endif
}


// gate_up [M, 2I] bf16 (gate, then up) -> silu(gate) * up [M, I] bf16, rounded as torch's two
// bf16 ops round: silu(g) = g / (1 + e^-g) to bf16, then the product to bf16. One pass instead of
// torch's bf16 silu, which runs element by element on a CPU.
at::Tensor silu_mul_bf16(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 && gate_up.is_contiguous() &&
                  gate_up.size(1) % 32 == 0, "gate_up must be a contiguous bfloat16 [M, 2I] tensor, I a multiple of 16");
#if defined(KVBRIDGE_VEC)
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({M, I}, gate_up.options());
  const at::BFloat16* x = gate_up.data_ptr<at::BFloat16>();
  uint16_t* y = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / I), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t i = 0; i < I; i += 16) {
        const F32x16 g = load(x + m * 2 * I + i), u = load(x + m * 2 * I + I + i);
        const F32x16 silu = round_bf16(div(g, add(set1(1.f), kvbridge_vec::exp(sub(zero(), g)))));
        store_bf16(y + m * I + i, mul(silu, u));
      }
  });
  return out;
#else
  TORCH_CHECK(false, "this build has neither AVX2 nor AVX-512");
#endif
}

// x [M, H] bf16, weight [H] bf16 -> weight * bf16(x * rsqrt(mean(x^2) + eps)) [M, H] bf16: RMSNorm in
// one pass, rounded where transformers' bf16 RMSNorm rounds (the normalized row to bf16, then the
// product with the weight). The mean is summed in float32 over 16 lanes in a fixed order, the same
// for a row whatever its batch.
at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(1) % 16 == 0,
              "x must be a contiguous bfloat16 [M, H] tensor, H a multiple of 16");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.size(0) == x.size(1), "weight must be a contiguous bfloat16 [H] tensor");
#if defined(KVBRIDGE_VEC)
  const int64_t M = x.size(0), H = x.size(1);
  at::Tensor out = at::empty_like(x);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / H), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const at::BFloat16* row = xp + m * H;
      F32x16 sq = zero();
      for (int64_t i = 0; i < H; i += 16) {
        const F32x16 v = load(row + i);
        sq = fmadd(v, v, sq);
      }
      const float inv = 1.f / std::sqrt(reduce_add(sq) / static_cast<float>(H) + static_cast<float>(eps));
      const F32x16 s = set1(inv);
      for (int64_t i = 0; i < H; i += 16)
        store_bf16(op + m * H + i, mul(load(wp + i), round_bf16(mul(load(row + i), s))));
    }
  });
  return out;
#else
  TORCH_CHECK(false, "this build has neither AVX2 nor AVX-512");
#endif
}

// The rotary embedding of the q and k heads of qkv [N, (heads + kv_heads + kv_heads) * D] bf16
// (q heads, k heads, v heads side by side), rotate-half convention, rounded as torch's bf16 ops
// round x * cos + rotate_half(x) * sin (each product to bf16, then the sum): -> [N, heads +
// kv_heads, D] bf16, contiguous. cos, sin: [N, D] bf16, the rows' positions already looked up.
at::Tensor rope_bf16(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t rotated_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kBFloat16 && qkv.is_contiguous(), "qkv must be a contiguous bfloat16 [N, W] tensor");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == qkv.size(0) && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
              "cos and sin must be contiguous bfloat16 [N, head_dim] tensors");
  const int64_t N = qkv.size(0), W = qkv.size(1), D = cos.size(1), half = D / 2;
  TORCH_CHECK(D % 32 == 0 && rotated_heads > 0 && rotated_heads * D <= W, "head_dim must be a multiple of 32 and the heads fit qkv");
#if defined(KVBRIDGE_VEC)
  at::Tensor out = at::empty({N, rotated_heads, D}, qkv.options());
  const at::BFloat16* x = qkv.data_ptr<at::BFloat16>();
  const at::BFloat16* cp = cos.data_ptr<at::BFloat16>();
  const at::BFloat16* sp = sin.data_ptr<at::BFloat16>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, N, std::max<int64_t>(1, 4096 / (rotated_heads * D)), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t h = 0; h < rotated_heads; ++h) {
        const at::BFloat16* xh = x + n * W + h * D;
        uint16_t* oh = op + (n * rotated_heads + h) * D;
        for (int64_t d = 0; d < D; d += 16) {
          // rotate_half: (-x[half:], x[:half])
          const F32x16 rot = d < half ? neg(load(xh + d + half)) : load(xh + d - half);
          const F32x16 a = round_bf16(mul(load(xh + d), load(cp + n * D + d)));
          const F32x16 b = round_bf16(mul(rot, load(sp + n * D + d)));
          store_bf16(oh + d, add(a, b));
        }
      }
  });
  return out;
#else
  TORCH_CHECK(false, "this build has neither AVX2 nor AVX-512");
#endif
}

}  // namespace kvbridge_kernels

TORCH_LIBRARY_FRAGMENT(kvbridge, m) {
  m.def("pack_bf16(Tensor w) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor packed, int n, bool out_float) -> Tensor");
  m.def("silu_mul_bf16(Tensor gate_up) -> Tensor");
  m.def("rms_norm_bf16(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_bf16(Tensor qkv, Tensor cos, Tensor sin, int rotated_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvbridge, CPU, m) {
  using namespace kvbridge_kernels;
  m.impl("pack_bf16", pack_bf16);
  m.impl("linear_bf16", linear_bf16);
  m.impl("silu_mul_bf16", silu_mul_bf16);
  m.impl("rms_norm_bf16", rms_norm_bf16);
  m.impl("rope_bf16", rope_bf16);
}
