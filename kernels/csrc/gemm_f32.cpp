// Small-batch float32 matmul, out = x W^T (+ bias), for decode steps in float32 (the dtype
// of CPUs without native bf16): W packed once as [N/16][K][16], 16 output rows interleaved
// per k, so a k step reads each block's 16 weights as one 64-byte row. A register tile of
// MB rows of x by NV vectors of outputs (AVX-512: 6 x 4 x 16 = 6 rows x 64 outputs, AVX2:
// 6 x 2 x 8) takes, per k, NV weight loads, MB broadcasts of x and MB x NV FMAs: compute
// bound at a few dozen rows, and at one row a single in-order pass over the weights.
// Rows go 6 at a time, re-reading their group's weights from cache, not memory.
//
// Vector builds only (simd.h); returns -1 elsewhere or for N not a multiple of 16, and the
// caller keeps F.linear.
#include <cstdint>

#include "simd.h"

#if HAVE_SIMD
namespace {

using simd::LANES;
using simd::vec;

constexpr int kBlock = 16;  // output rows per packed block
constexpr int kPerBlock = kBlock / LANES;  // vectors per block
constexpr int kGroupVectors = LANES == 16 ? 4 : 2;  // vectors of outputs per register tile
constexpr int kTileRows = 6;

// MB rows of x against NV vectors of outputs starting at block `w` (blocks `block_st`
// floats apart), over all of K.
template <int MB, int NV>
void tile(const float* x, int64_t x_st, const float* w, int64_t block_st, int k, const float* bias, float* out,
          int64_t o_st) {
  vec acc[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = simd::zero();
  const float* wj[NV];
  for (int j = 0; j < NV; ++j) wj[j] = w + (j / kPerBlock) * block_st + (j % kPerBlock) * LANES;
  for (int kk = 0; kk < k; ++kk) {
    vec wv[NV];
    for (int j = 0; j < NV; ++j) {
      wv[j] = simd::load(wj[j] + kk * kBlock);
      __builtin_prefetch(wj[j] + (kk + 16) * kBlock);
    }
    for (int m = 0; m < MB; ++m) {
      const vec xb = simd::set1(x[m * x_st + kk]);
      for (int j = 0; j < NV; ++j) acc[m][j] = simd::fma(xb, wv[j], acc[m][j]);
    }
  }
  for (int j = 0; j < NV; ++j) {
    const vec b = bias != nullptr ? simd::load(bias + j * LANES) : simd::zero();
    for (int m = 0; m < MB; ++m) simd::store(out + m * o_st + j * LANES, simd::add(acc[m][j], b));
  }
}

// All rows of x against NV vectors of outputs: tiles of 6 rows, then the remainder.
template <int NV>
void rows(const float* x, int64_t x_st, const float* w, int64_t block_st, int m, int k, const float* bias, float* out,
          int64_t o_st) {
  int r = 0;
  for (; r + kTileRows <= m; r += kTileRows)
    tile<kTileRows, NV>(x + r * x_st, x_st, w, block_st, k, bias, out + r * o_st, o_st);
  const float* xr = x + r * x_st;
  float* orow = out + r * o_st;
  switch (m - r) {
    case 5: tile<5, NV>(xr, x_st, w, block_st, k, bias, orow, o_st); break;
    case 4: tile<4, NV>(xr, x_st, w, block_st, k, bias, orow, o_st); break;
    case 3: tile<3, NV>(xr, x_st, w, block_st, k, bias, orow, o_st); break;
    case 2: tile<2, NV>(xr, x_st, w, block_st, k, bias, orow, o_st); break;
    case 1: tile<1, NV>(xr, x_st, w, block_st, k, bias, orow, o_st); break;
    default: break;
  }
}

void gemm(const float* x, int64_t x_st, const float* packed, const float* bias, float* out, int64_t o_st, int m,
          int n, int k, int threads) {
  constexpr int group_blocks = kGroupVectors / kPerBlock;  // AVX-512: 4 blocks, AVX2: 1
  const int blocks = n / kBlock, groups = (blocks + group_blocks - 1) / group_blocks;
  const int64_t block_st = static_cast<int64_t>(k) * kBlock;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int g = 0; g < groups; ++g) {
    const int b0 = g * group_blocks;
    const int nb = blocks - b0 < group_blocks ? blocks - b0 : group_blocks;
    const float* w = packed + b0 * block_st;
    const float* bg = bias != nullptr ? bias + b0 * kBlock : nullptr;
    float* o = out + b0 * kBlock;
    switch (nb * kPerBlock) {
      case 4: rows<4>(x, x_st, w, block_st, m, k, bg, o, o_st); break;
      case 3: rows<3>(x, x_st, w, block_st, m, k, bg, o, o_st); break;
      case 2: rows<2>(x, x_st, w, block_st, m, k, bg, o, o_st); break;
      default: rows<1>(x, x_st, w, block_st, m, k, bg, o, o_st); break;
    }
  }
}

}  // namespace
#endif

extern "C" {

// x [m, k] float32 (row stride x_st), packed by kernels/native.py's pack_f32_weight from a
// [n, k] weight, bias [n] or null, out [m, n] (row stride o_st).
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

}  // extern "C"
