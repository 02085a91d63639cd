// Paged decode attention on CPU: one query token per sequence, K/V read in place from the
// paged pool through each sequence's block table (no gather copy). Grouped-query heads
// share every K/V row read: a row is converted to fp32 once and used by the G query heads
// of its KV head. Scores for the whole context are kept (fp32), then one softmax and one
// pass over V. Work items are (sequence, KV head), split across OpenMP threads.
//
// Where the build has a vector ISA (simd.h: AVX-512 or AVX2), head_dim is 64 or 128, the
// block size a multiple of the vector width and G <= 8, `decode_simd` runs: the scores of
// a vector's worth of positions at a time, an online softmax (running max and sum, so K
// and V are each read once and no score buffer grows with the context), and the G query
// heads' accumulators in registers. Anything else takes `decode`, plain loops.
//
// Built by kernels/native.py with g++ once per ISA level (-march=x86-64-v4 for AVX-512,
// x86-64-v3 for AVX2). C ABI, raw pointers and element strides: called through ctypes, no
// torch headers (a build takes seconds).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "simd.h"

namespace {

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline void load_row(const float* src, float* dst, int n) { std::memcpy(dst, src, sizeof(float) * n); }

inline void load_row(const uint16_t* src, float* dst, int n) {
  uint32_t* bits = reinterpret_cast<uint32_t*>(dst);  // bf16 is the top half of an fp32
#pragma omp simd
  for (int i = 0; i < n; ++i) bits[i] = static_cast<uint32_t>(src[i]) << 16;
}

// A row as fp32: float32 rows are read where they lie, bfloat16 ones widened into `buf`.
inline const float* as_f32(const float* src, float*, int) { return src; }

inline const float* as_f32(const uint16_t* src, float* buf, int n) {
  load_row(src, buf, n);
  return buf;
}

inline void store_row(const float* src, float* dst, int n) { std::memcpy(dst, src, sizeof(float) * n); }

inline void store_row(const float* src, uint16_t* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

template <typename T>
void decode(const T* q, int64_t q_st, int64_t q_sh, const T* k, int64_t k_sb, int64_t k_ss, int64_t k_sh,
            const T* v, int64_t v_sb, int64_t v_ss, int64_t v_sh, const int64_t* tables, int64_t tables_st,
            const int64_t* lens, T* out, int64_t o_st, int64_t o_sh, int num_seqs, int num_heads, int kv_heads,
            int head_dim, int block_size, float scale, int threads) {
  const int G = num_heads / kv_heads;
  const int64_t items = static_cast<int64_t>(num_seqs) * kv_heads;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> qf, acc, row(head_dim), scores;
    qf.resize(static_cast<size_t>(G) * head_dim);
    acc.resize(static_cast<size_t>(G) * head_dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < items; ++w) {
      const int64_t s = w / kv_heads;
      const int h = static_cast<int>(w % kv_heads);
      const int64_t ctx = lens[s];
      const int64_t* table = tables + s * tables_st;
      scores.resize(static_cast<size_t>(G) * (ctx > 0 ? ctx : 1));
      for (int g = 0; g < G; ++g) {
        load_row(q + s * q_st + static_cast<int64_t>(h * G + g) * q_sh, &qf[g * head_dim], head_dim);
        for (int d = 0; d < head_dim; ++d) qf[g * head_dim + d] *= scale;
      }
      // Scores: each K row once, for the G query heads; block by block (no division per position).
      for (int64_t p0 = 0, bi = 0; p0 < ctx; p0 += block_size, ++bi) {
        const int n = static_cast<int>(ctx - p0 < block_size ? ctx - p0 : block_size);
        const T* base = k + table[bi] * k_sb + h * k_sh;
        for (int j = 0; j < n; ++j) {
          const float* kr = as_f32(base + j * k_ss, row.data(), head_dim);
          for (int g = 0; g < G; ++g) {
            const float* qg = &qf[g * head_dim];
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < head_dim; ++d) dot += qg[d] * kr[d];
            scores[g * ctx + p0 + j] = dot;
          }
        }
      }
      float inv_sum[64];  // G <= 64 (checked by the caller)
      for (int g = 0; g < G; ++g) {
        float* sg = &scores[g * ctx];
        float m = -INFINITY;
        for (int64_t p = 0; p < ctx; ++p) m = sg[p] > m ? sg[p] : m;
        float sum = 0.f;
        for (int64_t p = 0; p < ctx; ++p) {
          sg[p] = std::exp(sg[p] - m);
          sum += sg[p];
        }
        inv_sum[g] = sum > 0.f ? 1.f / sum : 0.f;
      }
      // Output: each V row once, weighted into the G accumulators.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p0 = 0, bi = 0; p0 < ctx; p0 += block_size, ++bi) {
        const int n = static_cast<int>(ctx - p0 < block_size ? ctx - p0 : block_size);
        const T* base = v + table[bi] * v_sb + h * v_sh;
        for (int j = 0; j < n; ++j) {
          const float* vr = as_f32(base + j * v_ss, row.data(), head_dim);
          for (int g = 0; g < G; ++g) {
            const float w_gp = scores[g * ctx + p0 + j];
            float* ag = &acc[g * head_dim];
#pragma omp simd
            for (int d = 0; d < head_dim; ++d) ag[d] += w_gp * vr[d];
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        float* ag = &acc[g * head_dim];
        for (int d = 0; d < head_dim; ++d) ag[d] *= inv_sum[g];
        store_row(ag, out + s * o_st + static_cast<int64_t>(h * G + g) * o_sh, head_dim);
      }
    }
  }
}

#if HAVE_SIMD
template <typename T, int G, int HD>
void decode_simd(const T* q, int64_t q_st, int64_t q_sh, const T* k, int64_t k_sb, int64_t k_ss, int64_t k_sh,
                 const T* v, int64_t v_sb, int64_t v_ss, int64_t v_sh, const int64_t* tables, int64_t tables_st,
                 const int64_t* lens, T* out, int64_t o_st, int64_t o_sh, int num_seqs, int kv_heads,
                 int block_size, float scale, int threads) {
  constexpr int L = simd::LANES;
  constexpr int C = HD / L;  // vectors per row
  const int64_t items = static_cast<int64_t>(num_seqs) * kv_heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t w = 0; w < items; ++w) {
    const int64_t s = w / kv_heads;
    const int h = static_cast<int>(w % kv_heads);
    const int64_t ctx = lens[s];
    const int64_t* table = tables + s * tables_st;
    simd::vec qv[G][C], acc[G][C];
    float m[G], l[G];
    alignas(64) float sc[G][L];
    for (int g = 0; g < G; ++g) {
      const T* qr = q + s * q_st + static_cast<int64_t>(h * G + g) * q_sh;
      for (int c = 0; c < C; ++c) {
        qv[g][c] = simd::mul(simd::load(qr + c * L), simd::set1(scale));
        acc[g][c] = simd::zero();
      }
      m[g] = -INFINITY;
      l[g] = 0.f;
    }
    for (int64_t p0 = 0; p0 < ctx; p0 += L) {  // L positions at a time, all in one block
      const int n = static_cast<int>(ctx - p0 < L ? ctx - p0 : L);
      const int64_t block = table[p0 / block_size], row = p0 % block_size;
      const T* kb = k + block * k_sb + row * k_ss + h * k_sh;
      for (int j = 0; j < n; ++j) {  // scores: each K row read once for the G heads
        simd::vec kr[C];
        for (int c = 0; c < C; ++c) kr[c] = simd::load(kb + j * k_ss + c * L);
        for (int g = 0; g < G; ++g) {
          simd::vec t = simd::mul(qv[g][0], kr[0]);
          for (int c = 1; c < C; ++c) t = simd::fma(qv[g][c], kr[c], t);
          sc[g][j] = simd::reduce_add(t);
        }
      }
      const simd::mask valid = simd::first(n);
      for (int g = 0; g < G; ++g) {  // online softmax: rescale what came before to the new max
        const simd::vec sv = simd::select(valid, simd::load(sc[g]), simd::set1(-INFINITY));
        const float mx = std::max(m[g], simd::reduce_max(sv));
        const simd::vec pv = simd::select(valid, simd::exp_nonpositive(simd::add(sv, simd::set1(-mx))), simd::zero());
        const float alpha = std::exp(m[g] - mx);  // 0 on the first chunk (m = -inf)
        l[g] = l[g] * alpha + simd::reduce_add(pv);
        for (int c = 0; c < C; ++c) acc[g][c] = simd::mul(acc[g][c], simd::set1(alpha));
        simd::store(sc[g], pv);
        m[g] = mx;
      }
      const T* vb = v + block * v_sb + row * v_ss + h * v_sh;
      for (int j = 0; j < n; ++j) {  // output: each V row read once, weighted into the G accumulators
        simd::vec vr[C];
        for (int c = 0; c < C; ++c) vr[c] = simd::load(vb + j * v_ss + c * L);
        for (int g = 0; g < G; ++g) {
          const simd::vec wgt = simd::set1(sc[g][j]);
          for (int c = 0; c < C; ++c) acc[g][c] = simd::fma(wgt, vr[c], acc[g][c]);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      alignas(64) float o[HD];
      const simd::vec inv = simd::set1(l[g] > 0.f ? 1.f / l[g] : 0.f);
      for (int c = 0; c < C; ++c) simd::store(o + c * L, simd::mul(acc[g][c], inv));
      store_row(o, out + s * o_st + static_cast<int64_t>(h * G + g) * o_sh, HD);
    }
  }
}

// decode_simd for the run-time group size g (1..8); false if g is larger.
template <typename T, int HD, int G = 1, typename... A>
bool run_simd(int g, A... args) {
  if (g == G) {
    decode_simd<T, G, HD>(args...);
    return true;
  }
  if constexpr (G < 8) return run_simd<T, HD, G + 1>(g, args...);
  return false;
}
#endif

template <typename T>
void dispatch(const T* q, int64_t q_st, int64_t q_sh, const T* k, int64_t k_sb, int64_t k_ss, int64_t k_sh,
              const T* v, int64_t v_sb, int64_t v_ss, int64_t v_sh, const int64_t* tables, int64_t tables_st,
              const int64_t* lens, T* out, int64_t o_st, int64_t o_sh, int num_seqs, int num_heads, int kv_heads,
              int head_dim, int block_size, float scale, int threads) {
#if HAVE_SIMD
  if (block_size % simd::LANES == 0 && (head_dim == 64 || head_dim == 128)) {
    const int g = num_heads / kv_heads;
    const bool done = head_dim == 64
        ? run_simd<T, 64>(g, q, q_st, q_sh, k, k_sb, k_ss, k_sh, v, v_sb, v_ss, v_sh, tables, tables_st, lens, out,
                          o_st, o_sh, num_seqs, kv_heads, block_size, scale, threads)
        : run_simd<T, 128>(g, q, q_st, q_sh, k, k_sb, k_ss, k_sh, v, v_sb, v_ss, v_sh, tables, tables_st, lens, out,
                           o_st, o_sh, num_seqs, kv_heads, block_size, scale, threads);
    if (done) return;
  }
#endif
  decode(q, q_st, q_sh, k, k_sb, k_ss, k_sh, v, v_sb, v_ss, v_sh, tables, tables_st, lens, out, o_st, o_sh, num_seqs,
         num_heads, kv_heads, head_dim, block_size, scale, threads);
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16. Strides are in elements. Returns 0, or -1 on bad shapes.
int pdserve_paged_decode(int dtype, const void* q, int64_t q_st, int64_t q_sh, const void* k, int64_t k_sb,
                         int64_t k_ss, int64_t k_sh, const void* v, int64_t v_sb, int64_t v_ss, int64_t v_sh,
                         const int64_t* tables, int64_t tables_st, const int64_t* lens, void* out, int64_t o_st,
                         int64_t o_sh, int num_seqs, int num_heads, int kv_heads, int head_dim, int block_size,
                         float scale, int threads) {
  if (kv_heads <= 0 || num_heads % kv_heads != 0 || num_heads / kv_heads > 64 || head_dim <= 0 || block_size <= 0)
    return -1;
  if (dtype == 0)
    dispatch(static_cast<const float*>(q), q_st, q_sh, static_cast<const float*>(k), k_sb, k_ss, k_sh,
           static_cast<const float*>(v), v_sb, v_ss, v_sh, tables, tables_st, lens, static_cast<float*>(out), o_st,
           o_sh, num_seqs, num_heads, kv_heads, head_dim, block_size, scale, threads);
  else if (dtype == 1)
    dispatch(static_cast<const uint16_t*>(q), q_st, q_sh, static_cast<const uint16_t*>(k), k_sb, k_ss, k_sh,
           static_cast<const uint16_t*>(v), v_sb, v_ss, v_sh, tables, tables_st, lens, static_cast<uint16_t*>(out),
           o_st, o_sh, num_seqs, num_heads, kv_heads, head_dim, block_size, scale, threads);
  else
    return -1;
  return 0;
}

}  // extern "C"
