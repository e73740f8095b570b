// The FMA core of the few-row GEMMs (small_gemm.cpp over float weights, int8_gemm.cpp over the fp32 scratch a
// block of int8 weight rows is dequantized into): R weight rows against M input rows, R * M accumulators in
// registers. Every output is one FMA chain of simd::LANES lanes over k and then reduce_add's horizontal sum
// (simd::reduce4 sums four at once in the same order), whatever M and R are, so a row's result never depends on
// the other rows of the call.
#pragma once
#include <immintrin.h>

#include <algorithm>
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
// PF: prefetch `ahead` along the loop (else the caller has). Not inlined: inlined into its callers' loops, GCC
// kept the accumulators on the stack (a store and a load per FMA)
template <int M, int R, bool PF, typename W>
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
      if constexpr (PF) prefetch_l2(ahead.base, i * ahead.row_bytes + (at >> 16));
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
  constexpr int F = R * M;  // the outputs in acc's order: f is acc[f / M][f % M], y's row f % M, column f / M
  for (int f = 0; f + 4 <= F; f += 4) {
    float s[4];
    simd::reduce4(acc[f / M][f % M], acc[(f + 1) / M][(f + 1) % M], acc[(f + 2) / M][(f + 2) % M],
                  acc[(f + 3) / M][(f + 3) % M], s);
    for (int j = 0; j < 4; ++j) y[(f + j) % M * N + (f + j) / M] = s[j];
  }
  for (int f = F / 4 * 4; f < F; ++f) y[f % M * N + f / M] = simd::reduce_add(acc[f / M][f % M]);
}

// block<m, R, PF> for a run-time m <= Mc
template <int Mc, int R, bool PF, typename W>
inline void pass(int64_t m, const float* x, const W* w, float* y, int64_t K, int64_t N, Prefetch ahead) {
  if constexpr (Mc > 1) {
    if (m < Mc) return pass<Mc - 1, R, PF>(m, x, w, y, K, N, ahead);
  }
  block<Mc, R, PF>(x, w, y, K, N, ahead);
}

// Calls of more passes than this over each block (above 32 input rows on AVX-512's fp32 kernel, 24 on AVX2's; the
// int8 kernel's scratch passes likewise) issue each pass's share of the next block's lines before the pass instead
// of along its loop, which then keeps to its loads and FMAs (with many passes most of the loop's prefetches ask
// again for a line already asked for): 1.1-1.2x faster from 64 rows up. Fewer passes are bound by streaming the
// weights, and prefetches spread along the loop keep the memory busier (up front: 0.87-0.92x at 24-32 rows;
// docs/performance.md)
constexpr int64_t SPREAD_PASSES = 8;

// The passes over one block of R weight rows w[R, K]: the M input rows x in groups of `per` <= Mc, while the
// next block's R rows (`next`, K * k_bytes bytes each) stream into L2
template <int Mc, int R, typename W>
inline void passes(int64_t M, int64_t per, const float* x, const W* w, float* y, int64_t K, int64_t N,
                   const char* next, int64_t k_bytes) {
  const int64_t P = (M + per - 1) / per, row_bytes = K * k_bytes, lines = (row_bytes + 63) / 64;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t m = std::min(per, M - p * per);
    if (P <= SPREAD_PASSES) {  // pass p prefetches the p-th P-th of each row along its loop
      const Prefetch ahead{next, row_bytes, p * row_bytes / P, 65536 * k_bytes / P};
      pass<Mc, R, true>(m, x + p * per * K, w, y + p * per * N, K, N, ahead);
    } else {
      for (int i = 0; i < R; ++i)
        for (int64_t l = p * lines / P; l < (p + 1) * lines / P; ++l) prefetch_l2(next, i * row_bytes + l * 64);
      pass<Mc, R, false>(m, x + p * per * K, w, y + p * per * N, K, N, Prefetch{next, row_bytes, 0, 0});
    }
  }
}

}  // namespace gemm_block
