// Attention over the paged KV pool, read in place (no gather of a request's pages), for decodes and
// prompt chunks alike.
//
// The pool is [num_pages, num_layers, 2, page_size, kv_heads, head_dim] (engine/kv_pool.py):
// token t of page p, layer l, K (0) or V (1), head h starts at
//   ((p * num_layers + l) * 2 + kv) * page_size * kv_heads * head_dim + t * kv_heads * head_dim + h * head_dim.
// Each query row (a decode, or one token of a prompt chunk) attends over the first ctx keys of its
// request's pages; the query heads of a group share one K/V head (GQA). Scores, softmax and the
// weighted sum are computed in float32 whatever the pool's dtype; the output is rounded to the
// query's dtype once. Work is split over (row, kv head) on ATen's thread pool; each item walks its
// pages once (online softmax), in vec.h's vectors where the compiler targets AVX2 or AVX-512.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace {

#if defined(KVBRIDGE_VEC)
using namespace kvbridge_vec;
constexpr bool kVector = true;
#else
constexpr bool kVector = false;
#endif

// si[0..n) = e^(si - m); returns their sum
inline float exp_sub(float* si, int64_t n, float m) {
  float sum = 0.f;
  int64_t t = 0;
#if defined(KVBRIDGE_VEC)
  const F32x16 mv = set1(m);
  F32x16 acc = zero();
  for (; t < n; t += 16) {
    const F32x16 e = kvbridge_vec::exp(sub(load_n(si + t, n - t), mv));
    store_n(si + t, e, n - t);
    acc = add(acc, first(n - t, e, zero()));
  }
  sum = reduce_add(acc);
#endif
  for (; t < n; ++t) sum += (si[t] = std::exp(si[t] - m));
  return sum;
}

// max(si[0..n)), n >= 1 (exact: the order of a max does not matter)
inline float max_of(const float* si, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#if defined(KVBRIDGE_VEC)
  F32x16 mv = set1(m);
  for (; t < n; t += 16) mv = kvbridge_vec::max(mv, first(n - t, load_n(si + t, n - t), mv));
  m = reduce_max(mv);
#endif
  for (; t < n; ++t) m = std::max(m, si[t]);
  return m;
}

struct Shape {
  int64_t batch, heads, head_dim, layers, page_size, kv_heads, groups, max_pages, token_stride, half;
};

#if defined(KVBRIDGE_VEC)
// The scores of one query head (q: C chunks of 16 floats, scaled) against n <= 16 keys at k,
// k + stride, ...: lane j of the result is key j's (0 past n). Each key's 16 lanes of partial
// products (lane l: d = l, l + 16, ...) are summed by one fixed tree (vec.h sums16), the same for
// every key in every slot, so a score's bits do not depend on the keys it is computed beside.
template <typename T>
inline F32x16 dots16(const F32x16* q, int64_t C, const T* k, int64_t stride, int64_t n) {
  return sums16([&](int64_t key) {
    F32x16 v = zero();
    if (key < n)
      for (int64_t c = 0; c < C; ++c) v = fmadd(q[c], load(k + key * stride + 16 * c), v);
    return v;
  });
}
#endif

// The online softmax of one query row over kv heads [h0, h1) (Q = (h1 - h0) * groups query
// heads), one page at a time: the page's scores, then the running max, sum and weighted V
// rescaled. Its state: q (scaled), acc, top, total, in one block of floats (Row::floats).
// CHUNKS: head_dim / 16 when known at compile time (the weighted sum stays in registers), else 0.
template <typename T, int CHUNKS>
struct Row {
  const Shape& z;
  int64_t Q;
  float* q;  // [Q, D] the query heads, scaled; then acc [Q, D], top [Q], total [Q]

  static int64_t floats(const Shape& z, int64_t Q) { return 2 * Q * z.head_dim + ((2 * Q + 15) & ~int64_t(15)); }
  float* acc() const { return q + Q * z.head_dim; }
  float* top() const { return acc() + Q * z.head_dim; }
  float* total() const { return top() + Q; }

  void start(const T* qh, float scale) const {
    for (int64_t i = 0; i < Q * z.head_dim; ++i) q[i] = static_cast<float>(qh[i]) * scale;
    std::fill(acc(), acc() + Q * z.head_dim, 0.f);
    std::fill(top(), top() + Q, -std::numeric_limits<float>::infinity());
    std::fill(total(), total() + Q, 0.f);
  }

  // the first n keys of a page: kbase / vbase point at this range's first kv head of its K / V block
  // (the pool's, or the page widened to float32: the same values)
  template <typename K>
  void page(const K* kbase, const K* vbase, int64_t n, float* score) const {
    const int64_t G = z.groups, D = z.head_dim;
    for (int64_t i = 0; i < Q; ++i) {  // query head i reads kv head i / G of this range
      const K* k = kbase + (i / G) * D;
      const float* qi = q + i * D;
      float* si = score;
      if constexpr (kVector) {
#if defined(KVBRIDGE_VEC)
        F32x16 qv[CHUNKS > 0 ? CHUNKS : 16];
        const int64_t C = CHUNKS > 0 ? CHUNKS : D / 16;
        if (C > 16) {  // (a head_dim over 256: plain loops)
          for (int64_t t = 0; t < n; ++t) {
            float dot = 0.f;
            for (int64_t d = 0; d < D; ++d) dot += qi[d] * static_cast<float>(k[t * z.token_stride + d]);
            si[t] = dot;
          }
        } else {
          for (int64_t c = 0; c < C; ++c) qv[c] = load(qi + 16 * c);
          for (int64_t t = 0; t < n; t += 16)
            store(si + t, dots16(qv, C, k + t * z.token_stride, z.token_stride, std::min<int64_t>(16, n - t)));
        }
#endif
      } else {
        for (int64_t t = 0; t < n; ++t) {
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qi[d] * static_cast<float>(k[t * z.token_stride + d]);
          si[t] = dot;
        }
      }
      const float m = std::max(top()[i], max_of(si, n));
      const float rescale = std::exp(top()[i] - m);  // (0 on the first page: exp(-inf))
      top()[i] = m;
      total()[i] = total()[i] * rescale + exp_sub(si, n, m);
      float* a = acc() + i * D;
      const K* v = vbase + (i / G) * D;
      if constexpr (kVector && CHUNKS > 0) {
#if defined(KVBRIDGE_VEC)
        F32x16 ar[CHUNKS];  // the weighted sum in registers over the page
        const F32x16 rv = set1(rescale);
        for (int c = 0; c < CHUNKS; ++c) ar[c] = mul(load(a + 16 * c), rv);
        for (int64_t t = 0; t < n; ++t) {
          const F32x16 pv = set1(si[t]);
          for (int c = 0; c < CHUNKS; ++c) ar[c] = fmadd(pv, load(v + t * z.token_stride + 16 * c), ar[c]);
        }
        for (int c = 0; c < CHUNKS; ++c) store(a + 16 * c, ar[c]);
#endif
      } else {
        for (int64_t d = 0; d < D; ++d) a[d] *= rescale;
        for (int64_t t = 0; t < n; ++t)
          for (int64_t d = 0; d < D; ++d) a[d] += si[t] * static_cast<float>(v[t * z.token_stride + d]);
      }
    }
  }

  void finish(T* oh) const {
    const int64_t D = z.head_dim;
    for (int64_t i = 0; i < Q; ++i) {
      const float inv = 1.f / total()[i];
      for (int64_t d = 0; d < D; ++d) oh[i * D + d] = static_cast<T>(acc()[i * D + d] * inv);
    }
  }
};

constexpr int64_t kBlock = 16;  // query rows of one request that walk its pages together

// Rows n0..n1 (one request: the same pages) over kv heads [h0, h1). The block walks the pages
// once, each page's K/V read from memory once and then from cache for every row that sees it;
// each row's arithmetic is Row::page, in page order, exactly as if it were alone.
template <typename T, int CHUNKS>
void block(const Shape& z, const T* qp, const T* kv, const int64_t* pages, const int64_t* lens, int64_t n0,
           int64_t n1, int64_t layer, int64_t h0, int64_t h1, float scale, T* op) {
  const int64_t Q = (h1 - h0) * z.groups, D = z.head_dim, ps = z.page_size, per = z.heads * D;
  const int64_t sstride = (ps + 15) & ~int64_t(15), each = Row<T, CHUNKS>::floats(z, Q);
  // a page's K and V widened to float32 once for every row and head, not per head (the same
  // values either way: widening is exact); a lone row reads the pool's own where the vector path
  // runs (its loads widen exactly as this copy does; plain loops widen here always, so that the
  // compiler's code for them is one and the same for every row)
  const bool widen = !std::is_same_v<T, float> && (n1 - n0 > 1 || !kVector || z.head_dim > 256);
  const int64_t rows = (h1 - h0) * D, wide = widen ? 2 * ps * rows : 0;
  thread_local std::vector<float> scratch;  // (one per thread, reused: a prompt chunk has thousands of rows)
  scratch.resize(each * (n1 - n0) + sstride + wide + 16);
  float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
  float* score = base + each * (n1 - n0);  // (64-byte aligned: `each` is a multiple of 16 floats)
  float* kw = score + sstride;  // [2, ps, h1 - h0, D]: this range's K, then V, of the page
  Shape zw = z;  // (the widened page's strides)
  zw.token_stride = rows;
  int64_t ctx = 0;
  for (int64_t n = n0; n < n1; ++n) {
    Row<T, CHUNKS>{z, Q, base + each * (n - n0)}.start(qp + n * per + h0 * z.groups * D, scale);
    ctx = std::max(ctx, lens[n]);
  }
  for (int64_t first = 0; first < ctx; first += ps) {
    const T* kbase = kv + (pages[first / ps] * z.layers + layer) * 2 * z.half + h0 * D;
#if defined(KVBRIDGE_VEC)
    if (first + ps < ctx) {  // the next page's blocks are elsewhere in the pool: start reading them now
      const char* next = reinterpret_cast<const char*>(kv + (pages[first / ps + 1] * z.layers + layer) * 2 * z.half);
      for (int64_t off = 0; off < int64_t(2 * z.half * sizeof(T)); off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
    }
#endif
    if (widen) {
      const int64_t keys = std::min(ps, ctx - first);
      for (int64_t kv2 = 0; kv2 < 2; ++kv2)
        for (int64_t t = 0; t < keys; ++t) {
          const T* src = kbase + kv2 * z.half + t * z.token_stride;
          float* dst = kw + (kv2 * ps + t) * rows;
          for (int64_t d = 0; d < rows; ++d) dst[d] = static_cast<float>(src[d]);
        }
      for (int64_t n = n0; n < n1; ++n)
        if (lens[n] > first)
          Row<T, CHUNKS>{zw, Q, base + each * (n - n0)}.page(kw, kw + ps * rows, std::min(ps, lens[n] - first), score);
    } else {
      for (int64_t n = n0; n < n1; ++n)
        if (lens[n] > first)
          Row<T, CHUNKS>{z, Q, base + each * (n - n0)}.page(kbase, kbase + z.half, std::min(ps, lens[n] - first), score);
    }
  }
  for (int64_t n = n0; n < n1; ++n) Row<T, CHUNKS>{z, Q, base + each * (n - n0)}.finish(op + n * per + h0 * z.groups * D);
}

// Each row's query heads, work split by cost (a row reads its ctx keys) into one contiguous range of
// (row, kv-head range) items per thread; within a range, consecutive rows of one request go in
// blocks (a prompt chunk's rows share their pages).
template <typename T, int CHUNKS>
void attend(const Shape& z, const at::Tensor& q, const at::Tensor& pool, const at::Tensor& tables,
            const at::Tensor& rows, const at::Tensor& ctx_lens, int64_t layer, double scale, at::Tensor& out) {
  const T* qp = q.data_ptr<T>();
  const T* kv = pool.data_ptr<T>();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* row_table = rows.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float s = static_cast<float>(scale);
  const int64_t threads = at::get_num_threads();
  // a row's heads together (its page blocks read front to back), unless too few rows to keep
  // every thread busy: then one item per (row, kv head). The result is the same either way.
  const int64_t split = z.batch >= 2 * threads ? 1 : z.kv_heads, items = z.batch * split;
  std::vector<int64_t> cost(items + 1, 0);  // cost[w]: keys read by items before w
  for (int64_t w = 0; w < items; ++w) cost[w + 1] = cost[w] + lens[w / split] + 16;  // (+ a row's fixed work)
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t lo = std::lower_bound(cost.begin(), cost.end(), cost[items] * t / threads) - cost.begin();
      const int64_t hi = std::min(items, std::lower_bound(cost.begin(), cost.end(), cost[items] * (t + 1) / threads) - cost.begin());
      if (split > 1) {
        for (int64_t w = lo; w < hi; ++w) {
          const int64_t n = w / split, width = z.kv_heads / split, h0 = (w % split) * width;
          block<T, CHUNKS>(z, qp, kv, table + row_table[n] * z.max_pages, lens, n, n + 1, layer, h0, h0 + width, s, op);
        }
        continue;
      }
      for (int64_t n0 = lo, n1; n0 < hi; n0 = n1) {
        for (n1 = n0 + 1; n1 < hi && n1 - n0 < kBlock && row_table[n1] == row_table[n0]; ++n1) {}
        block<T, CHUNKS>(z, qp, kv, table + row_table[n0] * z.max_pages, lens, n0, n1, layer, 0, z.kv_heads, s, op);
      }
    }
  });
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& tables, const at::Tensor& rows,
            const at::Tensor& ctx_lens, int64_t layer, double scale, at::Tensor& out) {
  Shape z;
  z.batch = q.size(0), z.heads = q.size(1), z.head_dim = q.size(2);
  z.layers = pool.size(1), z.page_size = pool.size(3), z.kv_heads = pool.size(4);
  z.groups = z.heads / z.kv_heads, z.max_pages = tables.size(1);
  z.token_stride = z.kv_heads * z.head_dim, z.half = z.page_size * z.token_stride;
  if (z.head_dim == 64) attend<T, 4>(z, q, pool, tables, rows, ctx_lens, layer, scale, out);
  else if (z.head_dim == 128) attend<T, 8>(z, q, pool, tables, rows, ctx_lens, layer, scale, out);
  else attend<T, 0>(z, q, pool, tables, rows, ctx_lens, layer, scale, out);
}

}  // namespace

namespace kvbridge_kernels {

// q [N, heads, head_dim]: N query rows; pool as above; tables [R, max_pages] int64 (page ids,
// padded); rows [N] int64: the table of each query row; ctx_lens [N] int64: the keys it sees (a
// decode: its context; a prompt token at position t: t + 1); layer: index in the pool. Each row is
// computed alone, in the same order whatever else is in the call: a prompt's token gets the same
// bits whether it was prefilled in one chunk, in several, or decoded.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& tables,
                           const at::Tensor& rows, const at::Tensor& ctx_lens, int64_t layer, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [N, heads, head_dim] tensor");
  TORCH_CHECK(pool.dim() == 6 && pool.is_contiguous(), "pool must be a contiguous 6-d tensor");
  TORCH_CHECK(q.scalar_type() == pool.scalar_type(), "q and pool dtypes differ");
  TORCH_CHECK(pool.size(5) == q.size(2) && q.size(1) % pool.size(4) == 0, "head shapes do not match the pool");
  TORCH_CHECK(q.size(2) % 16 == 0, "head_dim must be a multiple of 16, got ", q.size(2));  // (16 lanes a vector)
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.is_contiguous(),
              "tables must be a contiguous int64 [R, max_pages] tensor");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.numel() == q.size(0) && rows.is_contiguous(),
              "rows must be a contiguous int64 [N] tensor");
  TORCH_CHECK(ctx_lens.scalar_type() == at::kLong && ctx_lens.numel() == q.size(0) && ctx_lens.is_contiguous(),
              "ctx_lens must be a contiguous int64 [N] tensor");
  TORCH_CHECK(0 <= layer && layer < pool.size(1), "layer out of range");
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* row_table = rows.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const int64_t ps = pool.size(3), width = tables.size(1);
  std::vector<int64_t> reach(tables.size(0), 0);  // keys read through each table
  for (int64_t n = 0; n < q.size(0); ++n) {
    TORCH_CHECK(0 <= row_table[n] && row_table[n] < tables.size(0), "row's table out of range");
    TORCH_CHECK(1 <= lens[n] && lens[n] <= width * ps, "context length out of range");
    reach[row_table[n]] = std::max(reach[row_table[n]], lens[n]);
  }
  for (int64_t r = 0; r < tables.size(0); ++r)  // every page read lies in the pool
    for (int64_t p = 0; p < (reach[r] + ps - 1) / ps; ++p)
      TORCH_CHECK(0 <= table[r * width + p] && table[r * width + p] < pool.size(0), "page id out of range");
  at::Tensor out = at::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: attend<float>(q, pool, tables, rows, ctx_lens, layer, scale, out); break;
    case at::kBFloat16: attend<at::BFloat16>(q, pool, tables, rows, ctx_lens, layer, scale, out); break;
    case at::kHalf: attend<at::Half>(q, pool, tables, rows, ctx_lens, layer, scale, out); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace kvbridge_kernels

TORCH_LIBRARY(kvbridge, m) {
  m.def("paged_attention(Tensor q, Tensor pool, Tensor tables, Tensor rows, Tensor ctx_lens, int layer, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvbridge, CPU, m) { m.impl("paged_attention", kvbridge_kernels::paged_attention); }
