// Decode attention over the paged KV pool, read in place (no gather of a request's pages).
//
// The pool is [num_pages, num_layers, 2, page_size, kv_heads, head_dim] (engine/kv_pool.py):
// token t of page p, layer l, K (0) or V (1), head h starts at
//   ((p * num_layers + l) * 2 + kv) * page_size * kv_heads * head_dim + t * kv_heads * head_dim + h * head_dim.
// One query token per request; the query heads of a group share one K/V head (GQA). Scores,
// softmax and the weighted sum are computed in float32 whatever the pool's dtype; the output is
// rounded to the query's dtype once. Work is split over (request, kv head) on ATen's thread pool;
// each item walks its pages once (online softmax), with AVX-512 where the compiler targets it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr bool kVector = true;
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // bf16 is the high half of a float32
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// e^x on 16 lanes (x <= 0 here: scores less their max): 2^n * e^r, r = x - n ln 2 in
// [-ln2/2, ln2/2], e^r by its Taylor polynomial to degree 7 (relative error ~1e-7); vscalefps
// multiplies by 2^n and gives 0 for the very negative (-inf included).
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2, high part (exact product)
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);  // and low part
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#else
constexpr bool kVector = false;
#endif

// si[0..n) = e^(si - m); returns their sum
inline float exp_sub(float* si, int64_t n, float m) {
  float sum = 0.f;
  int64_t t = 0;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (; t < n; t += 16) {
    const __mmask16 keep = n - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, si + t), mv));
    _mm512_mask_storeu_ps(si + t, keep, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(keep, e));
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; t < n; ++t) sum += (si[t] = std::exp(si[t] - m));
  return sum;
}

struct Shape {
  int64_t batch, heads, head_dim, layers, page_size, kv_heads, groups, max_pages, token_stride, half;
};

// One request's kv heads [h0, h1), each with its `groups` query heads, over the request's
// context: online softmax page by page (the scores of a page, then the running max, sum and
// weighted V rescaled). A page's rows hold every kv head side by side, so walking all heads of a
// token reads its K (then V) block of the page front to back.
template <typename T>
void heads_of(const Shape& z, const T* qp, const T* kv, const int64_t* pages, int64_t ctx, int64_t layer,
              int64_t h0, int64_t h1, float scale, T* op) {
  const int64_t G = z.groups, D = z.head_dim, ps = z.page_size, Q = (h1 - h0) * G;  // query heads here
  std::vector<float> qbuf(Q * D + 16), abuf(Q * D + 16), score(Q * ps), top(Q), total(Q);
  float* q = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(qbuf.data()) + 63) & ~uintptr_t(63));
  float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(abuf.data()) + 63) & ~uintptr_t(63));
  const T* qh = qp + h0 * G * D;
  for (int64_t i = 0; i < Q * D; ++i) q[i] = static_cast<float>(qh[i]) * scale;
  std::fill(top.begin(), top.end(), -std::numeric_limits<float>::infinity());
  std::fill(total.begin(), total.end(), 0.f);
  std::fill(acc, acc + Q * D, 0.f);
  for (int64_t first = 0; first < ctx; first += ps) {
    const int64_t n = std::min(ps, ctx - first);
    const T* kbase = kv + (pages[first / ps] * z.layers + layer) * 2 * z.half + h0 * D;
    const T* vbase = kbase + z.half;
#if defined(__AVX512F__)
    if (first + ps < ctx) {  // the next page's blocks are elsewhere in the pool: start reading them now
      const char* next = reinterpret_cast<const char*>(kv + (pages[first / ps + 1] * z.layers + layer) * 2 * z.half);
      for (int64_t off = 0; off < int64_t(2 * z.half * sizeof(T)); off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
    }
#endif
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t i = 0; i < Q; ++i) {  // query head i reads kv head i / G of this range
        const T* k = kbase + t * z.token_stride + (i / G) * D;
        const float* qi = q + i * D;
        float dot;
        if constexpr (kVector) {
#if defined(__AVX512F__)
          __m512 sum = _mm512_setzero_ps();
          for (int64_t d = 0; d < D; d += 16) sum = _mm512_fmadd_ps(_mm512_load_ps(qi + d), load16(k + d), sum);
          dot = _mm512_reduce_add_ps(sum);
#endif
        } else {
          dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qi[d] * static_cast<float>(k[d]);
        }
        score[i * ps + t] = dot;
      }
    }
    for (int64_t i = 0; i < Q; ++i) {
      float* si = score.data() + i * ps;
      const float m = std::max(top[i], *std::max_element(si, si + n));
      const float rescale = std::exp(top[i] - m);  // (0 on the first page: exp(-inf))
      top[i] = m;
      total[i] = total[i] * rescale + exp_sub(si, n, m);
      if (rescale != 1.f)
        for (int64_t d = 0; d < D; ++d) acc[i * D + d] *= rescale;
    }
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t i = 0; i < Q; ++i) {
        const T* v = vbase + t * z.token_stride + (i / G) * D;
        const float p = score[i * ps + t];
        float* a = acc + i * D;
        if constexpr (kVector) {
#if defined(__AVX512F__)
          const __m512 pv = _mm512_set1_ps(p);
          for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(a + d, _mm512_fmadd_ps(pv, load16(v + d), _mm512_load_ps(a + d)));
#endif
        } else {
          for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(v[d]);
        }
      }
    }
  }
  T* oh = op + h0 * G * D;
  for (int64_t i = 0; i < Q; ++i) {
    const float inv = 1.f / total[i];
    for (int64_t d = 0; d < D; ++d) oh[i * D + d] = static_cast<T>(acc[i * D + d] * inv);
  }
}

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& tables, const at::Tensor& ctx_lens,
            int64_t layer, double scale, at::Tensor& out) {
  Shape z;
  z.batch = q.size(0), z.heads = q.size(1), z.head_dim = q.size(2);
  z.layers = pool.size(1), z.page_size = pool.size(3), z.kv_heads = pool.size(4);
  z.groups = z.heads / z.kv_heads, z.max_pages = tables.size(1);
  z.token_stride = z.kv_heads * z.head_dim, z.half = z.page_size * z.token_stride;
  const T* qp = q.data_ptr<T>();
  const T* kv = pool.data_ptr<T>();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float s = static_cast<float>(scale);
  const int64_t per = z.heads * z.head_dim;
  // a request's heads together (its page blocks read front to back), unless too few requests
  // to keep every thread busy: then one item per (request, kv head)
  const int64_t split = z.batch >= 2 * at::get_num_threads() ? 1 : z.kv_heads;
  at::parallel_for(0, z.batch * split, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / split, part = w % split, width = z.kv_heads / split;
      heads_of(z, qp + b * per, kv, table + b * z.max_pages, lens[b], layer, part * width, (part + 1) * width, s,
               op + b * per);
    }
  });
}

// q [B, heads, head_dim]; pool as above; tables [B, max_pages] int64 (page ids, padded);
// ctx_lens [B] int64 (keys in context, <= max_pages * page_size); layer: index in the pool.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& tables,
                                  const at::Tensor& ctx_lens, int64_t layer, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B, heads, head_dim] tensor");
  TORCH_CHECK(pool.dim() == 6 && pool.is_contiguous(), "pool must be a contiguous 6-d tensor");
  TORCH_CHECK(q.scalar_type() == pool.scalar_type(), "q and pool dtypes differ");
  TORCH_CHECK(pool.size(5) == q.size(2) && q.size(1) % pool.size(4) == 0, "head shapes do not match the pool");
  TORCH_CHECK(q.size(2) % 16 == 0, "head_dim must be a multiple of 16, got ", q.size(2));  // (16 lanes a vector)
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.size(0) == q.size(0) &&
                  tables.is_contiguous(), "tables must be a contiguous int64 [B, max_pages] tensor");
  TORCH_CHECK(ctx_lens.scalar_type() == at::kLong && ctx_lens.numel() == q.size(0) && ctx_lens.is_contiguous(),
              "ctx_lens must be a contiguous int64 [B] tensor");
  TORCH_CHECK(0 <= layer && layer < pool.size(1), "layer out of range");
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {  // every key read lies in the pool
    TORCH_CHECK(1 <= lens[b] && lens[b] <= tables.size(1) * pool.size(3), "context length out of range");
    for (int64_t p = 0; p < (lens[b] + pool.size(3) - 1) / pool.size(3); ++p)
      TORCH_CHECK(0 <= table[b * tables.size(1) + p] && table[b * tables.size(1) + p] < pool.size(0), "page id out of range");
  }
  at::Tensor out = at::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: decode<float>(q, pool, tables, ctx_lens, layer, scale, out); break;
    case at::kBFloat16: decode<at::BFloat16>(q, pool, tables, ctx_lens, layer, scale, out); break;
    case at::kHalf: decode<at::Half>(q, pool, tables, ctx_lens, layer, scale, out); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(kvbridge, m) {
  m.def("paged_decode_attention(Tensor q, Tensor pool, Tensor tables, Tensor ctx_lens, int layer, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvbridge, CPU, m) { m.impl("paged_decode_attention", paged_decode_attention); }
