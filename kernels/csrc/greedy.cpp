// Greedy token choice: the index of each row's largest logit, as torch.argmax(dim=-1)
// picks it (the first index of the maximum; a row with a NaN: its first NaN). torch's CPU
// argmax walks a [32, 49152] batch-32 step's logits at ~10 GB/s (0.66 ms a step on AMD
// Zen 5); this is two vector passes over each row while it is in L2: the maximum, then the
// first index that holds it.
//
// Vector builds only (simd.h); float32 rows; returns -1 elsewhere (the caller keeps torch).
#include <cmath>
#include <cstdint>

#include "simd.h"

#if HAVE_SIMD
namespace {

using simd::LANES;
using simd::vec;

constexpr int64_t kParallelElements = 1 << 16;  // below this, one thread: OpenMP costs more

int64_t scalar_argmax(const float* x, int64_t n) {  // torch's rule: NaN beats everything
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

int64_t row_argmax(const float* x, int64_t n) {
  const int64_t nv = n / LANES * LANES;
  if (nv == 0) return scalar_argmax(x, n);
  vec m[4] = {simd::load(x), simd::load(x), simd::load(x), simd::load(x)};
  vec poison = simd::zero();  // x * 0: NaN where x is NaN or infinite
  int64_t i = 0;
  for (; i + 4 * LANES <= nv; i += 4 * LANES)
    for (int j = 0; j < 4; ++j) {
      const vec v = simd::load(x + i + j * LANES);
      m[j] = simd::max(m[j], v);
      poison = simd::add(poison, simd::mul(v, simd::zero()));
    }
  for (; i < nv; i += LANES) {
    const vec v = simd::load(x + i);
    m[0] = simd::max(m[0], v);
    poison = simd::add(poison, simd::mul(v, simd::zero()));
  }
  if (nv < n || std::isnan(simd::reduce_add(poison))) return scalar_argmax(x, n);  // NaN, inf or a tail: exact rule
  const float best = simd::reduce_max(simd::max(simd::max(m[0], m[1]), simd::max(m[2], m[3])));
  const vec b = simd::set1(best);
  for (i = 0; i < nv; i += LANES) {
    const unsigned bits = simd::bits(simd::ge(simd::load(x + i), b));
    if (bits) return i + __builtin_ctz(bits);
  }
  return scalar_argmax(x, n);  // not reached
}

}  // namespace
#endif

extern "C" {

int pdserve_argmax(const float* x, int64_t x_st, int64_t* out, int64_t rows, int64_t n, int threads) {
#if HAVE_SIMD
  if (n < 1) return -1;
#pragma omp parallel for num_threads(threads) if (rows * n >= kParallelElements && rows > 1)
  for (int64_t r = 0; r < rows; ++r) out[r] = row_argmax(x + r * x_st, n);
  return 0;
#else
  return -1;
#endif
}

}  // extern "C"
