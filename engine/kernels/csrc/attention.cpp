// Causal attention for the C++ step (attention.h): per (row, head), the scores q . k_j over the visible keys, their
// softmax and the weighted sum of values, each in a fixed order, so a row's output never depends on the other rows
// of the call. Rows of one sequence that share a head run as a tile of up to QT queries: each key and value vector
// loaded once serves all of them, while every query's sums stay the chains it has alone.
#include "attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

// q . k over D floats: FMA chains of simd::LANES lanes when D is a multiple of LANES, a scalar loop otherwise
inline float dot(const float* q, const float* k, int64_t D) {
  if (D % simd::LANES == 0) {
    simd::Vec acc = simd::zero();
    for (int64_t e = 0; e < D; e += simd::LANES) acc = simd::fmadd(simd::load(q + e), simd::load(k + e), acc);
    return simd::reduce_add(acc);
  }
  float acc = 0.f;
  for (int64_t e = 0; e < D; ++e) acc += q[e] * k[e];
  return acc;
}

// a head's outputs are summed CHUNK floats at a time (tile_weighted_sum): head sizes that are a multiple of it take
// the vector paths, others a scalar loop
constexpr int CHUNK = 4 * simd::LANES;

// the largest of s[lo, hi) (NaN skipped; -inf for none): exact in any order, so LANES at a time
inline float max_of(const float* s, int64_t lo, int64_t hi) {
  simd::Vec mv = simd::set1(-INFINITY);
  for (int64_t j = lo; j < hi; j += simd::LANES) {  // max(x, m) is m where x is NaN
    const int64_t n = std::min<int64_t>(simd::LANES, hi - j);
    mv = simd::max(simd::select_first(simd::load_first(s + j, n), n, -INFINITY), mv);
  }
  alignas(64) float t[simd::LANES];
  simd::store(t, mv);
  return *std::max_element(t, t + simd::LANES);
}

// the weights e^(s - mx) over s[lo, hi), in place, LANES at a time (the tail masked), and 1 / their sum (lane-wise,
// then across lanes)
inline float softmax_weights(float* s, int64_t lo, int64_t hi, float mx) {
  simd::Vec acc = simd::zero();
  for (int64_t j = lo; j < hi; j += simd::LANES) {
    const int64_t n = std::min<int64_t>(simd::LANES, hi - j);
    const simd::Vec w = simd::exp(simd::sub(simd::load_first(s + j, n), simd::set1(mx)));
    simd::store_first(s + j, w, n);
    acc = simd::add(acc, simd::keep_first(w, n));
  }
  return 1.f / simd::reduce_add(acc);
}

// queries per tile: N * 4 score accumulators, 4 keys and a query in registers (16 of them on AVX2)
constexpr int QT = simd::LANES == 16 ? 4 : 2;

// A tile's scores: s[t][j] = q[t] . k_j * scale for j in [lo, hmax) (keys past a query's own hi are scored too and
// never read): each one FMA chain over D and reduce_add's sum (reduce4 sums four the same way), whatever N
template <int N>
void tile_scores(const float* const* q, const float* k, int64_t D, int64_t lo, int64_t hmax, float scale,
                 float* const* s) {
  using simd::LANES;
  int64_t j = lo;
  for (; j + 4 <= hmax; j += 4) {
    simd::Vec acc[N][4];
    for (int t = 0; t < N; ++t)
      for (int c = 0; c < 4; ++c) acc[t][c] = simd::zero();
    for (int64_t e = 0; e < D; e += LANES) {
      simd::Vec kv[4];
      for (int c = 0; c < 4; ++c) kv[c] = simd::load(k + (j + c) * D + e);
      for (int t = 0; t < N; ++t) {
        const simd::Vec qv = simd::load(q[t] + e);
        for (int c = 0; c < 4; ++c) acc[t][c] = simd::fmadd(qv, kv[c], acc[t][c]);
      }
    }
    for (int t = 0; t < N; ++t) {
      float r[4];
      simd::reduce4(acc[t][0], acc[t][1], acc[t][2], acc[t][3], r);
      for (int c = 0; c < 4; ++c) s[t][j + c] = r[c] * scale;
    }
  }
  for (; j < hmax; ++j)
    for (int t = 0; t < N; ++t) s[t][j] = dot(q[t], k + j * D, D) * scale;
}

// A tile's outputs out[t] = inv[t] * sum_{lo <= j < hi[t]} w[t][j] v_j, C vectors of the head at a time (4 for one
// query, 2 for more: the accumulators fit the registers): the pairs of keys below every query's hi read once for all,
// then each query's own rest. Every output element is two FMA chains, the even and the odd j from lo (one chain
// would wait on the FMA's latency), added at the end: the same bits for any N and C (D a multiple of CHUNK)
template <int N>
void tile_weighted_sum(const float* const* w, const float* v, int64_t D, int64_t lo, const int64_t* hi,
                       const float* inv, float* const* out) {
  using simd::LANES;
  constexpr int C = N == 1 ? CHUNK / LANES : CHUNK / LANES / 2;
  const int64_t hmin = *std::min_element(hi, hi + N);
  for (int64_t e = 0; e < D; e += C * LANES) {
    simd::Vec even[N][C], odd[N][C];
    for (int t = 0; t < N; ++t)
      for (int c = 0; c < C; ++c) even[t][c] = odd[t][c] = simd::zero();
    int64_t j = lo;
    for (; j + 2 <= hmin; j += 2) {
      simd::Vec v0[C], v1[C];
      for (int c = 0; c < C; ++c) {
        v0[c] = simd::load(v + j * D + e + LANES * c);
        v1[c] = simd::load(v + (j + 1) * D + e + LANES * c);
      }
      for (int t = 0; t < N; ++t) {
        const simd::Vec w0 = simd::set1(w[t][j]), w1 = simd::set1(w[t][j + 1]);
        for (int c = 0; c < C; ++c) {
          even[t][c] = simd::fmadd(w0, v0[c], even[t][c]);
          odd[t][c] = simd::fmadd(w1, v1[c], odd[t][c]);
        }
      }
    }
    for (int t = 0; t < N; ++t) {
      int64_t jt = j;
      for (; jt + 2 <= hi[t]; jt += 2) {
        const simd::Vec w0 = simd::set1(w[t][jt]), w1 = simd::set1(w[t][jt + 1]);
        for (int c = 0; c < C; ++c) {
          even[t][c] = simd::fmadd(w0, simd::load(v + jt * D + e + LANES * c), even[t][c]);
          odd[t][c] = simd::fmadd(w1, simd::load(v + (jt + 1) * D + e + LANES * c), odd[t][c]);
        }
      }
      if (jt < hi[t]) {
        const simd::Vec w0 = simd::set1(w[t][jt]);
        for (int c = 0; c < C; ++c) even[t][c] = simd::fmadd(w0, simd::load(v + jt * D + e + LANES * c), even[t][c]);
      }
      for (int c = 0; c < C; ++c)
        simd::store(out[t] + e + LANES * c, simd::mul(simd::add(even[t][c], odd[t][c]), simd::set1(inv[t])));
    }
  }
}

// N queries of one sequence and head with the same first key lo, each with keys below hi[t] (> lo): their outputs
template <int N>
void attend_tile(const float* const* q, const float* k, const float* v, int64_t D, int64_t lo, const int64_t* hi,
                 float scale, float* const* s, float* const* out) {
  tile_scores<N>(q, k, D, lo, *std::max_element(hi, hi + N), scale, s);
  float inv[N];
  for (int t = 0; t < N; ++t) inv[t] = softmax_weights(s[t], lo, hi[t], max_of(s[t], lo, hi[t]));
  tile_weighted_sum<N>(s, v, D, lo, hi, inv, out);
}

// One query alone (a draft tree's rows, under their mask, and queries with no tile-mate): out = the head's output,
// the bits tile_scores and tile_weighted_sum give it in a tile
void attend_one(const float* q, const float* k, const float* v, int64_t D, int64_t lo, int64_t hi, const bool* seen,
                float scale, float* s, float* out) {
  std::fill_n(out, D, 0.f);
  if (hi <= lo) return;
  if (D % simd::LANES == 0) {
    tile_scores<1>(&q, k, D, lo, hi, scale, &s);
  } else {
    for (int64_t j = lo; j < hi; ++j) s[j] = dot(q, k + j * D, D) * scale;
  }
  float mx = -INFINITY;
  if (seen) {
    for (int64_t j = lo; j < hi; ++j)
      if (seen[j]) mx = std::max(mx, s[j]);
    for (int64_t j = lo; j < hi; ++j)  // the slots this row does not see weigh e^-1e4 = 0
      if (!seen[j]) s[j] = mx - 1e4f;
  } else {
    mx = max_of(s, lo, hi);
  }
  const float inv = softmax_weights(s, lo, hi, mx);
  if (D % CHUNK == 0) {
    tile_weighted_sum<1>(&s, v, D, lo, &hi, &inv, &out);
  } else {
    for (int64_t j = lo; j < hi; ++j)
      for (int64_t e = 0; e < D; ++e) out[e] = std::fma(s[j], v[j * D + e], out[e]);
    for (int64_t e = 0; e < D; ++e) out[e] *= inv;
  }
}

// the first key row m sees (a sliding window's) and one past its last
inline int64_t lo_of(const int64_t* slot, int64_t m, const attention::Dims& d) {
  return d.window > 0 ? std::max<int64_t>(0, slot[m] - d.window + 1) : 0;
}
inline int64_t hi_of(const int64_t* slot, int64_t m, int64_t kv_len) { return std::min(slot[m] + 1, kv_len); }

}  // namespace

namespace attention {

std::vector<Tile> plan_tiles(const int64_t* slot, const bool* mask, const int64_t* row, int64_t kv_len,
                             const Dims& d) {
  const bool tiled = !mask && d.D % CHUNK == 0;
  std::vector<Tile> tiles;
  tiles.reserve(d.M * d.nh);
  for (int64_t h = 0; h < d.nh; ++h)
    for (int64_t m = 0; m < d.M;) {
      const int64_t lo = lo_of(slot, m, d);
      int64_t n = 1;
      if (tiled && hi_of(slot, m, kv_len) > lo)
        while (n < QT && m + n < d.M && row[m + n] == row[m] && lo_of(slot, m + n, d) == lo &&
               hi_of(slot, m + n, kv_len) > lo)
          ++n;
      tiles.push_back({h, m, n});
      m += n;
    }
  return tiles;
}

void attend(const std::vector<Tile>& tiles, const float* qkv, const float* kc, const float* vc, const int64_t* slot,
            const bool* mask, const int64_t* row, int64_t kv_len, const Dims& d, float* o) {
  const int64_t width = (d.nh + 2 * d.nkv) * d.D, group = d.nh / d.nkv;
  const float scale = 1.f / std::sqrt(static_cast<float>(d.D));
  const int64_t n_tiles = static_cast<int64_t>(tiles.size()), work = d.M * d.nh * kv_len * d.D;
  at::parallel_for(0, n_tiles, work < (1 << 18) ? n_tiles : 1, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> buf;  // the scores, grown to the longest call seen, never shrunk
    const size_t need = static_cast<size_t>(QT) * (kv_len + simd::LANES);
    if (buf.size() < need) buf.resize(need);
    for (int64_t i = i0; i < i1; ++i) {
      const Tile& tl = tiles[i];
      const int64_t kvh = tl.h / group, base = ((row[tl.m] * d.nkv + kvh) * d.S) * d.D;
      const float* q[QT];
      float *s[QT], *out[QT];
      int64_t hi[QT];
      for (int64_t t = 0; t < tl.n; ++t) {
        q[t] = qkv + (tl.m + t) * width + tl.h * d.D;
        s[t] = buf.data() + t * (kv_len + simd::LANES);
        out[t] = o + (tl.m + t) * d.nh * d.D + tl.h * d.D;
        hi[t] = hi_of(slot, tl.m + t, kv_len);
      }
      const int64_t lo = lo_of(slot, tl.m, d);
      if (tl.n == 1) {
        attend_one(q[0], kc + base, vc + base, d.D, lo, hi[0], mask ? mask + tl.m * kv_len : nullptr, scale, s[0],
                   out[0]);
      } else if (tl.n == 2) {
        attend_tile<2>(q, kc + base, vc + base, d.D, lo, hi, scale, s, out);
      } else if constexpr (QT == 4) {
        if (tl.n == 3) attend_tile<3>(q, kc + base, vc + base, d.D, lo, hi, scale, s, out);
        else attend_tile<4>(q, kc + base, vc + base, d.D, lo, hi, scale, s, out);
      }
    }
  });
}

}  // namespace attention
