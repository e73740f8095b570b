// The AMX kernel for bf16-valued weights (amx_gemm.cpp), shared by the decoder-layer step (decode_layers.cpp).
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <string>

// "" when this process can run AMX tiles (CPU features and the kernel's permission, probed once), else why not
const std::string& amx_status();
// w [N, K] bfloat16 -> its tiles in the order amx_gemm reads them (zero-padded to 16 columns, 32 k)
torch::Tensor amx_pack(const torch::Tensor& w);
// y[M, N] = x[M, K] @ w^T, x fp32 row-major, packed = amx_pack(w); each row computed the same way for any M
// (the tiles do not record K inside its padding to 32: pass the shape that was packed)
void amx_gemm_into(const float* x, const torch::Tensor& packed, float* y, int64_t M, int64_t K, int64_t N);
torch::Tensor amx_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t N);
