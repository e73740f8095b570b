// y[M, N] = x[M, K] @ w[N, K]^T in fp32 for the few rows of a decode step or a speculative verify pass.
//
// Every output element is one dot product accumulated in the same order whatever M is (FMA chains of
// simd::LANES lanes over k, then a fixed horizontal sum), so row m of a verify pass is bit for bit the value a
// one-row decode step computes for the same input: speculation does not change the rounding.
// Weight rows stream from memory once per call (blocks of NB rows, prefetched one block ahead), and each
// block is reused from L1 for every group of up to MB input rows, so a pass of a few rows costs little
// more than one row (PyTorch's default fp32 GEMM switches to a kernel that does not from 4 rows on).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"
#include "small_gemm.h"

namespace {

using simd::BF16;
using simd::F16;
using simd::LANES;
using simd::Vec;

// weight rows per block and input rows per pass over it: NB * MB accumulators, MB inputs and a weight in
// registers (32 of them on AVX-512, 16 on AVX2)
constexpr int NB = LANES == 16 ? 8 : 4;
constexpr int MB = LANES == 16 ? 4 : 3;

// Prefetch: at k, the weight rows pf[i * K + (start + k * rate / 65536)] (rate in 1/65536 elements per element)
struct Prefetch {
  const void* pf;
  int64_t start, rate;
};

template <int M, int R, typename W>
inline void block(const float* __restrict x, const W* __restrict w, float* __restrict y,
                  int64_t K, int64_t N, int64_t n0, Prefetch ahead) {
  const W* pf = static_cast<const W*>(ahead.pf);
  int64_t at = ahead.start << 16;  // fixed point, 16 fraction bits
  const int64_t step = ahead.rate * LANES;
  Vec acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) acc[i][m] = simd::zero();
  const int64_t full = K / LANES * LANES;
  for (int64_t k = 0; k < full; k += LANES) {
    Vec xv[M];
    for (int m = 0; m < M; ++m) xv[m] = simd::load(x + m * K + k);
    for (int i = 0; i < R; ++i) {
      // a hint only (never faults); the address is formed as an integer, as it may lie past the weight
      _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(pf + i * K + (at >> 16))), _MM_HINT_T0);
      const Vec wv = simd::load(w + (n0 + i) * K + k);
      for (int m = 0; m < M; ++m) acc[i][m] = simd::fmadd(wv, xv[m], acc[i][m]);
    }
    at += step;
  }
  if (full < K) {  // the K tail: lanes past it load as 0 and add 0
    Vec xv[M];
    for (int m = 0; m < M; ++m) xv[m] = simd::load_first(x + m * K + full, K - full);
    for (int i = 0; i < R; ++i) {
      const Vec wv = simd::load_first(w + (n0 + i) * K + full, K - full);
      for (int m = 0; m < M; ++m) acc[i][m] = simd::fmadd(wv, xv[m], acc[i][m]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) y[m * N + n0 + i] = simd::reduce_add(acc[i][m]);
}

// block<m, R> for a run-time m <= Mc
template <int Mc, int R, typename W>
inline void pass(int64_t m, const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n0, Prefetch ahead) {
  if constexpr (Mc > 1) {
    if (m < Mc) return pass<Mc - 1, R>(m, x, w, y, K, N, n0, ahead);
  }
  block<Mc, R>(x, w, y, K, N, n0, ahead);
}

// The weight rows stream from memory one block ahead: the P passes over a block (MB input rows each) prefetch
// the next block's rows, pass p its p-th P-th, so the memory streams while the FMAs run (prefetching a fixed
// distance ahead on the rows being read left the memory idle during the passes after the first).
template <int R, typename W>
inline void rows(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0) {
  const int64_t P = (M + MB - 1) / MB;
  for (int64_t p = 0; p < P; ++p) {
    const float* xs = x + p * MB * K;
    float* ys = y + p * MB * N;
    const Prefetch ahead{w + (n0 + R) * K, p * K / P, 65536 / P};
    pass<MB, R>(std::min<int64_t>(MB, M - p * MB), xs, w, ys, K, N, n0, ahead);
  }
}

template <typename W>
void gemm(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = N / NB;
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) rows<NB>(x, w, y, M, K, N, b * NB);
  });
  for (int64_t n = blocks * NB; n < N; ++n) rows<1>(x, w, y, M, K, N, n);  // the N tail
}

}  // namespace

void small_gemm_into(const float* x, const torch::Tensor& w, float* y, int64_t M, int64_t K, int64_t N) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) == N && w.size(1) == K && w.is_contiguous() && w.device().is_cpu(),
              "small_gemm: weight [", N, ", ", K, "] contiguous on the CPU, got ", w.sizes());
  switch (w.scalar_type()) {
    case at::kFloat: return gemm(x, w.data_ptr<float>(), y, M, K, N);
    case at::kHalf: return gemm(x, reinterpret_cast<const F16*>(w.data_ptr<at::Half>()), y, M, K, N);
    case at::kBFloat16: return gemm(x, reinterpret_cast<const BF16*>(w.data_ptr<at::BFloat16>()), y, M, K, N);
    default: TORCH_CHECK(false, "small_gemm: float32, float16 or bfloat16 weights, got ", w.scalar_type());
  }
}

torch::Tensor small_gemm(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_gemm: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "small_gemm: x contiguous float32 on the CPU");
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  small_gemm_into(x.data_ptr<float>(), w, y.data_ptr<float>(), x.size(0), x.size(1), w.size(0));
  return y;
}
