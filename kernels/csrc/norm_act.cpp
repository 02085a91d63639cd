// The row-wise ops between a decoder layer's matmuls, each one pass over its rows instead
// of a chain of torch ops: RMS norm (optionally with the residual add before it), rotary
// embedding (rotate-half form) and SiLU-and-multiply. Each rounds to the tensor's dtype
// where kernels/reference.py's torch ops round (between ops), so bf16 results match them
// but for the last bit of the norm's rsqrt and SiLU's exp.
//
// Vector code only (simd.h); a build without a vector ISA, or a row length that is not a
// multiple of the vector width, returns -1 and the caller keeps the torch ops. C ABI, raw
// pointers, row strides in elements; called through ctypes (kernels/native.py).
#include <cmath>
#include <cstdint>

#include "simd.h"

#if HAVE_SIMD
namespace {

using simd::LANES;
using simd::vec;

constexpr int64_t kParallelElements = 1 << 15;  // below this, one thread: OpenMP costs more

// RMS norm of x (+ residual), as reference.rms_norm / add_rms_norm: the sum rounded to T
// (the residual stream out), then normalised in fp32; float32 scales by the weight in fp32,
// bf16 rounds the normalised row first and then rounds its product with the weight.
template <typename T>
void rms_norm(const T* x, int64_t x_st, const T* res, int64_t r_st, T* res_out, int64_t ro_st, const T* w, T* out,
              int64_t o_st, int64_t rows, int hidden, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * hidden >= kParallelElements)
  for (int64_t i = 0; i < rows; ++i) {
    const T* xr = x + i * x_st;
    vec ss = simd::zero();
    for (int c = 0; c < hidden; c += LANES) {
      vec v = simd::load(xr + c);
      if (res != nullptr) {
        v = simd::as_stored(simd::add(v, simd::load(res + i * r_st + c)), out);
        simd::store(res_out + i * ro_st + c, v);
      }
      ss = simd::fma(v, v, ss);
    }
    const vec inv = simd::set1(1.f / std::sqrt(simd::reduce_add(ss) / static_cast<float>(hidden) + eps));
    const T* src = res != nullptr ? res_out + i * ro_st : xr;
    for (int c = 0; c < hidden; c += LANES) {
      const vec normed = simd::as_stored(simd::mul(simd::load(src + c), inv), out);
      simd::store(out + i * o_st + c, simd::as_stored(simd::mul(normed, simd::load(w + c)), out));
    }
  }
}

// out[t, h] = x[t, h] * cos[t] + rotate_half(x[t, h]) * sin[t], each product and the sum
// rounded to T, as reference.rotary's three ops do.
template <typename T>
void rotary(const T* x, int64_t x_st, int64_t x_sh, const T* cos, const T* sin, int64_t cs_st, T* out, int64_t o_st,
            int64_t o_sh, int64_t tokens, int heads, int head_dim, int threads) {
  const int half = head_dim / 2;
#pragma omp parallel for num_threads(threads) if (tokens * heads * head_dim >= kParallelElements)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* ct = cos + t * cs_st;
    const T* st = sin + t * cs_st;
    for (int h = 0; h < heads; ++h) {
      const T* xr = x + t * x_st + h * x_sh;
      T* orow = out + t * o_st + h * o_sh;
      for (int c = 0; c < half; c += LANES) {
        const vec lo = simd::load(xr + c), hi = simd::load(xr + half + c);
        const vec lo_cos = simd::as_stored(simd::mul(lo, simd::load(ct + c)), out);
        const vec hi_sin = simd::as_stored(simd::mul(hi, simd::load(st + c)), out);  // (-hi) * sin, negated below
        const vec hi_cos = simd::as_stored(simd::mul(hi, simd::load(ct + half + c)), out);
        const vec lo_sin = simd::as_stored(simd::mul(lo, simd::load(st + half + c)), out);
        simd::store(orow + c, simd::as_stored(simd::add(lo_cos, simd::mul(hi_sin, simd::set1(-1.f))), out));
        simd::store(orow + half + c, simd::as_stored(simd::add(hi_cos, lo_sin), out));
      }
    }
  }
}

// out = silu(gate) * up, gate and up the two halves of each row of x; silu in fp32
// (x / (1 + e^-x)) rounded to T, then the product rounded to T, as F.silu(gate) * up.
template <typename T>
void silu_mul(const T* x, int64_t x_st, T* out, int64_t o_st, int64_t rows, int width, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * width >= kParallelElements)
  for (int64_t i = 0; i < rows; ++i) {
    const T* gate = x + i * x_st;
    const T* up = gate + width;
    for (int c = 0; c < width; c += LANES) {
      const vec g = simd::load(gate + c);
      const vec one = simd::set1(1.f);
      const vec act = simd::as_stored(simd::div(g, simd::add(one, simd::exp(simd::mul(g, simd::set1(-1.f))))), out);
      simd::store(out + i * o_st + c, simd::as_stored(simd::mul(act, simd::load(up + c)), out));
    }
  }
}

}  // namespace
#endif

extern "C" {

// dtype: 0 float32, 1 bfloat16. res may be null (plain RMS norm; res_out then unused).
// Returns 0, or -1 where this build or these shapes are not served.
int pdserve_rms_norm(int dtype, const void* x, int64_t x_st, const void* res, int64_t r_st, void* res_out,
                     int64_t ro_st, const void* w, void* out, int64_t o_st, int64_t rows, int hidden, float eps,
                     int threads) {
#if HAVE_SIMD
  if (hidden % LANES != 0) return -1;
  if (dtype == 0)
    rms_norm(static_cast<const float*>(x), x_st, static_cast<const float*>(res), r_st, static_cast<float*>(res_out),
             ro_st, static_cast<const float*>(w), static_cast<float*>(out), o_st, rows, hidden, eps, threads);
  else if (dtype == 1)
    rms_norm(static_cast<const uint16_t*>(x), x_st, static_cast<const uint16_t*>(res), r_st,
             static_cast<uint16_t*>(res_out), ro_st, static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out),
             o_st, rows, hidden, eps, threads);
  else
    return -1;
  return 0;
#else
  return -1;
#endif
}

int pdserve_rotary(int dtype, const void* x, int64_t x_st, int64_t x_sh, const void* cos, const void* sin,
                   int64_t cs_st, void* out, int64_t o_st, int64_t o_sh, int64_t tokens, int heads, int head_dim,
                   int threads) {
#if HAVE_SIMD
  if (head_dim % (2 * LANES) != 0) return -1;
  if (dtype == 0)
    rotary(static_cast<const float*>(x), x_st, x_sh, static_cast<const float*>(cos), static_cast<const float*>(sin),
           cs_st, static_cast<float*>(out), o_st, o_sh, tokens, heads, head_dim, threads);
  else if (dtype == 1)
    rotary(static_cast<const uint16_t*>(x), x_st, x_sh, static_cast<const uint16_t*>(cos),
           static_cast<const uint16_t*>(sin), cs_st, static_cast<uint16_t*>(out), o_st, o_sh, tokens, heads, head_dim,
           threads);
  else
    return -1;
  return 0;
#else
  return -1;
#endif
}

int pdserve_silu_mul(int dtype, const void* x, int64_t x_st, void* out, int64_t o_st, int64_t rows, int width,
                     int threads) {
#if HAVE_SIMD
  if (width % LANES != 0) return -1;
  if (dtype == 0)
    silu_mul(static_cast<const float*>(x), x_st, static_cast<float*>(out), o_st, rows, width, threads);
  else if (dtype == 1)
    silu_mul(static_cast<const uint16_t*>(x), x_st, static_cast<uint16_t*>(out), o_st, rows, width, threads);
  else
    return -1;
  return 0;
#else
  return -1;
#endif
}

}  // extern "C"
