// y[M, N] = x[M, K] @ (q * s)^T for the few rows of a decode step or a verify pass, reading int8 weights.
//
// The loop is the fp32 kernel's (small_gemm.cpp: blocks of NB weight rows streamed once, prefetched ahead into
// L2), with each weight vector loaded as int8, widened to fp32 and multiplied by its row's (group's) scale
// before the FMA (in registers for a few rows, into an L1 scratch once per block for more): a quarter of the
// fp32 bytes to stream, the dequantized value q * s exactly as quant.int8 computes it, and the same FMA order,
// so every output equals small_gemm on the dequantized weight bit for bit, for any M.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gemm_block.h"
#include "int8_gemm.h"
#include "simd.h"

namespace {

using simd::LANES;
using simd::Vec;

// weight rows per block: R * M accumulators, M inputs, a weight and R scales in registers (30 of AVX-512's 32 at
// 5 rows; a block too large for the registers spills its accumulators at every group boundary)
constexpr int NB = LANES == 16 ? 4 : 2;
// up to direct_rows() input rows (at most MAX_DIRECT_ROWS, as the registers allow) read the int8 block directly;
// more dequantize it once into a scratch. Which is faster depends on the core (docs/performance.md): on a Zen 4
// EPYC the scratch from 4 rows, on an AMX Xeon the direct read up to 5 (each 512-bit op at full width on two
// ports, so widening a weight once per row pass costs less than the scratch's store and reload)
constexpr int MAX_DIRECT_ROWS = 5;
// input rows per pass over the scratch, the passes made equal (9 rows: 5 + 4, not 4 + 4 + 1): on AVX-512,
// 4 * 6 accumulators, 6 inputs and a weight fill the registers (7-15% faster than passes of 4 at 5 and 9 rows)
constexpr int SCRATCH_ROWS = LANES == 16 ? 6 : 4;
// the weight bytes prefetched ahead of the ones being read (whole blocks, at least this many)
constexpr int64_t AHEAD_BYTES = 8192;

struct Weights {
  const int8_t* q;
  const float* s;
  int64_t G, group;  // scales per row and input channels per scale (per-row scaling: G 1, group K)
};

// the int8 vector at q widened to fp32 and scaled: the weight value quant.int8 dequantizes to, in registers
inline Vec dequant(const int8_t* q, Vec scale) { return simd::mul(simd::load(q), scale); }
inline Vec dequant_first(const int8_t* q, Vec scale, int64_t n) { return simd::mul(simd::load_first(q, n), scale); }

// One pass of up to MAX_DIRECT_ROWS rows reading the int8 block directly, each weight vector dequantized in
// registers (not inlined, as gemm_block::block); `next`: the int8 block to pull into L2 meanwhile, row by row
template <int M, int R>
__attribute__((noinline)) void block(const float* __restrict x, const Weights& w, float* __restrict y, int64_t K,
                                     int64_t N, int64_t n0, const char* next) {
  Vec acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) acc[i][m] = simd::zero();
  const int8_t* wr = w.q + n0 * K;
  const float* sr = w.s + n0 * w.G;
  for (int64_t g = 0; g < w.G; ++g) {
    const int64_t k0 = g * w.group, k1 = std::min(K, k0 + w.group);
    const int64_t full = k0 + (k1 - k0) / LANES * LANES;
    Vec sc[R];
    for (int i = 0; i < R; ++i) sc[i] = simd::set1(sr[i * w.G + g]);
    for (int64_t k = k0; k < full; k += LANES) {
      if ((k & 63) == 0)  // a cache line of each row a block ahead per 64 k
        for (int i = 0; i < R; ++i) gemm_block::prefetch_l2(next, i * K + k);
      Vec xv[M];
      for (int m = 0; m < M; ++m) xv[m] = simd::load(x + m * K + k);
      for (int i = 0; i < R; ++i) {
        const Vec wv = dequant(wr + i * K + k, sc[i]);
        for (int m = 0; m < M; ++m) acc[i][m] = simd::fmadd(wv, xv[m], acc[i][m]);
      }
    }
    if (full < k1) {  // the K tail (the last group only: groups are multiples of LANES); lanes past K add 0
      Vec xv[M];
      for (int m = 0; m < M; ++m) xv[m] = simd::load_first(x + m * K + full, k1 - full);
      for (int i = 0; i < R; ++i) {
        const Vec wv = dequant_first(wr + i * K + full, sc[i], k1 - full);
        for (int m = 0; m < M; ++m) acc[i][m] = simd::fmadd(wv, xv[m], acc[i][m]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) y[m * N + n0 + i] = simd::reduce_add(acc[i][m]);
}

template <int Mc, int R>
inline void pass(int64_t m, const float* x, const Weights& w, float* y, int64_t K, int64_t N, int64_t n0,
                 const char* next) {
  if constexpr (Mc > 1) {
    if (m < Mc) return pass<Mc - 1, R>(m, x, w, y, K, N, n0, next);
  }
  block<Mc, R>(x, w, y, K, N, n0, next);
}

// the block's R weight rows dequantized into out[R, K] (fp32, L1-resident): the values block() forms in registers
template <int R>
inline void dequant_rows(const Weights& w, int64_t K, int64_t n0, float* __restrict out) {
  for (int i = 0; i < R; ++i) {
    const int8_t* q = w.q + (n0 + i) * K;
    const float* s = w.s + (n0 + i) * w.G;
    float* o = out + i * K;
    for (int64_t g = 0; g < w.G; ++g) {
      const int64_t k0 = g * w.group, k1 = std::min(K, k0 + w.group);
      const int64_t full = k0 + (k1 - k0) / LANES * LANES;
      const Vec sc = simd::set1(s[g]);
      for (int64_t k = k0; k < full; k += LANES) simd::store(o + k, dequant(q + k, sc));
      if (full < k1) simd::store_first(o + full, dequant_first(q + full, sc, k1 - full), k1 - full);
    }
  }
}

// A block of R weight rows against all M input rows. Up to `direct` rows read the int8 weights directly, in
// one pass. More dequantize the block once into `scratch` and run the fp32 passes over it (widening and scaling
// each weight once, not once per pass); their sums are the same FMA chains over the same values, so
// a row's result is bit for bit the direct one. Meanwhile the block `ahead` bytes on streams into L2.
template <int R>
inline void rows(const float* x, const Weights& w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
                 int64_t ahead, int64_t direct, float* scratch) {
  const char* next = reinterpret_cast<const char*>(w.q + n0 * K + ahead);
  if (M <= direct) return pass<MAX_DIRECT_ROWS, R>(M, x, w, y, K, N, n0, next);
  dequant_rows<R>(w, K, n0, scratch);
  const int64_t P = (M + SCRATCH_ROWS - 1) / SCRATCH_ROWS, per = (M + P - 1) / P;  // passes of equal rows
  gemm_block::passes<SCRATCH_ROWS, R>(M, per, x, scratch, y + n0, K, N, next, 1);
}

// the most input rows that read the int8 block directly on this CPU (decided once per process): 5 on a CPU
// with AMX-BF16 (the cores measured faster so), else 3; the two ways give the same bits
int64_t direct_rows() {
  static const int64_t n = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    const bool amx_core = LANES == 16 && __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1u);
    return amx_core ? int64_t{MAX_DIRECT_ROWS} : int64_t{3};
  }();
  return n;
}

// this thread's dequantization scratch of at least n floats: grown, never shrunk or freed, so a verify pass
// allocates nothing once the largest block has been seen
float* thread_scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// float32 sums of at most this many int8 x int8 products are exact integers (127^2 * 1040 < 2^24; a multiple of LANES)
constexpr int64_t EXACT_K = 1024;

// sum_k a[k] * w[k] over [0, K) for int8-valued a (as floats) and int8 w: exact, in int64 across chunks
inline int64_t int_dot(const float* a, const int8_t* w, int64_t K) {
  int64_t total = 0;
  for (int64_t k0 = 0; k0 < K; k0 += EXACT_K) {
    const int64_t k1 = std::min(K, k0 + EXACT_K), full = k0 + (k1 - k0) / LANES * LANES;
    Vec acc = simd::zero();
    for (int64_t k = k0; k < full; k += LANES) acc = simd::fmadd(simd::load(w + k), simd::load(a + k), acc);
    if (full < k1) acc = simd::fmadd(simd::load_first(w + full, k1 - full), simd::load_first(a + full, k1 - full), acc);
    total += static_cast<int64_t>(simd::reduce_add(acc));
  }
  return total;
}

// a row quantized as quant.int8.quantize_int8_rowwise does (after the division by smooth): -> its scale
float quantize_row(const float* x, const float* smooth, int64_t K, float* out) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    out[k] = smooth ? x[k] / smooth[k] : x[k];
    amax = std::max(amax, std::fabs(out[k]));
  }
  float scale = amax / 127.f;
  for (int i = 0; i < 2; ++i)
    if (scale * 127.f > amax) scale = std::nextafter(scale, 0.f);
  scale = std::max(scale, FLT_MIN);
  for (int64_t k = 0; k < K; ++k) out[k] = std::min(127.f, std::max(-127.f, std::nearbyint(out[k] / scale)));
  return scale;
}

}  // namespace

void w8a8_gemm_into(const float* x, const torch::Tensor& q, const torch::Tensor& ws, const torch::Tensor& smooth,
                    float* y, int64_t M, int64_t K, int64_t N) {
  check_int8_weight(q, ws, 0, N, K, "w8a8_gemm");
  TORCH_CHECK(smooth.numel() == 0 || (smooth.numel() == K && smooth.scalar_type() == at::kFloat &&
                                      smooth.is_contiguous()), "w8a8_gemm: smooth [K] float32 or empty");
  const float* sm = smooth.numel() ? smooth.data_ptr<float>() : nullptr;
  std::vector<float> xq(M * K), xs(M);
  for (int64_t m = 0; m < M; ++m) xs[m] = quantize_row(x + m * K, sm, K, xq.data() + m * K);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* wsp = ws.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m)
        y[m * N + n] = static_cast<float>(int_dot(xq.data() + m * K, qp + n * K, K)) * xs[m] * wsp[n];
  });
}

torch::Tensor w8a8_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& ws,
                        const torch::Tensor& smooth) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "w8a8_gemm: x [M, K] contiguous float32 on the CPU");
  TORCH_CHECK(q.dim() == 2 && q.size(1) == x.size(1), "w8a8_gemm: q [N, K] with K = x.size(1)");
  auto y = torch::empty({x.size(0), q.size(0)}, x.options());
  w8a8_gemm_into(x.data_ptr<float>(), q, ws, smooth, y.data_ptr<float>(), x.size(0), x.size(1), q.size(0));
  return y;
}

int64_t int8_group_multiple() { return LANES; }

void check_int8_weight(const torch::Tensor& q, const torch::Tensor& s, int64_t group, int64_t N, int64_t K,
                       const char* what) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.size(0) == N && q.size(1) == K &&
              q.is_contiguous() && q.device().is_cpu(), what, ": int8 weight [", N, ", ", K,
              "] contiguous on the CPU, got ", q.sizes(), " ", q.scalar_type());
  TORCH_CHECK(group == 0 || (group > 0 && group % LANES == 0), what, ": group size 0 (per row) or a multiple of ",
              LANES, ", got ", group);
  const int64_t G = group == 0 ? 1 : (K + group - 1) / group;
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.device().is_cpu() && s.numel() == N * G &&
              (group == 0 ? s.dim() == 1 : s.dim() == 2), what, ": float32 scales [", N,
              group == 0 ? "]" : ", groups]", " contiguous on the CPU, got ", s.sizes());
}

void int8_gemm_into(const float* x, const torch::Tensor& q, const torch::Tensor& s, int64_t group, float* y,
                    int64_t M, int64_t K, int64_t N) {
  check_int8_weight(q, s, group, N, K, "int8_gemm");
  const Weights w{q.data_ptr<int8_t>(), s.data_ptr<float>(), group == 0 ? 1 : (K + group - 1) / group,
                  group == 0 ? K : group};
  if (M == 0) return;
  const int64_t blocks = N / NB;
  // prefetch distance: whole blocks, at least AHEAD_BYTES (a single block of a short row is too near)
  const int64_t ahead = NB * K * std::max<int64_t>(1, (AHEAD_BYTES + NB * K - 1) / (NB * K));
  const int64_t direct = direct_rows();
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    float* scratch = M > direct ? thread_scratch(NB * K) : nullptr;
    for (int64_t b = b0; b < b1; ++b) rows<NB>(x, w, y, M, K, N, b * NB, ahead, direct, scratch);
  });
  float* scratch = M > direct ? thread_scratch(K) : nullptr;
  for (int64_t n = blocks * NB; n < N; ++n) rows<1>(x, w, y, M, K, N, n, K, direct, scratch);  // the N tail
}

torch::Tensor int8_gemm_call(Int8GemmInto into, const char* what, const torch::Tensor& x, const torch::Tensor& q,
                             const torch::Tensor& s, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(), what,
              ": x [M, K] contiguous float32 on the CPU");
  TORCH_CHECK(q.dim() == 2 && q.size(1) == x.size(1), what, ": q [N, K] with K = x.size(1)");
  auto y = torch::empty({x.size(0), q.size(0)}, x.options());
  into(x.data_ptr<float>(), q, s, group, y.data_ptr<float>(), x.size(0), x.size(1), q.size(0));
  return y;
}

torch::Tensor int8_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s, int64_t group) {
  return int8_gemm_call(int8_gemm_into, "int8_gemm", x, q, s, group);
}
