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

// s[j] = q . k_j * scale for the keys j in [lo, hi) (k_j at k + j * D): four keys at a time, their horizontal sums
// in one reduce4, each sum dot's bits
inline void scores(const float* q, const float* k, int64_t D, int64_t lo, int64_t hi, float scale, float* s) {
  int64_t j = lo;
  if (D % simd::LANES == 0) {
    for (; j + 4 <= hi; j += 4) {
      simd::Vec acc[4] = {simd::zero(), simd::zero(), simd::zero(), simd::zero()};
      for (int64_t e = 0; e < D; e += simd::LANES) {
        const simd::Vec qv = simd::load(q + e);
        for (int c = 0; c < 4; ++c) acc[c] = simd::fmadd(qv, simd::load(k + (j + c) * D + e), acc[c]);
      }
      float t[4];
      simd::reduce4(acc[0], acc[1], acc[2], acc[3], t);
      for (int c = 0; c < 4; ++c) s[j + c] = t[c] * scale;
    }
  }
  for (; j < hi; ++j) s[j] = dot(q, k + j * D, D) * scale;
}

// out[0, CHUNK) = inv * sum_{lo <= j < hi} w[j] v[j * stride ...]: CHUNK floats of a head in registers, the even
// and the odd j in two sets of FMA chains added at the end (one set waits on the FMA's latency); each output its own
// chains, so a head split in such chunks gives the same bits as a whole one
constexpr int CHUNK = 4 * simd::LANES;
inline void weighted_sum(const float* w, const float* v, int64_t stride, int64_t lo, int64_t hi, float inv,
                         float* out) {
  constexpr int C = CHUNK / simd::LANES;
  simd::Vec even[C], odd[C];
  for (int c = 0; c < C; ++c) even[c] = odd[c] = simd::zero();
  int64_t j = lo;
  for (; j + 2 <= hi; j += 2) {
    const simd::Vec w0 = simd::set1(w[j]), w1 = simd::set1(w[j + 1]);
    for (int c = 0; c < C; ++c) {
      even[c] = simd::fmadd(w0, simd::load(v + j * stride + simd::LANES * c), even[c]);
      odd[c] = simd::fmadd(w1, simd::load(v + (j + 1) * stride + simd::LANES * c), odd[c]);
    }
  }
  if (j < hi) {
    const simd::Vec w0 = simd::set1(w[j]);
    for (int c = 0; c < C; ++c) even[c] = simd::fmadd(w0, simd::load(v + j * stride + simd::LANES * c), even[c]);
  }
  for (int c = 0; c < C; ++c)
    simd::store(out + simd::LANES * c, simd::mul(simd::add(even[c], odd[c]), simd::set1(inv)));
}

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

// One query alone (a draft tree's rows, under their mask, and queries with no tile-mate): out = the head's output
void attend_one(const float* q, const float* k, const float* v, int64_t D, int64_t lo, int64_t hi, const bool* seen,
                float scale, float* s, float* out) {
  std::fill_n(out, D, 0.f);
  if (hi <= lo) return;
  scores(q, k, D, lo, hi, scale, s);
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
  // out = sum_j w_j v_j: with the head in registers, CHUNK floats at a time, for the usual head sizes
  if (D % CHUNK == 0) {
    for (int64_t e = 0; e < D; e += CHUNK) weighted_sum(s, v + e, D, lo, hi, inv, out + e);
  } else {
    for (int64_t j = lo; j < hi; ++j)
      for (int64_t e = 0; e < D; ++e) out[e] = std::fma(s[j], v[j * D + e], out[e]);
    for (int64_t e = 0; e < D; ++e) out[e] *= inv;
  }
}

// queries per tile: N * 4 score accumulators, 4 keys and a query in registers (16 of them on AVX2)
constexpr int QT = simd::LANES == 16 ? 4 : 2;

// A tile's scores: s[t][j] = q[t] . k_j * scale for j in [lo, hmax) (keys past a query's own hi are scored too and
// never read), each the bits scores() gives that query alone
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

// A tile's outputs out[t] = inv[t] * sum_{lo <= j < hi[t]} w[t][j] v_j, 2 * LANES floats of the head at a time:
// the pairs of keys below every query's hi read once for all, then each query's own rest; every output element the
// even and odd chains weighted_sum runs for that query alone
template <int N>
void tile_weighted_sum(const float* const* w, const float* v, int64_t D, int64_t lo, const int64_t* hi,
                       const float* inv, float* const* out) {
  using simd::LANES;
  constexpr int C = 2;
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

// a run of up to QT rows of one head: its first row, its length
struct Tile {
  int64_t h, m, n;
};

}  // namespace

namespace attention {

void attend(const float* qkv, const float* kc, const float* vc, const int64_t* slot, const bool* mask,
            const int64_t* row, int64_t kv_len, const Dims& d, float* o) {
  const int64_t width = (d.nh + 2 * d.nkv) * d.D, group = d.nh / d.nkv;
  const float scale = 1.f / std::sqrt(static_cast<float>(d.D));
  auto lo_of = [&](int64_t m) { return d.window > 0 ? std::max<int64_t>(0, slot[m] - d.window + 1) : 0; };
  auto hi_of = [&](int64_t m) { return std::min(slot[m] + 1, kv_len); };
  // tiles, head-major (the rows of a head run one after another on one thread, while its keys and values are in
  // L2): consecutive rows of one cache row with the same first key and some key to see, unless a mask is given
  const bool tiled = !mask && d.D % CHUNK == 0;
  std::vector<Tile> tiles;
  for (int64_t h = 0; h < d.nh; ++h)
    for (int64_t m = 0; m < d.M;) {
      int64_t n = 1;
      if (tiled && hi_of(m) > lo_of(m))
        while (n < QT && m + n < d.M && row[m + n] == row[m] && lo_of(m + n) == lo_of(m) && hi_of(m + n) > lo_of(m))
          ++n;
      tiles.push_back({h, m, n});
      m += n;
    }
  const int64_t n_tiles = static_cast<int64_t>(tiles.size()), work = d.M * d.nh * kv_len * d.D;
  at::parallel_for(0, n_tiles, work < (1 << 18) ? n_tiles : 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(static_cast<size_t>(QT) * (kv_len + simd::LANES));
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
        hi[t] = hi_of(tl.m + t);
      }
      const int64_t lo = lo_of(tl.m);
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
