// The int8-weight GEMM on AMX-INT8 tiles (int8_amx.cpp), shared by the decoder-layer step (decode_layers.cpp).
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <string>

// "" when this process can run AMX-INT8 tiles (CPU features and the kernel's permission, probed once), else why not
const std::string& int8_amx_status();
// y[M, N] = x[M, K] @ (q[N, K] * s)^T as int8_gemm_into takes them (q int8 [N, K] as it is, s float32 per row or
// per group), for group 0 or a multiple of 32: each input row split exactly enough into int8 parts, exact
// integer tile sums, scaled in fp32 (int8_amx.cpp says how exact); each row computed the same way for any M
void int8_amx_gemm_into(const float* x, const torch::Tensor& q, const torch::Tensor& s, int64_t group, float* y,
                        int64_t M, int64_t K, int64_t N);
torch::Tensor int8_amx_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s, int64_t group);
// the group sizes int8_amx_gemm takes: 0 (per output row) or a positive multiple of this
int64_t int8_amx_group_multiple();
