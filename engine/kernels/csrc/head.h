// The draft heads' steps (head_step.cpp), their weights held once: a call passes only the step's tensors.
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <tuple>
#include <vector>

class EagleStep {
 public:
  // weights: embed [V, H] (the target's, float32), embed_norm [H], fc [H, 2H]; per block norm [H],
  // gate_up [2I, H], down [H, I]; out_norm [H], lm [V', H] (the LM head's rows), vocab_ids [V'] int64 or
  // empty (the full vocabulary). GEMM weights float32, float16 or bfloat16; norms float32
  EagleStep(std::vector<torch::Tensor> weights, double eps);
  // (f [B, H], tok [B]) -> (the next features [B, H], their logits [B, V'])
  std::tuple<torch::Tensor, torch::Tensor> step(const torch::Tensor& f, const torch::Tensor& tok) const;
  // steps greedy drafts in one call -> [B, steps] int64 ids of the full vocabulary
  torch::Tensor greedy(const torch::Tensor& f, const torch::Tensor& tok, int64_t steps) const;

 private:
  int64_t scratch_size(int64_t B) const;
  void run(const float* f, const int64_t* tok, int64_t B, float* f_out, float* logits, float* scratch) const;
  void check_inputs(const torch::Tensor& f, const torch::Tensor& tok) const;
  std::vector<torch::Tensor> w_;
  double eps_;
  int64_t layers_ = 0, vocab_ = 0, hidden_ = 0, inter_ = 0, draft_vocab_ = 0;
};

class MedusaStep {
 public:
  // weight [L, M, H, H] (float32, float16 or bfloat16), bias [L, M, H] float32, lm [V', H] (the LM head's rows),
  // vocab_ids [V'] int64 ids below vocab (the target's vocabulary size) or empty (the full vocabulary)
  MedusaStep(torch::Tensor weight, torch::Tensor bias, torch::Tensor lm, torch::Tensor ids, int64_t vocab);
  // h [B, H] -> the first n heads' logits [B, n, V']
  torch::Tensor step(const torch::Tensor& h, int64_t n) const;
  // their argmaxes -> [B, n] int64 ids of the full vocabulary
  torch::Tensor greedy(const torch::Tensor& h, int64_t n) const;

 private:
  torch::Tensor weight_, bias_, lm_, ids_;
  int64_t layers_ = 0, heads_ = 0, hidden_ = 0, draft_vocab_ = 0;
};
