// Small-batch matmul on fp32 FMA register tiles, out = x W^T (+ bias), for decode steps on
// CPUs without a bf16 dot product in hardware: in float32 (W packed once as [N/16][K][16],
// 16 output rows interleaved per k, so a k step reads each block's 16 weights as one 64-byte
// row), and in bf16 (W in the bf16 kernels' [N/16][K/2][16][2] layout, each 64-byte row the
// (k, k+1) pair of 16 output rows, widened to fp32 in registers by one shift or one mask per
// vector: half the bytes of float32 from memory for a few more ALU ops). A register tile of
// MB rows of x by NV vectors of outputs (AVX-512: 6 x 4 x 16 = 6 rows x 64 outputs, AVX2:
// 6 x 2 x 8) takes, per k, NV weight loads, MB broadcasts of x and MB x NV FMAs: compute
// bound at a few dozen rows, and at one row a single in-order pass over the weights.
// Rows go 6 at a time, re-reading their group's weights from cache, not memory. bf16 x is
// widened to fp32 once per call (exact); products accumulate in fp32 and round to bf16 once
// at the end, bias added first, as oneDNN's bf16 matmul does.
//
// Vector builds only (simd.h); returns -1 elsewhere or for N not a multiple of 16 (bf16: or
// K odd), and the caller keeps oneDNN / F.linear.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>

#include "simd.h"

#if HAVE_SIMD
namespace {

using simd::LANES;
using simd::vec;

constexpr int kBlock = 16;  // output rows per packed block
constexpr int kPerBlock = kBlock / LANES;  // vectors per block
constexpr int kGroupVectors = LANES == 16 ? 4 : 2;  // vectors of outputs per register tile
constexpr int kTileRows = 6;
constexpr int kAhead = 16;  // k to prefetch ahead (float32: 1 KB of a block's weights, bf16: 512 B)

// k + H of the pair at k (even), bf16 weights: acc += x[:, k + H] * W[k + H].
template <int H, int MB, int NV>
inline void pair_half(const float* x, int64_t x_st, const uint16_t* const* wj, int kk, vec (&acc)[MB][NV]) {
  vec wv[NV];
  for (int j = 0; j < NV; ++j) wv[j] = simd::widen_pair<H>(wj[j] + kk * kBlock);
  for (int m = 0; m < MB; ++m) {
    const vec xb = simd::set1(x[m * x_st + kk + H]);
    for (int j = 0; j < NV; ++j) acc[m][j] = simd::fma(xb, wv[j], acc[m][j]);
  }
}

// MB rows of x (fp32) against NV vectors of outputs starting at block `w` (blocks
// `block_st` elements apart), over all of K. W: float (one k per 16-weight row) or uint16_t
// (bf16 pairs: two k per 32-weight row); O: the output's and the bias's type.
// `ahead` (may be null): `ahead_lines` 64-byte lines to prefetch into L2 along the way,
// spread over K (a share of the next group's weights, see rows()).
template <int MB, int NV, typename W, typename O>
void tile(const float* x, int64_t x_st, const W* w, int64_t block_st, int k, const O* bias, O* out, int64_t o_st,
          const char* ahead = nullptr, int64_t ahead_lines = 0) {
  constexpr int per_k = std::is_same_v<W, float> ? 1 : 2;  // k per packed row
  const int64_t lines_per_k = k > 0 ? (ahead_lines * per_k + k - 1) / k : 0;  // per k step of the loops below
  const char* const ahead_end = ahead + 64 * ahead_lines;
  vec acc[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = simd::zero();
  const W* wj[NV];
  for (int j = 0; j < NV; ++j) wj[j] = w + (j / kPerBlock) * block_st + (j % kPerBlock) * LANES * per_k;
  if constexpr (per_k == 1) {
    for (int kk = 0; kk < k; ++kk) {
      for (int64_t i = 0; i < lines_per_k && ahead < ahead_end; ++i, ahead += 64) __builtin_prefetch(ahead, 0, 2);
      vec wv[NV];
      for (int j = 0; j < NV; ++j) {
        wv[j] = simd::load(wj[j] + kk * kBlock);
        __builtin_prefetch(wj[j] + (kk + kAhead) * kBlock);
      }
      for (int m = 0; m < MB; ++m) {
        const vec xb = simd::set1(x[m * x_st + kk]);
        for (int j = 0; j < NV; ++j) acc[m][j] = simd::fma(xb, wv[j], acc[m][j]);
      }
    }
  } else {
    // Even k, then odd k of each pair: the same 64-byte rows (L1 hits the second time),
    // so only NV widened vectors are live beside the accumulators.
    for (int kk = 0; kk < k; kk += 2) {
      for (int64_t i = 0; i < lines_per_k && ahead < ahead_end; ++i, ahead += 64) __builtin_prefetch(ahead, 0, 2);
      for (int j = 0; j < NV; ++j) __builtin_prefetch(wj[j] + (kk + kAhead) * kBlock);
      pair_half<0, MB, NV>(x, x_st, wj, kk, acc);
      pair_half<1, MB, NV>(x, x_st, wj, kk, acc);
    }
  }
  for (int j = 0; j < NV; ++j) {
    const vec b = bias != nullptr ? simd::load(bias + j * LANES) : simd::zero();
    for (int m = 0; m < MB; ++m) {
      O* o = out + m * o_st + j * LANES;
      simd::store(o, simd::as_stored(simd::add(acc[m][j], b), o));
    }
  }
}

// All rows of x against NV vectors of outputs: tiles of 6 rows, then the remainder. The
// first tile streams the group's weights from memory; the others re-read them from cache
// and leave the memory idle, so from 3 tiles on they prefetch the next group's weights
// (`next`, `next_bytes`; null for none), a share each: the next group starts from L2, and
// reading the weights overlaps the FMAs (float32 SmolLM2 at 32 rows: ~540 MB of weights a
// step; 1.12x at 32 rows with every layer's weights in memory, not cache). Not with 2
// tiles: the second, short one cannot hide a whole group (measured 0.85x at 8 rows), nor in
// the first tile, whose own weights already stream from memory (0.97x).
template <int NV, typename W, typename O>
void rows(const float* x, int64_t x_st, const W* w, int64_t block_st, int m, int k, const O* bias, O* out,
          int64_t o_st, const char* next, int64_t next_bytes) {
  const int tiles = (m + kTileRows - 1) / kTileRows;
  const int64_t lines = tiles >= 3 && next != nullptr ? (next_bytes + 63) / 64 : 0;
  auto share = [&](int t, const char** at, int64_t* n) {  // tile t's part of the next group's lines
    const bool none = lines == 0 || t == 0 || t >= tiles;
    const int64_t l0 = none ? 0 : lines * (t - 1) / (tiles - 1), l1 = none ? 0 : lines * t / (tiles - 1);
    *at = next + 64 * l0;
    *n = l1 - l0;
  };
  const char* at;
  int64_t n;
  int r = 0, t = 0;
  for (; r + kTileRows <= m; r += kTileRows, ++t) {
    share(t, &at, &n);
    tile<kTileRows, NV>(x + r * x_st, x_st, w, block_st, k, bias, out + r * o_st, o_st, at, n);
  }
  share(t, &at, &n);
  const float* xr = x + r * x_st;
  O* orow = out + r * o_st;
  switch (m - r) {
    case 5: tile<5, NV>(xr, x_st, w, block_st, k, bias, orow, o_st, at, n); break;
    case 4: tile<4, NV>(xr, x_st, w, block_st, k, bias, orow, o_st, at, n); break;
    case 3: tile<3, NV>(xr, x_st, w, block_st, k, bias, orow, o_st, at, n); break;
    case 2: tile<2, NV>(xr, x_st, w, block_st, k, bias, orow, o_st, at, n); break;
    case 1: tile<1, NV>(xr, x_st, w, block_st, k, bias, orow, o_st, at, n); break;
    default: break;
  }
}

template <typename W, typename O>
void gemm(const float* x, int64_t x_st, const W* packed, const O* bias, O* out, int64_t o_st, int m, int n, int k,
          int threads) {
  constexpr int group_blocks = kGroupVectors / kPerBlock;  // AVX-512: 4 blocks, AVX2: 1
  const int blocks = n / kBlock, groups = (blocks + group_blocks - 1) / group_blocks;
  const int64_t block_st = static_cast<int64_t>(k) * kBlock;  // both layouts: K x 16 elements a block
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int g = 0; g < groups; ++g) {
    const int b0 = g * group_blocks;
    const int nb = blocks - b0 < group_blocks ? blocks - b0 : group_blocks;
    const W* w = packed + b0 * block_st;
    const O* bg = bias != nullptr ? bias + b0 * kBlock : nullptr;
    O* o = out + b0 * kBlock;
    // The next group (this thread's next one under the static schedule, but at the end of its range).
    const int next_blocks = g + 1 < groups ? std::min(group_blocks, blocks - b0 - group_blocks) : 0;
    const char* next = next_blocks > 0 ? reinterpret_cast<const char*>(w + group_blocks * block_st) : nullptr;
    const int64_t next_bytes = next_blocks * block_st * static_cast<int64_t>(sizeof(W));
    switch (nb * kPerBlock) {
      case 4: rows<4>(x, x_st, w, block_st, m, k, bg, o, o_st, next, next_bytes); break;
      case 3: rows<3>(x, x_st, w, block_st, m, k, bg, o, o_st, next, next_bytes); break;
      case 2: rows<2>(x, x_st, w, block_st, m, k, bg, o, o_st, next, next_bytes); break;
      default: rows<1>(x, x_st, w, block_st, m, k, bg, o, o_st, next, next_bytes); break;
    }
  }
}

// bf16 rows of x [m, k] (row stride x_st) as fp32 [m, k], contiguous.
void widen_rows(const uint16_t* x, int64_t x_st, int m, int k, float* out) {
  for (int r = 0; r < m; ++r) {
    const uint16_t* src = x + r * x_st;
    float* dst = out + static_cast<int64_t>(r) * k;
    int c = 0;
    for (; c + LANES <= k; c += LANES) simd::store(dst + c, simd::load(src + c));
    for (; c < k; ++c) {
      const uint32_t bits = static_cast<uint32_t>(src[c]) << 16;
      __builtin_memcpy(dst + c, &bits, sizeof bits);
    }
  }
}

}  // namespace
#endif

extern "C" {

// x [m, k] float32 (row stride x_st), packed by kernels/native.py's pack_matmul_weight
// ("f32") from a [n, k] weight, bias [n] or null, out [m, n] (row stride o_st).
int pdserve_gemm_f32(const void* x, int64_t x_st, const void* packed, const void* bias, void* out, int64_t o_st,
                     int m, int n, int k, int threads) {
#if HAVE_SIMD
  if (n % kBlock != 0 || m < 0) return -1;
  gemm(static_cast<const float*>(x), x_st, static_cast<const float*>(packed), static_cast<const float*>(bias),
       static_cast<float*>(out), o_st, m, n, k, threads);
  return 0;
#else
  return -1;
#endif
}

// The same in bf16: x [m, k] bf16, packed in the bf16 pair layout ("fma_bf16", as "dots"),
// bias [n] bf16 or null, out [m, n] bf16.
int pdserve_gemm_bf16_fma(const void* x, int64_t x_st, const void* packed, const void* bias, void* out, int64_t o_st,
                          int m, int n, int k, int threads) {
#if HAVE_SIMD
  if (n % kBlock != 0 || k % 2 != 0 || m < 0) return -1;
  // Not a std::vector: it would zero ~3 MB at 512 rows before the widening overwrites it.
  std::unique_ptr<float[]> wide(new (std::nothrow) float[static_cast<size_t>(m) * k]);
  if (!wide) return -1;
  widen_rows(static_cast<const uint16_t*>(x), x_st, m, k, wide.get());
  gemm(wide.get(), k, static_cast<const uint16_t*>(packed), static_cast<const uint16_t*>(bias),
       static_cast<uint16_t*>(out), o_st, m, n, k, threads);
  return 0;
#else
  return -1;
#endif
}

}  // extern "C"
