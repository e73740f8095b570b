// y[M, N] = x[M, K] @ w[N, K]^T in fp32 with bf16-valued weights on Intel AMX tiles, for the few rows of a
// decode step or a verify pass.
//
// Why: on AVX-512 each extra row of a verify pass costs its full share of FMAs (the demo target: ~0.4 ms
// a row on 2 cores, so a 6-token verify costs ~2.3 one-token steps once the weights stream at 16 bits).
// An AMX tile multiply takes 16 rows at once for the cost of one, so a pass of up to 16 rows streams the
// weights once and costs about one step.
//
// Exact inputs, fp32 arithmetic: the weights are bf16 values (a bf16 checkpoint; the caller checks), and
// each fp32 input is split into three bf16 parts hi + mid + lo == x exactly (8 + 8 + 8 significant bits).
// TDPBF16PS multiplies bf16 pairs exactly and accumulates in fp32, so y = sum_k (hi_k + mid_k + lo_k) w_k
// is an fp32 dot product of the exact inputs (its error ~2x the AVX-512 kernel's, tested against
// float64). Every row runs the same tile operations in the same order whatever else is in the call
// (rows of a tile never mix), so a verify pass equals the one-token steps bit for bit.
//
// Packed layout (amx_pack): for each block of 16 output columns, for each block of 32 k, one 1 KiB tile
// of 16 k-pairs x 16 columns x 2 (the "VNNI" order TDPBF16PS reads); N and K zero-padded.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "amx_gemm.h"

#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define SPECMIX_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t KT = 32;  // k per tile (16 bf16 pairs)
constexpr int64_t NT = 16;  // output columns per tile
constexpr int64_t TILE = KT * NT;  // bf16 elements per packed tile
constexpr int64_t G = 4;    // output tiles per pass over the inputs (tmm0-3; tmm4-6 the input parts, tmm7 the weights)

inline uint16_t bf16_rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float widen(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

#ifdef SPECMIX_AMX

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

std::string probe() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return "the CPU does not report its features (cpuid leaf 7)";
  if (!(d & (1u << 24)) || !(d & (1u << 22))) return "the CPU has no AMX-BF16 tiles";
  // Linux hands out the tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return "the kernel refused the AMX tile state (arch_prctl)";
  return "";
}

__attribute__((target("amx-tile,amx-bf16")))
void tiles(const uint16_t* parts, const uint16_t* w, float* y, int64_t rows, int64_t Kp, int64_t N,
           int64_t g0, int64_t g1) {
  const int64_t KB = Kp / KT, NB = (N + NT - 1) / NT, chunks = (rows + 15) / 16;
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  alignas(64) float out[16 * NT];
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t nb0 = g * G, nbs = std::min(G, NB - nb0);
    for (int64_t c = 0; c < chunks; ++c) {  // 16 input rows at a time (the group's weights stay in L2)
      const uint16_t* a = parts + c * 3 * 16 * Kp;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t kb = 0; kb < KB; ++kb) {
        _tile_loadd(4, a + kb * KT, Kp * 2);
        _tile_loadd(5, a + 16 * Kp + kb * KT, Kp * 2);
        _tile_loadd(6, a + 32 * Kp + kb * KT, Kp * 2);
        const uint16_t* wt = w + (nb0 * KB + kb) * TILE;
        // tile numbers are immediates: one line per output tile
#define SPECMIX_TILE_STEP(j)                            \
  if (j < nbs) {                                        \
    _tile_loadd(7, wt + j * KB * TILE, 64);             \
    _tile_dpbf16ps(j, 4, 7);                            \
    _tile_dpbf16ps(j, 5, 7);                            \
    _tile_dpbf16ps(j, 6, 7);                            \
  }
        SPECMIX_TILE_STEP(0) SPECMIX_TILE_STEP(1) SPECMIX_TILE_STEP(2) SPECMIX_TILE_STEP(3)
#undef SPECMIX_TILE_STEP
      }
      const int64_t m0 = c * 16, mr = std::min<int64_t>(16, rows - m0);
      for (int64_t j = 0; j < nbs; ++j) {
        switch (j) {
          case 0: _tile_stored(0, out, 64); break;
          case 1: _tile_stored(1, out, 64); break;
          case 2: _tile_stored(2, out, 64); break;
          default: _tile_stored(3, out, 64); break;
        }
        const int64_t n0 = (nb0 + j) * NT, nn = std::min(NT, N - n0);
        for (int64_t m = 0; m < mr; ++m) std::copy_n(out + m * NT, nn, y + (m0 + m) * N + n0);
      }
    }
  }
  _tile_release();
}

}  // namespace

const std::string& amx_status() {
  static const std::string reason = probe();  // once per process (thread-safe static)
  return reason;
}

void amx_gemm_into(const float* x, const torch::Tensor& packed, float* y, int64_t M, int64_t K, int64_t N) {
  TORCH_CHECK(amx_status().empty(), "amx_gemm: ", amx_status());
  const int64_t Kp = (K + KT - 1) / KT * KT, NB = (N + NT - 1) / NT, chunks = (M + 15) / 16;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.numel() == NB * Kp * NT,
              "amx_gemm: a packed weight of [", N, ", ", K, "] (amx_pack)");
  // the inputs' exact three-part split, [chunks][3][16][Kp] bf16, zero-padded
  std::vector<uint16_t> parts(static_cast<size_t>(chunks * 3 * 16 * Kp), 0);
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* p = parts.data() + (m / 16) * 3 * 16 * Kp + (m % 16) * Kp;
    for (int64_t k = 0; k < K; ++k) {
      const float v = x[m * K + k];
      const uint16_t hi = bf16_rne(v);
      const float r1 = v - widen(hi);  // exact: |r1| <= half an ulp of hi, 16 significant bits at most
      const uint16_t mid = bf16_rne(r1);
      p[k] = hi;
      p[16 * Kp + k] = mid;
      p[32 * Kp + k] = bf16_rne(r1 - widen(mid));  // exact: the last 8 bits
    }
  }
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, (NB + G - 1) / G, 1, [&](int64_t g0, int64_t g1) {
    tiles(parts.data(), w, y, M, Kp, N, g0, g1);
  });
}

#else  // a compiler or CPU without AMX intrinsics: the status says so and nothing else runs

const std::string& amx_status() {
  static const std::string reason = "built without AMX support (needs x86-64 and GCC >= 11 or Clang >= 12)";
  return reason;
}

void amx_gemm_into(const float*, const torch::Tensor&, float*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "amx_gemm: ", amx_status());
}

#endif

torch::Tensor amx_pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
              "amx_pack: a bfloat16 CPU matrix [N, K]");
  const torch::Tensor wc = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), NB = (N + NT - 1) / NT, KB = (K + KT - 1) / KT;
  torch::Tensor out = torch::zeros({NB * KB * TILE}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  for (int64_t nb = 0; nb < NB; ++nb)
    for (int64_t kb = 0; kb < KB; ++kb) {
      uint16_t* t = dst + (nb * KB + kb) * TILE;
      for (int64_t r = 0; r < KT / 2; ++r)  // a k pair per tile row, its 16 columns side by side
        for (int64_t n = 0; n < NT; ++n)
          for (int64_t e = 0; e < 2; ++e) {
            const int64_t col = nb * NT + n, k = kb * KT + 2 * r + e;
            if (col < N && k < K) t[r * 2 * NT + n * 2 + e] = src[col * K + k];
          }
    }
  return out;
}

torch::Tensor amx_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu() && N > 0,
              "amx_gemm: x contiguous float32 [M, K] on the CPU and N > 0");
  auto y = torch::empty({x.size(0), N}, x.options());
  amx_gemm_into(x.data_ptr<float>(), packed, y.data_ptr<float>(), x.size(0), x.size(1), N);
  return y;
}
