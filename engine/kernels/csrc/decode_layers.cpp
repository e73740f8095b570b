// The decoder layers of a Llama-family model for the few rows of a decode step, a draft step or a
// speculative verify pass, in fp32 on the CPU, as one C++ call instead of ~20 PyTorch ops per layer.
//
// A small model's step on a CPU is mostly dispatch, not arithmetic. This runs the same computation as engine/core/model.py
// (RMSNorm, fused q/k/v GEMM, rotary embedding, static position-indexed KV cache, causal attention
// with an optional sliding window, o_proj, RMSNorm, fused gate/up GEMM, SiLU, down_proj) with the
// small-GEMM kernel for every projection, or AMX tiles for bf16-valued weights (amx_gemm.cpp). Every row
// (one token of one sequence) is computed the same way whatever the number of rows in the call, so a
// verify pass equals the one-token steps bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "amx_gemm.h"
#include "attention.h"
#include "decode.h"
#include "int8_amx.h"
#include "int8_gemm.h"
#include "row_ops.h"
#include "small_gemm.h"

namespace {

using attention::attend;
using attention::Dims;
using row_ops::rms_norm;

// one head vector rotated in place: x * cos + roll(x, D/2) * sin_folded (engine/core/model.py apply_rope), the
// roll's index (d + D/2) mod D in two loops the compiler vectorizes
void rope(float* x, const float* cos, const float* sin, int64_t D, float* tmp) {
  const int64_t h = D / 2;
  for (int64_t d = 0; d < D - h; ++d) tmp[d] = x[d] * cos[d] + x[d + h] * sin[d];
  for (int64_t d = D - h; d < D; ++d) tmp[d] = x[d] * cos[d] + x[d + h - D] * sin[d];
  std::copy_n(tmp, D, x);
}

// f(m0, m1) over the rows [0, M) of a call, split across the threads when there are many (a prompt): every row is
// computed alone, so the split changes no result
constexpr int64_t ROW_GRAIN = 16;
template <typename F>
void by_rows(int64_t M, const F& f) {
  at::parallel_for(0, M, ROW_GRAIN, f);
}

// y = rms_norm(x) * w for the call's M rows of H floats, by_rows
void norm_rows(const float* x, const float* w, float* y, int64_t M, int64_t H, float eps) {
  by_rows(M, [&](int64_t m0, int64_t m1) { rms_norm(x + m0 * H, w, y + m0 * H, m1 - m0, H, eps); });
}

// Each row's q and k heads rotated in place (qkv [M, (nh + 2 nkv) D]), then its k and v stored at its cache slot
// (slot [M]) of its cache row (row [M]); cos, sin: the rotary tables by position (pos [M]). Rows that share a slot
// (padding rows all write the scratch slot, which no row reads) leave one of their values there, unspecified which.
void rotate_and_store(float* qkv, const int64_t* pos, const int64_t* slot, const int64_t* row, const float* cos,
                      const float* sin, const Dims& d, float* kc, float* vc) {
  const int64_t width = (d.nh + 2 * d.nkv) * d.D;
  by_rows(d.M, [&](int64_t m0, int64_t m1) {
    thread_local std::vector<float> tmp;  // a head's rotation, grown to the largest head seen
    if (static_cast<int64_t>(tmp.size()) < d.D) tmp.resize(d.D);
    for (int64_t m = m0; m < m1; ++m) {
      float* r = qkv + m * width;
      for (int64_t hh = 0; hh < d.nh + d.nkv; ++hh)
        rope(r + hh * d.D, cos + pos[m] * d.D, sin + pos[m] * d.D, d.D, tmp.data());
      for (int64_t kvh = 0; kvh < d.nkv; ++kvh) {
        const int64_t at = ((row[m] * d.nkv + kvh) * d.S + slot[m]) * d.D;
        std::copy_n(r + (d.nh + kvh) * d.D, d.D, kc + at);
        std::copy_n(r + (d.nh + d.nkv + kvh) * d.D, d.D, vc + at);
      }
    }
  });
}

void add_bias(float* y, const torch::Tensor& b, int64_t M, int64_t N) {
  if (b.numel() == 0) return;  // no bias (shape checked by DecodeModel)
  const float* bp = b.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) y[m * N + n] += bp[n];
}

const float* f32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
              "decode_layers: ", what, " must be a contiguous float32 CPU tensor");
  return t.data_ptr<float>();
}

// One GEMM weight of the step: float (s empty) or int8 with scales s, per row (group 0), per group, or W8A8
// (group -1: activations quantized per row after the division by smooth, s per output row)
// which kernels the step's GEMMs run on (DecodeModel's amx and int8_amx)
struct Kernels {
  bool amx, int8_amx;
};

struct Mat {
  const torch::Tensor &w, &s, &smooth;
  int64_t group;
};

// y[M, N] = x[M, K] @ w^T on the weight's GEMM kernel: int8 weights on the int8 kernels (weight-only ones on
// AMX-INT8 tiles where k.int8_amx), the others on AMX tiles (w packed by amx_pack) or the small GEMM
void gemm(Kernels k, const float* x, const Mat& w, float* y, int64_t M, int64_t K, int64_t N) {
  if (w.w.scalar_type() == at::kChar) {
    if (w.group < 0) return w8a8_gemm_into(x, w.w, w.s, w.smooth, y, M, K, N);
    if (k.int8_amx) return int8_amx_gemm_into(x, w.w, w.s, w.group, y, M, K, N);
    return int8_gemm_into(x, w.w, w.s, w.group, y, M, K, N);
  }
  if (k.amx) return amx_gemm_into(x, w.w, y, M, K, N);
  small_gemm_into(x, w.w, y, M, K, N);
}

// The layers on x [M, H] in place: pos [M] the position of each row, row [M] its cache row; kc0, vc0 the
// caches [L, max_batch, nkv, S, D]; w the 9 weights per layer (DecodeModel checked their shapes). Keys and
// values of every row are written before any row attends, so a row sees the rows before it in the same
// call (its sequence's earlier tokens). aux: feature layers whose inputs x are copied to cap [n_aux, M, H] (L: the
// last layer's output). qkv_in: null, or the first layer's q/k/v input [M, in0] (x is then only its residual).
void layers(float* xp, const int64_t* pp, const int64_t* slp, const bool* mp, const int64_t* rp, int64_t kv_len,
            const torch::Tensor* weights,
            const torch::Tensor* scales, const torch::Tensor* smooths, const int64_t* groups, Kernels kern, int64_t L, float* kc0, float* vc0, const Dims& d, int64_t inter, const float* cp,
            const float* sp, float eps, const std::vector<int64_t>& aux, float* cap, const float* qkv_in,
            int64_t in0) {
  const int64_t width = (d.nh + 2 * d.nkv) * d.D, layer_kv = d.max_batch * d.nkv * d.S * d.D;
  std::vector<float> h(d.M * d.H), qkv(d.M * width), attn(d.M * d.nh * d.D), y(d.M * d.H);
  std::vector<float> gu(d.M * 2 * inter), act(d.M * inter);
  const std::vector<attention::Tile> tiles = attention::plan_tiles(slp, mp, rp, kv_len, d);  // every layer's
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = weights + 9 * l;
    const torch::Tensor *s = scales + 9 * l, *sm = smooths + 9 * l;
    const int64_t* g = groups + 9 * l;
    auto mat = [&](int j) { return Mat{w[j], s[j], sm[j], g[j]}; };
    float* kc = kc0 + l * layer_kv;
    float* vc = vc0 + l * layer_kv;
    for (size_t a = 0; a < aux.size(); ++a)  // the hidden states entering a feature layer (EAGLE-3)
      if (aux[a] == l) std::copy_n(xp, d.M * d.H, cap + a * d.M * d.H);
    float* q = qkv.data();
    if (l == 0 && qkv_in) {  // a wide first layer (EAGLE-3's): its q/k/v read the given [M, in0], normed already
      gemm(kern, qkv_in, mat(1), q, d.M, in0, width);
    } else {
      norm_rows(xp, w[0].data_ptr<float>(), h.data(), d.M, d.H, eps);
      gemm(kern, h.data(), mat(1), q, d.M, d.H, width);
    }
    add_bias(q, w[2], d.M, width);
    rotate_and_store(q, pp, slp, rp, cp, sp, d, kc, vc);
    attend(tiles, q, kc, vc, slp, mp, rp, kv_len, d, attn.data());
    gemm(kern, attn.data(), mat(3), y.data(), d.M, d.nh * d.D, d.H);
    add_bias(y.data(), w[4], d.M, d.H);
    for (int64_t i = 0; i < d.M * d.H; ++i) xp[i] += y[i];
    norm_rows(xp, w[5].data_ptr<float>(), h.data(), d.M, d.H, eps);
    gemm(kern, h.data(), mat(6), gu.data(), d.M, d.H, 2 * inter);
    by_rows(d.M, [&](int64_t m0, int64_t m1) {
      row_ops::swiglu(gu.data() + m0 * 2 * inter, act.data() + m0 * inter, m1 - m0, inter);
    });
    gemm(kern, act.data(), mat(7), y.data(), d.M, inter, d.H);
    add_bias(y.data(), w[8], d.M, d.H);
    for (int64_t i = 0; i < d.M * d.H; ++i) xp[i] += y[i];
  }
  for (size_t a = 0; a < aux.size(); ++a)  // "entering layer L": the last layer's output, before the final norm
    if (aux[a] == L) std::copy_n(xp, d.M * d.H, cap + a * d.M * d.H);
}

}  // namespace

namespace {

// the rows idx scores (empty: every row of [B, T]) and the logits' shape: [B, T, V], [B, V] or [B, J, V]
std::vector<int64_t> scored_rows(const torch::Tensor& idx, int64_t B, int64_t T, int64_t V,
                                 std::vector<int64_t>& shape) {
  std::vector<int64_t> sel;
  if (idx.numel() == 0) {
    for (int64_t m = 0; m < B * T; ++m) sel.push_back(m);
    shape = {B, T, V};
    return sel;
  }
  TORCH_CHECK(idx.size(0) == B && idx.dim() <= 2 && idx.scalar_type() == at::kLong, "decode_forward: idx [B] or [B, J]");
  const torch::Tensor ic = idx.contiguous();
  const int64_t J = idx.dim() == 2 ? idx.size(1) : 1;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < J; ++j) {
      const int64_t t = ic.data_ptr<int64_t>()[b * J + j];
      TORCH_CHECK(t >= 0 && t < T, "decode_forward: idx out of range");
      sel.push_back(b * T + t);
    }
  shape = idx.dim() == 2 ? std::vector<int64_t>{B, J, V} : std::vector<int64_t>{B, V};
  return sel;
}

// the feature layers asked for (aux: empty or [n] int64, each in 0..n_layers), checked
std::vector<int64_t> feature_layers(const torch::Tensor& aux, int64_t n_layers, const torch::Tensor& hidden) {
  std::vector<int64_t> feat;
  if (!aux.defined() || aux.numel() == 0) return feat;
  TORCH_CHECK(aux.dim() == 1 && aux.scalar_type() == at::kLong, "decode_forward: aux layers [n] int64");
  const torch::Tensor ac = aux.contiguous();
  feat.assign(ac.data_ptr<int64_t>(), ac.data_ptr<int64_t>() + ac.numel());
  for (int64_t l : feat) TORCH_CHECK(l >= 0 && l <= n_layers, "decode_forward: an aux layer is not in 0..", n_layers);
  TORCH_CHECK(hidden.numel() > 0, "decode_forward: aux layers need a hidden tensor to write to");
  return feat;
}

// hidden [rows, W]: the rows' final-norm outputs (W = H) or the n captured states cap [n, M, H] (W = n H), of
// every row ([B, T, W]) or of the scored rows sel (the logits' shape, W for V)
void write_hidden(torch::Tensor& hidden, const float* x, const float* norm, float eps, const std::vector<float>& cap,
                  int64_t n, int64_t B, int64_t T, int64_t H, const std::vector<int64_t>& sel,
                  std::vector<int64_t> shape, bool every) {
  const int64_t M = B * T;
  std::vector<int64_t> out(sel);
  if (every) {
    out.resize(M);
    for (int64_t m = 0; m < M; ++m) out[m] = m;
    shape = {B, T, 0};
  }
  shape.back() = n ? n * H : H;
  hidden.resize_(shape);
  float* hp = hidden.data_ptr<float>();
  for (size_t r = 0; r < out.size(); ++r) {
    if (n == 0) rms_norm(x + out[r] * H, norm, hp + r * H, 1, H, eps);
    for (int64_t a = 0; a < n; ++a) std::copy_n(cap.data() + (a * M + out[r]) * H, H, hp + (r * n + a) * H);
  }
}

}  // namespace

torch::Tensor DecodeModel::run(std::vector<float>& x, int64_t B, int64_t T, const torch::Tensor& pos,
                               const torch::Tensor& rows, const torch::Tensor& idx, int64_t kv_len, int64_t n_layers,
                               torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& cos,
                               const torch::Tensor& sin, torch::Tensor hidden, const torch::Tensor& slots,
                               const torch::Tensor& mask, const torch::Tensor& aux, bool every,
                               const float* qkv_in) const {
  TORCH_CHECK(n_layers >= 1 && n_layers <= n_layers_, "decode_forward: n_layers in 1..", n_layers_);
  const torch::Tensor &embed = weights_[9 * n_layers_], &norm = weights_[9 * n_layers_ + 1];
  const torch::Tensor& head = weights_[9 * n_layers_ + 2];
  const int64_t M = B * T, H = hidden_, V = vocab_;
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.sizes() == k_cache.sizes() && n_layers <= k_cache.size(0) &&
              k_cache.size(2) == n_kv_ && k_cache.size(4) == head_dim_,
              "decode_forward: caches [L, max_batch, n_kv, S, head_dim] matching the model");
  const attention::Dims d{M, H, n_heads_, n_kv_, head_dim_, k_cache.size(3), k_cache.size(1), window_};
  TORCH_CHECK(cos.size(-1) == d.D && sin.size(-1) == d.D && cos.size(0) == sin.size(0) && kv_len >= 0 &&
              kv_len <= d.S, "decode_forward: rotary tables [N, head_dim], 0 <= kv_len <= cache length");
  TORCH_CHECK(rows.numel() == 0 || ((rows.numel() == B || rows.numel() == M) && rows.scalar_type() == at::kLong),
              "decode_forward: rows [B] or [B, T]");
  TORCH_CHECK(hidden.numel() == 0 || hidden.scalar_type() == at::kFloat, "decode_forward: hidden float32");
  const torch::Tensor posc = pos.contiguous();
  const torch::Tensor rws = rows.numel() ? rows.contiguous() : rows;
  const int64_t* pp = posc.data_ptr<int64_t>();
  const bool tree = slots.defined() && slots.numel() > 0;
  TORCH_CHECK(!tree || (slots.sizes() == pos.sizes() && slots.scalar_type() == at::kLong &&
                        mask.dim() == 3 && mask.size(0) == B && mask.size(1) == T && mask.size(2) == kv_len &&
                        mask.scalar_type() == at::kBool),
              "decode_forward: a tree's slots [B, T] int64 and mask [B, T, kv_len] bool");
  const torch::Tensor slc = tree ? slots.contiguous() : posc, mc = tree ? mask.contiguous() : mask;
  const int64_t* slp = slc.data_ptr<int64_t>();
  std::vector<int64_t> row(M);
  for (int64_t m = 0; m < M; ++m) {
    row[m] = rows.numel() == M ? rws.data_ptr<int64_t>()[m] : rows.numel() ? rws.data_ptr<int64_t>()[m / T] : m / T;
    TORCH_CHECK(pp[m] >= 0 && pp[m] < d.S && pp[m] < cos.size(0) && row[m] >= 0 && row[m] < d.max_batch &&
                    slp[m] >= 0 && slp[m] < d.S,
                "decode_forward: a position, slot or cache row is out of range");
  }
  std::vector<int64_t> shape;
  const std::vector<int64_t> sel = scored_rows(idx, B, T, V, shape), feat = feature_layers(aux, n_layers, hidden);
  std::vector<float> cap(feat.size() * M * H);
  layers(x.data(), pp, slp, tree ? mc.data_ptr<bool>() : nullptr, row.data(), kv_len, weights_.data(), scales_.data(), smooths_.data(), groups_.data(), Kernels{amx_, int8_amx_},
         n_layers, const_cast<float*>(f32(k_cache, "k_cache")),
         const_cast<float*>(f32(v_cache, "v_cache")), d, inter_, f32(cos, "cos"), f32(sin, "sin"),
         static_cast<float>(eps_), feat, cap.data(), qkv_in, in0_);
  // the scored rows: final norm and head
  const int64_t R = static_cast<int64_t>(sel.size());
  std::vector<float> normed(R * H);
  for (int64_t r = 0; r < R; ++r)
    rms_norm(x.data() + sel[r] * H, norm.data_ptr<float>(), normed.data() + r * H, 1, H, static_cast<float>(eps_));
  torch::Tensor logits = torch::empty(shape, embed.options().dtype(at::kFloat));
  const size_t hi = static_cast<size_t>(9 * n_layers_ + 2);
  gemm(Kernels{amx_, int8_amx_}, normed.data(), Mat{head, scales_[hi], smooths_[hi], groups_[hi]}, logits.data_ptr<float>(), R, H, V);
  if (hidden.numel() > 0)
    write_hidden(hidden, x.data(), norm.data_ptr<float>(), static_cast<float>(eps_), cap,
                 static_cast<int64_t>(feat.size()), B, T, H, sel, shape, every);
  return logits;
}
