// Score transforms of the attention forward: what happens to a tile of scores between Q K^T and
// the softmax, element by element in the fp32 fragments, in the order the reference applies it
// (torch_steel/reference.py): softcap, then the additive mask, then everything that hides a key
// (bool mask, causal and window diagonals, keys past S) as -inf.
//
// Score units. Without an additive mask, q is prescaled by scale * log2(e), so scores are in
// units of log2(e) nats and the softmax uses exp2 directly. With an additive mask, scores stay in
// nats (q is prescaled by scale alone) and exp2 gets the factor log2(e) after the row max is
// subtracted: a mask of finfo.min (Hugging Face's padding) multiplied by log2(e) first would
// overflow to -inf, and a row of equal huge scores must come out uniform, as in the reference.
#pragma once

#include <metal_stdlib>

#include "../fragment.h"
#include "../params.h"

using namespace metal;

constant bool attn_softcap [[function_constant(STEEL_ATTN_FC_SOFTCAP)]];
constant int attn_mask [[function_constant(STEEL_ATTN_FC_MASK)]];
constant bool attn_has_hi [[function_constant(STEEL_ATTN_FC_HAS_HI)]];
constant bool attn_has_lo [[function_constant(STEEL_ATTN_FC_HAS_LO)]];
constant bool attn_additive = attn_mask == kSteelAttnMaskAdd || attn_mask == kSteelAttnMaskAddF32;
// exp(x) = exp2(x * attn_exp_unit) for a score difference x in the current unit.
constant float attn_exp_unit = attn_additive ? M_LOG2E_F : 1.0f;
// The score unit in nats (log(e) = 1 nat per unit with an additive mask, ln 2 without).
constant float attn_unit_nats = attn_additive ? 1.0f : M_LN2_F;

namespace steel {

// Element `i` of a buffer holding T, or float when `is_f32` (the mask's and sinks' dtypes).
template <typename T>
inline float attn_read(const device uchar* buffer, bool is_f32, steel_i64 i) {
  return is_f32 ? ((const device float*)buffer)[i] : float(((const device T*)buffer)[i]);
}

// The attention one threadgroup computes: its query rows, its keys and where the causal and
// window diagonals start. A dense launch takes them from AttnParams; a varlen launch derives
// them on the device from its sequence's cu_seqlens entries (forward.h). Rows and keys count
// from the start of the (sequence's) block.
struct AttnExtent {
  int L;      // query rows
  int S;      // keys
  int shift;  // S - L when the diagonals align bottom-right, else 0
};

// Which keys query row `row` may see: [row + shift - lo_off, row + shift + hi_off] within
// [0, S), each side only where its function constant is set. Tile-level culling uses the same
// bounds (forward.h); this is the element-level test for tiles that cross a boundary.
inline bool attn_visible(constant AttnParams& p, AttnExtent x, int row, int key) {
  bool keep = key < x.S;
  if (attn_has_hi) keep = keep && key <= row + x.shift + p.hi_off;
  if (attn_has_lo) keep = keep && key >= row + x.shift - p.lo_off;
  return keep;
}

// One score through the transforms, at query row `row` and key `key` of the extent `ext`. `t`
// receives tanh(x) when softcap is on (the backward's derivative needs it). `row_ok`: the row is
// inside L; `mask_at`: the mask's element offset of (row, key); `edge`: the tile crosses a
// visibility boundary (decided once per threadgroup), so the element test runs.
template <typename T>
inline float attn_score(float x, constant AttnParams& p, AttnExtent ext, int row, int key,
                        bool row_ok, const device uchar* mask, steel_i64 mask_at, bool edge,
                        thread float& t) {
  if (attn_softcap) {
    t = precise::tanh(x);
    x = t * p.softcap;
  }
  if (attn_mask != kSteelAttnMaskNone && row_ok && key < ext.S) {
    if (attn_mask == kSteelAttnMaskBool) {
      if (mask[mask_at] == 0) x = -INFINITY;
    } else {
      x += attn_read<T>(mask, attn_mask == kSteelAttnMaskAddF32, mask_at);
    }
  }
  if (edge && !(row_ok && attn_visible(p, ext, row, key))) x = -INFINITY;
  return x;
}

// Transforms one lane's elements of a 8 x (8 * TK) score tile in place (the forward's
// orientation: the lane's query row is fixed, keys run along the tile). `key0` is the tile's
// first key, `mask_row` the mask's element offset of (row, key 0).
template <typename T, short TK>
inline void attn_transform_scores(thread FragTile<1, TK>& s, constant AttnParams& p,
                                  AttnExtent ext, int row, int key0, bool row_ok,
                                  const device uchar* mask, steel_i64 mask_row, bool edge,
                                  ushort lane) {
  const short fc = frag_col(lane);
  // Read once, and only with a mask: per element it would be a params read per score.
  const steel_i64 m_cs = attn_mask != kSteelAttnMaskNone ? p.m_cs : 0;
#pragma clang loop unroll(full)
  for (short j = 0; j < TK; ++j) {
#pragma clang loop unroll(full)
    for (short e = 0; e < 2; ++e) {
      const int key = key0 + j * 8 + fc + e;
      float t = 0.0f;
      s.frag[j].thread_elements()[e] =
          attn_score<T>(s.frag[j].thread_elements()[e], p, ext, row, key, row_ok, mask,
                        mask_row + key * m_cs, edge, t);
    }
  }
}

}  // namespace steel
