// The fp32 vector of the CPU kernels (the GEMMs, the step's layers, attention, the per-row ops): 16 lanes on
// AVX-512, 8 on AVX2 with FMA and F16C. The compiler flags pick one (engine/kernels/cpu_gemm.py builds one
// binary per ISA); the kernels are written once against these functions. Within a binary every function is
// deterministic and lane-order fixed (reduce_add sums in one order), so the kernels' row independence holds on both.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace simd {

// 16-bit weight formats (their bits): fp16 and bf16
struct F16 { uint16_t bits; };
struct BF16 { uint16_t bits; };

#if defined(__AVX512F__)

constexpr int LANES = 16;
using Vec = __m512;

inline __mmask16 first(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec set1(float v) { return _mm512_set1_ps(v); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const F16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vec load(const BF16* p) {  // the 16 bits moved to the top of a float: exact
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline Vec load(const int8_t* p) {  // int8 weights widened to fp32: exact
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }  // zeros after n
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void store_first(float* p, Vec v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }
inline Vec keep_first(Vec v, int64_t n) { return _mm512_maskz_mov_ps(first(n), v); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }  // b where either is NaN
inline Vec select_first(Vec v, int64_t n, float fill) { return _mm512_mask_blend_ps(first(n), set1(fill), v); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, fused
// the lanes' sum in one fixed tree, written out (not left to a compiler's reduction): lane j + lane j+8, then + the
// one 4 on, then 2 on, then lanes 0 + 1
inline float reduce_add(Vec v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_permute_ps(q, 0x4E));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}
// out[j] = reduce_add(the j-th of a, b, c, d), bit for bit: the same tree for the four interleaved in one vector
// (half the shuffles and a third of the adds of four reduce_adds)
inline void reduce4(Vec a, Vec b, Vec c, Vec d, float* out) {
  const Vec ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));  // [a8 b8]
  const Vec cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));  // [c8 d8]
  const Vec z = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));  // [a4 b4 c4 d4]
  const Vec two = _mm512_add_ps(z, _mm512_permute_ps(z, 0x4E));  // per 4 lanes: j + (j ^ 2)
  const Vec one = _mm512_add_ps(two, _mm512_permute_ps(two, 0xB1));  // per 4 lanes: j + (j ^ 1)
  alignas(64) float t[16];
  _mm512_store_ps(t, one);
  for (int j = 0; j < 4; ++j) out[j] = t[4 * j];
}
inline Vec round(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

constexpr int LANES = 8;
using Vec = __m256;

inline __m256i first(int64_t n) {  // lanes < n all ones
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec set1(float v) { return _mm256_set1_ps(v); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const F16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Vec load(const BF16* p) {  // the 16 bits moved to the top of a float: exact
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline Vec load(const int8_t* p) {  // int8 weights widened to fp32: exact
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec load_first(const float* p, int64_t n) { return _mm256_maskload_ps(p, first(n)); }  // zeros after n
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline void store_first(float* p, Vec v, int64_t n) { _mm256_maskstore_ps(p, first(n), v); }
inline Vec keep_first(Vec v, int64_t n) { return _mm256_and_ps(v, _mm256_castsi256_ps(first(n))); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }  // b where either is NaN
inline Vec select_first(Vec v, int64_t n, float fill) {  // lanes from n on: fill
  return _mm256_blendv_ps(set1(fill), v, _mm256_castsi256_ps(first(n)));
}
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b, fused
inline Vec round(Vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float reduce_add(Vec v) {  // (lanes 0-3 + lanes 4-7), then pairs, then the two halves
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline void reduce4(Vec a, Vec b, Vec c, Vec d, float* out) {  // out[j] = reduce_add(the j-th of a, b, c, d)
  out[0] = reduce_add(a);
  out[1] = reduce_add(b);
  out[2] = reduce_add(c);
  out[3] = reduce_add(d);
}

#else
#error "the fp32 CPU kernels need -mavx512f, or -mavx2 -mfma -mf16c"
#endif

// Cephes' expf on r = x - n ln2 (n = round(x log2 e)): the polynomial p with e^x = p 2^n (~1 ulp)
inline Vec exp_poly(Vec x, Vec n) {
  Vec r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  Vec p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  return fmadd(mul(p, r), r, add(r, set1(1.f)));
}

// e^x per lane (one vector op chain instead of LANES libm calls); x below -88 gives 0 (as e^x does in fp32
// but for denormals), NaN stays NaN
#if defined(__AVX512F__)
inline Vec exp(Vec x) {
  const Vec n = round(mul(x, set1(1.44269504088896341f)));
  const Vec y = _mm512_scalef_ps(exp_poly(x, n), n);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, set1(-88.f), _CMP_NLT_UQ), y);
}
#else
inline Vec pow2(__m256i k) {  // 2^k for -126 <= k <= 127
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}
// AVX2 has no scalef: 2^n goes on as two exact powers 2^(n/2), so n = -127 (x near -88: a subnormal result)
// rounds once, as scalef does; x is first capped at 88.38 (above it e^x overflows fp32: a finite value
// instead of inf: SiLU's 1 + e^-g then gives g / 1e38 ~ -0 for g < -88). _mm256_min_ps returns its second operand
// for a NaN.
inline Vec exp(Vec x) {
  const Vec xc = _mm256_min_ps(set1(88.3762626647949f), x);
  const Vec n = round(mul(xc, set1(1.44269504088896341f)));
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
  const Vec y = mul(mul(exp_poly(xc, n), pow2(half)), pow2(_mm256_sub_epi32(ni, half)));
  return _mm256_and_ps(y, _mm256_cmp_ps(xc, set1(-88.f), _CMP_NLT_UQ));
}
#endif

// n < LANES 16-bit or int8 weights widened to fp32, zeros after
template <typename W>
inline Vec load_first(const W* p, int64_t n) {
  W buf[LANES] = {};
  std::copy_n(p, n, buf);
  return load(buf);
}

}  // namespace simd
