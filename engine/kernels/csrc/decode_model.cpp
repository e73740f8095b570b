// DecodeModel's construction (every weight checked once) and its entry points: token ids (forward), a head's
// entries (forward_x), a wide first layer's inputs (forward_pair), greedy drafting; each runs `run`
// (decode_layers.cpp).
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx_gemm.h"
#include "decode.h"
#include "int8_amx.h"
#include "int8_gemm.h"
#include "row_ops.h"
#include "small_gemm.h"

namespace {

// a GEMM weight: float32/float16/bfloat16, or int8 with its scales (per row: group 0, per group, W8A8: -1)
void check_matrix(const torch::Tensor& w, const torch::Tensor& s, const torch::Tensor& smooth, int64_t group,
                  int64_t rows, int64_t cols, const char* what) {
  TORCH_CHECK(smooth.numel() == 0 || (group < 0 && smooth.numel() == cols && smooth.scalar_type() == at::kFloat &&
                                      smooth.is_contiguous()), "DecodeModel: ", what, " smooth [", cols,
              "] float32 with W8A8 only");
  if (w.scalar_type() == at::kChar) return check_int8_weight(w, s, std::max<int64_t>(group, 0), rows, cols, what);
  TORCH_CHECK(s.numel() == 0, "DecodeModel: ", what, " has scales but is not int8");
  TORCH_CHECK(w.dim() == 2 && w.size(0) == rows && w.size(1) == cols && w.is_contiguous() && w.device().is_cpu() &&
              (w.scalar_type() == at::kFloat || w.scalar_type() == at::kHalf || w.scalar_type() == at::kBFloat16),
              "DecodeModel: ", what, " must be a contiguous float32/float16/bfloat16 (or int8) CPU matrix [", rows, ", ",
              cols, "]");
}

void check_vector(const torch::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.numel() == n, "DecodeModel: ", what, " must have ", n, " elements");
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(), "DecodeModel: ", what,
              " must be a contiguous float32 CPU tensor");
}

}  // namespace

DecodeModel::DecodeModel(std::vector<torch::Tensor> weights, std::vector<torch::Tensor> scales,
                         std::vector<torch::Tensor> smooths, std::vector<int64_t> groups, int64_t n_heads,
                         int64_t n_kv, int64_t window, double eps, bool amx, bool int8_amx)
    : weights_(std::move(weights)), scales_(std::move(scales)), smooths_(std::move(smooths)),
      groups_(std::move(groups)), n_heads_(n_heads), n_kv_(n_kv), window_(window), eps_(eps), amx_(amx), int8_amx_(int8_amx) {
  TORCH_CHECK(weights_.size() >= 12 && (weights_.size() - 3) % 9 == 0, "DecodeModel: 9 weights per layer + 3");
  TORCH_CHECK(scales_.size() == weights_.size() && smooths_.size() == weights_.size() &&
              groups_.size() == weights_.size(),
              "DecodeModel: a scale tensor and a group size per weight (empty and 0 where not int8)");
  TORCH_CHECK(n_heads > 0 && n_kv > 0 && n_heads % n_kv == 0, "DecodeModel: heads a positive multiple of kv heads");
  n_layers_ = static_cast<int64_t>(weights_.size() - 3) / 9;
  const torch::Tensor &embed = weights_[9 * n_layers_], &head = weights_[9 * n_layers_ + 2];
  TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous() && embed.device().is_cpu() &&
              (embed.scalar_type() == at::kFloat || embed.scalar_type() == at::kHalf ||
               embed.scalar_type() == at::kBFloat16),
              "DecodeModel: embed must be a contiguous float32/float16/bfloat16 CPU matrix [V, H]");
  hidden_ = embed.size(1);
  check_vector(weights_[9 * n_layers_ + 1], hidden_, "final norm");
  TORCH_CHECK(head.dim() == 2, "DecodeModel: head [V, H]");
  const size_t hi = static_cast<size_t>(9 * n_layers_ + 2);
  check_matrix(head, scales_[hi], smooths_[hi], groups_[hi], head.size(0), hidden_, "head");
  const torch::Tensor& qkv0 = weights_[1];
  TORCH_CHECK(qkv0.dim() == 2 && qkv0.size(0) % (n_heads + 2 * n_kv) == 0, "DecodeModel: qkv weight rows");
  head_dim_ = qkv0.size(0) / (n_heads + 2 * n_kv);
  TORCH_CHECK(head_dim_ % 2 == 0, "DecodeModel: head_dim must be even");
  inter_ = weights_[7].dim() == 2 ? weights_[7].size(1) : 0;
  const int64_t width = (n_heads + 2 * n_kv) * head_dim_;
  in0_ = qkv0.size(1);
  TORCH_CHECK(in0_ == hidden_ || in0_ == 2 * hidden_, "DecodeModel: the first q/k/v weight reads H or 2H columns");
  for (int64_t l = 0; l < n_layers_; ++l) {  // every weight checked once here, not on each call
    const torch::Tensor* w = weights_.data() + 9 * l;
    const torch::Tensor *s = scales_.data() + 9 * l, *sm = smooths_.data() + 9 * l;
    const int64_t* g = groups_.data() + 9 * l;
    check_vector(w[0], hidden_, "input norm");
    check_matrix(w[1], s[1], sm[1], g[1], width, l == 0 ? in0_ : hidden_, "qkv weight");
    if (w[2].numel()) check_vector(w[2], width, "qkv bias");
    check_matrix(w[3], s[3], sm[3], g[3], hidden_, n_heads * head_dim_, "o_proj weight");
    if (w[4].numel()) check_vector(w[4], hidden_, "o_proj bias");
    check_vector(w[5], hidden_, "post norm");
    check_matrix(w[6], s[6], sm[6], g[6], 2 * inter_, hidden_, "gate_up weight");
    check_matrix(w[7], s[7], sm[7], g[7], hidden_, inter_, "down weight");
    if (w[8].numel()) check_vector(w[8], hidden_, "down bias");
  }
  vocab_ = head.size(0);
  if (int8_amx_) {  // the weight-only int8 GEMMs on AMX-INT8 tiles: each one's grouping must suit them
    TORCH_CHECK(int8_amx_status().empty(), "DecodeModel: int8_amx=True, but ", int8_amx_status());
    for (size_t i = 0; i < weights_.size(); ++i)
      TORCH_CHECK(weights_[i].scalar_type() != at::kChar || groups_[i] < 0 ||
                  groups_[i] % int8_amx_group_multiple() == 0,
                  "DecodeModel: int8_amx=True needs int8 groups of 0 or a multiple of ", int8_amx_group_multiple(),
                  ", got ", groups_[i]);
  }
  if (amx_) {  // every 16-bit GEMM weight (bf16) replaced by its tiles (int8 ones stay on the int8 kernel)
    TORCH_CHECK(amx_status().empty(), "DecodeModel: amx=True, but ", amx_status());
    std::vector<size_t> mats;
    for (int64_t l = 0; l < n_layers_; ++l)
      for (int64_t j : {1, 3, 6, 7}) mats.push_back(static_cast<size_t>(9 * l + j));
    mats.push_back(static_cast<size_t>(9 * n_layers_ + 2));
    for (size_t i : mats) {
      if (weights_[i].scalar_type() == at::kChar) continue;
      TORCH_CHECK(weights_[i].scalar_type() == at::kBFloat16, "DecodeModel: amx=True needs bfloat16 GEMM weights");
      weights_[i] = amx_pack(weights_[i]);
    }
  }
}

// tokens [B, T] at positions pos [B, T] in cache rows rows [B] (empty: 0..B-1) -> logits of the rows chosen
// by idx: empty -> [B, T, V]; [B] -> [B, V]; [B, J] -> [B, J, V]; the first n_layers layers. A non-empty
// float32 `hidden` receives the final-norm outputs or the aux states of the scored rows, or of every row (decode.h)
torch::Tensor DecodeModel::forward(const torch::Tensor& tokens, const torch::Tensor& pos, const torch::Tensor& rows,
                                   const torch::Tensor& idx, int64_t kv_len, int64_t n_layers,
                                   torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& cos,
                                   const torch::Tensor& sin, torch::Tensor hidden, const torch::Tensor& slots,
                                   const torch::Tensor& mask, const torch::Tensor& aux, bool every) const {
  TORCH_CHECK(in0_ == hidden_, "decode_forward: a wide first layer takes forward_pair");
  TORCH_CHECK(tokens.dim() == 2 && pos.sizes() == tokens.sizes() && tokens.scalar_type() == at::kLong &&
              pos.scalar_type() == at::kLong, "decode_forward: tokens and pos [B, T] int64");
  const torch::Tensor& embed = weights_[9 * n_layers_];
  const int64_t B = tokens.size(0), T = tokens.size(1), M = B * T, H = hidden_;
  const torch::Tensor tok = tokens.contiguous();
  const int64_t* tp = tok.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(tp[m] >= 0 && tp[m] < embed.size(0), "decode_forward: a token id is out of range");
  std::vector<float> x(M * H);
  table_rows(embed, tp, M, x.data());  // a 16-bit table (a draft's, a CPU plan's): rows widened exactly
  return run(x, B, T, pos, rows, idx, kv_len, n_layers, k_cache, v_cache, cos, sin, hidden, slots, mask, aux, every);
}

// the same forward from the first layer's inputs x [B, T, H] float32 (no embedding lookup)
torch::Tensor DecodeModel::forward_x(const torch::Tensor& x_in, const torch::Tensor& pos, const torch::Tensor& rows,
                                     const torch::Tensor& idx, int64_t kv_len, int64_t n_layers,
                                     torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& cos,
                                     const torch::Tensor& sin, torch::Tensor hidden, const torch::Tensor& slots,
                                     const torch::Tensor& mask) const {
  TORCH_CHECK(in0_ == hidden_, "decode_forward_x: a wide first layer takes forward_pair");
  TORCH_CHECK(x_in.dim() == 3 && x_in.size(2) == hidden_ && x_in.scalar_type() == at::kFloat &&
              x_in.device().is_cpu(), "decode_forward_x: x [B, T, ", hidden_, "] float32 on the CPU");
  TORCH_CHECK(pos.dim() == 2 && pos.size(0) == x_in.size(0) && pos.size(1) == x_in.size(1) &&
              pos.scalar_type() == at::kLong, "decode_forward_x: pos [B, T] int64");
  const torch::Tensor xc = x_in.contiguous();
  std::vector<float> x(xc.data_ptr<float>(), xc.data_ptr<float>() + xc.numel());
  const torch::Tensor none;
  return run(x, x_in.size(0), x_in.size(1), pos, rows, idx, kv_len, n_layers, k_cache, v_cache, cos, sin, hidden,
             slots, mask, none, false);
}

// a wide first layer's forward: its q/k/v read qkv_in [B, T, 2H] (normed by the caller), residual [B, T, H] the
// stream they add to
torch::Tensor DecodeModel::forward_pair(const torch::Tensor& qkv_in, const torch::Tensor& residual,
                                        const torch::Tensor& pos, const torch::Tensor& rows, const torch::Tensor& idx,
                                        int64_t kv_len, torch::Tensor k_cache, torch::Tensor v_cache,
                                        const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor hidden,
                                        const torch::Tensor& aux, const torch::Tensor& slots,
                                        const torch::Tensor& mask) const {
  TORCH_CHECK(in0_ == 2 * hidden_, "decode_forward_pair: the model's first layer reads H columns: use forward_x");
  TORCH_CHECK(residual.dim() == 3 && residual.size(2) == hidden_ && residual.scalar_type() == at::kFloat &&
                  residual.device().is_cpu() && qkv_in.dim() == 3 && qkv_in.size(0) == residual.size(0) &&
                  qkv_in.size(1) == residual.size(1) && qkv_in.size(2) == in0_ &&
                  qkv_in.scalar_type() == at::kFloat && qkv_in.device().is_cpu(),
              "decode_forward_pair: residual [B, T, ", hidden_, "] and qkv_in [B, T, ", in0_, "] float32 on the CPU");
  TORCH_CHECK(pos.dim() == 2 && pos.size(0) == residual.size(0) && pos.size(1) == residual.size(1) &&
              pos.scalar_type() == at::kLong, "decode_forward_pair: pos [B, T] int64");
  const torch::Tensor rc = residual.contiguous(), qc = qkv_in.contiguous();
  std::vector<float> x(rc.data_ptr<float>(), rc.data_ptr<float>() + rc.numel());
  return run(x, residual.size(0), residual.size(1), pos, rows, idx, kv_len, n_layers_, k_cache, v_cache, cos, sin,
             hidden, slots, mask, aux, false, qc.data_ptr<float>());
}

// greedy drafting: the forward above scored at `last` [B], then steps - 1 more one-token forwards on its own
// argmax (the first maximum, NaN counted as the maximum, like torch.argmax) over the first vocab logits
torch::Tensor DecodeModel::greedy(const torch::Tensor& tokens, const torch::Tensor& pos, const torch::Tensor& rows,
                                  const torch::Tensor& last, int64_t kv_len, int64_t n_layers, torch::Tensor k_cache,
                                  torch::Tensor v_cache, const torch::Tensor& cos, const torch::Tensor& sin,
                                  int64_t steps, int64_t vocab) const {
  TORCH_CHECK(steps >= 1 && vocab >= 1 && vocab <= vocab_, "greedy: steps >= 1 and 1 <= vocab <= ", vocab_);
  TORCH_CHECK(last.dim() == 1, "greedy: last [B]");
  const torch::Tensor none = torch::empty({0}, tokens.options().dtype(at::kFloat));
  torch::Tensor logits =
      forward(tokens, pos, rows, last, kv_len, n_layers, k_cache, v_cache, cos, sin, none, none, none, none, false);
  const int64_t B = tokens.size(0), T = tokens.size(1);
  const torch::Tensor pc = pos.contiguous(), lc = last.contiguous();
  auto opts = tokens.options().dtype(at::kLong);
  torch::Tensor out = torch::empty({B, steps}, opts), tok = torch::empty({B, 1}, opts);
  torch::Tensor next = torch::empty({B, 1}, opts), zero = torch::zeros({B}, opts);
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < steps; ++i) {
    const float* lp = logits.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t best = row_ops::argmax(lp + b * vocab_, vocab);
      op[b * steps + i] = best;
      tok.data_ptr<int64_t>()[b] = best;
      next.data_ptr<int64_t>()[b] = pc.data_ptr<int64_t>()[b * T + lc.data_ptr<int64_t>()[b]] + 1 + i;
    }
    if (i + 1 < steps)
      logits = forward(tok, next, rows, zero, kv_len + i + 1, n_layers, k_cache, v_cache, cos, sin, none, none, none,
                       none, false);
  }
  return out;
}
