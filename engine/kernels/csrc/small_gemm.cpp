// y[M, N] = x[M, K] @ w[N, K]^T in fp32 for the few rows of a decode step or a speculative verify pass.
//
// Every output element is one dot product accumulated in the same order whatever M is (16-lane FMA
// chains over k, then a fixed horizontal sum), so row m of a verify pass is bit for bit the value a
// one-row decode step computes for the same input: speculation does not change the rounding.
// Weight rows stream from memory once per call (blocks of NB rows, software-prefetched), and each
// block is reused from L1 for every group of up to MB input rows, so a pass of a few rows costs little
// more than one row (PyTorch's default fp32 GEMM switches to a kernel that does not from 4 rows on).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "small_gemm.h"

namespace {

constexpr int NB = 8;            // weight rows per block
constexpr int MB = 4;            // input rows per pass over a block
constexpr int PREFETCH = 1024;   // bytes ahead on each weight row stream

// 16-bit weight formats (their bits): fp16 and bf16
struct F16 { uint16_t bits; };
struct BF16 { uint16_t bits; };

// 16 weights widened to fp32, exactly (fp16: vcvtph2ps; bf16: the 16 bits moved to the top of a float);
// the tail loads n < 16 of them, zeros after
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const F16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const BF16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load_tail(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
template <typename W>
inline __m512 load_tail(const W* p, int64_t n) {
  W buf[16] = {};
  std::copy_n(p, n, buf);
  return load16(buf);
}

template <int M, int R, typename W>
inline void block(const float* __restrict x, const W* __restrict w, float* __restrict y,
                  int64_t K, int64_t N, int64_t n0) {
  __m512 acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) acc[i][m] = _mm512_setzero_ps();
  const int64_t full = K / 16 * 16;
  for (int64_t k = 0; k < full; k += 16) {
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
    for (int i = 0; i < R; ++i) {
      const W* wr = w + (n0 + i) * K + k;
      // a hint only (never faults); the address is formed as an integer, as it may lie past the weight
      _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(wr) + PREFETCH), _MM_HINT_T0);
      const __m512 wv = load16(wr);
      for (int m = 0; m < M; ++m) acc[i][m] = _mm512_fmadd_ps(wv, xv[m], acc[i][m]);
    }
  }
  if (full < K) {  // the K tail: masked lanes load as 0 and add 0
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - full)) - 1);
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_maskz_loadu_ps(mask, x + m * K + full);
    for (int i = 0; i < R; ++i) {
      const __m512 wv = load_tail(w + (n0 + i) * K + full, K - full);
      for (int m = 0; m < M; ++m) acc[i][m] = _mm512_fmadd_ps(wv, xv[m], acc[i][m]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) y[m * N + n0 + i] = _mm512_reduce_add_ps(acc[i][m]);
}

template <int R, typename W>
inline void rows(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0) {
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const float* xs = x + m0 * K;
    float* ys = y + m0 * N;
    switch (std::min<int64_t>(MB, M - m0)) {
      case 1: block<1, R>(xs, w, ys, K, N, n0); break;
      case 2: block<2, R>(xs, w, ys, K, N, n0); break;
      case 3: block<3, R>(xs, w, ys, K, N, n0); break;
      default: block<4, R>(xs, w, ys, K, N, n0); break;
    }
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
