// The decoder layers of a Llama-family model for the few rows of a decode step, a draft step or a
// speculative verify pass, in fp32 on the CPU, as one C++ call instead of ~20 PyTorch ops per layer.
//
// A small model's step on a CPU is mostly dispatch: the demo draft's 2 layers cost ~0.9 ms through
// PyTorch, ~0.2 ms of which is arithmetic. This runs the same computation as engine/model.py
// (RMSNorm, fused q/k/v GEMM, rotary embedding, static position-indexed KV cache, causal attention
// with an optional sliding window, o_proj, RMSNorm, fused gate/up GEMM, SiLU, down_proj) with the
// small-GEMM kernel for every projection. Every row (one token of one sequence) is computed the same
// way whatever the number of rows in the call, so a verify pass equals the one-token steps bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "decode.h"
#include "small_gemm.h"

namespace {

// y[m] = x[m] * rsqrt(mean(x[m]^2) + eps) * w, per row
void rms_norm(const float* x, const float* w, float* y, int64_t M, int64_t H, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * H;
    float ss = 0.f;
    for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
    float* yr = y + m * H;
    for (int64_t i = 0; i < H; ++i) yr[i] = xr[i] * r * w[i];
  }
}

// one head vector rotated in place: x * cos + roll(x, D/2) * sin_folded (engine/model.py apply_rope)
void rope(float* x, const float* cos, const float* sin, int64_t D, float* tmp) {
  const int64_t h = D / 2;
  for (int64_t d = 0; d < D; ++d) tmp[d] = x[d] * cos[d] + x[(d + h) % D] * sin[d];
  for (int64_t d = 0; d < D; ++d) x[d] = tmp[d];
}

// q . k over D floats: 16-lane FMA chains when D is a multiple of 16, a scalar loop otherwise
inline float dot(const float* q, const float* k, int64_t D) {
  if (D % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t e = 0; e < D; e += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + e), _mm512_loadu_ps(k + e), acc);
    return _mm512_reduce_add_ps(acc);
  }
  float acc = 0.f;
  for (int64_t e = 0; e < D; ++e) acc += q[e] * k[e];
  return acc;
}

struct Dims {
  int64_t M, H, nh, nkv, D, S, max_batch, window;  // window <= 0: none
};

// o[m, head, :] = softmax(q . k_j / sqrt(D)) v over the visible cache slots j of row m's sequence
void attend(const float* qkv, const float* kc, const float* vc, const int64_t* pos, const int64_t* row,
            int64_t kv_len, const Dims& d, float* o) {
  const int64_t width = (d.nh + 2 * d.nkv) * d.D, group = d.nh / d.nkv;
  const float scale = 1.f / std::sqrt(static_cast<float>(d.D));
  const int64_t items = d.M * d.nh;
  const int64_t work = items * kv_len * d.D;
  at::parallel_for(0, items, work < (1 << 18) ? items : 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> s(static_cast<size_t>(kv_len));
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t m = it / d.nh, h = it % d.nh, kvh = h / group, p = pos[m];
      const int64_t hi = std::min(p + 1, kv_len);
      const int64_t lo = d.window > 0 ? std::max<int64_t>(0, p - d.window + 1) : 0;
      const float* q = qkv + m * width + h * d.D;
      const int64_t base = ((row[m] * d.nkv + kvh) * d.S) * d.D;
      float mx = -INFINITY;
      for (int64_t j = lo; j < hi; ++j) {
        s[j] = dot(q, kc + base + j * d.D, d.D) * scale;
        mx = std::max(mx, s[j]);
      }
      float* out = o + m * d.nh * d.D + h * d.D;
      for (int64_t e = 0; e < d.D; ++e) out[e] = 0.f;
      float sum = 0.f;
      for (int64_t j = lo; j < hi; ++j) {
        const float w = std::exp(s[j] - mx);
        sum += w;
        const float* v = vc + base + j * d.D;
        for (int64_t e = 0; e < d.D; ++e) out[e] += w * v[e];
      }
      const float inv = hi > lo ? 1.f / sum : 0.f;
      for (int64_t e = 0; e < d.D; ++e) out[e] *= inv;
    }
  });
}

void add_bias(float* y, const torch::Tensor& b, int64_t M, int64_t N) {
  if (!b.defined() || b.numel() == 0) return;  // no bias
  TORCH_CHECK(b.numel() == N && b.scalar_type() == at::kFloat && b.is_contiguous(), "decode_layers: bias shape");
  const float* bp = b.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) y[m * N + n] += bp[n];
}

const float* f32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
              "decode_layers: ", what, " must be a contiguous float32 CPU tensor");
  return t.data_ptr<float>();
}

}  // namespace

// x [M, H] (the embedded tokens, updated in place to the last layer's output); pos [M] the position
// of each row and row [M] its cache row; k_cache, v_cache [L, max_batch, nkv, S, D]; weights: per layer
// 9 tensors (input norm, qkv weight, qkv bias or empty, o weight, o bias or empty, post norm,
// gate_up weight, down weight, down bias or empty; the four matrices float32 or float16, the rest
// float32). Keys and values of every row are written before
// any row attends, so a row sees the rows before it in the same call (its sequence's earlier tokens).
void decode_layers(torch::Tensor x, const torch::Tensor& pos, const torch::Tensor& row, int64_t kv_len,
                   const torch::Tensor* weights, int64_t L, torch::Tensor k_cache, torch::Tensor v_cache,
                   const torch::Tensor& cos, const torch::Tensor& sin, int64_t n_heads, int64_t n_kv,
                   int64_t window, double eps) {
  TORCH_CHECK(x.dim() == 2 && pos.dim() == 1 && row.dim() == 1 && pos.size(0) == x.size(0) &&
              row.size(0) == x.size(0), "decode_layers: x [M, H], pos [M], row [M]");
  TORCH_CHECK(pos.scalar_type() == at::kLong && row.scalar_type() == at::kLong && pos.is_contiguous() &&
              row.is_contiguous(), "decode_layers: pos and row are contiguous int64");
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.sizes() == k_cache.sizes(),
              "decode_layers: caches [L, max_batch, nkv, S, D]");
  TORCH_CHECK(L <= k_cache.size(0) && k_cache.size(2) == n_kv && n_heads % n_kv == 0,
              "decode_layers: cache shape does not match the model");
  Dims d{x.size(0), x.size(1), n_heads, n_kv, k_cache.size(4), k_cache.size(3), k_cache.size(1), window};
  TORCH_CHECK(cos.size(-1) == d.D && sin.size(-1) == d.D && d.D % 2 == 0 && kv_len >= 0 && kv_len <= d.S,
              "decode_layers: rotary tables [N, head_dim], 0 <= kv_len <= cache length");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* rp = row.data_ptr<int64_t>();
  for (int64_t m = 0; m < d.M; ++m)
    TORCH_CHECK(pp[m] >= 0 && pp[m] < d.S && pp[m] < cos.size(0) && rp[m] >= 0 && rp[m] < d.max_batch,
                "decode_layers: a position or cache row is out of range");
  float* xp = const_cast<float*>(f32(x, "x"));
  const float* cp = f32(cos, "cos");
  const float* sp = f32(sin, "sin");
  const int64_t width = (d.nh + 2 * d.nkv) * d.D, layer_kv = d.max_batch * d.nkv * d.S * d.D;
  std::vector<float> h(d.M * d.H), qkv(d.M * width), attn(d.M * d.nh * d.D), y(d.M * d.H), tmp(d.D);
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = weights + 9 * l;
    TORCH_CHECK(w[0].numel() == d.H && w[5].numel() == d.H, "decode_layers: norm weights [H]");
    float* kc = const_cast<float*>(f32(k_cache, "k_cache")) + l * layer_kv;
    float* vc = const_cast<float*>(f32(v_cache, "v_cache")) + l * layer_kv;
    rms_norm(xp, f32(w[0], "input norm"), h.data(), d.M, d.H, static_cast<float>(eps));
    TORCH_CHECK(w[1].size(0) == width && w[1].size(1) == d.H, "decode_layers: qkv weight shape");
    float* q = qkv.data();
    small_gemm_into(h.data(), w[1], q, d.M, d.H, width);
    add_bias(q, w[2], d.M, width);
    for (int64_t m = 0; m < d.M; ++m) {  // rotate q and k heads, then store k and v at the row's position
      const int64_t p = pp[m];
      float* r = q + m * width;
      for (int64_t hh = 0; hh < d.nh + d.nkv; ++hh) rope(r + hh * d.D, cp + p * d.D, sp + p * d.D, d.D, tmp.data());
      for (int64_t kvh = 0; kvh < d.nkv; ++kvh) {
        const int64_t at = ((rp[m] * d.nkv + kvh) * d.S + p) * d.D;
        std::copy_n(r + (d.nh + kvh) * d.D, d.D, kc + at);
        std::copy_n(r + (d.nh + d.nkv + kvh) * d.D, d.D, vc + at);
      }
    }
    attend(q, kc, vc, pp, rp, kv_len, d, attn.data());
    TORCH_CHECK(w[3].size(0) == d.H && w[3].size(1) == d.nh * d.D, "decode_layers: o_proj weight shape");
    small_gemm_into(attn.data(), w[3], y.data(), d.M, d.nh * d.D, d.H);
    add_bias(y.data(), w[4], d.M, d.H);
    for (int64_t i = 0; i < d.M * d.H; ++i) xp[i] += y[i];
    rms_norm(xp, f32(w[5], "post norm"), h.data(), d.M, d.H, static_cast<float>(eps));
    const int64_t I2 = w[6].size(0), I = I2 / 2;
    TORCH_CHECK(w[6].size(1) == d.H && w[7].size(0) == d.H && w[7].size(1) == I, "decode_layers: MLP shapes");
    std::vector<float> gu(d.M * I2), a(d.M * I);
    small_gemm_into(h.data(), w[6], gu.data(), d.M, d.H, I2);
    for (int64_t m = 0; m < d.M; ++m)
      for (int64_t i = 0; i < I; ++i) {
        const float g = gu[m * I2 + i];
        a[m * I + i] = g / (1.f + std::exp(-g)) * gu[m * I2 + I + i];
      }
    small_gemm_into(a.data(), w[7], y.data(), d.M, I, d.H);
    add_bias(y.data(), w[8], d.M, d.H);
    for (int64_t i = 0; i < d.M * d.H; ++i) xp[i] += y[i];
  }
}

namespace {

// The whole few-row forward: tokens [B, T] at positions pos [B, T] in cache rows rows [B] (empty: 0..B-1)
// -> logits of the rows chosen by idx: empty -> [B, T, V]; [B] -> [B, V]; [B, J] -> [B, J, V]. The first
// 9 * n_layers weights are the layers' (as decode_layers), the last three embed [V, H] (float32), final
// norm [H] (float32) and head [V', H].
torch::Tensor decode_forward(const torch::Tensor& tokens, const torch::Tensor& pos, const torch::Tensor& rows,
                             const torch::Tensor& idx, int64_t kv_len, int64_t n_layers,
                             const std::vector<torch::Tensor>& weights, torch::Tensor k_cache, torch::Tensor v_cache,
                             const torch::Tensor& cos, const torch::Tensor& sin, int64_t n_heads, int64_t n_kv,
                             int64_t window, double eps) {
  TORCH_CHECK(tokens.dim() == 2 && pos.sizes() == tokens.sizes() && tokens.scalar_type() == at::kLong &&
              pos.scalar_type() == at::kLong, "decode_forward: tokens and pos [B, T] int64");
  const int64_t n_all = static_cast<int64_t>(weights.size()) - 3;
  TORCH_CHECK(n_all >= 9 * n_layers && n_all % 9 == 0 && n_layers >= 1, "decode_forward: weights");
  const torch::Tensor &embed = weights[n_all], &norm = weights[n_all + 1], &head = weights[n_all + 2];
  const int64_t B = tokens.size(0), T = tokens.size(1), M = B * T, H = embed.size(1), V = head.size(0);
  TORCH_CHECK(head.dim() == 2 && head.size(1) == H && norm.numel() == H, "decode_forward: head [V, H], norm [H]");
  const torch::Tensor tok = tokens.contiguous(), posc = pos.contiguous().view({M});
  const int64_t* tp = tok.data_ptr<int64_t>();
  torch::Tensor row = torch::empty({M}, tokens.options());
  int64_t* rp = row.data_ptr<int64_t>();
  const torch::Tensor rws = rows.numel() ? rows.contiguous() : rows;
  TORCH_CHECK(rows.numel() == 0 || (rows.numel() == B && rows.scalar_type() == at::kLong), "decode_forward: rows [B]");
  for (int64_t m = 0; m < M; ++m) rp[m] = rows.numel() ? rws.data_ptr<int64_t>()[m / T] : m / T;
  torch::Tensor x = torch::empty({M, H}, embed.options());
  const float* ep = f32(embed, "embed");
  float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(tp[m] >= 0 && tp[m] < embed.size(0), "decode_forward: a token id is out of range");
    std::copy_n(ep + tp[m] * H, H, xp + m * H);
  }
  decode_layers(x, posc, row, kv_len, weights.data(), n_layers, k_cache, v_cache, cos, sin, n_heads, n_kv, window,
                eps);
  // the rows to score
  std::vector<int64_t> sel;
  std::vector<int64_t> shape;
  if (idx.numel() == 0) {
    for (int64_t m = 0; m < M; ++m) sel.push_back(m);
    shape = {B, T, V};
  } else {
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
  }
  const int64_t R = static_cast<int64_t>(sel.size());
  std::vector<float> picked(R * H), normed(R * H);
  for (int64_t r = 0; r < R; ++r) std::copy_n(xp + sel[r] * H, H, picked.data() + r * H);
  rms_norm(picked.data(), f32(norm, "final norm"), normed.data(), R, H, static_cast<float>(eps));
  torch::Tensor logits = torch::empty(shape, embed.options());
  small_gemm_into(normed.data(), head, logits.data_ptr<float>(), R, H, V);
  return logits;
}

}  // namespace

DecodeModel::DecodeModel(std::vector<torch::Tensor> weights, int64_t n_heads, int64_t n_kv, int64_t window,
                         double eps)
    : weights_(std::move(weights)), n_heads_(n_heads), n_kv_(n_kv), window_(window), eps_(eps) {
  TORCH_CHECK(weights_.size() >= 12 && (weights_.size() - 3) % 9 == 0, "DecodeModel: 9 weights per layer + 3");
  TORCH_CHECK(n_heads > 0 && n_kv > 0 && n_heads % n_kv == 0, "DecodeModel: heads a positive multiple of kv heads");
}

torch::Tensor DecodeModel::forward(const torch::Tensor& tokens, const torch::Tensor& pos, const torch::Tensor& rows,
                                   const torch::Tensor& idx, int64_t kv_len, int64_t n_layers,
                                   torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& cos,
                                   const torch::Tensor& sin) const {
  return decode_forward(tokens, pos, rows, idx, kv_len, n_layers, weights_, k_cache, v_cache, cos, sin, n_heads_,
                        n_kv_, window_, eps_);
}
