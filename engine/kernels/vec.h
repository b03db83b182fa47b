// The kernels' vector layer: F32x16, 16 float32 lanes, and the operations the kernels are written
// in. One __m512 where the compiler targets AVX-512, two __m256 (lanes 0-7, 8-15) where it targets
// AVX2 + FMA + F16C: one source serves both x86 levels. Each lane's arithmetic is the same
// sequence of IEEE float operations at either level (the same FMAs, the same e^x polynomial, sums
// across lanes by one fixed tree, operands in the same order), and the build turns off
// contraction and reassociation on x86 (engine/kernels/__init__.py), so an AVX2 build computes the
// same bits as an AVX-512 one. KVBRIDGE_VEC is 512, 256, or unset where neither level is targeted
// (the kernels keep plain loops there, or refuse to run).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#define KVBRIDGE_VEC 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVBRIDGE_VEC 256
#endif

#if defined(KVBRIDGE_VEC)
#include <immintrin.h>

namespace kvbridge_vec {

#if KVBRIDGE_VEC == 512
constexpr int kRegisters = 32;  // vector registers: what the kernels' tile sizes are chosen by
struct F32x16 {
  __m512 v;
};

inline F32x16 zero() { return {_mm512_setzero_ps()}; }
inline F32x16 set1(float x) { return {_mm512_set1_ps(x)}; }
inline F32x16 add(F32x16 a, F32x16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F32x16 sub(F32x16 a, F32x16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F32x16 mul(F32x16 a, F32x16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F32x16 div(F32x16 a, F32x16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F32x16 max(F32x16 a, F32x16 b) { return {_mm512_max_ps(a.v, b.v)}; }  // b where either is NaN
inline F32x16 min(F32x16 a, F32x16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline F32x16 fmadd(F32x16 a, F32x16 b, F32x16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a b + c
inline F32x16 fnmadd(F32x16 a, F32x16 b, F32x16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a b
inline F32x16 neg(F32x16 a) { return {_mm512_xor_ps(a.v, _mm512_set1_ps(-0.f))}; }  // the sign bit flipped

inline F32x16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F32x16 load(const at::BFloat16* p) {  // bf16 is the high half of a float32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline F32x16 load(const at::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline __mmask16 lanes_below(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }
// p[0..n), n < 16 (all 16 lanes from n = 16 on), zeros past n; nothing past p + n is read
inline F32x16 load_n(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(lanes_below(n), p)}; }
inline void store(float* p, F32x16 a) { _mm512_storeu_ps(p, a.v); }
inline void store_n(float* p, F32x16 a, int64_t n) { _mm512_mask_storeu_ps(p, lanes_below(n), a.v); }
// lanes [0, n) of a (all from n = 16 on), the others of b
inline F32x16 first(int64_t n, F32x16 a, F32x16 b) { return {_mm512_mask_mov_ps(b.v, lanes_below(n), a.v)}; }

// float32 -> bfloat16 bits, round to nearest even (a NaN stays a quiet NaN), in the low half of each lane
inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  return _mm512_srli_epi32(r, 16);
}
// a rounded to bfloat16 (as float32: the value torch's bf16 result widens to)
inline F32x16 round_bf16(F32x16 a) { return {_mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(a.v), 16))}; }
inline void store_bf16(uint16_t* p, F32x16 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(a.v)));
}

// 16 32-bit lanes of two bf16 each (linear_bf16.cpp: a lane holds w[k] and w[k+1]) -> the low
// halves (shifted up) and the high halves (masked), widened
inline void load_pairs(const uint16_t* p, F32x16& low, F32x16& high) {
  const __m512i w = _mm512_loadu_si512(p);
  low.v = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  high.v = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 2^n p, n integral, |n| <= 160 (exp's range), rounded once: vscalefps
inline F32x16 scale2(F32x16 p, F32x16 n) { return {_mm512_scalef_ps(p.v, n.v)}; }
inline F32x16 round_int(F32x16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }

// the sum of lanes l and l + 8, as 8 lanes (the first step of every sum across lanes)
inline __m256 fold8(F32x16 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
}
inline __m256 fold8_max(F32x16 a) {
  return _mm256_max_ps(_mm512_castps512_ps256(a.v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
}

// lane j: the sum of lanes of key(j), by reduce_add's tree. Slot j takes key 4 * (j % 4) + j / 4:
// the shuffles below leave slot j's sum in lane 4 * (j % 4) + j / 4 (a 4 x 4 transpose), so key j
// lands in lane j.
template <typename Key>
inline F32x16 sums16(Key key) {
  __m512 w[8], u[4], r[2];
  for (int j = 0; j < 8; ++j) {  // lanes l + (l + 8): slot 2j's in quads 0-1, 2j+1's in quads 2-3
    const __m512 a = key(4 * (2 * j % 4) + 2 * j / 4).v, b = key(4 * ((2 * j + 1) % 4) + (2 * j + 1) / 4).v;
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int j = 0; j < 4; ++j)  // + (l + 4): quad q holds slot 4j + q
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88), _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
  for (int j = 0; j < 2; ++j)  // + (l + 2): quad q lanes 0-1 slot 8j + q, lanes 2-3 slot 8j + 4 + q
    r[j] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * j], u[2 * j + 1], 0x44), _mm512_shuffle_ps(u[2 * j], u[2 * j + 1], 0xEE));
  // + (l + 1): quad q, lane p holds slot 4p + q
  return {_mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], 0x88), _mm512_shuffle_ps(r[0], r[1], 0xDD))};
}

// 64 bytes (a cache line) in registers, and their store to a 64-byte-aligned p around the caches
// (streaming: an sfence orders such stores after)
struct Line {
  __m512i v;
};
inline Line load_line(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline void stream_line(uint8_t* p, Line a) { _mm512_stream_si512(reinterpret_cast<__m512i*>(p), a.v); }

#else  // AVX2 + FMA + F16C: lanes 0-7 in lo, 8-15 in hi, every operation done to both halves
constexpr int kRegisters = 16;
struct F32x16 {
  __m256 lo, hi;
};

inline F32x16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F32x16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F32x16 add(F32x16 a, F32x16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F32x16 sub(F32x16 a, F32x16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F32x16 mul(F32x16 a, F32x16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F32x16 div(F32x16 a, F32x16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F32x16 max(F32x16 a, F32x16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F32x16 min(F32x16 a, F32x16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline F32x16 fmadd(F32x16 a, F32x16 b, F32x16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline F32x16 fnmadd(F32x16 a, F32x16 b, F32x16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline F32x16 neg(F32x16 a) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  return {_mm256_xor_ps(a.lo, sign), _mm256_xor_ps(a.hi, sign)};
}

inline __m256 widen8(__m128i bf16) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16), 16)); }
inline F32x16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F32x16 load(const at::BFloat16* p) {  // bf16 is the high half of a float32
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return {widen8(_mm_loadu_si128(q)), widen8(_mm_loadu_si128(q + 1))};
}
inline F32x16 load(const at::Half* p) {
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(q)), _mm256_cvtph_ps(_mm_loadu_si128(q + 1))};
}
// all ones in lanes [0, n) of the 8 lanes from `start`
inline __m256i lanes_below(int64_t n, int start) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - start)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
// p[0..n), n < 16 (all 16 lanes from n = 16 on), zeros past n; nothing past p + n is read
// (masked lanes do not fault)
inline F32x16 load_n(const float* p, int64_t n) {
  return {_mm256_maskload_ps(p, lanes_below(n, 0)), _mm256_maskload_ps(p + 8, lanes_below(n, 8))};
}
inline void store(float* p, F32x16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline void store_n(float* p, F32x16 a, int64_t n) {
  _mm256_maskstore_ps(p, lanes_below(n, 0), a.lo);
  _mm256_maskstore_ps(p + 8, lanes_below(n, 8), a.hi);
}
// lanes [0, n) of a (all from n = 16 on), the others of b
inline F32x16 first(int64_t n, F32x16 a, F32x16 b) {
  return {_mm256_blendv_ps(b.lo, a.lo, _mm256_castsi256_ps(lanes_below(n, 0))),
          _mm256_blendv_ps(b.hi, a.hi, _mm256_castsi256_ps(lanes_below(n, 8)))};
}

// float32 -> bfloat16 bits, round to nearest even (a NaN stays a quiet NaN), in the low half of each lane
inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
  return _mm256_srli_epi32(r, 16);
}
// a rounded to bfloat16 (as float32: the value torch's bf16 result widens to)
inline F32x16 round_bf16(F32x16 a) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(a.lo), 16)), _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(a.hi), 16))};
}
inline void store_bf16(uint16_t* p, F32x16 a) {
  // packus interleaves the 128-bit halves (lo 0-3, hi 0-3, lo 4-7, hi 4-7); the permute restores the order
  const __m256i packed = _mm256_packus_epi32(bf16_bits(a.lo), bf16_bits(a.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}

// 16 32-bit lanes of two bf16 each (linear_bf16.cpp: a lane holds w[k] and w[k+1]) -> the low
// halves (shifted up) and the high halves (masked), widened; lanes 0-7 of the pairs
// are outputs 0-7 and 16-23, lanes 8-15 outputs 8-15 and 24-31
inline void load_pairs(const uint16_t* p, F32x16& low, F32x16& high) {
  const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  low = {_mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16))};
  high = {_mm256_castsi256_ps(_mm256_and_si256(w0, mask)), _mm256_castsi256_ps(_mm256_and_si256(w1, mask))};
}

// 2^n p, n integral, |n| <= 160 (exp's range), rounded once as vscalefps rounds: by two powers
// of two, 2^(n/2) each (normal floats), the first product exact (p is within [0.7, 1.5]), the
// second the one rounding. A NaN n (from a NaN x) converts to INT_MIN, whose halves shift out to
// 2^0 each: the product is p's NaN, as vscalefps gives.
inline __m256 scale2(__m256 p, __m256 n) {
  const __m256i k = _mm256_cvtps_epi32(n), k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
inline F32x16 scale2(F32x16 p, F32x16 n) { return {scale2(p.lo, n.lo), scale2(p.hi, n.hi)}; }
inline F32x16 round_int(F32x16 a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}

inline __m256 fold8(F32x16 a) { return _mm256_add_ps(a.lo, a.hi); }  // lanes l + (l + 8)
inline __m256 fold8_max(F32x16 a) { return _mm256_max_ps(a.lo, a.hi); }

// lane j: the sum of lanes of key(j), by reduce_add's tree, eight keys at a time. Slot s of a
// group takes key s / 2 + 4 (s % 2): the shuffles leave slot s's sum in that lane.
template <typename Key>
inline F32x16 sums16(Key key) {
  __m256 out[2];
  for (int g = 0; g < 2; ++g) {
    __m256 t[4];
    for (int i = 0; i < 4; ++i) {  // slots 2i and 2i + 1: lanes l + (l + 8), then + (l + 4)
      const __m256 a = fold8(key(8 * g + i)), b = fold8(key(8 * g + i + 4));
      t[i] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    }
    // + (l + 2): lanes 0-1 slot 4j, 2-3 slot 4j + 2, 4-5 slot 4j + 1, 6-7 slot 4j + 3
    const __m256 r0 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x44), _mm256_shuffle_ps(t[0], t[1], 0xEE));
    const __m256 r1 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], 0x44), _mm256_shuffle_ps(t[2], t[3], 0xEE));
    // + (l + 1): lanes 0-3 slots 0, 2, 4, 6; lanes 4-7 slots 1, 3, 5, 7
    out[g] = _mm256_add_ps(_mm256_shuffle_ps(r0, r1, 0x88), _mm256_shuffle_ps(r0, r1, 0xDD));
  }
  return {out[0], out[1]};
}

// 64 bytes (a cache line) in registers, and their store to a 64-byte-aligned p around the caches
// (streaming: an sfence orders such stores after)
struct Line {
  __m256i a, b;
};
inline Line load_line(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline void stream_line(uint8_t* p, Line line) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), line.a);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p + 32), line.b);
}
#endif

// Level-independent from here on: written in the operations above.

// the sum of the 16 lanes by one tree: l + (l + 8), then + (l + 4), + (l + 2), + (l + 1)
inline float reduce_add(F32x16 a) {
  const __m256 h = fold8(a);
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}
inline float reduce_max(F32x16 a) {  // (the same tree)
  const __m256 h = fold8_max(a);
  const __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_max_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_max_ss(p, _mm_movehdup_ps(p)));
}

// bfloat16 of lanes [0, n), n < 16, stored
inline void store_bf16_n(uint16_t* p, F32x16 a, int64_t n) {
  alignas(32) uint16_t buf[16];
  store_bf16(buf, a);
  std::memcpy(p, buf, n * sizeof(uint16_t));
}

// e^x: 2^n e^r, r = x - n ln 2 in [-ln2/2, ln2/2], e^r by its Taylor polynomial to degree 7
// (relative error ~1e-7): 0 for the very negative (-inf included), inf past the float range. x is
// clamped first to [-110, 100], where e^x is 0 or inf already: past that n ln 2 is no longer exact
// enough for r to stay in the polynomial's range (e^(1e8) came out -inf), and +-inf would make r
// inf - inf. A NaN passes the clamp (minps and maxps return their second operand then).
inline F32x16 exp(F32x16 x) {
  x = kvbridge_vec::max(set1(-110.f), min(set1(100.f), x));
  const F32x16 n = round_int(mul(x, set1(1.44269504088896341f)));
  F32x16 r = fnmadd(n, set1(0.693145751953125f), x);  // ln 2, high part (exact product)
  r = fnmadd(n, set1(1.42860682030941723212e-6f), r);  // and low part
  F32x16 p = set1(1.f / 5040);
  p = fmadd(p, r, set1(1.f / 720));
  p = fmadd(p, r, set1(1.f / 120));
  p = fmadd(p, r, set1(1.f / 24));
  p = fmadd(p, r, set1(1.f / 6));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.f));
  p = fmadd(p, r, set1(1.f));
  return scale2(p, n);
}

// The bf16 pair dot of linear_bf16.cpp: 16 lanes, each a pair of bf16 weights (w[k] in the low
// half of the 32-bit lane, w[k+1] in the high half), times one pair of x broadcast, added to acc as
// AVX512-BF16's vdpbf16ps adds it: acc + x[k+1] w[k+1], rounded to nearest even, then + x[k] w[k],
// rounded (a product of two bf16 is exact in float32, so each step is one FMA), with denormal
// inputs read as 0 and denormal results flushed to 0 (measured: 2M random cases, denormals among
// them, the same bits on a Zen 4). One instruction where the CPU has it (dot_pair); two FMAs under
// MXCSR's DAZ | FTZ elsewhere (linear_bf16.cpp; a DotPairMode must be live on the thread: it sets
// them, and puts back what was there when it ends).
#if defined(__AVX512BF16__)
constexpr bool kDotPairInstruction = true;
inline __m512bh xpair(const uint16_t* x) {  // x[k], x[k+1] in every lane
  uint32_t bits;
  std::memcpy(&bits, x, sizeof bits);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
}
inline __m512bh load_wpair(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline F32x16 dot_pair(F32x16 acc, __m512bh x, __m512bh w) { return {_mm512_dpbf16_ps(acc.v, x, w)}; }
#else
constexpr bool kDotPairInstruction = false;
#endif

class DotPairMode {
 public:
  DotPairMode() : saved_(_mm_getcsr()) {
    if (!kDotPairInstruction) _mm_setcsr(saved_ | kDaz | kFtz);
  }
  ~DotPairMode() { _mm_setcsr(saved_); }
  DotPairMode(const DotPairMode&) = delete;
  DotPairMode& operator=(const DotPairMode&) = delete;

 private:
  static constexpr unsigned kDaz = 0x0040, kFtz = 0x8000;
  unsigned saved_;
};

}  // namespace kvbridge_vec

#endif
