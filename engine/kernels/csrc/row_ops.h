// Per-row helpers shared by the C++ steps (decode_layers.cpp, head_step.cpp): each computes a row the same way
// whatever the number of rows in the call.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "simd.h"

namespace row_ops {

// y[m] = x[m] * rsqrt(mean(x[m]^2) + eps) * w, per row of H floats (y may be x): the squares summed in
// simd::LANES lanes, then reduce_add
inline void rms_norm(const float* x, const float* w, float* y, int64_t M, int64_t H, float eps) {
  using simd::LANES;
  const int64_t full = H / LANES * LANES;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * H;
    simd::Vec acc = simd::zero();
    for (int64_t i = 0; i < full; i += LANES) acc = simd::fmadd(simd::load(xr + i), simd::load(xr + i), acc);
    if (full < H) acc = simd::fmadd(simd::load_first(xr + full, H - full), simd::load_first(xr + full, H - full), acc);
    const float r = 1.f / std::sqrt(simd::reduce_add(acc) / static_cast<float>(H) + eps);
    const simd::Vec rv = simd::set1(r);
    float* yr = y + m * H;
    for (int64_t i = 0; i < full; i += LANES)
      simd::store(yr + i, simd::mul(simd::mul(simd::load(xr + i), rv), simd::load(w + i)));
    for (int64_t i = full; i < H; ++i) yr[i] = xr[i] * r * w[i];
  }
}

// act[m, i] = silu(g) * u = g / (1 + e^-g) * u for gu[m] = [g (I floats); u (I floats)], simd::exp's e^x
inline void swiglu(const float* gu, float* act, int64_t M, int64_t I) {
  using simd::LANES;
  const simd::Vec one = simd::set1(1.f), zero = simd::zero();
  for (int64_t m = 0; m < M; ++m) {
    const float *g = gu + m * 2 * I, *u = g + I;
    float* a = act + m * I;
    for (int64_t i = 0; i < I; i += LANES) {
      const int64_t n = std::min<int64_t>(LANES, I - i);
      const simd::Vec gv = simd::load_first(g + i, n);
      const simd::Vec s = simd::div(gv, simd::add(one, simd::exp(simd::sub(zero, gv))));
      simd::store_first(a + i, simd::mul(s, simd::load_first(u + i, n)), n);
    }
  }
}

// the first maximum of r[0, V) (NaN counted as the maximum, like torch.argmax)
inline int64_t argmax(const float* r, int64_t V) {
  int64_t best = 0;
  for (int64_t j = 1; j < V; ++j)
    if (!std::isnan(r[best]) && (r[j] > r[best] || std::isnan(r[j]))) best = j;
  return best;
}

}  // namespace row_ops
