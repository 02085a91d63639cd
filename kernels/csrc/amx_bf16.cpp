// Small-batch bf16 matmul on AMX tiles, out = x W^T (+ bias), for decode steps of up to a
// few dozen rows: W in gemv_bf16.cpp's packed layout, [N/16][K/2][16][2], whose 16
// consecutive (k, k+1) pair-rows of an N block are exactly one AMX B tile (16 rows of 64
// bytes, the VNNI layout `tdpbf16ps` reads). Each step multiplies up to 32 rows of x (two
// A tiles) by 32 output columns (two B tiles) into four fp32 C tiles, K in steps of 32.
// The tiles do 16x16x32 multiply-adds per instruction, so even a single row costs little
// compute; what is left is streaming W, once, in order. Rows beyond 32 loop inside an N
// block, whose weights (18 KB for K = 576) are then read again from cache, not memory.
//
// Needs AMX-BF16 at run time (and the kernel's permission to use the tile state, asked of
// Linux once per process); returns -1 without them, for K not a multiple of 32, or N not
// a multiple of 16, and the caller keeps its other matmul. Built into the same library as
// the other kernels (native.py).
#include <cstdint>
#include <cstring>

#include "simd.h"

#if defined(__AVX512F__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int kRows = 16;  // output columns per packed block (one B tile's width)
constexpr int kStepK = 32;  // K per tile step (one A tile's width in bf16)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row, per tile
  uint8_t rows[16] = {};
};

// tmm0..3: C (rows 0-15 x block 0, block 1; rows 16-31 x block 0, block 1); tmm4, 5: A rows
// 0-15 and 16-31; tmm6, 7: B blocks 0 and 1. `rows_hi` rows in the second row tile (0: none).
TileConfig config_for(int rows_lo, int rows_hi) {
  const int lo = rows_lo, hi = rows_hi ? rows_hi : 1;  // an unused tile still needs a valid shape
  const int rows[8] = {lo, lo, hi, hi, lo, hi, 16, 16};
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows[t]);
    c.colsb[t] = 64;  // 16 fp32 (C), 32 bf16 (A), 16 (k, k+1) pairs (B)
  }
  return c;
}

bool tile_permission() {  // Linux hands out the AMX tile state only on request
  static const bool granted = [] {
    constexpr long kReqPerm = 0x1023, kXtileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqPerm, kXtileData) == 0;
  }();
  return granted;
}

// One group of up to 32 rows of x against one or two N blocks (`two`): C tiles zeroed,
// K in steps of 32, then fp32 C out through `cbuf`, bias added, rounded to bf16.
__attribute__((target("avx512f,amx-tile,amx-bf16"))) void tile_group(
    const uint16_t* x, int64_t x_st, int rows, const uint16_t* w0, const uint16_t* w1, int pairs, bool two,
    const uint16_t* bias, uint16_t* out, int64_t o_st, float* cbuf) {
  const bool hi = rows > 16;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t xb = x_st * 2;  // bytes per row of x
  for (int p = 0; p < pairs; p += kStepK / 2) {
    _tile_loadd(4, x + 2 * p, xb);
    if (hi) _tile_loadd(5, x + 16 * x_st + 2 * p, xb);
    _tile_loadd(6, w0 + static_cast<int64_t>(p) * 2 * kRows, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (hi) _tile_dpbf16ps(2, 5, 6);
    if (two) {
      _tile_loadd(7, w1 + static_cast<int64_t>(p) * 2 * kRows, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (hi) _tile_dpbf16ps(3, 5, 7);
    }
  }
  // cbuf: [32 rows][32 columns] fp32
  _tile_stored(0, cbuf, 128);
  if (two) _tile_stored(1, cbuf + 16, 128);
  if (hi) {
    _tile_stored(2, cbuf + 16 * 32, 128);
    if (two) _tile_stored(3, cbuf + 16 * 32 + 16, 128);
  }
  const int blocks = two ? 2 : 1;
  for (int b = 0; b < blocks; ++b) {
    const __m512 bv = bias != nullptr ? simd::load(bias + b * kRows) : _mm512_setzero_ps();
    for (int m = 0; m < rows; ++m)
      simd::store(out + m * o_st + b * kRows, simd::round_bf16(_mm512_add_ps(_mm512_load_ps(cbuf + m * 32 + b * 16), bv)));
  }
}

__attribute__((target("avx512f,amx-tile,amx-bf16"))) void matmul(const uint16_t* x, int64_t x_st,
                                                                 const uint16_t* packed, const uint16_t* bias,
                                                                 uint16_t* out, int64_t o_st, int m, int n, int k,
                                                                 int threads) {
  const int blocks = n / kRows, pairs = k / 2, duos = (blocks + 1) / 2;
  const int64_t block_elems = static_cast<int64_t>(pairs) * 2 * kRows;
#pragma omp parallel num_threads(threads)
  {
    alignas(64) float cbuf[32 * 32];
    int configured = -1;  // rows of the group the tiles are set up for
#pragma omp for schedule(static)
    for (int d = 0; d < duos; ++d) {
      const int nb = 2 * d;
      const bool two = nb + 1 < blocks;
      for (int r = 0; r < m; r += 32) {
        const int rows = m - r < 32 ? m - r : 32;
        if (rows != configured) {
          const TileConfig cfg = config_for(rows < 16 ? rows : 16, rows > 16 ? rows - 16 : 0);
          _tile_loadconfig(&cfg);
          configured = rows;
        }
        tile_group(x + r * x_st, x_st, rows, packed + nb * block_elems, packed + (nb + 1) * block_elems, pairs, two,
                   bias != nullptr ? bias + nb * kRows : nullptr, out + r * o_st + nb * kRows, o_st, cbuf);
      }
    }
    if (configured != -1) _tile_release();
  }
}

}  // namespace
#endif

extern "C" {

// x [m, k] bf16 (row stride x_st), packed by kernels/native.py's pack_gemv_weight from a
// [n, k] weight, bias [n] bf16 or null, out [m, n] bf16 (row stride o_st).
int pdserve_amx_bf16(const void* x, int64_t x_st, const void* packed, const void* bias, void* out, int64_t o_st,
                     int m, int n, int k, int threads) {
#if defined(__AVX512F__) && defined(__linux__)
  if (!__builtin_cpu_supports("amx-bf16") || n % kRows != 0 || k % kStepK != 0 || m < 0 || !tile_permission())
    return -1;
  matmul(static_cast<const uint16_t*>(x), x_st, static_cast<const uint16_t*>(packed),
         static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), o_st, m, n, k, threads);
  return 0;
#else
  return -1;
#endif
}

}  // extern "C"
