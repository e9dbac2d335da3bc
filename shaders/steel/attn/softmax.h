// OnlineSoftmax: the running state of one query row across key tiles (flash attention).
//
// Each lane holds one row (frag_row of its lane); the four lanes that share a row differ in
// lane bits 0 and 3 (fragment.h's map), so row reductions are two xor shuffles. After each tile:
//   m' = max(m, max_j s_j); p_j = exp(s_j - m'); l' = l * exp(m - m') + sum_j p_j,
// and the caller scales its output accumulators by the same correction exp(m - m'). A row that
// has seen only hidden keys keeps m = -inf; the subtraction then uses 0 instead of m', so that
// -inf - -inf never makes a NaN and its probabilities stay 0 (the row's output is 0, its
// log-sum-exp -inf, as the reference defines).
#pragma once

#include <metal_stdlib>

#include "../fragment.h"
#include "score.h"

using namespace metal;

namespace steel {

inline float attn_row_max(float x) {
  x = max(x, simd_shuffle_xor(x, ushort(1)));
  return max(x, simd_shuffle_xor(x, ushort(8)));
}

inline float attn_row_sum(float x) {
  x += simd_shuffle_xor(x, ushort(1));
  return x + simd_shuffle_xor(x, ushort(8));
}

struct OnlineSoftmax {
  float m;  // running max of the row's scores (score units, see score.h)
  float l;  // running sum of exp(s - m)

  // A sink logit (already in score units) is a key with no value: it starts the row's state.
  void init(bool has_sink, float sink) {
    m = has_sink ? sink : -INFINITY;
    l = has_sink ? 1.0f : 0.0f;
  }

  // Turns the scores of `s` into probabilities relative to the new max; returns the correction
  // factor for the output accumulators.
  template <short TK>
  float update(thread FragTile<1, TK>& s) {
    float tile_max = m;
#pragma clang loop unroll(full)
    for (short j = 0; j < TK; ++j) {
      tile_max = max(tile_max, max(s.frag[j].thread_elements()[0], s.frag[j].thread_elements()[1]));
    }
    const float m_new = attn_row_max(tile_max);
    const float shift = m_new == -INFINITY ? 0.0f : m_new;
    const float factor = exp2((m - shift) * attn_exp_unit);
    float sum = 0.0f;
#pragma clang loop unroll(full)
    for (short j = 0; j < TK; ++j) {
#pragma clang loop unroll(full)
      for (short e = 0; e < 2; ++e) {
        const float p = exp2((s.frag[j].thread_elements()[e] - shift) * attn_exp_unit);
        s.frag[j].thread_elements()[e] = p;
        sum += p;
      }
    }
    l = l * factor + attn_row_sum(sum);
    m = m_new;
    return factor;
  }

  // 1 / l for the final normalisation; 0 for a row that saw nothing (l = 0), NaN stays NaN.
  float inverse_sum() const { return l == 0.0f ? 0.0f : 1.0f / l; }

  // The row's log-sum-exp in nats: -inf for a row that saw nothing.
  float lse() const { return l == 0.0f ? -INFINITY : m * attn_unit_nats + log(l); }
};

}  // namespace steel
