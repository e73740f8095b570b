// Per-row helpers shared by the C++ steps (decode_layers.cpp, head_step.cpp): each computes a row the same way
// whatever the number of rows in the call.
#pragma once
#include <cmath>
#include <cstdint>

namespace row_ops {

// y[m] = x[m] * rsqrt(mean(x[m]^2) + eps) * w, per row of H floats
inline void rms_norm(const float* x, const float* w, float* y, int64_t M, int64_t H, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * H;
    float ss = 0.f;
    for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
    float* yr = y + m * H;
    for (int64_t i = 0; i < H; ++i) yr[i] = xr[i] * r * w[i];
  }
}

// act[m, i] = silu(g) * u for gu[m] = [g (I floats); u (I floats)]
inline void swiglu(const float* gu, float* act, int64_t M, int64_t I) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < I; ++i) {
      const float g = gu[m * 2 * I + i];
      act[m * I + i] = g / (1.f + std::exp(-g)) * gu[m * 2 * I + I + i];
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
