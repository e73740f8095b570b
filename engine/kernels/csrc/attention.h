// Causal attention over the static KV cache for the C++ step's rows (attention.cpp), shared by the decoder layers
// (decode_layers.cpp).
#pragma once
#include <cstdint>
#include <vector>

namespace attention {

struct Dims {
  int64_t M, H, nh, nkv, D, S, max_batch, window;  // window <= 0: none
};

// A run of rows of one head that attend together (attention.cpp): its head, first row and length. Rows of one
// sequence (cache row) with the same first key run as tiles of up to 4 (2 on AVX2) queries, unless a mask is given.
struct Tile {
  int64_t h, m, n;
};

// The call's tiles, head-major (a head's rows run one after another on one thread while its keys and values are in
// L2), from what every layer shares: the rows' slots, mask, cache rows and kv_len (as attend's)
std::vector<Tile> plan_tiles(const int64_t* slot, const bool* mask, const int64_t* row, int64_t kv_len, const Dims& d);

// o[m, head, :] = softmax(q . k_j / sqrt(D)) v over the visible cache slots j of row m's sequence: qkv [M, (nh +
// 2 nkv) D] the rows' rotated q (k and v already in the caches [max_batch, nkv, S, D]); slot [M]: each row's own
// cache slot, the last it sees; mask: null, or [M, kv_len] the slots each row sees (a draft tree); row [M]: each
// row's cache row; tiles: plan_tiles' of the same. Every row's output is computed alone: the same bits whatever
// else is in the call.
void attend(const std::vector<Tile>& tiles, const float* qkv, const float* kc, const float* vc, const int64_t* slot,
            const bool* mask, const int64_t* row, int64_t kv_len, const Dims& d, float* o);

}  // namespace attention
