// Small-batch bf16 matmul, out = x W^T (+ bias), for decode steps (a few rows of x against
// every weight of the model): W is packed once as [N/16][K/2][16][2], so one 64-byte load
// holds the (k, k+1) pair of 16 output rows, and one AVX512-BF16 `vdpbf16ps` per row of x
// adds both products into 16 fp32 accumulators. The weights stream through memory once, in
// order, with no horizontal sums; rows of x go 8 at a time, so the block of W they share
// (16 output rows, K/2 pairs: 18 KB for K = 576) is re-read from cache, not memory. fp32
// accumulation, one rounding to bf16 at the end (bias added first), as oneDNN does. Above 8
// rows, register tiles of 12 rows x 32 outputs (`tile`): there the dots are the bound.
//
// Needs AVX512-BF16 at run time: the function is compiled for it (target attribute) and
// returns -1 on a CPU without it, or for N not a multiple of 16 or K odd; the caller then
// keeps oneDNN / F.linear. Built into the same library as the other kernels (native.py).
#include <cstdint>
#include <cstring>

#include "simd.h"

#if defined(__AVX512F__)
namespace {

constexpr int kRows = 16;  // output rows per packed block: one zmm of fp32 accumulators
constexpr int kAhead = 32;  // pairs to prefetch ahead (2 KB of W)
constexpr int kGemvRows = 8;  // up to this many rows: the weight-streaming gemv, above: register tiles

// The (k, k+1) pair of x's row broadcast to every lane, loaded as one 32-bit broadcast
// (a load-port op; a broadcast from a general register would compete with the dots).
__attribute__((target("avx512f,avx512bf16"))) inline __m512bh pair_of(const uint16_t* row, int p) {
  return (__m512bh)_mm512_castps_si512(_mm512_broadcastss_ps(_mm_load_ss(reinterpret_cast<const float*>(row + 2 * p))));
}

// MB rows of x against one packed block; KS independent accumulators per row hide the
// latency of the dot instruction when MB is small.
template <int MB, int KS>
__attribute__((target("avx512f,avx512bf16"))) void block_dot(const uint16_t* x, int64_t x_st,
                                                             const uint16_t* w, int pairs, __m512* acc_out) {
  __m512 acc[MB][KS];
  for (int m = 0; m < MB; ++m)
    for (int s = 0; s < KS; ++s) acc[m][s] = _mm512_setzero_ps();
  int p = 0;
  for (; p + KS <= pairs; p += KS) {
    for (int s = 0; s < KS; ++s) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + static_cast<int64_t>(p + s) * 2 * kRows);
      for (int m = 0; m < MB; ++m) acc[m][s] = _mm512_dpbf16_ps(acc[m][s], wv, pair_of(x + m * x_st, p + s));
    }
    _mm_prefetch(reinterpret_cast<const char*>(w + static_cast<int64_t>(p + kAhead) * 2 * kRows), _MM_HINT_T0);
  }
  for (; p < pairs; ++p) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + static_cast<int64_t>(p) * 2 * kRows);
    for (int m = 0; m < MB; ++m) acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, pair_of(x + m * x_st, p));
  }
  for (int m = 0; m < MB; ++m) {
    __m512 sum = acc[m][0];
    for (int s = 1; s < KS; ++s) sum = _mm512_add_ps(sum, acc[m][s]);
    acc_out[m] = sum;
  }
}

template <int MB, int KS>
__attribute__((target("avx512f,avx512bf16"))) void rows_block(const uint16_t* x, int64_t x_st, const uint16_t* w,
                                                              int pairs, const uint16_t* bias, uint16_t* out,
                                                              int64_t o_st) {
  __m512 acc[MB];
  block_dot<MB, KS>(x, x_st, w, pairs, acc);
  const __m512 b = bias != nullptr ? simd::load(bias) : _mm512_setzero_ps();
  for (int m = 0; m < MB; ++m) simd::store(out + m * o_st, simd::round_bf16(_mm512_add_ps(acc[m], b)));
}

// Above a few rows the dots are the bound, not the weights: a register tile of MB rows of x
// by NB packed blocks (12 x 2 x 16: 24 accumulators) takes, per pair, NB weight loads, MB
// broadcasts and MB x NB dots, so each weight load feeds 12 dots instead of 8, and the
// dots' latency is hidden by 24 independent chains.
template <int MB, int NB>
__attribute__((target("avx512f,avx512bf16"))) void tile(const uint16_t* x, int64_t x_st, const uint16_t* w,
                                                        int64_t block_st, int pairs, const uint16_t* bias,
                                                        uint16_t* out, int64_t o_st) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int p = 0; p < pairs; ++p) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = (__m512bh)_mm512_loadu_si512(w + j * block_st + static_cast<int64_t>(p) * 2 * kRows);
      _mm_prefetch(reinterpret_cast<const char*>(w + j * block_st + static_cast<int64_t>(p + kAhead) * 2 * kRows),
                   _MM_HINT_T0);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512bh xb = pair_of(x + m * x_st, p);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xb);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __m512 b = bias != nullptr ? simd::load(bias + j * kRows) : _mm512_setzero_ps();
    for (int m = 0; m < MB; ++m) simd::store(out + m * o_st + j * kRows, simd::round_bf16(_mm512_add_ps(acc[m][j], b)));
  }
}

constexpr int kTileRows = 12;
constexpr int kTileBlocks = 2;

// Rows [0, m) against NB blocks: tiles of 12 rows, then the remainder.
template <int NB, int MB = kTileRows - 1>
__attribute__((target("avx512f,avx512bf16"))) void tile_rest(int rest, const uint16_t* x, int64_t x_st,
                                                             const uint16_t* w, int64_t block_st, int pairs,
                                                             const uint16_t* bias, uint16_t* out, int64_t o_st) {
  if (rest == MB) return tile<MB, NB>(x, x_st, w, block_st, pairs, bias, out, o_st);
  if constexpr (MB > 1) tile_rest<NB, MB - 1>(rest, x, x_st, w, block_st, pairs, bias, out, o_st);
}

template <int NB>
__attribute__((target("avx512f,avx512bf16"))) void tile_rows(const uint16_t* x, int64_t x_st, const uint16_t* w,
                                                             int64_t block_st, int m, int pairs, const uint16_t* bias,
                                                             uint16_t* out, int64_t o_st) {
  int r = 0;
  for (; r + kTileRows <= m; r += kTileRows)
    tile<kTileRows, NB>(x + r * x_st, x_st, w, block_st, pairs, bias, out + r * o_st, o_st);
  if (r < m) tile_rest<NB>(m - r, x + r * x_st, x_st, w, block_st, pairs, bias, out + r * o_st, o_st);
}

__attribute__((target("avx512f,avx512bf16"))) void gemm_tiles(const uint16_t* x, int64_t x_st, const uint16_t* packed,
                                                              const uint16_t* bias, uint16_t* out, int64_t o_st,
                                                              int m, int n, int k, int threads) {
  const int blocks = n / kRows, pairs = k / 2;
  const int groups = (blocks + kTileBlocks - 1) / kTileBlocks;
  const int64_t block_st = static_cast<int64_t>(pairs) * 2 * kRows;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int g = 0; g < groups; ++g) {
    const int b0 = g * kTileBlocks;
    const uint16_t* w = packed + b0 * block_st;
    const uint16_t* b = bias != nullptr ? bias + b0 * kRows : nullptr;
    if (blocks - b0 >= 2)
      tile_rows<2>(x, x_st, w, block_st, m, pairs, b, out + b0 * kRows, o_st);
    else
      tile_rows<1>(x, x_st, w, block_st, m, pairs, b, out + b0 * kRows, o_st);
  }
}

__attribute__((target("avx512f,avx512bf16"))) void gemv(const uint16_t* x, int64_t x_st, const uint16_t* packed,
                                                        const uint16_t* bias, uint16_t* out, int64_t o_st, int m,
                                                        int n, int k, int threads) {
  const int blocks = n / kRows, pairs = k / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int nb = 0; nb < blocks; ++nb) {
    const uint16_t* w = packed + static_cast<int64_t>(nb) * pairs * 2 * kRows;
    const uint16_t* b = bias != nullptr ? bias + nb * kRows : nullptr;
    uint16_t* o = out + nb * kRows;
    int r = 0;
    for (; r + 8 <= m; r += 8) rows_block<8, 1>(x + r * x_st, x_st, w, pairs, b, o + r * o_st, o_st);
    if (r + 4 <= m) rows_block<4, 1>(x + r * x_st, x_st, w, pairs, b, o + r * o_st, o_st), r += 4;
    if (r + 2 <= m) rows_block<2, 2>(x + r * x_st, x_st, w, pairs, b, o + r * o_st, o_st), r += 2;
    if (r < m) rows_block<1, 4>(x + r * x_st, x_st, w, pairs, b, o + r * o_st, o_st);
  }
}

}  // namespace
#endif

extern "C" {

// x [m, k] bf16 (row stride x_st), packed from a [n, k] weight by kernels/native.py's
// pack_gemv_weight, bias [n] bf16 or null, out [m, n] bf16 (row stride o_st).
int pdserve_gemv_bf16(const void* x, int64_t x_st, const void* packed, const void* bias, void* out, int64_t o_st,
                      int m, int n, int k, int threads) {
#if defined(__AVX512F__)
  if (!__builtin_cpu_supports("avx512bf16") || n % kRows != 0 || k % 2 != 0 || m < 0) return -1;
  (m > kGemvRows ? gemm_tiles : gemv)(static_cast<const uint16_t*>(x), x_st, static_cast<const uint16_t*>(packed),
                                       static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), o_st, m, n,
                                       k, threads);
  return 0;
#else
  return -1;
#endif
}

}  // extern "C"
