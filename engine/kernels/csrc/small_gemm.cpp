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

#include "gemm_block.h"
#include "simd.h"
#include "small_gemm.h"

namespace {

using simd::BF16;
using simd::F16;
using simd::LANES;

// weight rows per block and input rows per pass over it: NB * MB accumulators, MB inputs and a weight in
// registers (32 of them on AVX-512, 16 on AVX2). A call of at most MB rows (a decode step) streams the weights
// in blocks of NB_FEW rows; a larger one (a verify pass, a prompt) runs NB_MANY x MB tiles: on AVX-512 8 x 4
// needs 37 registers and spills, 6 x 4 fits (29) and runs passes of 8 to 300 rows 1.1-1.5x faster, while
// the decode steps stream 8-row blocks a little faster (docs/performance.md). The tile decides which outputs are
// computed together, never how one is summed: the results are the same bits either way.
constexpr int NB_FEW = LANES == 16 ? 8 : 4;
constexpr int NB_MANY = LANES == 16 ? 6 : 4;
constexpr int MB = LANES == 16 ? 4 : 3;

// The weight rows stream from memory one block ahead, while the passes over this block (MB input rows each) run
template <int R, typename W>
inline void rows(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0) {
  gemm_block::passes<MB, R>(M, MB, x, w + n0 * K, y + n0, K, N, reinterpret_cast<const char*>(w + (n0 + R) * K),
                            static_cast<int64_t>(sizeof(W)));
}

template <int NB, typename W>
void gemm_blocks(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = N / NB;
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) rows<NB>(x, w, y, M, K, N, b * NB);
  });
  for (int64_t n = blocks * NB; n < N; ++n) rows<1>(x, w, y, M, K, N, n);  // the N tail
}

// Input bytes one pass over the weights reuses: each weight block is multiplied by every input row of the pass,
// so the pass's rows must stay in L2 while the blocks stream by. A prompt's thousands of rows run as passes of
// at most this much (the weights then stream once per pass); one pass over all of them would reread its inputs
// from L3 or memory for every block of weight rows, and a 2,048-token prompt would cost twice a 256-token one
// per token.
constexpr int64_t PASS_X_BYTES = 1024 << 10;

template <typename W>
void gemm(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N) {
  if (M <= MB) return gemm_blocks<NB_FEW>(x, w, y, M, K, N);
  const int64_t row_bytes = std::max<int64_t>(K, 1) * static_cast<int64_t>(sizeof(float));
  const int64_t rows = std::max<int64_t>(MB, PASS_X_BYTES / row_bytes / MB * MB);
  for (int64_t m0 = 0; m0 < M; m0 += rows)  // (M - m0 <= MB in the last pass still runs the NB_MANY tiles)
    gemm_blocks<NB_MANY>(x + m0 * K, w, y + m0 * N, std::min(rows, M - m0), K, N);
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

namespace {
template <typename T>
void widen_rows(const T* table, const int64_t* ids, int64_t M, int64_t H, float* out) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < H; ++h) out[m * H + h] = static_cast<float>(table[ids[m] * H + h]);
}
}  // namespace

void table_rows(const torch::Tensor& table, const int64_t* ids, int64_t M, float* out) {
  const int64_t H = table.size(1);
  if (table.scalar_type() == at::kFloat) {
    const float* p = table.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) std::copy_n(p + ids[m] * H, H, out + m * H);
  } else if (table.scalar_type() == at::kHalf) {
    widen_rows(table.data_ptr<at::Half>(), ids, M, H, out);
  } else {
    TORCH_CHECK(table.scalar_type() == at::kBFloat16, "table_rows: a float32, float16 or bfloat16 table");
    widen_rows(table.data_ptr<at::BFloat16>(), ids, M, H, out);
  }
}
