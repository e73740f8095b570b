// The fp32 small-GEMM kernel (small_gemm.cpp), shared by the decoder-layer step (decode_layers.cpp).
#pragma once
#include <torch/extension.h>

#include <cstdint>

// y[M, N] = x[M, K] @ w[N, K]^T, row-major and contiguous; each output accumulated the same way for any M.
// fp16 and bf16 weights are widened to fp32 in registers (exact): half the bytes to stream, fp32 arithmetic.
// w a float32, float16 or bfloat16 [N, K] tensor (checked)
void small_gemm_into(const float* x, const torch::Tensor& w, float* y, int64_t M, int64_t K, int64_t N);
torch::Tensor small_gemm(const torch::Tensor& x, const torch::Tensor& w);

// out[m, :] = table[ids[m], :] widened exactly to fp32, for a float32, float16 or bfloat16 table [V, H] (an embedding
// lookup; the ids checked by the caller)
void table_rows(const torch::Tensor& table, const int64_t* ids, int64_t M, float* out);
