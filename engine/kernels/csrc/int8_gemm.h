// The int8-weight few-row GEMM (int8_gemm.cpp), shared by the decoder-layer step (decode_layers.cpp).
#pragma once
#include <torch/extension.h>

#include <cstdint>

// y[M, N] = x[M, K] @ (q[N, K] * s)^T with q int8 and s float32: one scale per output row (group 0, s [N])
// or per group of `group` input channels (s [N, ceil(K / group)], group a multiple of simd::LANES). Each
// weight is dequantized in registers (q * s, one fp32 product) and accumulated as the fp32 kernel does, so
// the result is bit for bit small_gemm(x, q * s): row-independent, and no fp32 copy of the weight exists.
void int8_gemm_into(const float* x, const torch::Tensor& q, const torch::Tensor& s, int64_t group, float* y,
                    int64_t M, int64_t K, int64_t N);
torch::Tensor int8_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s, int64_t group);
// a kernel of int8_gemm_into's signature called on tensors: y = x [M, K] @ (q * s)^T, x checked (named `what`)
using Int8GemmInto = void (*)(const float*, const torch::Tensor&, const torch::Tensor&, int64_t, float*, int64_t,
                              int64_t, int64_t);
torch::Tensor int8_gemm_call(Int8GemmInto into, const char* what, const torch::Tensor& x, const torch::Tensor& q,
                             const torch::Tensor& s, int64_t group);
// y[M, N] = (x / smooth) quantized per row to int8 (scale absmax / 127, stepped down until 127 * scale <= absmax,
// at least FLT_MIN; round half to even) @ q^T in exact integer sums, times the row's scale, times ws[n]: the
// numbers quant.matmul_kernels' w8a8 computes (smooth [K] float32 or empty; ws [N] per output row)
void w8a8_gemm_into(const float* x, const torch::Tensor& q, const torch::Tensor& ws, const torch::Tensor& smooth,
                    float* y, int64_t M, int64_t K, int64_t N);
torch::Tensor w8a8_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& ws,
                        const torch::Tensor& smooth);
// the shapes int8_gemm_into reads (TORCH_CHECK naming `what`)
void check_int8_weight(const torch::Tensor& q, const torch::Tensor& s, int64_t group, int64_t N, int64_t K,
                       const char* what);
// the group sizes the kernel takes: 0 (per output row) or a positive multiple of this
int64_t int8_group_multiple();
