// A float vector of the widest width this build targets, with the handful of operations
// the kernels need: AVX-512 (16 lanes, -march=x86-64-v4) or AVX2 + FMA (8 lanes,
// x86-64-v3). `HAVE_SIMD` is 0 for other targets; the kernels then keep their plain loops.
//
// Why intrinsics: without -ffast-math the compiler vectorises `sum += a[i] * b[i]`, then
// adds the lanes one after another (a chain of ~16 dependent adds per dot product), and
// keeps small per-row arrays in memory; both cost more than the arithmetic here.
#pragma once

#include <immintrin.h>

#include <cstdint>

#if defined(__AVX512F__)
#define HAVE_SIMD 1
namespace simd {
constexpr int LANES = 16;
using vec = __m512;
using mask = __mmask16;
inline vec zero() { return _mm512_setzero_ps(); }
inline vec set1(float x) { return _mm512_set1_ps(x); }
inline vec load(const float* p) { return _mm512_loadu_ps(p); }
inline vec load(const uint16_t* p) {  // bf16 is the top half of an fp32
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store(float* p, vec x) { _mm512_storeu_ps(p, x); }
// LANES (k, k+1) bf16 pairs, one per 32-bit lane: k (the low half, H = 0) or k + 1 (the
// high half, H = 1) of each, widened to fp32 by one shift or one mask (no shuffle).
template <int H>
inline vec widen_pair(const uint16_t* p) {
  const __m512i v = _mm512_loadu_si512(p);
  return _mm512_castsi512_ps(H == 0 ? _mm512_slli_epi32(v, 16) : _mm512_and_si512(v, _mm512_set1_epi32(-65536)));
}
inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec max(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec min(vec a, vec b) { return _mm512_min_ps(a, b); }
inline float reduce_add(vec x) { return _mm512_reduce_add_ps(x); }
inline float reduce_max(vec x) { return _mm512_reduce_max_ps(x); }
// Lane j of the result: the sum of t[j]'s lanes (16 horizontal sums for ~45 shuffles and
// adds, against ~8 dependent steps for each one alone).
inline vec transpose_sum(const vec* t) {
  __m512 r[4];
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: (t[4i], .., t[4i+3]) partial sums
    const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(t[4 * i], t[4 * i + 1]), _mm512_unpackhi_ps(t[4 * i], t[4 * i + 1]));
    const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(t[4 * i + 2], t[4 * i + 3]),
                                   _mm512_unpackhi_ps(t[4 * i + 2], t[4 * i + 3]));
    const __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b);
    r[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ad, bd)), _mm512_castpd_ps(_mm512_unpackhi_pd(ad, bd)));
  }
  const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(r[2], r[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(r[2], r[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline mask first(int n) { return static_cast<mask>(n >= LANES ? 0xffff : (1u << n) - 1u); }
inline vec select(mask m, vec x, vec otherwise) { return _mm512_mask_blend_ps(m, otherwise, x); }
inline mask ge(vec a, vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }  // lanes where a >= b
inline unsigned bits(mask m) { return m; }  // bit j: lane j
inline vec round_nearest(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec times_pow2(vec x, vec n) { return _mm512_scalef_ps(x, n); }  // x * 2^n
inline vec div(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec round_bf16(vec x) {  // to the nearest bf16 (ties to even), kept as fp32; no NaN inputs
  __m512i u = _mm512_castps_si512(x);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void store(uint16_t* p, vec x) {  // x already a bf16 value (round_bf16): keep its top half
  __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
}
}  // namespace simd
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_SIMD 1
namespace simd {
constexpr int LANES = 8;
using vec = __m256;
using mask = __m256;
inline vec zero() { return _mm256_setzero_ps(); }
inline vec set1(float x) { return _mm256_set1_ps(x); }
inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline vec load(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void store(float* p, vec x) { _mm256_storeu_ps(p, x); }
template <int H>
inline vec widen_pair(const uint16_t* p) {  // as the AVX-512 one, 8 pairs
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_castsi256_ps(H == 0 ? _mm256_slli_epi32(v, 16) : _mm256_and_si256(v, _mm256_set1_epi32(-65536)));
}
inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec max(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec min(vec a, vec b) { return _mm256_min_ps(a, b); }
inline float reduce_add(vec x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(vec x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
// Lane j of the result: the sum of t[j]'s lanes (8 horizontal sums for ~21 shuffles and adds).
inline vec transpose_sum(const vec* t) {
  __m256 r[2];
  for (int i = 0; i < 2; ++i) {  // per 128-bit lane: (t[4i], .., t[4i+3]) partial sums
    const __m256 a = _mm256_add_ps(_mm256_unpacklo_ps(t[4 * i], t[4 * i + 1]), _mm256_unpackhi_ps(t[4 * i], t[4 * i + 1]));
    const __m256 b = _mm256_add_ps(_mm256_unpacklo_ps(t[4 * i + 2], t[4 * i + 3]),
                                   _mm256_unpackhi_ps(t[4 * i + 2], t[4 * i + 3]));
    const __m256d ad = _mm256_castps_pd(a), bd = _mm256_castps_pd(b);
    r[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(ad, bd)), _mm256_castpd_ps(_mm256_unpackhi_pd(ad, bd)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(r[0], r[1], 0x20), _mm256_permute2f128_ps(r[0], r[1], 0x31));
}
inline mask first(int n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
}
inline vec select(mask m, vec x, vec otherwise) { return _mm256_blendv_ps(otherwise, x, m); }
inline mask ge(vec a, vec b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }  // lanes where a >= b
inline unsigned bits(mask m) { return static_cast<unsigned>(_mm256_movemask_ps(m)); }  // bit j: lane j
inline vec round_nearest(vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec times_pow2(vec x, vec n) {  // n integral in [-127, 127]
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(x, _mm256_castsi256_ps(e));
}
inline vec div(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec round_bf16(vec x) {  // to the nearest bf16 (ties to even), kept as fp32; no NaN inputs
  __m256i u = _mm256_castps_si256(x);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void store(uint16_t* p, vec x) {  // x already a bf16 value (round_bf16): keep its top half
  __m256i h = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);  // lanes 0-7 in the low half
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
}  // namespace simd
#else
#define HAVE_SIMD 0
#endif

#if HAVE_SIMD
namespace simd {
// e^x for x clamped to [-87, hi], to ~2 ulp: x = n ln2 + r, |r| <= ln2/2, e^x = 2^n * p(r)
// with a degree-6 polynomial (Cephes' expf).
inline vec exp_clamped(vec x, float hi) {
  x = max(x, set1(-87.f));
  x = min(x, set1(hi));
  const vec n = round_nearest(mul(x, set1(1.44269504088896341f)));
  vec r = fma(n, set1(-0.693359375f), x);
  r = fma(n, set1(2.12194440e-4f), r);
  vec p = set1(1.9875691500e-4f);
  p = fma(p, r, set1(1.3981999507e-3f));
  p = fma(p, r, set1(8.3334519073e-3f));
  p = fma(p, r, set1(4.1665795894e-2f));
  p = fma(p, r, set1(1.6666665459e-1f));
  p = fma(p, r, set1(5.0000001201e-1f));
  p = fma(p, mul(r, r), r);
  return times_pow2(add(p, set1(1.f)), n);
}

inline vec exp_nonpositive(vec x) { return exp_clamped(x, 0.f); }
inline vec exp(vec x) { return exp_clamped(x, 88.f); }  // e^x, saturating at e^88

// x rounded as a store into T rounds it (bf16: to nearest, ties to even; float: unchanged):
// the rounding each separate torch op does between the steps of a fused kernel.
inline vec as_stored(vec x, float*) { return x; }
inline vec as_stored(vec x, uint16_t*) { return round_bf16(x); }
}  // namespace simd
#endif
