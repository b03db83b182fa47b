// bfloat16 linear layers on AVX-512 CPUs: y = x W^T with the weights packed once.
//
// torch's bf16 matmul on a CPU without AMX tiles is slower than its fp32 one (a Xeon with
// AVX512-BF16, 256x576 by 576x3072: 6.0 ms against 3.7 ms): vdpbf16ps issues at half the rate of
// fp32 FMAs there. So weights stay bf16 in memory (half the bytes to stream: what decode waits
// for) and are widened to fp32 in registers for fp32 FMAs (what prefill waits for). Packed as
// [N/32][K][32] with the two halves of a 32-bit lane holding outputs j and j + 16, widening is one
// shift (outputs 0-15) and one mask (16-31). A tile of up to 8 rows x 32 outputs accumulates in
// 16 registers over k in order.
//
// Every output is the same sequence of operations whatever M is and wherever its row sits in
// the batch (k in order, float32 sums, one rounding at the end): a request's numbers do not
// depend on what it is batched with.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 16, kTile = 32, kRows = 12;

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

#if defined(__AVX512F__)
// rows [0, R) of x (fp32, leading dimension ldx) times one packed tile -> 32 outputs per row
template <int R>
inline void tile(const float* x, int64_t ldx, const uint16_t* wt, int64_t K, float* out, int64_t ldo,
                 int64_t n_valid) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < K; ++k) {
    const __m512i w = _mm512_loadu_si512(wt + k * kTile);
    const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));  // outputs 0-15
    const __m512 w1 = _mm512_castsi512_ps(_mm512_and_si512(w, high));  // outputs 16-31
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (n_valid >= kTile) {
      _mm512_storeu_ps(out + r * ldo, acc[r][0]);
      _mm512_storeu_ps(out + r * ldo + kBlock, acc[r][1]);
    } else {
      alignas(64) float buf[kTile];
      _mm512_store_ps(buf, acc[r][0]);
      _mm512_store_ps(buf + kBlock, acc[r][1]);
      std::memcpy(out + r * ldo, buf, n_valid * sizeof(float));
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, float*, int64_t, int64_t);
constexpr TileFn kTiles[kRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>,
                                     tile<7>, tile<8>, tile<9>, tile<10>, tile<11>, tile<12>};
#endif

// x [M, K] bf16, packed from pack_bf16, n = N -> [M, N] float32 (out_float) or bf16
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool out_float) {
#if defined(__AVX512F__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be a 2-d bfloat16 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kTile && packed.is_contiguous(), "packed must come from pack_bf16");
  TORCH_CHECK(x.size(1) == packed.size(1), "x has ", x.size(1), " columns; the weights ", packed.size(1));
  TORCH_CHECK(0 < n && n <= packed.size(0) * kTile && n > (packed.size(0) - 1) * kTile, "n does not match the weights");
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // (exact)
  const int64_t M = xf.size(0), K = xf.size(1), tiles = packed.size(0);
  at::Tensor acc = at::empty({M, n}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* op = acc.data_ptr<float>();
  // each thread takes whole tiles (a tile's weights stay in its cache while every row passes)
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* wt = wp + t * K * kTile;
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int64_t rows = std::min(kRows, M - m0);
        kTiles[rows](xp + m0 * K, K, wt, K, op + m0 * n + t * kTile, n, std::min(kTile, n - t * kTile));
      }
    }
  });
  return out_float ? acc : acc.to(at::kBFloat16);
#else
  TORCH_CHECK(false, "this build has no AVX-512");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvbridge, m) {
  m.def("pack_bf16(Tensor w) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor packed, int n, bool out_float) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvbridge, CPU, m) {
  m.impl("pack_bf16", pack_bf16);
  m.impl("linear_bf16", linear_bf16);
}
