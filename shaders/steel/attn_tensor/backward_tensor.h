// The attention backward on Metal 4's matrix units (M5's neural accelerators): the dK/dV and dQ
// kernels of ../attn/backward.h, with every product formed by mpp::tensor_ops::matmul2d over the
// whole threadgroup (execution_simdgroups<N>), for the forward's (D, D) head-dim pairs
// (forward_tensor.h). Every product has the shape of one of the forward's two operations, so
// both kernels use AttnTensor<T, D, D>'s ScoreOp (BQ x BK over D, right operand transposed) and
// OutOp (BQ x D += BQ x BK times BK x D):
//
//   dK/dV: a threadgroup owns BQ = 64 keys of one (batch entry or sequence, KV head), their K
//     and V in left-input cooperative tensors and dK, dV in destination ones, and streams
//     tiles of BK = 32 query rows of every query head of the group (GQA summed in registers):
//       S^T = K Q^T and dP^T = V dO^T (ScoreOp, Q and dO read from device memory);
//       P^T = exp(S^T - lse), dS^T = P^T o (dP^T o Z - delta) times the softcap slope;
//       dV += (P o Z)^T dO and dK += dS^T Q (OutOp, the left operands through threadgroup
//       memory in the inputs' dtype, as the forward's P).
//   dQ: a threadgroup owns BQ = 64 query rows (as the forward), Q and dO in left-input
//     cooperative tensors, dQ in a destination one, and streams key tiles of BK = 32:
//       S = Q K^T, dP = dO V^T, P, dS as above, dQ += dS K.
//
// S and dP are destinations of one operation type, so slot i of the two is the same element;
// every other element is reached through the cooperative tensor index API (the layout is the
// driver's and differs between GPU generations). The rows' lse, delta and 1 / normaliser are
// staged in threadgroup memory once per tile (dK/dV) or block (dQ). The delta pre-pass, the
// dsinks and dmask kernels, the score transforms (score.h), the dropout generator (dropout.h),
// the causal / window bounds, the varlen offsets and the stores' scale are backward.h's.
// Barriers: dK/dV three per query tile (before the stats and tiles are overwritten, after the
// stats, after the tiles), dQ two per key tile and one after the stats. No atomics.
#pragma once

#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>

#include "../attn/backward.h"
#include "../params.h"
#include "forward_tensor.h"

using namespace metal;

namespace steel {

template <typename T>
using attn_tensor_out = tensor<device T, dextents<int32_t, 2>, tensor_inline>;

// Where slot i of a cooperative tensor lies ([0] column, [1] row): the index API. A parameter of
// the blocks so that a test can show that an index assuming a layout fails
// (tests/attn/kernels/attention_bwd_tensor_layout_msl4.metal).
struct AttnTensorIndex {
  template <typename Coop>
  static array<int, 2> at(thread const Coop& c, ushort i, ushort) {
    return c.get_multidimensional_index(i);
  }
};

// The dK/dV block: keys key0 .. key0 + BQ of KV head tg.y of (batch entry | sequence) tg.z.
// `p_mem` and `ds_mem` hold BQ x BK elements each, `stats` 3 * BK floats.
template <typename T, short D, typename Index = AttnTensorIndex>
inline void attention_bwd_tensor_dkdv_block(
    const device T* q, const device T* k, const device T* v, const device uchar* mask,
    const device T* grad_out, const device float* lse, const device float* delta, device T* dk,
    device T* dv, const device int* cu_q, const device int* cu_k, constant AttnBackwardParams& bp,
    threadgroup T* p_mem, threadgroup T* ds_mem, threadgroup float* stats, uint3 tg,
    ushort thread_index) {
  using A = AttnTensor<T, D, D>;
  using View = typename A::View;
  constant AttnParams& p = bp.fwd;
  const int key0 = int(tg.x) * A::BQ;
  const int hk = int(tg.y);
  const int zb = int(tg.z);
  const AttnBwdSeq sq = attn_bwd_seq(bp, cu_q, cu_k, zb);
  const AttnExtent ext = sq.ext;
  // Varlen: blocks past this sequence's keys have nothing to write; uniform, before any
  // operation. (A sequence without query rows still stores its keys' zero gradients.)
  if (attn_varlen && key0 >= ext.S) return;
  const int keys = ext.S - key0;  // may exceed BQ: the views' edge is the extent's
  const int last_key = min(key0 + int(A::BQ), ext.S) - 1;
  const bool keys_whole = keys >= A::BQ;

  typename A::ScoreOp score_op;
  typename A::OutOp acc_op;
  typename A::QIn kc;
  typename A::QIn vc;
  kc.load(View(k + sq.k + hk * p.k_hs + key0 * p.k_rs, dextents<int32_t, 2>(p.E, keys),
               array<int32_t, 2>({1, int32_t(p.k_rs)})));
  vc.load(View(v + sq.v + hk * p.v_hs + key0 * p.v_rs, dextents<int32_t, 2>(p.Ev, keys),
               array<int32_t, 2>({1, int32_t(p.v_rs)})));
  typename A::Out dkc;
  typename A::Out dvc;
  for (ushort i = 0; i < dkc.get_capacity(); ++i) {
    dkc[i] = 0.0f;
    dvc[i] = 0.0f;
  }

  // The query rows that see some key of the block (the forward's bounds, read the other way).
  int row_begin = 0;
  int row_end = ext.L;
  if (attn_has_hi) row_begin = max(0, key0 - ext.shift - p.hi_off);
  if (attn_has_lo) row_end = min(ext.L, last_key - ext.shift + p.lo_off + 1);
  const int t_begin = row_begin / A::BK;
  const int t_end = row_end > row_begin ? (row_end + A::BK - 1) / A::BK : t_begin;

  const typename A::PTile p_tile(p_mem, extents<int32_t, A::BK, A::BQ>());
  const typename A::PTile ds_tile(ds_mem, extents<int32_t, A::BK, A::BQ>());
  threadgroup float* lse_s = stats;
  threadgroup float* delta_s = stats + A::BK;
  threadgroup float* norm_s = stats + 2 * A::BK;
  const bool whole_e = attn_align_e && attn_align_ev;
  bool first = true;
  for (int g = 0; g < p.group; ++g) {
    const int h = hk * p.group + g;
    const device T* q_h = q + sq.q + h * p.q_hs;
    const device T* g_h = grad_out + sq.g + h * bp.g_hs;
    const steel_i64 stat_h = sq.rows + steel_i64(h) * p.L;
    const steel_i64 mask_h = sq.m + h * p.m_hs;
    const uint bh = uint(zb) * uint(p.Hq) + uint(h);
    for (int t = t_begin; t < t_end; ++t) {
      const int row0 = t * A::BK;
      const int rows = ext.L - row0;
      const int valid = min(int(A::BK), rows);
      const int last_row = row0 + valid - 1;
      const bool whole = whole_e && valid == A::BK;  // uniform: static slices, no edge checks
      const bool edge = valid < A::BK || !keys_whole ||
                        (attn_has_hi && last_key > row0 + ext.shift + p.hi_off) ||
                        (attn_has_lo && key0 < last_row + ext.shift - p.lo_off);

      // The tile's rows' statistics (-inf and 0 past L), once the previous tile's operations
      // have read the tiles.
      if (!first) threadgroup_barrier(mem_flags::mem_threadgroup);
      first = false;
      if (thread_index < 3 * A::BK) {
        const int r = thread_index % A::BK;
        const bool in = r < valid;
        const steel_i64 at = stat_h + row0 + r;
        if (thread_index < A::BK) {
          lse_s[r] = in ? lse[at] : -INFINITY;
        } else if (thread_index < 2 * A::BK) {
          delta_s[r] = in ? delta[at] : 0.0f;
        } else {
          norm_s[r] = in ? delta[attn_rows(bp) + at] : 0.0f;
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);

      // S^T = K Q^T and dP^T = V dO^T.
      const View tq(q_h + row0 * p.q_rs, dextents<int32_t, 2>(p.E, rows),
                    array<int32_t, 2>({1, int32_t(p.q_rs)}));
      const View tdo(g_h + row0 * bp.g_rs, dextents<int32_t, 2>(p.Ev, rows),
                     array<int32_t, 2>({1, int32_t(bp.g_rs)}));
      typename A::Scores st;
      typename A::Scores dp;
      if (whole) {
        score_op.run(kc, tq.template slice<D, A::BK>(0, 0), st);
        score_op.run(vc, tdo.template slice<D, A::BK>(0, 0), dp);
      } else {
        score_op.run(kc, tq.slice(0, 0), st);
        score_op.run(vc, tdo.slice(0, 0), dp);
      }
      // P^T, (P o Z)^T into st, dS^T into dp: S^T's column is the tile's query row.
      for (ushort i = 0; i < st.get_capacity(); ++i) {
        if (!st.is_valid_element(i)) continue;
        const auto at = Index::at(st, i, thread_index);
        const int r = at[0];
        const int row = row0 + r;
        const int key = key0 + at[1];
        const bool row_ok = r < valid;
        float th = 0.0f;
        const float s = attn_score<T>(st[i] * p.q_scale, p, ext, row, key, row_ok, mask,
                                      mask_h + row * p.m_rs + key * p.m_cs, edge, th);
        const float pv = row_ok ? attn_probability(s, lse_s[r]) * norm_s[r] : 0.0f;
        const float z = attn_dropout ? attn_dropout_one(p, bh, row, key) : 1.0f;
        const float slope = attn_softcap ? 1.0f - th * th : 1.0f;
        st[i] = pv * z;
        dp[i] = pv * (dp[i] * z - delta_s[r]) * slope;
      }
      st.store(p_tile);
      dp.store(ds_tile);
      threadgroup_barrier(mem_flags::mem_threadgroup);

      // dV += (P o Z)^T dO, dK += dS^T Q.
      if (whole) {
        acc_op.run(p_tile, tdo.template slice<D, A::BK>(0, 0), dvc);
        acc_op.run(ds_tile, tq.template slice<D, A::BK>(0, 0), dkc);
      } else {
        acc_op.run(p_tile, tdo.slice(0, 0), dvc);
        acc_op.run(ds_tile, tq.slice(0, 0), dkc);
      }
    }
  }

  // dK gets the softmax scale; keys past S and columns past E / Ev lie beyond the extents.
  for (ushort i = 0; i < dkc.get_capacity(); ++i) {
    if (dkc.is_valid_element(i)) dkc[i] *= bp.scale;
  }
  const int Hkv = p.Hq / p.group;
  const int ld_k = attn_varlen ? Hkv * p.E : p.E;  // dk, dv: contiguous (backward.h)
  const int ld_v = attn_varlen ? Hkv * p.Ev : p.Ev;
  dkc.store(attn_tensor_out<T>(dk + attn_bwd_grad_at(zb, sq.k0, Hkv, p.S, hk, key0, p.E),
                               dextents<int32_t, 2>(p.E, keys), array<int32_t, 2>({1, ld_k})));
  dvc.store(attn_tensor_out<T>(dv + attn_bwd_grad_at(zb, sq.k0, Hkv, p.S, hk, key0, p.Ev),
                               dextents<int32_t, 2>(p.Ev, keys), array<int32_t, 2>({1, ld_v})));
}

// The dQ block: query rows row0 .. row0 + BQ of head tg.y of (batch entry | sequence) tg.z.
// `ds_mem` holds BQ x BK elements, `stats` 3 * BQ floats.
template <typename T, short D, typename Index = AttnTensorIndex>
inline void attention_bwd_tensor_dq_block(const device T* q, const device T* k, const device T* v,
                                          const device uchar* mask, const device T* grad_out,
                                          const device float* lse, const device float* delta,
                                          device T* dq, const device int* cu_q,
                                          const device int* cu_k, constant AttnBackwardParams& bp,
                                          threadgroup T* ds_mem, threadgroup float* stats,
                                          uint3 tg, ushort thread_index) {
  using A = AttnTensor<T, D, D>;
  using View = typename A::View;
  constant AttnParams& p = bp.fwd;
  const int row0 = int(tg.x) * A::BQ;
  const int h = int(tg.y);
  const int zb = int(tg.z);
  const AttnBwdSeq sq = attn_bwd_seq(bp, cu_q, cu_k, zb);
  const AttnExtent ext = sq.ext;
  if (attn_varlen && row0 >= ext.L) return;  // past the sequence: uniform, before any operation
  const int hk = h / p.group;
  const int rows = ext.L - row0;
  const device T* k_h = k + sq.k + hk * p.k_hs;
  const device T* v_h = v + sq.v + hk * p.v_hs;

  typename A::ScoreOp score_op;
  typename A::OutOp acc_op;
  typename A::QIn qc;
  typename A::QIn gc;
  qc.load(View(q + sq.q + h * p.q_hs + row0 * p.q_rs, dextents<int32_t, 2>(p.E, rows),
               array<int32_t, 2>({1, int32_t(p.q_rs)})));
  gc.load(View(grad_out + sq.g + h * bp.g_hs + row0 * bp.g_rs, dextents<int32_t, 2>(p.Ev, rows),
               array<int32_t, 2>({1, int32_t(bp.g_rs)})));
  typename A::Out dqc;
  for (ushort i = 0; i < dqc.get_capacity(); ++i) dqc[i] = 0.0f;

  // The block's rows' lse, delta and 1 / normaliser (-inf and 0 past L).
  threadgroup float* lse_s = stats;
  threadgroup float* delta_s = stats + A::BQ;
  threadgroup float* norm_s = stats + 2 * A::BQ;
  const steel_i64 stat_h = sq.rows + steel_i64(h) * p.L + row0;
  for (int i = thread_index; i < 3 * A::BQ; i += 32 * A::kSimdgroups) {
    const int r = i % A::BQ;
    const bool in = r < rows;
    if (i < A::BQ) {
      lse_s[r] = in ? lse[stat_h + r] : -INFINITY;
    } else if (i < 2 * A::BQ) {
      delta_s[r] = in ? delta[stat_h + r] : 0.0f;
    } else {
      norm_s[r] = in ? delta[attn_rows(bp) + stat_h + r] : 0.0f;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const int last_row = min(row0 + int(A::BQ), ext.L) - 1;
  int t_begin, t_end;
  attn_key_tiles(p, ext, row0, last_row, A::BK, t_begin, t_end);
  const typename A::PTile ds_tile(ds_mem, extents<int32_t, A::BK, A::BQ>());
  const steel_i64 mask_h = sq.m + h * p.m_hs;
  const uint bh = uint(zb) * uint(p.Hq) + uint(h);
  const bool whole_e = attn_align_e && attn_align_ev;
  for (int t = t_begin; t < t_end; ++t) {
    const int key0 = t * A::BK;
    const int keys = ext.S - key0;
    const bool whole = whole_e && keys >= A::BK;  // uniform: static slices need no edge checks
    const bool edge = attn_edge_tile(p, ext, row0, last_row, key0, A::BK);
    const View tk(k_h + key0 * p.k_rs, dextents<int32_t, 2>(p.E, keys),
                  array<int32_t, 2>({1, int32_t(p.k_rs)}));
    const View tv(v_h + key0 * p.v_rs, dextents<int32_t, 2>(p.Ev, keys),
                  array<int32_t, 2>({1, int32_t(p.v_rs)}));

    // S = Q K^T, dP = dO V^T, then dS = P (dP o Z - delta) times the softcap slope into dp.
    typename A::Scores s;
    typename A::Scores dp;
    if (whole) {
      score_op.run(qc, tk.template slice<D, A::BK>(0, 0), s);
      score_op.run(gc, tv.template slice<D, A::BK>(0, 0), dp);
    } else {
      score_op.run(qc, tk.slice(0, 0), s);
      score_op.run(gc, tv.slice(0, 0), dp);
    }
    for (ushort i = 0; i < s.get_capacity(); ++i) {
      if (!s.is_valid_element(i)) continue;
      const auto at = Index::at(s, i, thread_index);
      const int r = at[1];
      const int row = row0 + r;
      const int key = key0 + at[0];
      float th = 0.0f;
      const float x = attn_score<T>(s[i] * p.q_scale, p, ext, row, key, r < rows, mask,
                                    mask_h + row * p.m_rs + key * p.m_cs, edge, th);
      const float pv = attn_probability(x, lse_s[r]) * norm_s[r];
      const float z = attn_dropout ? attn_dropout_one(p, bh, row, key) : 1.0f;
      const float slope = attn_softcap ? 1.0f - th * th : 1.0f;
      dp[i] = pv * (dp[i] * z - delta_s[r]) * slope;
    }

    // dS to threadgroup memory once the previous tile's dQ += dS K has read it, then dQ += dS K.
    if (t > t_begin) threadgroup_barrier(mem_flags::mem_threadgroup);
    dp.store(ds_tile);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (whole) {
      acc_op.run(ds_tile, tk.template slice<D, A::BK>(0, 0), dqc);
    } else {
      acc_op.run(ds_tile, tk.slice(0, 0), dqc);
    }
  }

  // dQ gets the softmax scale; rows past L and columns past E lie beyond the extents.
  for (ushort i = 0; i < dqc.get_capacity(); ++i) {
    if (dqc.is_valid_element(i)) dqc[i] *= bp.scale;
  }
  dqc.store(attn_tensor_out<T>(dq + attn_bwd_grad_at(zb, sq.q0, p.Hq, p.L, h, row0, p.E),
                               dextents<int32_t, 2>(p.E, rows),
                               array<int32_t, 2>({1, attn_varlen ? p.Hq * p.E : p.E})));
}

}  // namespace steel
