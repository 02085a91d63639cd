// Paged prefill attention on CPU: a chunk of a prompt's queries (the last `num_new` of its
// `ctx` positions, causal) against its whole context, K/V read in place from the paged pool
// through the sequence's block table: no gather copy of the cached prefix, no mask tensor.
//
// Work items are (chunk, KV head, tile of query tokens). A tile's rows are its tokens times
// the G query heads of the KV head (at most 4 vectors of rows), kept transposed (Q^T, head
// dims by rows, pre-scaled), so that for each key the scores of every row are a few vector
// FMAs over a broadcast K element: S^T[key][rows]. The online softmax then runs across
// vectors of rows (running max and sum per row, no horizontal reductions), the causal mask is
// one compare per key (row position >= key position), and P V adds each V row, weighted by
// a broadcast probability, into a register tile of a few rows' accumulators. Keys go a block
// at a time (16 positions: one block of the pool); bf16 K/V blocks are widened to fp32 once
// per block and item; fp32 math throughout, one rounding at the store, as torch's SDPA does.
//
// Needs a vector ISA (simd.h: AVX-512 or AVX2), head_dim a multiple of the vector width
// (up to 256) and G <= 4 vectors' worth of rows per token; otherwise returns -1 and the
// caller runs the reference (gather + SDPA). C ABI, raw pointers, element strides.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

#if HAVE_SIMD
namespace {

constexpr int kMaxBlock = 64;  // positions per pool block read at once (the pool's block size)
constexpr int kKeyQuad = 4;  // keys scored together: 4 x RV accumulators
constexpr float kNoScore = -1e30f;  // running max before any key: finite, so alpha = e^0 = 1
// Register budget: AVX-512 has 32 vector registers, AVX2 16. Scores: kKeyQuad x RV
// accumulators (RV <= kMaxRV); P V: PV rows x HD / LANES accumulators (<= kAccRegs).
constexpr int kMaxRV = simd::LANES == 16 ? 4 : 2;
constexpr int kAccRegs = simd::LANES == 16 ? 16 : 8;

inline void widen(const float* src, float* dst, int n) { std::memcpy(dst, src, sizeof(float) * n); }
inline void widen(const uint16_t* src, float* dst, int n) {
  for (int d = 0; d < n; d += simd::LANES) simd::store(dst + d, simd::load(src + d));
}
inline float scalar(float x) { return x; }
inline float scalar(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

struct Chunk {  // one chunk's place in the flat batch and the pool
  int64_t q0;  // first query token in the flat batch
  int num_new;
  int64_t ctx;  // context length after the chunk (cached prefix + chunk)
  const int64_t* table;
};

// One work item: query tokens [t0, t0 + tokens) of a chunk, KV head h. RV vectors of rows
// (row r = token * G + g). HD: head dims; PV: rows per P V register tile.
template <typename T, int RV, int HD>
void tile_item(const T* q, int64_t q_st, int64_t q_sh, const T* k, int64_t k_sb, int64_t k_ss, int64_t k_sh,
               const T* v, int64_t v_sb, int64_t v_ss, int64_t v_sh, const Chunk& c, int h, int G, int t0,
               int tokens, int block_size, float scale, T* out, int64_t o_st, int64_t o_sh) {
  constexpr int L = simd::LANES, RP = RV * L, HV = HD / L;
  constexpr int PV = kAccRegs / HV > 0 ? kAccRegs / HV : 1;  // rows per P V register tile
  const int rows = tokens * G;
  alignas(64) float qt[HD * RP];  // Q^T, scaled
  alignas(64) float acc[RP * HD];  // output accumulators, row-major
  alignas(64) float pt[kMaxBlock * RP];  // P^T of the current block
  alignas(64) float kf[kMaxBlock * HD], vf[kMaxBlock * HD];  // the block's K, V rows as fp32
  alignas(64) float m[RP], l[RP], alpha[RP], pos[RP];
  std::fill(qt, qt + HD * RP, 0.f);
  std::fill(acc, acc + rows * HD, 0.f);
  const int64_t first_pos = c.ctx - c.num_new + t0;  // the tile's first query position
  for (int r = 0; r < RP; ++r) {
    m[r] = kNoScore;
    l[r] = 0.f;
    pos[r] = r < rows ? static_cast<float>(first_pos + r / G) : -1.f;  // padding rows see no key
  }
  for (int r = 0; r < rows; ++r) {
    const T* qr = q + (c.q0 + t0 + r / G) * q_st + static_cast<int64_t>(h * G + r % G) * q_sh;
    for (int d = 0; d < HD; ++d) qt[d * RP + r] = scalar(qr[d]) * scale;
  }
  const int64_t last = first_pos + tokens - 1;  // the last key position any row of the tile sees
  for (int64_t p0 = 0, bi = 0; p0 <= last; p0 += block_size, ++bi) {
    const int n = static_cast<int>(std::min<int64_t>(block_size, last + 1 - p0));  // keys used in this block
    const int nq = (n + kKeyQuad - 1) / kKeyQuad * kKeyQuad;  // scored (in-block rows past n are never used)
    const T* kb = k + c.table[bi] * k_sb + h * k_sh;
    const T* vb = v + c.table[bi] * v_sb + h * v_sh;
    for (int j = 0; j < nq; ++j) widen(kb + j * k_ss, kf + j * HD, HD);
    for (int j = 0; j < n; ++j) widen(vb + j * v_ss, vf + j * HD, HD);
    // S^T: four keys at a time, every row vector.
    simd::vec s[kMaxBlock][RV];
    for (int j = 0; j < nq; j += kKeyQuad) {
      simd::vec a[kKeyQuad][RV];
      for (int kk = 0; kk < kKeyQuad; ++kk)
        for (int rv = 0; rv < RV; ++rv) a[kk][rv] = simd::zero();
      for (int d = 0; d < HD; ++d) {
        simd::vec qv[RV];
        for (int rv = 0; rv < RV; ++rv) qv[rv] = simd::load(qt + d * RP + rv * L);
        for (int kk = 0; kk < kKeyQuad; ++kk) {
          const simd::vec kd = simd::set1(kf[(j + kk) * HD + d]);
          for (int rv = 0; rv < RV; ++rv) a[kk][rv] = simd::fma(kd, qv[rv], a[kk][rv]);
        }
      }
      for (int kk = 0; kk < kKeyQuad; ++kk)
        for (int rv = 0; rv < RV; ++rv) s[j + kk][rv] = a[kk][rv];
    }
    // Online softmax across row vectors: causal mask, new max, alpha, probabilities.
    for (int rv = 0; rv < RV; ++rv) {
      const simd::vec rp = simd::load(pos + rv * L);
      const simd::vec m_old = simd::load(m + rv * L);
      simd::vec m_new = m_old;
      simd::mask ok[kMaxBlock];  // row sees key p0 + j
      for (int j = 0; j < n; ++j) {
        ok[j] = simd::ge(rp, simd::set1(static_cast<float>(p0 + j)));
        s[j][rv] = simd::select(ok[j], s[j][rv], simd::set1(-INFINITY));
        m_new = simd::max(m_new, s[j][rv]);
      }
      simd::vec sum = simd::zero();
      for (int j = 0; j < n; ++j) {
        const simd::vec p = simd::exp_nonpositive(simd::sub(s[j][rv], m_new));
        const simd::vec pm = simd::select(ok[j], p, simd::zero());
        simd::store(pt + j * RP + rv * L, pm);
        sum = simd::add(sum, pm);
      }
      const simd::vec al = simd::exp_nonpositive(simd::sub(m_old, m_new));
      simd::store(alpha + rv * L, al);
      simd::store(l + rv * L, simd::fma(simd::load(l + rv * L), al, sum));
      simd::store(m + rv * L, m_new);
    }
    // acc = acc * alpha + P V, PV rows at a time.
    for (int r0 = 0; r0 < rows; r0 += PV) {
      const int nr = std::min(PV, rows - r0);
      simd::vec o[PV][HV];
      for (int rr = 0; rr < PV; ++rr) {
        const simd::vec al = simd::set1(alpha[r0 + rr]);
        for (int c2 = 0; c2 < HV; ++c2)
          o[rr][c2] = rr < nr ? simd::mul(simd::load(acc + (r0 + rr) * HD + c2 * L), al) : simd::zero();
      }
      for (int j = 0; j < n; ++j) {
        simd::vec vv[HV];
        for (int c2 = 0; c2 < HV; ++c2) vv[c2] = simd::load(vf + j * HD + c2 * L);
        for (int rr = 0; rr < PV; ++rr) {
          const simd::vec p = simd::set1(pt[j * RP + r0 + rr]);  // padding rows read their own zeros
          for (int c2 = 0; c2 < HV; ++c2) o[rr][c2] = simd::fma(p, vv[c2], o[rr][c2]);
        }
      }
      for (int rr = 0; rr < nr; ++rr)
        for (int c2 = 0; c2 < HV; ++c2) simd::store(acc + (r0 + rr) * HD + c2 * L, o[rr][c2]);
    }
  }
  for (int r = 0; r < rows; ++r) {
    const simd::vec inv = simd::set1(1.f / l[r]);  // l > 0: key 0 is in every row's context
    T* dst = out + (c.q0 + t0 + r / G) * o_st + static_cast<int64_t>(h * G + r % G) * o_sh;
    for (int c2 = 0; c2 < HV; ++c2)
      simd::store(dst + c2 * L, simd::as_stored(simd::mul(simd::load(acc + r * HD + c2 * L), inv), dst));
  }
}

template <typename T, int RV, int HD>
void run(const T* q, int64_t q_st, int64_t q_sh, const T* k, int64_t k_sb, int64_t k_ss, int64_t k_sh, const T* v,
         int64_t v_sb, int64_t v_ss, int64_t v_sh, const int64_t* cu, const int64_t* lens, const int64_t* tables,
         int64_t tables_st, int num_seqs, int kv_heads, int G, int block_size, float scale, T* out, int64_t o_st,
         int64_t o_sh, int threads) {
  const int tile_tokens = RV * simd::LANES / G;
  // Items: (chunk, tile, KV head), the longest-context tiles first (dynamic schedule).
  std::vector<int64_t> start(num_seqs + 1, 0);  // first item of each chunk
  for (int s = 0; s < num_seqs; ++s)
    start[s + 1] = start[s] + static_cast<int64_t>((cu[s + 1] - cu[s] + tile_tokens - 1) / tile_tokens) * kv_heads;
  const int64_t items = start[num_seqs];
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t w = 0; w < items; ++w) {
    const int s = static_cast<int>(std::upper_bound(start.begin(), start.end(), w) - start.begin() - 1);
    const int64_t local = w - start[s];
    const int tiles = static_cast<int>((start[s + 1] - start[s]) / kv_heads);
    const int tile = tiles - 1 - static_cast<int>(local / kv_heads);  // last tile (most keys) first
    const int h = static_cast<int>(local % kv_heads);
    const Chunk c{cu[s], static_cast<int>(cu[s + 1] - cu[s]), lens[s], tables + s * tables_st};
    const int t0 = tile * tile_tokens;
    tile_item<T, RV, HD>(q, q_st, q_sh, k, k_sb, k_ss, k_sh, v, v_sb, v_ss, v_sh, c, h, G, t0,
                         std::min(tile_tokens, c.num_new - t0), block_size, scale, out, o_st, o_sh);
  }
}

template <typename T, int HD>
bool run_rv(int G, const T* q, int64_t q_st, int64_t q_sh, const T* k, int64_t k_sb, int64_t k_ss, int64_t k_sh,
            const T* v, int64_t v_sb, int64_t v_ss, int64_t v_sh, const int64_t* cu, const int64_t* lens,
            const int64_t* tables, int64_t tables_st, int num_seqs, int kv_heads, int block_size, float scale, T* out,
            int64_t o_st, int64_t o_sh, int threads) {
  // Row vectors per tile: enough for the longest chunk's rows, at most kMaxRV (short chunks,
  // e.g. a few tokens of a prompt's tail, do not pay for padding rows).
  if (G > kMaxRV * simd::LANES) return false;
  int64_t longest = 1;
  for (int s = 0; s < num_seqs; ++s) longest = std::max<int64_t>(longest, cu[s + 1] - cu[s]);
  const int rv = static_cast<int>(std::min<int64_t>(kMaxRV, (longest * G + simd::LANES - 1) / simd::LANES));
#define PDSERVE_RUN(RVN) \
  run<T, RVN, HD>(q, q_st, q_sh, k, k_sb, k_ss, k_sh, v, v_sb, v_ss, v_sh, cu, lens, tables, tables_st, num_seqs, \
                  kv_heads, G, block_size, scale, out, o_st, o_sh, threads)
  switch (rv) {
    case 1: PDSERVE_RUN(1); break;
    case 2: PDSERVE_RUN(2); break;
    case 3: if constexpr (kMaxRV >= 3) PDSERVE_RUN(3); break;
    default: if constexpr (kMaxRV >= 4) PDSERVE_RUN(4); break;
  }
#undef PDSERVE_RUN
  return true;
}

template <typename T>
int dispatch(const T* q, int64_t q_st, int64_t q_sh, const T* k, int64_t k_sb, int64_t k_ss, int64_t k_sh, const T* v,
             int64_t v_sb, int64_t v_ss, int64_t v_sh, const int64_t* cu, const int64_t* lens, const int64_t* tables,
             int64_t tables_st, int num_seqs, int num_heads, int kv_heads, int head_dim, int block_size, float scale,
             T* out, int64_t o_st, int64_t o_sh, int threads) {
  if (kv_heads <= 0 || num_heads % kv_heads != 0 || block_size <= 0 || block_size > kMaxBlock) return -1;
  for (int s = 0; s < num_seqs; ++s)  // every chunk ends its context and fits in it
    if (cu[s + 1] < cu[s] || lens[s] < cu[s + 1] - cu[s]) return -1;
  const int G = num_heads / kv_heads;
  bool done = false;
#define PDSERVE_HD(HDN)                                                                                            \
  done = run_rv<T, HDN>(G, q, q_st, q_sh, k, k_sb, k_ss, k_sh, v, v_sb, v_ss, v_sh, cu, lens, tables, tables_st, \
                        num_seqs, kv_heads, block_size, scale, out, o_st, o_sh, threads)
  if (head_dim == 64)
    PDSERVE_HD(64);
  else if (head_dim == 128)
    PDSERVE_HD(128);
#undef PDSERVE_HD
  return done ? 0 : -1;
}

}  // namespace
#endif

extern "C" {

// dtype: 0 float32, 1 bfloat16. Strides in elements. cu: [num_seqs + 1] query offsets of
// the chunks in the flat batch; lens: [num_seqs] context lengths (each chunk the last
// positions of its context). Returns 0, or -1 where the kernel does not serve the shapes.
int pdserve_paged_prefill(int dtype, const void* q, int64_t q_st, int64_t q_sh, const void* k, int64_t k_sb,
                          int64_t k_ss, int64_t k_sh, const void* v, int64_t v_sb, int64_t v_ss, int64_t v_sh,
                          const int64_t* cu, const int64_t* lens, const int64_t* tables, int64_t tables_st, void* out,
                          int64_t o_st, int64_t o_sh, int num_seqs, int num_heads, int kv_heads, int head_dim,
                          int block_size, float scale, int threads) {
#if HAVE_SIMD
  if (dtype == 0)
    return dispatch(static_cast<const float*>(q), q_st, q_sh, static_cast<const float*>(k), k_sb, k_ss, k_sh,
                    static_cast<const float*>(v), v_sb, v_ss, v_sh, cu, lens, tables, tables_st, num_seqs, num_heads,
                    kv_heads, head_dim, block_size, scale, static_cast<float*>(out), o_st, o_sh, threads);
  if (dtype == 1)
    return dispatch(static_cast<const uint16_t*>(q), q_st, q_sh, static_cast<const uint16_t*>(k), k_sb, k_ss, k_sh,
                    static_cast<const uint16_t*>(v), v_sb, v_ss, v_sh, cu, lens, tables, tables_st, num_seqs,
                    num_heads, kv_heads, head_dim, block_size, scale, static_cast<uint16_t*>(out), o_st, o_sh,
                    threads);
#endif
  return -1;
}

}  // extern "C"
