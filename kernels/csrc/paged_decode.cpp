// Paged decode attention on CPU: one query token per sequence, K/V read in place from the
// paged pool through each sequence's block table (no gather copy). Grouped-query heads
// share every K/V row read: a row is used by the G query heads of its KV head.
//
// Where the build has a vector ISA (simd.h: AVX-512 or AVX2), head_dim is 64 or 128, the
// block size a multiple of the vector width and G <= 8, `decode_simd` runs: work items are
// (sequence, part of its context), each walking its blocks once and taking every KV head of
// a block while it is in cache (and prefetching the next block, far away in the block-major
// pool); scores a vector's worth of positions at a time, summed across lanes together; an
// online softmax (running max and sum: K and V read once, no score buffer); the parts of a
// split context merged at the end. Anything else takes `decode`, plain loops over
// (sequence, KV head) items that keep every score.
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
constexpr int L = simd::LANES;
constexpr int AHEAD = 1;  // blocks prefetched ahead (2 or 3 measured no better, into L1 or L2)

// Scores of L positions (one block's rows [row, row + L)) for the G query heads of one KV
// head: sc[g][j] = q_g . k_j (q already scaled). Each K row is widened to fp32 once (into
// `kf`, from L1 after the first head), each dot product left as a vector of partial sums,
// and the L of them summed across lanes together (simd::transpose_sum).
template <typename T, int G, int HD>
inline void scores_fma(const float* qf, const T* kb, int64_t k_ss, float* kf, float (*sc)[L]) {
  constexpr int C = HD / L;
  const float* rows[L];
  for (int j = 0; j < L; ++j) {
    if constexpr (sizeof(T) == sizeof(float)) {
      rows[j] = reinterpret_cast<const float*>(kb + j * k_ss);
    } else {
      for (int c = 0; c < C; ++c) simd::store(kf + j * HD + c * L, simd::load(kb + j * k_ss + c * L));
      rows[j] = kf + j * HD;
    }
  }
  for (int g = 0; g < G; ++g) {
    const float* qg = qf + g * HD;
    simd::vec t[L];
    for (int j = 0; j < L; ++j) {
      simd::vec a = simd::mul(simd::load(qg), simd::load(rows[j]));
      for (int c = 1; c < C; ++c) a = simd::fma(simd::load(qg + c * L), simd::load(rows[j] + c * L), a);
      t[j] = a;
    }
    simd::store(sc[g], simd::transpose_sum(t));
  }
}

#if defined(__AVX512F__)
// scores_fma for bf16 on CPUs with AVX512-BF16: `vdpbf16ps` multiplies bf16 pairs of q and
// k and adds both products into fp32 lanes, so rows are read as they lie (no widening) and
// a 64-wide dot is two instructions. q unscaled; the scale is applied to the sums.
template <int G, int HD>
__attribute__((target("avx512f,avx512bf16"))) void scores_dots(const uint16_t* q, int64_t q_sh, const uint16_t* kb,
                                                               int64_t k_ss, float scale, float (*sc)[L]) {
  constexpr int P = HD / 32;  // 32 bf16 per zmm
  for (int g = 0; g < G; ++g) {
    __m512bh qv[P];
    for (int p = 0; p < P; ++p) qv[p] = (__m512bh)_mm512_loadu_si512(q + g * q_sh + 32 * p);
    __m512 t[L];
    for (int j = 0; j < L; ++j) {
      __m512 a = _mm512_setzero_ps();
      for (int p = 0; p < P; ++p) a = _mm512_dpbf16_ps(a, qv[p], (__m512bh)_mm512_loadu_si512(kb + j * k_ss + 32 * p));
      t[j] = a;
    }
    _mm512_storeu_ps(sc[g], _mm512_mul_ps(simd::transpose_sum(t), _mm512_set1_ps(scale)));
  }
}
#endif

// Per query head, the running state of an online softmax over part of a context.
struct Partial {
  float* m;    // [heads] running max of the scores
  float* l;    // [heads] running sum of e^(score - m)
  float* acc;  // [heads][HD] running sum of e^(score - m) v
};

// Positions [p_begin, p_end) of sequence s, every KV head, into `st` (reset first). A work
// item walks the sequence's blocks once and takes all KV heads of each block while it is in
// cache: the block's K (and V) rows for one layer are one contiguous run, read in order.
template <typename T, int G, int HD, bool DOTS>
void decode_part(const T* q, int64_t q_sh, const T* k, int64_t k_sb, int64_t k_ss, int64_t k_sh, const T* v,
                 int64_t v_sb, int64_t v_ss, int64_t v_sh, const int64_t* table, int64_t p_begin, int64_t p_end,
                 int kv_heads, int block_size, float scale, float* qf, float* kf, Partial st) {
  constexpr int C = HD / L;
  const int heads = kv_heads * G;
  for (int hq = 0; hq < heads; ++hq) {
    st.m[hq] = -INFINITY;
    st.l[hq] = 0.f;
    for (int c = 0; c < C; ++c) simd::store(st.acc + hq * HD + c * L, simd::zero());
    if constexpr (!DOTS)
      for (int c = 0; c < C; ++c)
        simd::store(qf + hq * HD + c * L, simd::mul(simd::load(q + hq * q_sh + c * L), simd::set1(scale)));
  }
  alignas(64) float sc[G][L];
  const int64_t span = static_cast<int64_t>(block_size) * k_ss * sizeof(T);
  for (int64_t p0 = p_begin, i = 0; i < AHEAD && p0 < p_end; p0 += block_size, ++i) {
    const char* kb = reinterpret_cast<const char*>(k + table[p0 / block_size] * k_sb);
    const char* vb = reinterpret_cast<const char*>(v + table[p0 / block_size] * v_sb);
    for (int64_t off = 0; off < span; off += 64) {
      __builtin_prefetch(kb + off);
      __builtin_prefetch(vb + off);
    }
  }
  for (int64_t p0 = p_begin; p0 < p_end; p0 += L) {  // L positions at a time, all in one block
    const int n = static_cast<int>(p_end - p0 < L ? p_end - p0 : L);
    const int64_t block = table[p0 / block_size], row = p0 % block_size;
    const simd::mask valid = simd::first(n);
    // The next block is 100s of KiB away (block-major pool): no hardware prefetcher guesses
    // it, so ask for its K and V rows while this one is computed: a share per KV head, spread
    // over the head's V rows (a burst of 2 x 4 KB per head at once measured 0.92x in float32
    // with the pool in memory, not cache: it stalls on the miss buffers the loads need).
    const char* next_k = nullptr;
    const char* next_v = nullptr;
    int64_t share = 0;
    if (row == 0 && p0 + AHEAD * block_size < p_end) {
      const int64_t nb = table[p0 / block_size + AHEAD];
      next_k = reinterpret_cast<const char*>(k + nb * k_sb);
      next_v = reinterpret_cast<const char*>(v + nb * v_sb);
      share = (static_cast<int64_t>(block_size) * k_ss * sizeof(T) + kv_heads - 1) / kv_heads;
    }
    for (int h = 0; h < kv_heads; ++h) {
      const T* kb = k + block * k_sb + row * k_ss + h * k_sh;  // rows past n are in the block: read, then masked
#if defined(__AVX512F__)
      if constexpr (DOTS)
        scores_dots<G, HD>(reinterpret_cast<const uint16_t*>(q) + h * G * q_sh, q_sh,
                           reinterpret_cast<const uint16_t*>(kb), k_ss, scale, sc);
      else
#endif
        scores_fma<T, G, HD>(qf + h * G * HD, kb, k_ss, kf, sc);
      float alpha[G];
      for (int g = 0; g < G; ++g) {  // online softmax: rescale what came before to the new max
        const int hq = h * G + g;
        const simd::vec sv = simd::select(valid, simd::load(sc[g]), simd::set1(-INFINITY));
        const float mx = std::max(st.m[hq], simd::reduce_max(sv));
        const simd::vec pv = simd::select(valid, simd::exp_nonpositive(simd::add(sv, simd::set1(-mx))), simd::zero());
        alpha[g] = std::exp(st.m[hq] - mx);  // 0 on the first chunk (m = -inf)
        st.l[hq] = st.l[hq] * alpha[g] + simd::reduce_add(pv);
        st.m[hq] = mx;
        simd::store(sc[g], pv);
      }
      simd::vec acc[G][C];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c)
          acc[g][c] = simd::mul(simd::load(st.acc + (h * G + g) * HD + c * L), simd::set1(alpha[g]));
      const T* vb = v + block * v_sb + row * v_ss + h * v_sh;
      const int64_t pf = h * share, pf_end = (h + 1) * share, pf_step = (share + L - 1) / L;
      for (int j = 0; j < n; ++j) {  // output: each V row read once, weighted into the G accumulators
        for (int64_t off = pf + j * pf_step; off < pf + (j + 1) * pf_step && off < pf_end; off += 64) {
          __builtin_prefetch(next_k + off, 0, 2);  // into L2 (T1): L1 has too few miss buffers for 12 KB
          __builtin_prefetch(next_v + off, 0, 2);
        }
        simd::vec vr[C];
        for (int c = 0; c < C; ++c) vr[c] = simd::load(vb + j * v_ss + c * L);
        for (int g = 0; g < G; ++g) {
          const simd::vec w = simd::set1(sc[g][j]);
          for (int c = 0; c < C; ++c) acc[g][c] = simd::fma(w, vr[c], acc[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) simd::store(st.acc + (h * G + g) * HD + c * L, acc[g][c]);
    }
  }
}

// The vector path. Work items are (sequence, part of its context): one part per sequence
// when there are enough sequences to keep every thread busy, more for small batches (a
// batch of one is split across the threads), the parts' softmax states merged at the end.
template <typename T, int G, int HD, bool DOTS>
void decode_simd(const T* q, int64_t q_st, int64_t q_sh, const T* k, int64_t k_sb, int64_t k_ss, int64_t k_sh,
                 const T* v, int64_t v_sb, int64_t v_ss, int64_t v_sh, const int64_t* tables, int64_t tables_st,
                 const int64_t* lens, T* out, int64_t o_st, int64_t o_sh, int num_seqs, int kv_heads,
                 int block_size, float scale, int threads) {
  const int heads = kv_heads * G;
  int64_t max_len = 0;
  for (int s = 0; s < num_seqs; ++s) max_len = std::max(max_len, lens[s]);
  // Parts of >= 2 blocks each: one per thread for fewer sequences than threads (each part
  // starts cold: more parts measured slower at batch 1), ~2 items per thread up to twice the
  // threads, one part when single-threaded.
  const int64_t max_parts = std::max<int64_t>(1, max_len / (2 * block_size));
  const int want = num_seqs < threads ? (threads + num_seqs - 1) / num_seqs : (2 * threads + num_seqs - 1) / num_seqs;
  const int parts = threads <= 1 ? 1 : static_cast<int>(std::min<int64_t>(max_parts, want));
  const int64_t items = static_cast<int64_t>(num_seqs) * parts;
  const int64_t per_item = static_cast<int64_t>(heads) * (HD + 2);
  std::vector<float> merged(parts > 1 ? items * per_item : 0);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> own(static_cast<size_t>(per_item + heads * HD + L * HD + 16));
    float* qf = own.data() + per_item;
    float* kf = qf + heads * HD;
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < items; ++w) {
      const int64_t s = w / parts;
      const int part = static_cast<int>(w % parts);
      const int64_t blocks = (lens[s] + block_size - 1) / block_size;
      const int64_t b0 = blocks * part / parts, b1 = blocks * (part + 1) / parts;
      float* base = parts > 1 ? merged.data() + w * per_item : own.data();
      Partial st{base, base + heads, base + 2 * heads};
      decode_part<T, G, HD, DOTS>(q + s * q_st, q_sh, k, k_sb, k_ss, k_sh, v, v_sb, v_ss, v_sh, tables + s * tables_st,
                                  b0 * block_size, std::min(lens[s], b1 * block_size), kv_heads, block_size, scale,
                                  qf, kf, st);
      if (parts == 1) {
        for (int hq = 0; hq < heads; ++hq) {
          alignas(64) float o[HD];
          const float inv = st.l[hq] > 0.f ? 1.f / st.l[hq] : 0.f;
          for (int d = 0; d < HD; ++d) o[d] = st.acc[hq * HD + d] * inv;
          store_row(o, out + s * o_st + static_cast<int64_t>(hq) * o_sh, HD);
        }
      }
    }
    if (parts > 1) {
#pragma omp for schedule(static)
      for (int64_t sh = 0; sh < static_cast<int64_t>(num_seqs) * heads; ++sh) {  // merge the parts
        const int64_t s = sh / heads;
        const int hq = static_cast<int>(sh % heads);
        float mx = -INFINITY;
        for (int p = 0; p < parts; ++p) mx = std::max(mx, merged[(s * parts + p) * per_item + hq]);
        alignas(64) float o[HD] = {};
        float l = 0.f;
        for (int p = 0; p < parts; ++p) {
          const float* b = merged.data() + (s * parts + p) * per_item;
          if (b[hq] == -INFINITY) continue;  // an empty part
          const float wgt = std::exp(b[hq] - mx);
          l += b[heads + hq] * wgt;
          const float* a = b + 2 * heads + hq * HD;
          for (int d = 0; d < HD; ++d) o[d] += a[d] * wgt;
        }
        const float inv = l > 0.f ? 1.f / l : 0.f;
        for (int d = 0; d < HD; ++d) o[d] *= inv;
        store_row(o, out + s * o_st + static_cast<int64_t>(hq) * o_sh, HD);
      }
    }
  }
}

// decode_simd for the run-time group size g (1..8); false if g is larger.
template <typename T, int HD, bool DOTS, int G = 1, typename... A>
bool run_simd(int g, A... args) {
  if (g == G) {
    decode_simd<T, G, HD, DOTS>(args...);
    return true;
  }
  if constexpr (G < 8) return run_simd<T, HD, DOTS, G + 1>(g, args...);
  return false;
}

template <typename T, bool DOTS, typename... A>
bool run_simd_hd(int head_dim, int g, A... args) {
  return head_dim == 64 ? run_simd<T, 64, DOTS>(g, args...) : run_simd<T, 128, DOTS>(g, args...);
}
#endif

template <typename T>
void dispatch(const T* q, int64_t q_st, int64_t q_sh, const T* k, int64_t k_sb, int64_t k_ss, int64_t k_sh,
              const T* v, int64_t v_sb, int64_t v_ss, int64_t v_sh, const int64_t* tables, int64_t tables_st,
              const int64_t* lens, T* out, int64_t o_st, int64_t o_sh, int num_seqs, int num_heads, int kv_heads,
              int head_dim, int block_size, float scale, int threads, bool allow_dots) {
#if HAVE_SIMD
  if (block_size % simd::LANES == 0 && (head_dim == 64 || head_dim == 128)) {
    const int g = num_heads / kv_heads;
    bool done = false;
#if defined(__AVX512F__)
    if constexpr (sizeof(T) == 2) {
      if (allow_dots && __builtin_cpu_supports("avx512bf16"))
        done = run_simd_hd<T, true>(head_dim, g, q, q_st, q_sh, k, k_sb, k_ss, k_sh, v, v_sb, v_ss, v_sh, tables,
                                    tables_st, lens, out, o_st, o_sh, num_seqs, kv_heads, block_size, scale, threads);
    }
#endif
    if (!done)
      done = run_simd_hd<T, false>(head_dim, g, q, q_st, q_sh, k, k_sb, k_ss, k_sh, v, v_sb, v_ss, v_sh, tables,
                                   tables_st, lens, out, o_st, o_sh, num_seqs, kv_heads, block_size, scale, threads);
    if (done) return;
  }
#endif
  decode(q, q_st, q_sh, k, k_sb, k_ss, k_sh, v, v_sb, v_ss, v_sh, tables, tables_st, lens, out, o_st, o_sh, num_seqs,
         num_heads, kv_heads, head_dim, block_size, scale, threads);
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16. Strides are in elements. allow_dots: 0 keeps bf16 scores on
// widened rows even where AVX512-BF16 runs (tests check both). Returns 0, or -1 on bad shapes.
int pdserve_paged_decode(int dtype, const void* q, int64_t q_st, int64_t q_sh, const void* k, int64_t k_sb,
                         int64_t k_ss, int64_t k_sh, const void* v, int64_t v_sb, int64_t v_ss, int64_t v_sh,
                         const int64_t* tables, int64_t tables_st, const int64_t* lens, void* out, int64_t o_st,
                         int64_t o_sh, int num_seqs, int num_heads, int kv_heads, int head_dim, int block_size,
                         float scale, int threads, int allow_dots) {
  if (kv_heads <= 0 || num_heads % kv_heads != 0 || num_heads / kv_heads > 64 || head_dim <= 0 || block_size <= 0)
    return -1;
  if (dtype == 0)
    dispatch(static_cast<const float*>(q), q_st, q_sh, static_cast<const float*>(k), k_sb, k_ss, k_sh,
           static_cast<const float*>(v), v_sb, v_ss, v_sh, tables, tables_st, lens, static_cast<float*>(out), o_st,
           o_sh, num_seqs, num_heads, kv_heads, head_dim, block_size, scale, threads, allow_dots != 0);
  else if (dtype == 1)
    dispatch(static_cast<const uint16_t*>(q), q_st, q_sh, static_cast<const uint16_t*>(k), k_sb, k_ss, k_sh,
           static_cast<const uint16_t*>(v), v_sb, v_ss, v_sh, tables, tables_st, lens, static_cast<uint16_t*>(out),
           o_st, o_sh, num_seqs, num_heads, kv_heads, head_dim, block_size, scale, threads, allow_dots != 0);
  else
    return -1;
  return 0;
}

}  // extern "C"
