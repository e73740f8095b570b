// The draft heads' steps (engine/spec_decode/heads/modules.py, scored by the target's LM head) for the few rows of a draft
// round, in fp32 on the CPU, as one C++ call instead of ~20 PyTorch ops.
//
// EagleStep:
// (feature f [B, H], token t [B]) -> f' = out_norm(x_L), x_0 = fc([f; embed_norm(embed[t])]),
// x_{l+1} = x_l + down_l(silu(g) * u) with [g; u] = gate_up_l(norm_l(x_l)); logits = lm(f') over the draft
// vocabulary. ``greedy`` feeds each step's argmax (mapped to the full vocabulary) into the next, with no
// Python between the steps.
// MedusaStep: head m of the first n maps h [B, H] through blocks x += silu(W[l, m] x + b[l, m]) and scores it:
// logits [B, n, V'] in one call, ``greedy`` their argmaxes.
// The GEMMs run on the small-GEMM kernel (16-bit weights widened in registers).
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "head.h"
#include "row_ops.h"
#include "small_gemm.h"

namespace {

void check(bool ok, const char* what) { TORCH_CHECK(ok, "head step: ", what); }

void check_ids(const torch::Tensor& ids, int64_t draft_vocab, int64_t vocab) {
  check(ids.numel() == 0 || (ids.dim() == 1 && ids.numel() == draft_vocab && ids.scalar_type() == at::kLong &&
                             ids.is_contiguous()),
        "vocab_ids empty or [V'] int64");
  for (int64_t i = 0; i < ids.numel(); ++i)
    check(ids.data_ptr<int64_t>()[i] >= 0 && ids.data_ptr<int64_t>()[i] < vocab, "vocab_ids in 0..V-1");
}

bool gemm_weight(const torch::Tensor& w, int64_t rows, int64_t cols) {
  return w.dim() == 2 && w.size(0) == rows && w.size(1) == cols && w.is_contiguous() && w.device().is_cpu() &&
         (w.scalar_type() == at::kFloat || w.scalar_type() == at::kHalf || w.scalar_type() == at::kBFloat16);
}

bool vector_f32(const torch::Tensor& t, int64_t n) {
  return t.dim() == 1 && t.numel() == n && t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu();
}

}  // namespace

EagleStep::EagleStep(std::vector<torch::Tensor> weights, double eps) : w_(std::move(weights)), eps_(eps) {
  check(w_.size() >= 6 && (w_.size() - 6) % 3 == 0, "weights: embed, embed_norm, fc, 3 per block, out_norm, lm, ids");
  layers_ = static_cast<int64_t>(w_.size() - 6) / 3;
  const torch::Tensor& embed = w_[0];
  check(embed.dim() == 2 && gemm_weight(embed, embed.size(0), embed.size(1)), "embed [V, H] float32/float16/bfloat16");
  vocab_ = embed.size(0);
  hidden_ = embed.size(1);
  const int64_t H = hidden_;
  check(vector_f32(w_[1], H), "embed_norm [H] float32");
  check(gemm_weight(w_[2], H, 2 * H), "fc [H, 2H] float32/float16/bfloat16");
  inter_ = layers_ > 0 ? w_[5].size(1) : 0;
  for (int64_t l = 0; l < layers_; ++l) {
    check(vector_f32(w_[3 + 3 * l], H), "norm [H] float32");
    check(gemm_weight(w_[4 + 3 * l], 2 * inter_, H), "gate_up [2I, H] float32/float16/bfloat16");
    check(gemm_weight(w_[5 + 3 * l], H, inter_), "down [H, I] float32/float16/bfloat16");
  }
  check(vector_f32(w_[3 + 3 * layers_], H), "out_norm [H] float32");
  const torch::Tensor &lm = w_[4 + 3 * layers_], &ids = w_[5 + 3 * layers_];
  check(lm.dim() == 2 && gemm_weight(lm, lm.size(0), H), "lm [V', H] float32/float16/bfloat16");
  draft_vocab_ = lm.size(0);
  check_ids(ids, draft_vocab_, vocab_);
}

// the floats run() works in for B rows: in [B, 2H], x, h, y [B, H], gu [B, 2I], act [B, I]
int64_t EagleStep::scratch_size(int64_t B) const { return B * (5 * hidden_ + 3 * inter_); }

// f [B, H] fp32, tok [B] int64 -> f_out [B, H] written, logits [B, V'] written; scratch: scratch_size(B) floats
void EagleStep::run(const float* f, const int64_t* tok, int64_t B, float* f_out, float* logits, float* scratch) const {
  const int64_t H = hidden_, I = inter_;
  const float eps = static_cast<float>(eps_);
  float *in = scratch, *x = in + B * 2 * H, *h = x + B * H, *y = h + B * H, *gu = y + B * H, *act = gu + B * 2 * I;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(tok[b] >= 0 && tok[b] < vocab_, "EagleStep: a token id is out of range");
    std::copy_n(f + b * H, H, in + b * 2 * H);
    float* e = in + b * 2 * H + H;
    table_rows(w_[0], tok + b, 1, e);  // the target's embedding row (a CPU plan's fp16 table widened exactly)
    row_ops::rms_norm(e, w_[1].data_ptr<float>(), e, 1, H, eps);
  }
  small_gemm_into(in, w_[2], x, B, 2 * H, H);
  for (int64_t l = 0; l < layers_; ++l) {
    row_ops::rms_norm(x, w_[3 + 3 * l].data_ptr<float>(), h, B, H, eps);
    small_gemm_into(h, w_[4 + 3 * l], gu, B, H, 2 * I);
    row_ops::swiglu(gu, act, B, I);
    small_gemm_into(act, w_[5 + 3 * l], y, B, I, H);
    for (int64_t i = 0; i < B * H; ++i) x[i] += y[i];
  }
  row_ops::rms_norm(x, w_[3 + 3 * layers_].data_ptr<float>(), f_out, B, H, eps);
  small_gemm_into(f_out, w_[4 + 3 * layers_], logits, B, H, draft_vocab_);
}

void EagleStep::check_inputs(const torch::Tensor& f, const torch::Tensor& tok) const {
  TORCH_CHECK(f.dim() == 2 && f.size(1) == hidden_ && f.scalar_type() == at::kFloat && f.is_contiguous() &&
              f.device().is_cpu(), "EagleStep: f [B, ", hidden_, "] contiguous float32");
  TORCH_CHECK(tok.dim() == 1 && tok.size(0) == f.size(0) && tok.scalar_type() == at::kLong && tok.is_contiguous(),
              "EagleStep: tok [B] contiguous int64");
}

std::tuple<torch::Tensor, torch::Tensor> EagleStep::step(const torch::Tensor& f, const torch::Tensor& tok) const {
  check_inputs(f, tok);
  const int64_t B = f.size(0);
  torch::Tensor f_out = torch::empty({B, hidden_}, f.options());
  torch::Tensor logits = torch::empty({B, draft_vocab_}, f.options());
  std::vector<float> scratch(scratch_size(B));
  run(f.data_ptr<float>(), tok.data_ptr<int64_t>(), B, f_out.data_ptr<float>(), logits.data_ptr<float>(), scratch.data());
  return {f_out, logits};
}

// steps greedy drafts: each the argmax of its logits mapped through vocab_ids, fed to the next step
// -> [B, steps] int64 ids of the full vocabulary
torch::Tensor EagleStep::greedy(const torch::Tensor& f, const torch::Tensor& tok, int64_t steps) const {
  check_inputs(f, tok);
  TORCH_CHECK(steps >= 1, "EagleStep.greedy: steps >= 1");
  const int64_t B = f.size(0), H = hidden_, V = draft_vocab_;
  const torch::Tensor& ids = w_[5 + 3 * layers_];
  std::vector<float> fa(f.data_ptr<float>(), f.data_ptr<float>() + B * H), fb(B * H), logits(B * V);
  std::vector<float> scratch(scratch_size(B));  // once for every step
  std::vector<int64_t> t(tok.data_ptr<int64_t>(), tok.data_ptr<int64_t>() + B);
  torch::Tensor out = torch::empty({B, steps}, tok.options());
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < steps; ++i) {
    run(fa.data(), t.data(), B, fb.data(), logits.data(), scratch.data());
    for (int64_t b = 0; b < B; ++b) {
      const int64_t best = row_ops::argmax(logits.data() + b * V, V);
      t[b] = ids.numel() ? ids.data_ptr<int64_t>()[best] : best;
      op[b * steps + i] = t[b];
    }
    fa.swap(fb);
  }
  return out;
}

MedusaStep::MedusaStep(torch::Tensor weight, torch::Tensor bias, torch::Tensor lm, torch::Tensor ids, int64_t vocab)
    : weight_(std::move(weight)), bias_(std::move(bias)), lm_(std::move(lm)), ids_(std::move(ids)) {
  check(weight_.dim() == 4 && weight_.size(2) == weight_.size(3) && weight_.is_contiguous() &&
            gemm_weight(weight_.view({-1, weight_.size(3)}), weight_.numel() / weight_.size(3), weight_.size(3)),
        "weight [L, M, H, H] contiguous float32/float16/bfloat16");
  layers_ = weight_.size(0);
  heads_ = weight_.size(1);
  hidden_ = weight_.size(3);
  check(bias_.dim() == 3 && bias_.size(0) == layers_ && bias_.size(1) == heads_ && bias_.size(2) == hidden_ &&
            bias_.scalar_type() == at::kFloat && bias_.is_contiguous(),
        "bias [L, M, H] contiguous float32");
  check(lm_.dim() == 2 && gemm_weight(lm_, lm_.size(0), hidden_), "lm [V', H] float32/float16/bfloat16");
  draft_vocab_ = lm_.size(0);
  check_ids(ids_, draft_vocab_, vocab);
}

// h [B, H] -> logits [B, n, V'] of the first n heads
torch::Tensor MedusaStep::step(const torch::Tensor& h, int64_t n) const {
  TORCH_CHECK(h.dim() == 2 && h.size(1) == hidden_ && h.scalar_type() == at::kFloat && h.is_contiguous() &&
              h.device().is_cpu(), "MedusaStep: h [B, ", hidden_, "] contiguous float32");
  TORCH_CHECK(n >= 1 && n <= heads_, "MedusaStep: n in 1..", heads_);
  const int64_t B = h.size(0), H = hidden_, V = draft_vocab_;
  // x [B, n, H]: every head starts from h; head m's rows are strided by n * H, so each head's block runs on
  // a contiguous copy of its B rows
  std::vector<float> x(B * n * H), xm(B * H), y(B * H);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t m = 0; m < n; ++m) std::copy_n(h.data_ptr<float>() + b * H, H, x.data() + (b * n + m) * H);
  for (int64_t l = 0; l < layers_; ++l)
    for (int64_t m = 0; m < n; ++m) {
      for (int64_t b = 0; b < B; ++b) std::copy_n(x.data() + (b * n + m) * H, H, xm.data() + b * H);
      small_gemm_into(xm.data(), weight_.select(0, l).select(0, m), y.data(), B, H, H);
      const float* bp = bias_.data_ptr<float>() + (l * heads_ + m) * H;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < H; ++i) {
          const float z = y[b * H + i] + bp[i];
          x[(b * n + m) * H + i] += z / (1.f + std::exp(-z));
        }
    }
  torch::Tensor logits = torch::empty({B, n, V}, h.options());
  small_gemm_into(x.data(), lm_, logits.data_ptr<float>(), B * n, H, V);
  return logits;
}

// the argmax of each head's logits, mapped through vocab_ids -> [B, n] int64 ids of the full vocabulary
torch::Tensor MedusaStep::greedy(const torch::Tensor& h, int64_t n) const {
  const torch::Tensor logits = step(h, n);
  const int64_t B = h.size(0), V = draft_vocab_;
  torch::Tensor out = torch::empty({B, n}, h.options().dtype(at::kLong));
  for (int64_t r = 0; r < B * n; ++r) {
    const int64_t best = row_ops::argmax(logits.data_ptr<float>() + r * V, V);
    out.data_ptr<int64_t>()[r] = ids_.numel() ? ids_.data_ptr<int64_t>()[best] : best;
  }
  return out;
}
