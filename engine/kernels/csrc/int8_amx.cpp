// y[M, N] = x[M, K] @ (q * s)^T on Intel AMX-INT8 tiles, reading the int8 weights q [N, K] as they are held.
//
// Why: the AVX-512 int8 kernel (int8_gemm.cpp) widens and scales every weight to fp32 and pays an FMA per weight
// per row, so a verify pass of a few rows costs a few decode steps. A TDPBSSD multiplies a 16 x 32 int8 weight
// tile by 16 int8 input columns in one instruction, with no widening, so the pass stays memory-bound.
//
// The weights are the tiles' A operand (16 weight rows of 32 k, loaded at the weight's row stride: no packed
// copy). The inputs are split per row into four int8 parts, exactly: with e the row's exponent (x * 2^e below 64
// in magnitude), x * 2^e = p0 + p1 / 2^7 + p2 / 2^14 + p3 / 2^21 + r, each |p| <= 64 and |r| <= 2^-22, so
// each input is kept to 2^-22 / 2^e, below 2^-27 of the row's largest |x| (an fp32 input's own rounding is 2^-24
// of itself). Each part of a row is a column of the B operand (4 rows x 4 parts = 16 columns, quads of k).
// The int32 tile sums are exact and converted to fp32 exactly (at most 1024 k per conversion: |sum| < 2^24),
// then scaled by the weight's scale per group and summed in fp32; a row's outputs are
// 2^-e * (((S0 + S1 / 2^7) + S2 / 2^14) + S3 / 2^21). A row's tile operations are the same whatever else is in
// the call (columns of a tile never mix), so a verify pass equals the one-token steps bit for bit. A row with
// an infinite or NaN input goes to the AVX-512 kernel (whose IEEE arithmetic propagates them), by itself.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "int8_amx.h"
#include "int8_gemm.h"

#if !defined(SPECMIX_NO_AMX) && defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define SPECMIX_AMX 1
#include <immintrin.h>

#include "amx_tiles.h"
#endif

namespace {

constexpr int64_t KT = 32;  // k per weight tile
constexpr int64_t NT = 16;  // weight rows (output columns) per tile
constexpr int64_t PARTS = 4;  // int8 parts per input
constexpr int64_t ROWS = NT / PARTS;  // input rows per B tile
constexpr int64_t BTILE = KT * NT;  // bytes of a B tile: KT / 4 quads x 16 columns x 4
constexpr int64_t AHEAD = 1;  // weight blocks prefetched (into L1) ahead of the one being read
constexpr int64_t FLUSH_KT = 32;  // k tiles per exact int32 -> fp32 conversion (1024 k: 64 * 128 * 1024 < 2^24)

}  // namespace

#ifdef SPECMIX_AMX

namespace {

// the calls' layout: K padded to whole tiles, scales per row (G groups of `group` k)
struct Shape {
  int64_t M, K, N, KB, G, group;
};

// Row m's parts, written into its row group's B tiles (column 4 j + part, j = m % ROWS; zero-initialized, so
// k past K and absent rows add nothing); -> its exponent e, or INT32_MIN when a value is not finite
int prepare_row(const float* x, int64_t K, int64_t j, int8_t* dst) {
  __m512 amax = _mm512_setzero_ps();
  __mmask16 finite = 0xFFFF;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 in = static_cast<__mmask16>(K - k >= 16 ? 0xFFFF : (1u << (K - k)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(in, x + k);
    finite &= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_EQ_OQ);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
  }
  if (finite != 0xFFFF) return INT32_MIN;
  int E = 0;
  const float top = _mm512_reduce_max_ps(amax);
  const int e = top > 0.f ? (std::frexp(top, &E), 6 - E) : 0;
  const __m512 ev = _mm512_set1_ps(static_cast<float>(e)), step = _mm512_set1_ps(128.f);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 in = static_cast<__mmask16>(K - k >= 16 ? 0xFFFF : (1u << (K - k)) - 1);
    __m512 v = _mm512_scalef_ps(_mm512_maskz_loadu_ps(in, x + k), ev);  // exact: a power of 2
    __m128 p[PARTS];
    for (int i = 0; i < PARTS; ++i) {
      const __m512 r = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      p[i] = _mm_castsi128_ps(_mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
      v = _mm512_mul_ps(_mm512_sub_ps(v, r), step);  // the remainder (exact, |.| <= 1/2) times 2^7
    }
    _MM_TRANSPOSE4_PS(p[0], p[1], p[2], p[3]);  // p[d]: the 4 parts' quads of k + 4 d .. k + 4 d + 3
    int8_t* t = dst + (k / KT) * BTILE + ((k % KT) / 4) * 64 + j * 16;
    for (int d = 0; d < 4; ++d) _mm_storeu_ps(reinterpret_cast<float*>(t + d * 64), p[d]);
  }
  return e;
}

__attribute__((target("amx-tile,amx-int8")))
void configure() {
  amx_tiles::Config cfg;
  for (int t : {0, 7}) {  // tmm0, tmm7: weights, 16 rows of 32 int8 k
    cfg.rows[t] = NT;
    cfg.colsb[t] = KT;
  }
  for (int t = 1; t < 3; ++t) {  // tmm1-2: input parts, KT / 4 quads of 16 columns
    cfg.rows[t] = KT / 4;
    cfg.colsb[t] = 64;
  }
  for (int t = 3; t < 7; ++t) {  // tmm3-6: int32 sums, 16 weight rows x 16 columns (two sets of two)
    cfg.rows[t] = NT;
    cfg.colsb[t] = 64;
  }
  amx_tiles::load(cfg);
}

// acc[n][c] += s[n, g] * c[n][c] for the 16 weight rows of a block (scales past N count 0)
void flush(const int32_t* c, const float* s, const Shape& sh, int64_t n0, int64_t g, float* acc) {
  for (int64_t n = 0; n < NT; ++n) {
    const float sc = n0 + n < sh.N ? s[(n0 + n) * sh.G + g] : 0.f;
    const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512(c + n * 16));
    _mm512_store_ps(acc + n * 16, _mm512_fmadd_ps(v, _mm512_set1_ps(sc), _mm512_load_ps(acc + n * 16)));
  }
}

// the weight tile at (n0, kb): in place at the weight's row stride, or copied zero-padded where it passes N or K
const int8_t* weight_tile(const int8_t* q, const Shape& sh, int64_t n0, int64_t kb, int8_t* pad, int64_t* stride) {
  const int64_t k0 = kb * KT;
  if (n0 + NT <= sh.N && k0 + KT <= sh.K) {
    *stride = sh.K;
    return q + n0 * sh.K + k0;
  }
  std::memset(pad, 0, NT * KT);
  for (int64_t n = 0; n < std::min(NT, sh.N - n0); ++n)
    std::memcpy(pad + n * KT, q + (n0 + n) * sh.K + k0, std::min(KT, sh.K - k0));
  *stride = KT;
  return pad;
}

// A segment's sums of RB row groups (parts in tiles 1, 2) into tiles c0, c1 (tile numbers are immediates in the
// instructions), and the drain of tiles c0, c1 into acc at scale group gd
#define SPECMIX_DOTS(c0, c1)                                                                                   \
  _tile_zero(c0);                                                                                             \
  if (RB > 1) _tile_zero(c1);                                                                                 \
  for (int64_t kb = kb0; kb < kb1; ++kb) {                                                                    \
    if (kb % 2 == 0 && n0 + (AHEAD + 1) * NT <= sh.N)  /* a line of each row of the block AHEAD blocks on */ \
      for (int64_t i = 0; i < NT; ++i) _mm_prefetch(q + (n0 + AHEAD * NT + i) * sh.K + kb * KT, _MM_HINT_T0);  \
    int64_t stride;                                                                                           \
    const int8_t* a_ptr_ = weight_tile(q, sh, n0, kb, pad, &stride);                                          \
    amx_tiles::memory_barrier(); /* the padded copy is written before the tile reads it */                   \
    if (kb % 2 == 0) { SPECMIX_KB(0, c0, c1) } else { SPECMIX_KB(7, c0, c1) }                                 \
  }
// one k tile: the weights into tile a (0 and 7 alternate, so the next load overlaps this tile's products)
#define SPECMIX_KB(a, c0, c1)                                        \
  _tile_loadd(a, a_ptr_, stride);                                    \
  _tile_loadd(1, parts + (rg0 * sh.KB + kb) * BTILE, 64);            \
  _tile_dpbssd(c0, a, 1);                                            \
  if (RB > 1) {                                                      \
    _tile_loadd(2, parts + ((rg0 + 1) * sh.KB + kb) * BTILE, 64);    \
    _tile_dpbssd(c1, a, 2);                                          \
  }
#define SPECMIX_DRAIN(c0, c1, gd)                         \
  _tile_stored(c0, c[0], 64);                             \
  if (RB > 1) _tile_stored(c1, c[1], 64);                 \
  amx_tiles::memory_barrier();                            \
  flush(c[0], s, sh, n0, gd, acc);                        \
  if (RB > 1) flush(c[1], s, sh, n0, gd, acc + NT * 16);

// One pass: the weight rows n0.. against RB <= 2 row groups from rg0, over all of K -> acc [RB][16][16]. Segments
// (a scale group, at most FLUSH_KT tiles) alternate between tiles 3, 4 and 5, 6, so a segment's tile products
// run while the one before is drained
template <int RB>
__attribute__((target("amx-tile,amx-int8")))
void pass(const int8_t* q, const float* s, const int8_t* parts, const Shape& sh, int64_t n0, int64_t rg0, float* acc) {
  alignas(64) int32_t c[2][NT * 16];
  alignas(64) int8_t pad[NT * KT];
  int64_t g_prev = -1;
  bool odd = false;
  for (int64_t kb0 = 0; kb0 < sh.KB; odd = !odd) {
    const int64_t g = kb0 * KT / sh.group;  // one scale over the segment: it ends at the group's end
    const int64_t kb1 = std::min({sh.KB, kb0 + FLUSH_KT, (g + 1) * sh.group / KT});
    if (!odd) {
      SPECMIX_DOTS(3, 4);
      if (g_prev >= 0) { SPECMIX_DRAIN(5, 6, g_prev); }
    } else {
      SPECMIX_DOTS(5, 6);
      SPECMIX_DRAIN(3, 4, g_prev);
    }
    g_prev = g;
    kb0 = kb1;
  }
  if (odd) {
    SPECMIX_DRAIN(3, 4, g_prev);
  } else {
    SPECMIX_DRAIN(5, 6, g_prev);
  }
}
#undef SPECMIX_DOTS
#undef SPECMIX_DRAIN
#undef SPECMIX_KB

// y's rows of row group rg at weight rows n0..: 2^-e * (((S0 + S1 / 2^7) + S2 / 2^14) + S3 / 2^21) per row
void finish(const float* acc, const int* e, const Shape& sh, int64_t rg, int64_t n0, float* y) {
  const __mmask16 out = static_cast<__mmask16>(sh.N - n0 >= 16 ? 0xFFFF : (1u << (sh.N - n0)) - 1);
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(16));
  for (int64_t j = 0; j < ROWS && rg * ROWS + j < sh.M; ++j) {
    const int64_t m = rg * ROWS + j;
    if (e[m] == INT32_MIN) continue;  // a non-finite row: the AVX-512 kernel's, after the tiles
    __m512 v[PARTS];
    for (int i = 0; i < PARTS; ++i)
      v[i] = _mm512_i32gather_ps(_mm512_add_epi32(rows, _mm512_set1_epi32(static_cast<int>(PARTS * j + i))), acc, 4);
    __m512 sum = _mm512_add_ps(v[0], _mm512_mul_ps(v[1], _mm512_set1_ps(1.f / 128)));
    sum = _mm512_add_ps(sum, _mm512_mul_ps(v[2], _mm512_set1_ps(1.f / 16384)));
    sum = _mm512_add_ps(sum, _mm512_mul_ps(v[3], _mm512_set1_ps(1.f / 2097152)));
    _mm512_mask_storeu_ps(y + m * sh.N + n0, out, _mm512_scalef_ps(sum, _mm512_set1_ps(static_cast<float>(-e[m]))));
  }
}

__attribute__((target("amx-tile,amx-int8")))
void release() { _tile_release(); }

// this thread's parts buffer, n bytes zeroed (the B tiles' padding): grown, never shrunk, so a step allocates
// nothing once its largest call has been seen
int8_t* thread_parts(int64_t n) {
  thread_local std::vector<int8_t> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  std::memset(buf.data(), 0, n);
  return buf.data();
}

}  // namespace

const std::string& int8_amx_status() {
  static const std::string reason = amx_tiles::probe(25, "AMX-INT8");  // once per process (thread-safe static)
  return reason;
}

void int8_amx_gemm_into(const float* x, const torch::Tensor& q, const torch::Tensor& s, int64_t group, float* y,
                        int64_t M, int64_t K, int64_t N) {
  TORCH_CHECK(int8_amx_status().empty(), "int8_amx_gemm: ", int8_amx_status());
  check_int8_weight(q, s, group, N, K, "int8_amx_gemm");
  TORCH_CHECK(group % KT == 0, "int8_amx_gemm: group size 0 (per row) or a multiple of ", KT, ", got ", group);
  if (M == 0) return;
  if (K == 0) return std::fill(y, y + M * N, 0.f);  // empty sums
  const int64_t KB = (K + KT - 1) / KT, RG = (M + ROWS - 1) / ROWS, NB = (N + NT - 1) / NT;
  const Shape sh{M, K, N, KB, group == 0 ? 1 : (K + group - 1) / group, group == 0 ? KB * KT : group};
  int8_t* parts = thread_parts(RG * KB * BTILE);
  std::vector<int> e(M);
  for (int64_t m = 0; m < M; ++m) e[m] = prepare_row(x + m * K, K, m % ROWS, parts + (m / ROWS) * KB * BTILE);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    configure();
    alignas(64) float acc[2 * NT * 16];
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t rg0 = 0; rg0 < RG; rg0 += 2) {
        const int64_t rb = std::min<int64_t>(2, RG - rg0);
        std::fill(acc, acc + rb * NT * 16, 0.f);
        if (rb == 1) pass<1>(qp, sp, parts, sh, nb * NT, rg0, acc);
        else pass<2>(qp, sp, parts, sh, nb * NT, rg0, acc);
        for (int64_t r = 0; r < rb; ++r) finish(acc + r * NT * 16, e.data(), sh, rg0 + r, nb * NT, y);
      }
    release();
  });
  for (int64_t m = 0; m < M; ++m)  // rows with an infinity or NaN: the IEEE arithmetic of the AVX-512 kernel
    if (e[m] == INT32_MIN) int8_gemm_into(x + m * K, q, s, group, y + m * N, 1, K, N);
}

#else  // a compiler or CPU without AMX intrinsics: the status says so and nothing else runs

const std::string& int8_amx_status() {
  static const std::string reason = "built without AMX support (SPECMIX_NO_AMX, or not x86-64 with GCC >= 11 or Clang >= 12)";
  return reason;
}

void int8_amx_gemm_into(const float*, const torch::Tensor&, const torch::Tensor&, int64_t, float*, int64_t, int64_t,
                        int64_t) {
  TORCH_CHECK(false, "int8_amx_gemm: ", int8_amx_status());
}

#endif

int64_t int8_amx_group_multiple() { return KT; }

torch::Tensor int8_amx_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s, int64_t group) {
  return int8_gemm_call(int8_amx_gemm_into, "int8_amx_gemm", x, q, s, group);
}
