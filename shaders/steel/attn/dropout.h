// The dropout generator of the attention kernels: Philox4x32-10 keyed exactly as
// torch_steel/dropout.py, so that the forward and both backward kernels (and the reference)
// draw the same keep mask for a given seed and offset without storing it:
//   key = (seed_lo, seed_hi), counter = (col / 4, row, batch * heads + head, offset),
//   word = philox(counter, key)[col % 4], kept when word >= floor(p * 2^32), scaled 1 / (1 - p).
#pragma once

#include <metal_stdlib>

#include "../params.h"

using namespace metal;

constant bool attn_dropout [[function_constant(STEEL_ATTN_FC_DROPOUT)]];

namespace steel {

inline uint4 attn_philox(uint4 c, uint2 k) {
  for (int i = 0; i < 10; ++i) {
    if (i > 0) {
      k.x += 0x9E3779B9u;
      k.y += 0xBB67AE85u;
    }
    const uint hi0 = mulhi(c.x, 0xD2511F53u);
    const uint lo0 = c.x * 0xD2511F53u;
    const uint hi1 = mulhi(c.z, 0xCD9E8D57u);
    const uint lo1 = c.z * 0xCD9E8D57u;
    c = uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
  }
  return c;
}

// The four words of (row, the group of four columns holding `col`) for slice `bh`.
inline uint4 attn_dropout_words(constant AttnParams& p, uint bh, int row, int col) {
  return attn_philox(uint4(uint(col) / 4, uint(row), bh, p.drop_offset),
                     uint2(p.seed_lo, p.seed_hi));
}

// The factor (0 or 1 / (1 - p)) of word `w`.
inline float attn_keep(constant AttnParams& p, uint w) {
  return w >= p.drop_threshold ? p.drop_scale : 0.0f;
}

// The factors of (row, col) and (row, col + 1), col even (a fragment lane's two elements).
inline float2 attn_dropout_pair(constant AttnParams& p, uint bh, int row, int col) {
  const uint4 w = attn_dropout_words(p, bh, row, col);
  const bool low = (uint(col) & 2u) == 0;
  return float2(attn_keep(p, low ? w.x : w.z), attn_keep(p, low ? w.y : w.w));
}

// A score tile of TK 8x8 fragments (keys key0 .. key0 + 8 * TK, this lane's row and fragment
// column fc) times its dropout factors.
template <short TK, typename Tile>
inline void attn_dropout_tile(thread Tile& t, constant AttnParams& p, uint bh, int row, int key0,
                              short fc) {
#pragma clang loop unroll(full)
  for (short j = 0; j < TK; ++j) {
    const float2 z = attn_dropout_pair(p, bh, row, key0 + j * 8 + fc);
    t.frag[j].thread_elements()[0] *= z.x;
    t.frag[j].thread_elements()[1] *= z.y;
  }
}

// The factor of one (row, col).
inline float attn_dropout_one(constant AttnParams& p, uint bh, int row, int col) {
  const uint4 w = attn_dropout_words(p, bh, row, col);
  const uint c = uint(col) & 3u;
  return attn_keep(p, c == 0 ? w.x : c == 1 ? w.y : c == 2 ? w.z : w.w);
}

}  // namespace steel
