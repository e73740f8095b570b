// y[M, N] = x[M, K] @ w[N, K]^T in fp32 with bf16-valued weights on Intel AMX tiles, for the few rows of a
// decode step or a verify pass.
//
// Why: on AVX-512 each extra row of a verify pass costs its full share of FMAs, which adds up once the
// weights stream at 16 bits. A tile multiply takes 16 rows for about the cost of a few, so the pass stays
// memory-bound: each weight tile is loaded once per pass (docs/performance.md has the figures).
//
// Exact inputs, fp32 arithmetic: the weights are bf16 values (a bf16 checkpoint; the caller checks), and
// each fp32 input is split into three bf16 parts hi + mid + lo == x exactly (8 + 8 + 8 significant bits,
// by truncation; the tiles treat subnormal parts as zero, so below ~1e-31 the last bits of an input are
// dropped and below 2^-126 (~1.2e-38) the input counts as zero, as with flush-to-zero arithmetic).
// TDPBF16PS multiplies bf16 pairs exactly and accumulates in fp32. Each part of a row takes a tile row (5
// input rows per tile, up to 3 tiles share each weight tile load), and y = (hi . w + mid . w) + lo . w:
// an fp32 dot product of the exact inputs (its error ~2x the AVX-512 kernel's, tested against float64).
// A row's tile operations are the same whatever else is in the call (rows of a tile never mix), so a
// verify pass equals the one-token steps bit for bit.
//
// Packed layout (amx_pack): for each block of 16 output columns, for each block of 32 k, one 1 KiB tile
// of 16 k-pairs x 16 columns x 2 (the "VNNI" order TDPBF16PS reads); N and K zero-padded.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "amx_gemm.h"

#if !defined(SPECMIX_NO_AMX) && defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define SPECMIX_AMX 1
#include <immintrin.h>

#include "amx_tiles.h"
#endif

namespace {

constexpr int64_t KT = 32;  // k per tile (16 bf16 pairs)
constexpr int64_t NT = 16;  // output columns per tile
constexpr int64_t TILE = KT * NT;  // bf16 elements per packed tile
constexpr int64_t CHUNK = 5;  // input rows per tile: their 3 parts each take a tile row (15 of 16)

// the top 16 bits of f: bf16 by truncation (never overflows; the rest is exactly f minus it)
inline uint16_t bf16_top(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
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

// v = hi + mid + lo exactly: its top 8 significant bits (bf16 by truncation: never overflows), the next 8,
// the last 8 (each difference is exact: same sign as v, at most 16 then 8 significant bits). A non-finite
// v goes through hi alone (a NaN made quiet whatever its payload: truncation could leave an infinity).
inline void split1(float v, uint16_t* hi, uint16_t* mid, uint16_t* lo) {
  uint16_t h = bf16_top(v), md = 0, l = 0;
  if (std::isfinite(v)) {
    const float r1 = v - widen(h);
    md = bf16_top(r1);
    l = bf16_top(r1 - widen(md));
  } else if (std::isnan(v)) {
    h |= 0x40;
  }
  *hi = h;
  *mid = md;
  *lo = l;
}

// split1 on 16 floats at once (the same IEEE operations, so the same bits)
inline void split16(const float* v, uint16_t* hi, uint16_t* mid, uint16_t* lo) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 x = _mm512_loadu_ps(v);
  const __m512i u = _mm512_castps_si512(x);
  __m512i h = _mm512_and_si512(u, top);
  const __m512 r1 = _mm512_sub_ps(x, _mm512_castsi512_ps(h));
  __m512i md = _mm512_and_si512(_mm512_castps_si512(r1), top);
  __m512i l = _mm512_and_si512(_mm512_castps_si512(_mm512_sub_ps(r1, _mm512_castsi512_ps(md))), top);
  const __m512i exp_bits = _mm512_set1_epi32(0x7F800000);
  const __mmask16 nonfinite = _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, exp_bits), exp_bits);
  const __mmask16 nan = _mm512_mask_test_epi32_mask(nonfinite, u, _mm512_set1_epi32(0x007FFFFF));
  h = _mm512_mask_or_epi32(h, nan, h, _mm512_set1_epi32(0x00400000));
  md = _mm512_maskz_mov_epi32(static_cast<__mmask16>(~nonfinite), md);
  l = _mm512_maskz_mov_epi32(static_cast<__mmask16>(~nonfinite), l);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), _mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(mid), _mm512_cvtepi32_epi16(_mm512_srli_epi32(md, 16)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), _mm512_cvtepi32_epi16(_mm512_srli_epi32(l, 16)));
}


// Load the tile shapes of a pass over P chunks of input rows (chunk p fills trows[p] tile rows): tmm4+p its
// inputs, tmm(p * G + j) its outputs for weight column block j (G = 4 / P blocks per weight load), tmm7 a
// weight tile (16 k-pairs x 16 columns).
__attribute__((target("amx-tile,amx-bf16")))
void configure(int64_t P, const int64_t* trows) {
  amx_tiles::Config cfg;
  const int64_t G = 4 / P;
  for (int64_t p = 0; p < P; ++p) {
    cfg.rows[4 + p] = static_cast<uint8_t>(trows[p]);
    for (int64_t j = 0; j < G; ++j) cfg.rows[p * G + j] = static_cast<uint8_t>(trows[p]);
  }
  cfg.rows[7] = KT / 2;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = cfg.rows[t] ? 64 : 0;
  amx_tiles::load(cfg);
}

// tile numbers are immediates in the instructions: each pass shape is spelled out
#define SPECMIX_B(j) _tile_loadd(7, wt + (j) * KB * TILE, 64)
#define SPECMIX_DP(c, a) _tile_dpbf16ps(c, a, 7)

// One pass: rows m0.. (P chunks of CHUNK rows, mr[p] in chunk p) times weight column blocks nb0..nb0+nbs
// (nbs <= 4 / P), accumulated over all of K, then y = (hi . w + mid . w) + lo . w per row.
__attribute__((target("amx-tile,amx-bf16")))
void pass(const uint16_t* a, int64_t P, const int64_t* mr, const uint16_t* w, float* y, int64_t m0, int64_t KB,
          int64_t Kp, int64_t N, int64_t nb0, int64_t nbs) {
  const int64_t G = 4 / P, stride = Kp * 2, chunk = 16 * Kp;
  _tile_zero(0); _tile_zero(1); _tile_zero(2);
  if (P != 3) _tile_zero(3);
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint16_t* ak = a + kb * KT;
    const uint16_t* wt = w + (nb0 * KB + kb) * TILE;
    if (P == 1) {
      _tile_loadd(4, ak, stride);
      SPECMIX_B(0); SPECMIX_DP(0, 4);
      if (nbs > 1) { SPECMIX_B(1); SPECMIX_DP(1, 4); }
      if (nbs > 2) { SPECMIX_B(2); SPECMIX_DP(2, 4); }
      if (nbs > 3) { SPECMIX_B(3); SPECMIX_DP(3, 4); }
    } else if (P == 2) {
      _tile_loadd(4, ak, stride);
      _tile_loadd(5, ak + chunk, stride);
      SPECMIX_B(0); SPECMIX_DP(0, 4); SPECMIX_DP(2, 5);
      if (nbs > 1) { SPECMIX_B(1); SPECMIX_DP(1, 4); SPECMIX_DP(3, 5); }
    } else {
      _tile_loadd(4, ak, stride);
      _tile_loadd(5, ak + chunk, stride);
      _tile_loadd(6, ak + 2 * chunk, stride);
      SPECMIX_B(0); SPECMIX_DP(0, 4); SPECMIX_DP(1, 5); SPECMIX_DP(2, 6);
    }
  }
  alignas(64) float out[16 * NT];
  for (int64_t p = 0; p < P; ++p)
    for (int64_t j = 0; j < nbs; ++j) {
      switch (p * G + j) {
        case 0: _tile_stored(0, out, 64); break;
        case 1: _tile_stored(1, out, 64); break;
        case 2: _tile_stored(2, out, 64); break;
        default: _tile_stored(3, out, 64); break;
      }
      amx_tiles::memory_barrier();  // the tile's sums are in `out` before they are read
      const int64_t n0 = (nb0 + j) * NT, nn = std::min(NT, N - n0);
      for (int64_t m = 0; m < mr[p]; ++m) {  // the same order of additions for every row
        const float* r = out + 3 * m * NT;
        float* yr = y + (m0 + p * CHUNK + m) * N + n0;
        for (int64_t n = 0; n < nn; ++n) yr[n] = (r[n] + r[NT + n]) + r[2 * NT + n];
      }
    }
}
#undef SPECMIX_B
#undef SPECMIX_DP

// y's weight column blocks [nb_begin, nb_end) for all M rows: blocks of 4 column blocks (64 columns) at a time,
// each taking every pass of up to 3 chunks (15 rows) while its weights stay in L2
__attribute__((target("amx-tile,amx-bf16")))
void tiles(const uint16_t* parts, const uint16_t* w, float* y, int64_t M, int64_t Kp, int64_t N, int64_t nb_begin,
           int64_t nb_end) {
  const int64_t KB = Kp / KT, chunks = (M + CHUNK - 1) / CHUNK;
  int64_t shape = -1;  // the loaded configuration: 16 * P + the last chunk's rows
  for (int64_t nb = nb_begin; nb < nb_end; nb += 4) {
    const int64_t blocks = std::min<int64_t>(4, nb_end - nb);
    for (int64_t c0 = 0; c0 < chunks; c0 += 3) {
      const int64_t P = std::min<int64_t>(3, chunks - c0);
      int64_t mr[3], trows[3];
      for (int64_t p = 0; p < P; ++p) {
        mr[p] = std::min(CHUNK, M - (c0 + p) * CHUNK);
        trows[p] = 3 * mr[p];
      }
      if (16 * P + mr[P - 1] != shape) {
        configure(P, trows);
        shape = 16 * P + mr[P - 1];
      }
      const int64_t G = 4 / P;
      for (int64_t j = 0; j < blocks; j += G)
        pass(parts + c0 * 16 * Kp, P, mr, w, y, c0 * CHUNK, KB, Kp, N, nb + j, std::min(G, blocks - j));
    }
  }
  _tile_release();
}

}  // namespace

const std::string& amx_status() {
  static const std::string reason = amx_tiles::probe(22, "AMX-BF16");  // once per process (thread-safe static)
  return reason;
}

void amx_gemm_into(const float* x, const torch::Tensor& packed, float* y, int64_t M, int64_t K, int64_t N) {
  TORCH_CHECK(amx_status().empty(), "amx_gemm: ", amx_status());
  const int64_t Kp = (K + KT - 1) / KT * KT, NB = (N + NT - 1) / NT, chunks = (M + CHUNK - 1) / CHUNK;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.dim() == 3 &&
              packed.size(0) == NB && packed.size(1) == Kp / KT && packed.size(2) == TILE,
              "amx_gemm: a packed weight of [", N, ", ", K, "] (amx_pack)");
  // the inputs' exact three-part split, [chunks][16][Kp] bf16: row m at tile rows 3 (m % CHUNK) + part; the
  // last chunk only as far as its tiles read (3 rows of each of its inputs: a one-row step zeroes 3 rows, not 16)
  const int64_t last_rows = M > 0 ? 3 * (M - (chunks - 1) * CHUNK) : 0;
  std::vector<uint16_t> parts(static_cast<size_t>(std::max<int64_t>(0, chunks - 1) * 16 * Kp + last_rows * Kp), 0);
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* p = parts.data() + (m / CHUNK) * 16 * Kp + 3 * (m % CHUNK) * Kp;
    const int64_t full = K / 16 * 16;
    for (int64_t k = 0; k < full; k += 16) split16(x + m * K + k, p + k, p + Kp + k, p + 2 * Kp + k);
    for (int64_t k = full; k < K; ++k) split1(x[m * K + k], p + k, p + Kp + k, p + 2 * Kp + k);
  }
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) { tiles(parts.data(), w, y, M, Kp, N, b0, b1); });
}

#else  // a compiler or CPU without AMX intrinsics: the status says so and nothing else runs

const std::string& amx_status() {
  static const std::string reason = "built without AMX support (SPECMIX_NO_AMX, or not x86-64 with GCC >= 11 or Clang >= 12)";
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
  torch::Tensor out = torch::zeros({NB, KB, TILE}, w.options());
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
