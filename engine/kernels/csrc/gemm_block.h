// The FMA core of the few-row GEMMs (small_gemm.cpp over float weights, int8_gemm.cpp over the fp32 scratch a
// block of int8 weight rows is dequantized into): R weight rows against M input rows, R * M accumulators in
// registers. Every output is one FMA chain of simd::LANES lanes over k and then simd::reduce_add, whatever M
// and R are, so a row's result never depends on the other rows of the call.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "simd.h"

namespace gemm_block {

// The weight bytes to pull toward the core during a pass: at element k of the pass, the byte
// base + i * row_bytes + start + k * rate / 65536 for each of the R rows (rate 16.16 fixed point). Fetched into
// L2 (a prefetch into L1 left the memory idle on these streams: docs/performance.md). A hint only (never
// faults): the address may lie past the weight and is formed as an integer.
struct Prefetch {
  const char* base;
  int64_t row_bytes, start, rate;
};

inline void prefetch_l2(const char* base, int64_t offset) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + offset), _MM_HINT_T1);
}

// y[m * N + i] = x[m, :] . w[i, :] for m < M, i < R: w the block's first weight row (row stride K), y its column.
// Not inlined: inlined into its callers' loops, GCC kept the accumulators on the stack (a store and a load per FMA)
template <int M, int R, typename W>
__attribute__((noinline)) void block(const float* __restrict x, const W* __restrict w, float* __restrict y, int64_t K, int64_t N,
                  Prefetch ahead) {
  using simd::LANES;
  using simd::Vec;
  int64_t at = ahead.start << 16;
  const int64_t step = ahead.rate * LANES;
  Vec acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) acc[i][m] = simd::zero();
  const int64_t full = K / LANES * LANES;
  for (int64_t k = 0; k < full; k += LANES) {
    Vec xv[M];
    for (int m = 0; m < M; ++m) xv[m] = simd::load(x + m * K + k);
    for (int i = 0; i < R; ++i) {
      prefetch_l2(ahead.base, i * ahead.row_bytes + (at >> 16));
      const Vec wv = simd::load(w + i * K + k);
      for (int m = 0; m < M; ++m) acc[i][m] = simd::fmadd(wv, xv[m], acc[i][m]);
    }
    at += step;
  }
  if (full < K) {  // the K tail: lanes past it load as 0 and add 0
    Vec xv[M];
    for (int m = 0; m < M; ++m) xv[m] = simd::load_first(x + m * K + full, K - full);
    for (int i = 0; i < R; ++i) {
      const Vec wv = simd::load_first(w + i * K + full, K - full);
      for (int m = 0; m < M; ++m) acc[i][m] = simd::fmadd(wv, xv[m], acc[i][m]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) y[m * N + i] = simd::reduce_add(acc[i][m]);
}

// block<m, R> for a run-time m <= Mc
template <int Mc, int R, typename W>
inline void pass(int64_t m, const float* x, const W* w, float* y, int64_t K, int64_t N, Prefetch ahead) {
  if constexpr (Mc > 1) {
    if (m < Mc) return pass<Mc - 1, R>(m, x, w, y, K, N, ahead);
  }
  block<Mc, R>(x, w, y, K, N, ahead);
}

}  // namespace gemm_block
