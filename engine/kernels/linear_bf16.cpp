// bfloat16 linear layers on x86 CPUs (AVX2 or AVX-512: vec.h): y = x W^T with the weights packed once.
//
// Weights stay bf16 in memory (half the bytes of float32 to stream: what decode waits for) and
// every output is summed the way AVX512-BF16's vdpbf16ps sums it (vec.h `dot_pair`): over pairs
// of k in order, acc + x[k+1] w[k+1] rounded to float32, then + x[k] w[k] rounded (each product of
// two bf16 is exact in float32), denormals read as and flushed to 0. Where the CPU has AVX512-BF16
// that is one instruction for 16 outputs and two k (twice the products of an fp32 FMA: what prefill
// and large batches wait for; a Zen 4 issues it at the FMA's rate); elsewhere two FMAs under
// DAZ | FTZ compute the same bits (tests/engine/test_isa.py). Packed as [N/32][K/2][32][2]: at a
// pair of k, outputs 0-15 then 16-31, each a 32-bit lane holding w[k] (low half) and w[k+1]; an
// odd K is padded with a zero weight (and x with a zero). A tile of up to 12 rows (2 on AVX2) x 32
// outputs accumulates in registers.
//
// Every output is the same sequence of operations whatever M is and wherever its row sits in
// the batch: a request's numbers do not depend on what it is batched with.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kernels.h"
#include "vec.h"

namespace {

constexpr int64_t kBlock = 16, kTile = 32;

}  // namespace

#if defined(KVBRIDGE_VEC)
namespace {

using namespace kvbridge_vec;

constexpr int64_t kAhead = 8;  // decode tiles: weights prefetched this many pairs of k ahead (1 KiB a tile)
// Rows a tile takes: as many accumulators as the registers hold (a row's tile is 2 F32x16: 2
// registers of AVX-512's 32, 4 of AVX2's 16). At 3 rows on AVX2 one accumulator lives on the
// stack, its chain waiting on a store and a load every k (measured the slowest of 2, 3, 4 and 6);
// 2 rows spill nothing. The numbers do not depend on it: each output is the same operations in k order.
constexpr int64_t kRows = kRegisters == 32 ? 12 : 2;
// x as the kernels read it: bf16 (its pairs broadcast whole) for the instruction; float32, widened
// once per call, for the FMAs (a broadcast from memory, where a bf16 would need scalar work per use)
using XT = std::conditional_t<kDotPairInstruction, uint16_t, float>;

// acc[r][h] (rows r of x from x, leading dimension ldx, at a pair of k; outputs 16h..16h+15 of the
// tile) plus the pair's products, as vec.h's dot_pair sums them
template <int R>
inline void pair_step(F32x16 (&acc)[R][2], const XT* x, int64_t ldx, const uint16_t* w) {
#if defined(__AVX512BF16__)
  const __m512bh w0 = load_wpair(w), w1 = load_wpair(w + kTile);
  for (int r = 0; r < R; ++r) {
    const __m512bh xp = xpair(x + r * ldx);
    acc[r][0] = dot_pair(acc[r][0], xp, w0);
    acc[r][1] = dot_pair(acc[r][1], xp, w1);
  }
#else
  // the same two FMAs on each accumulator, k + 1 for every row first: half the weights live at a
  // time (each pass loads the pairs again and keeps its halves; the compiler drops the others)
  for (int half = 1; half >= 0; --half) {
    F32x16 even0, odd0, even1, odd1;
    load_pairs(w, even0, odd0);
    load_pairs(w + kTile, even1, odd1);
    const F32x16 w0 = half ? odd0 : even0, w1 = half ? odd1 : even1;
    for (int r = 0; r < R; ++r) {
      const F32x16 xb = set1(x[r * ldx + half]);
      acc[r][0] = fmadd(xb, w0, acc[r][0]);
      acc[r][1] = fmadd(xb, w1, acc[r][1]);
    }
  }
#endif
}

inline void store_tile(const F32x16 (&acc)[2], float* out, int64_t n_valid) {
  if (n_valid >= kTile) {
    store(out, acc[0]);
    store(out + kBlock, acc[1]);
  } else {
    float buf[kTile];
    store(buf, acc[0]);
    store(buf + kBlock, acc[1]);
    std::memcpy(out, buf, n_valid * sizeof(float));
  }
}

// rows [0, R) of x (bf16, leading dimension ldx, K even) times one packed tile -> 32 outputs per row
template <int R>
inline void tile(const XT* x, int64_t ldx, const uint16_t* wt, int64_t K, float* out, int64_t ldo,
                 int64_t n_valid) {
  F32x16 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = zero();
  for (int64_t k = 0; k < K; k += 2) pair_step<R>(acc, x + k, ldx, wt + k * kTile);
  for (int r = 0; r < R; ++r) store_tile(acc[r], out + r * ldo, n_valid);
}

// AVX2 (16 registers): a tile of 32 outputs holds 2 rows at most, and each pair of weight loads
// then feeds only 8 FMAs. half_tile<R> takes one half of a tile (16 outputs: 2 registers a row) for
// R = 6 rows, 24 FMAs a pair, the classic 6 x 16 of AVX2 sgemm kernels. Each output is the same
// two FMAs a pair of k, in k order, as in pair_step: the same bits.
constexpr int64_t kHalfRows = 6;

template <int R>
inline void half_tile(const XT* x, int64_t ldx, const uint16_t* wh, int64_t K, float* out, int64_t ldo,
                      int64_t n_valid) {
  F32x16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = zero();
  for (int64_t k = 0; k < K; k += 2) {
    const uint16_t* w = wh + k * kTile;  // this half's 16 pairs at the pair (k, k + 1)
    for (int half = 1; half >= 0; --half) {  // k + 1 for every row first, then k
      F32x16 even, odd;
      load_pairs(w, even, odd);
      const F32x16 wv = half ? odd : even;
      for (int r = 0; r < R; ++r) acc[r] = fmadd(set1(x[r * ldx + k + half]), wv, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (n_valid >= kBlock) {
      store(out + r * ldo, acc[r]);
    } else {
      store_n(out + r * ldo, acc[r], n_valid);
    }
  }
}

using HalfTileFn = void (*)(const XT*, int64_t, const uint16_t*, int64_t, float*, int64_t, int64_t);
template <size_t... R>
constexpr std::array<HalfTileFn, sizeof...(R) + 1> half_tile_table(std::index_sequence<R...>) {
  return {nullptr, half_tile<R + 1>...};
}
constexpr auto kHalfTiles = half_tile_table(std::make_index_sequence<kHalfRows>());  // kHalfTiles[rows]

using TileFn = void (*)(const XT*, int64_t, const uint16_t*, int64_t, float*, int64_t, int64_t);
template <size_t... R>
constexpr std::array<TileFn, sizeof...(R) + 1> tile_table(std::index_sequence<R...>) {
  return {nullptr, tile<R + 1>...};
}
constexpr auto kTiles = tile_table(std::make_index_sequence<kRows>());  // kTiles[rows]

// A decode has one row (or a few): tile<1> keeps two accumulator chains, and each step waits on
// the one before it in its chain, so the units idle and the weights stream at half the memory
// speed. tiles<R, T> walks T full tiles at once (2RT chains), prefetching each tile's weights
// ahead. Each output is still the same operations in the same order as in tile<R>: the numbers do
// not change, only their overlap.
template <int R, int T>
inline void tiles(const XT* x, int64_t ldx, const uint16_t* wt, int64_t K, float* out, int64_t ldo) {
  F32x16 acc[T][R][2];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r][0] = acc[t][r][1] = zero();
  for (int64_t k = 0; k < K; k += 2)
    for (int t = 0; t < T; ++t) {
      const uint16_t* w = wt + (t * K + k) * kTile;
      _mm_prefetch(reinterpret_cast<const char*>(w + 2 * kAhead * kTile), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + 2 * kAhead * kTile + kTile), _MM_HINT_T0);
      pair_step<R>(acc[t], x + k, ldx, w);
    }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) store_tile(acc[t][r], out + r * ldo + t * kTile, kTile);
}

using TilesFn = void (*)(const XT*, int64_t, const uint16_t*, int64_t, float*, int64_t);
// by rows (1-3): the most tiles at once; kMulti[rows][tiles] (fewer for a thread's last tiles)
constexpr int64_t kTilesAtOnce[4] = {0, 4, 2, 2};
constexpr TilesFn kMulti[4][5] = {{},
                                  {nullptr, tiles<1, 1>, tiles<1, 2>, tiles<1, 3>, tiles<1, 4>},
                                  {nullptr, tiles<2, 1>, tiles<2, 2>},
                                  {nullptr, tiles<3, 1>, tiles<3, 2>}};

}  // namespace
#endif

namespace kvbridge_kernels {

// w [N, K] (bf16) -> packed [ceil(N/32)][K'][32] bf16, K' = K rounded up to even: at the pair of k
// (k, k + 1), 2 x 32 values: outputs 0-15 then 16-31, each w[o][k], w[o][k + 1]; zero past N and K
at::Tensor pack_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w must be a 2-d bfloat16 tensor");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), K2 = (K + 1) / 2 * 2, tiles = (N + kTile - 1) / kTile;
  at::Tensor packed = at::zeros({tiles, K2, kTile}, wc.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t o = 0; o < kTile && t * kTile + o < N; ++o) {
        const uint16_t* row = src + (t * kTile + o) * K;
        const int64_t slot = o < kBlock ? 2 * o : kTile + 2 * (o - kBlock);  // within a pair's 64
        for (int64_t k = 0; k < K; ++k) dst[(t * K2 + k / 2 * 2) * kTile + slot + k % 2] = row[k];
      }
  });
  return packed;
}

// x [M, K] bf16, packed from pack_bf16, n = N -> [M, N] float32 (out_float) or bf16
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool out_float) {
#if defined(KVBRIDGE_VEC)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be a 2-d bfloat16 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kTile && packed.is_contiguous(), "packed must come from pack_bf16");
  TORCH_CHECK((x.size(1) + 1) / 2 * 2 == packed.size(1), "x has ", x.size(1), " columns; the weights ", packed.size(1));
  TORCH_CHECK(0 < n && n <= packed.size(0) * kTile && n > (packed.size(0) - 1) * kTile, "n does not match the weights");
  const int64_t M = x.size(0), K = packed.size(1), tiles = packed.size(0);
  // x's pairs of k (an odd K: a zero column after it, as the weights have): read in place by the
  // instruction, widened to float32 once (exact) for the FMAs
  at::Tensor xc = x.size(1) == K ? x.contiguous() : at::constant_pad_nd(x, {0, 1}, 0).contiguous();
  if (!kDotPairInstruction && M < 4) {  // (a decode's rows without a torch op: a layer makes four calls)
    at::Tensor xf = at::empty({M, K}, x.options().dtype(at::kFloat));
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    float* xw = xf.data_ptr<float>();
    for (int64_t i = 0; i < M * K; ++i) {
      const uint32_t bits = static_cast<uint32_t>(xb[i]) << 16;
      std::memcpy(xw + i, &bits, sizeof(float));
    }
    xc = xf;
  } else if (!kDotPairInstruction) {
    xc = xc.to(at::kFloat);
  }
  at::Tensor acc = at::empty({M, n}, x.options().dtype(at::kFloat));
  at::Tensor out = out_float ? acc : at::empty({M, n}, x.options());
  const XT* xp = static_cast<const XT*>(xc.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* op = acc.data_ptr<float>();
  uint16_t* ob = out_float ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // each thread takes whole tiles (a tile's weights stay in its cache while every row passes)
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    const DotPairMode mode;  // (denormals as dot_pair takes them, on this thread while it sums)
    for (int64_t t = begin; t < end;) {
      const uint16_t* wt = wp + t * K * kTile;
      const int64_t full = std::min(end, n / kTile) - t;  // full tiles left to this thread
      if (0 < M && M < 4 && full > 0) {
        const int64_t at_once = std::min(kTilesAtOnce[M], full);
        kMulti[M][at_once](xp, K, wt, K, op + t * kTile, n);
        t += at_once;
        continue;
      }
      if (kRegisters == 16 && M >= 2 * kHalfRows) {  // (AVX2 prefill: the tile's halves, 6 rows at a time;
        // fewer rows, a small decode batch, walk the whole tile: its weights stream once per row pair)
        for (int64_t h = 0; h < 2 && h * kBlock < n - t * kTile; ++h)
          for (int64_t m0 = 0; m0 < M; m0 += kHalfRows) {
            const int64_t rows = std::min(kHalfRows, M - m0);
            kHalfTiles[rows](xp + m0 * K, K, wt + h * kTile, K, op + m0 * n + t * kTile + h * kBlock, n,
                             std::min(kBlock, n - t * kTile - h * kBlock));
          }
      } else {
        for (int64_t m0 = 0; m0 < M; m0 += kRows) {
          const int64_t rows = std::min(kRows, M - m0);
          kTiles[rows](xp + m0 * K, K, wt, K, op + m0 * n + t * kTile, n, std::min(kTile, n - t * kTile));
        }
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
