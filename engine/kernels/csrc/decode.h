// A model's weights for the few-row forward (decode_model.cpp: construction and entry points; decode_layers.cpp:
// the layers), held once: a call passes only the step's tensors (tokens, positions, cache), not the ~40 weight
// tensors again.
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <vector>

class DecodeModel {
 public:
  // weights: 9 per layer (input norm, qkv weight, qkv bias or empty, o weight, o bias or empty, post norm,
  // gate_up weight, down weight, down bias or empty), then embed, final norm, head; GEMM weights and the
  // embedding table float32, float16 or bfloat16 (GEMM weights also int8), everything else float32.
  // scales, smooths, groups: per weight, an int8 GEMM weight's float32 scales, SmoothQuant factors and group
  // size (0: one scale per output row, -1: W8A8 with activations quantized per row; int8_gemm.h), empty,
  // empty and 0 for the others.
  // amx: the 16-bit GEMMs on AMX tiles (bf16 GEMM weights, packed here; int8 ones stay on the int8 kernels)
  // int8_amx: the weight-only int8 GEMMs on AMX-INT8 tiles (int8_amx.h; groups 0 or multiples of 32), else on
  // the AVX int8 kernel (int8_gemm.h)
  DecodeModel(std::vector<torch::Tensor> weights, std::vector<torch::Tensor> scales,
              std::vector<torch::Tensor> smooths, std::vector<int64_t> groups, int64_t n_heads, int64_t n_kv,
              int64_t window, double eps, bool amx, bool int8_amx);
  // tokens, pos [B, T] int64; rows [B] or [B, T] (a cache row per token; empty: 0..B-1); idx empty, [B] or [B, J]; the first n_layers layers;
  // hidden: empty, or a float32 tensor the scored rows' final-norm outputs are written to (its shape becomes
  // the logits' with H in place of V)
  // slots: empty, or [B, T] int64 the cache slots keys are written to (a draft tree: not the positions);
  // mask: empty, or [B, T, kv_len] bool, the keys each query sees (a draft tree's mask; with slots)
  // aux: empty, or [n] int64 feature layers (EAGLE-3): `hidden` then receives, for the scored rows, the hidden
  // states entering those layers (n_layers: the last layer's output), concatenated in aux's order (n * H in place
  // of V), not the final-norm outputs
  // every: `hidden` receives every row's [B, T, H or n * H] (the logits still only the scored rows')
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& pos, const torch::Tensor& rows,
                        const torch::Tensor& idx, int64_t kv_len, int64_t n_layers, torch::Tensor k_cache,
                        torch::Tensor v_cache, const torch::Tensor& cos, const torch::Tensor& sin,
                        torch::Tensor hidden, const torch::Tensor& slots, const torch::Tensor& mask,
                        const torch::Tensor& aux, bool every) const;
  // the same from the first layer's inputs x [B, T, H] float32 instead of token ids (a draft head's entries; slots
  // and mask: a draft tree's, as forward's)
  torch::Tensor forward_x(const torch::Tensor& x, const torch::Tensor& pos, const torch::Tensor& rows,
                          const torch::Tensor& idx, int64_t kv_len, int64_t n_layers, torch::Tensor k_cache,
                          torch::Tensor v_cache, const torch::Tensor& cos, const torch::Tensor& sin,
                          torch::Tensor hidden, const torch::Tensor& slots, const torch::Tensor& mask) const;
  // a model whose first layer's q/k/v read 2H columns (EAGLE-3's layer): qkv_in [B, T, 2H] those inputs, normed
  // already, residual [B, T, H] the stream the layer adds to; every layer; the rest as forward_x (aux as forward)
  torch::Tensor forward_pair(const torch::Tensor& qkv_in, const torch::Tensor& residual, const torch::Tensor& pos,
                             const torch::Tensor& rows, const torch::Tensor& idx, int64_t kv_len,
                             torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& cos,
                             const torch::Tensor& sin, torch::Tensor hidden, const torch::Tensor& aux,
                             const torch::Tensor& slots, const torch::Tensor& mask) const;
  // greedy drafting in one call: forward scored at last [B], then steps - 1 one-token forwards on the argmax
  // over the first vocab logits -> the steps argmaxes [B, steps] int64 (the caches hold every fed token)
  torch::Tensor greedy(const torch::Tensor& tokens, const torch::Tensor& pos, const torch::Tensor& rows,
                       const torch::Tensor& last, int64_t kv_len, int64_t n_layers, torch::Tensor k_cache,
                       torch::Tensor v_cache, const torch::Tensor& cos, const torch::Tensor& sin, int64_t steps,
                       int64_t vocab) const;

 private:
  torch::Tensor run(std::vector<float>& x, int64_t B, int64_t T, const torch::Tensor& pos, const torch::Tensor& rows,
                    const torch::Tensor& idx, int64_t kv_len, int64_t n_layers, torch::Tensor k_cache,
                    torch::Tensor v_cache, const torch::Tensor& cos, const torch::Tensor& sin,
                    torch::Tensor hidden, const torch::Tensor& slots, const torch::Tensor& mask,
                    const torch::Tensor& aux, bool every, const float* qkv_in = nullptr) const;
  std::vector<torch::Tensor> weights_, scales_, smooths_;
  std::vector<int64_t> groups_;
  int64_t n_heads_, n_kv_, window_;
  double eps_;
  bool amx_, int8_amx_;
  // derived from the weights (checked once, in the constructor); in0_: the first layer's q/k/v input width
  int64_t n_layers_, hidden_, head_dim_, inter_, vocab_, in0_;
};
