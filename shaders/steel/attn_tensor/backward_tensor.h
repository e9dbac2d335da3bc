// The attention backward on Metal 4's matrix units (M5's neural accelerators): the dK/dV, dQ and
// dmask kernels of ../attn/backward.h, with every product formed by mpp::tensor_ops::matmul2d
// over the whole threadgroup (execution_simdgroups<N>), for the forward's (D, D) head-dim pairs
// (forward_tensor.h). Every product has the shape of one of the forward's two operations, so
// the kernels use AttnTensor<T, D, D>'s ScoreOp (rows x BK over D, right operand transposed)
// and OutOp (rows x D += rows x BK times BK x D):
//
//   dK/dV: a threadgroup owns steel_attn_tensor_bwd_keys(D) keys (64, or 32 above D = 128,
//     params.h says why) of one (batch entry or sequence, KV head), their K and V in
//     left-input cooperative tensors and dK, dV in destination ones, and streams tiles of
//     BK = 32 query rows of every query head of the group (GQA summed in registers):
//       S^T = K Q^T and dP^T = V dO^T (ScoreOp, Q and dO read from device memory);
//       P^T = exp(S^T - lse), dS^T = P^T o (dP^T o Z - delta) times the softcap slope;
//       dV += (P o Z)^T dO and dK += dS^T Q (OutOp, the left operands through threadgroup
//       memory in the inputs' dtype, as the forward's P).
//   dQ: a threadgroup owns BQ = 64 query rows (as the forward), Q and dO in left-input
//     cooperative tensors (AttnTensorBwdRows), dQ in a destination one, and streams key tiles
//     of BK = 32: S = Q K^T, dP = dO V^T, P, dS as above, dQ += dS K.
//   dmask (a float attn_mask that requires grad): the dQ kernel's rows and key tiles, dS
//     without the softcap slope (the mask is added after the softcap), summed in fp32 into a
//     score-tile cooperative tensor over the (batch, head) pairs, row blocks and key tiles
//     the mask broadcasts over; then through threadgroup memory over the tile's broadcast rows
//     or keys, in a fixed order, and stored in the mask's shape and dtype.
//
// S and dP are destinations of one operation type, so slot i of the two is the same element
// (and of every tile's: dmask sums slot by slot); every other element is reached through the
// cooperative tensor index API (the layout is the driver's and differs between GPU
// generations). The rows' lse, delta and 1 / normaliser are staged in threadgroup memory once
// per tile (dK/dV) or block (dQ, dmask). The delta pre-pass, the dsinks kernel, the score
// transforms (score.h), the dropout generator (dropout.h), the causal / window bounds, the
// varlen offsets, dmask's broadcast pairs and the stores' scale are backward.h's.
// Barriers: dK/dV three per query tile (before the stats and tiles are overwritten, after the
// stats, after the tiles), dQ two per key tile and one after the stats, dmask two per row block
// and one before the sums. No atomics.
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

constant constexpr int kAttnTensorThreads = 32 * STEEL_ATTN_TENSOR_SIMDGROUPS;

// Where slot i of a cooperative tensor lies ([0] column, [1] row): the index API. A parameter of
// the blocks so that a test can show that an index assuming a layout fails
// (tests/attn/kernels/attention_bwd_tensor_layout_msl4.metal).
struct AttnTensorIndex {
  template <typename Coop>
  static array<int, 2> at(thread const Coop& c, ushort i, ushort) {
    return c.get_multidimensional_index(i);
  }
};

// The lse, delta and 1 / normaliser of n rows into stats[0, n), [n, 2n), [2n, 3n) (-inf and 0
// past `valid`): `at` is the first row's index in lse and delta, `planes` the offset of delta's
// second plane (attn_rows). Every thread calls it; the caller puts a barrier after.
inline void attn_tensor_stage_stats(threadgroup float* stats, int n, int valid,
                                    const device float* lse, const device float* delta,
                                    steel_i64 at, steel_i64 planes, ushort thread_index) {
  for (int i = thread_index; i < 3 * n; i += kAttnTensorThreads) {
    const int r = i % n;
    const bool in = r < valid;
    if (i < n) {
      stats[i] = in ? lse[at + r] : -INFINITY;
    } else if (i < 2 * n) {
      stats[i] = in ? delta[at + r] : 0.0f;
    } else {
      stats[i] = in ? delta[planes + at + r] : 0.0f;
    }
  }
}

// One score's share of the backward, from its raw product qk = q.k and dp = dO.v at (row, key):
// P o Z, what dV sees, and dS = P (dP o Z - delta), times the softcap's slope 1 - tanh^2 when
// `slope` (dQ and dK take it; dmask does not: the additive mask is added after the softcap).
// P is recomputed as the forward's, from the row's lse and 1 / normaliser; 0 on rows not `row_ok`.
struct AttnBwdScore {
  float pz;
  float ds;
};

template <typename T>
inline AttnBwdScore attn_tensor_bwd_score(float qk, float dp, constant AttnParams& p,
                                          AttnExtent ext, int row, int key, bool row_ok,
                                          const device uchar* mask, steel_i64 mask_h, bool edge,
                                          float lse, float delta, float norm, uint bh,
                                          bool slope) {
  float th = 0.0f;
  const float s = attn_score<T>(qk * p.q_scale, p, ext, row, key, row_ok, mask,
                                mask_h + row * p.m_rs + key * p.m_cs, edge, th);
  const float pv = row_ok ? attn_probability(s, lse) * norm : 0.0f;
  const float z = attn_dropout ? attn_dropout_one(p, bh, row, key) : 1.0f;
  const float sl = attn_softcap && slope ? 1.0f - th * th : 1.0f;
  return {pv * z, pv * (dp * z - delta) * sl};
}

// The query rows row0 .. row0 + BQ of head h that a dQ or dmask block owns: Q and dO in
// left-input cooperative tensors, the rows' statistics in `stats` (3 * BQ floats), and the dS
// tile of each key tile they meet.
template <typename T, short D>
struct AttnTensorBwdRows {
  using A = AttnTensor<T, D, D>;
  typename A::QIn qc;
  typename A::QIn gc;
  threadgroup float* stats;
  int row0;
  int rows;  // rows from row0 to the extent's end (may exceed BQ: the views' edge is L)

  // Every thread calls it; the caller orders it after the last read of `stats_mem` by a
  // barrier, and puts one after.
  void load(const device T* q, const device T* grad_out, const device float* lse,
            const device float* delta, constant AttnBackwardParams& bp,
            thread const AttnBwdSeq& sq, int h, int first_row, threadgroup float* stats_mem,
            ushort thread_index) {
    constant AttnParams& p = bp.fwd;
    row0 = first_row;
    rows = sq.ext.L - row0;
    stats = stats_mem;
    qc.load(attn_tensor_rows(q + sq.q + h * p.q_hs + row0 * p.q_rs, p.E, rows, p.q_rs));
    gc.load(attn_tensor_rows(grad_out + sq.g + h * bp.g_hs + row0 * bp.g_rs, p.Ev, rows,
                             bp.g_rs));
    attn_tensor_stage_stats(stats, A::BQ, rows, lse, delta, sq.rows + steel_i64(h) * p.L + row0,
                            attn_rows(bp), thread_index);
  }

  // dS of the key tile at key0 of K and V heads `k_h`, `v_h` into `ds`: S = Q K^T, dP = dO V^T,
  // then attn_tensor_bwd_score element by element (`bh`: the dropout's batch-head index).
  template <typename Index>
  void key_tile(thread typename A::Scores& ds, const device T* k_h, const device T* v_h,
                constant AttnParams& p, AttnExtent ext, int key0, bool whole, bool edge,
                const device uchar* mask, steel_i64 mask_h, uint bh, bool slope,
                ushort thread_index) const {
    typename A::ScoreOp score_op;
    const int keys = ext.S - key0;
    typename A::Scores s;
    const typename A::View tk = attn_tensor_rows(k_h + key0 * p.k_rs, p.E, keys, p.k_rs);
    const typename A::View tv = attn_tensor_rows(v_h + key0 * p.v_rs, p.Ev, keys, p.v_rs);
    attn_tensor_run<D, A::BK>(score_op, qc, tk, s, whole);
    attn_tensor_run<D, A::BK>(score_op, gc, tv, ds, whole);
    for (ushort i = 0; i < s.get_capacity(); ++i) {
      if (!s.is_valid_element(i)) continue;
      const auto at = Index::at(s, i, thread_index);
      const int r = at[1];
      ds[i] = attn_tensor_bwd_score<T>(s[i], ds[i], p, ext, row0 + r, key0 + at[0], r < rows,
                                       mask, mask_h, edge, stats[r], stats[A::BQ + r],
                                       stats[2 * A::BQ + r], bh, slope)
                  .ds;
    }
  }
};

// The dK/dV block: keys key0 .. key0 + KB (steel_attn_tensor_bwd_keys(D)) of KV head tg.y of
// (batch entry | sequence) tg.z. `p_mem` and `ds_mem` hold KB x BK elements each, `stats`
// 3 * BK floats.
template <typename T, short D, typename Index = AttnTensorIndex>
inline void attention_bwd_tensor_dkdv_block(
    const device T* q, const device T* k, const device T* v, const device uchar* mask,
    const device T* grad_out, const device float* lse, const device float* delta, device T* dk,
    device T* dv, const device int* cu_q, const device int* cu_k, constant AttnBackwardParams& bp,
    threadgroup T* p_mem, threadgroup T* ds_mem, threadgroup float* stats, uint3 tg,
    ushort thread_index) {
  using A = AttnTensor<T, D, D, steel_attn_tensor_bwd_keys(D)>;
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
  const int keys = ext.S - key0;  // may exceed the block: the views' edge is the extent's
  const int last_key = min(key0 + int(A::BQ), ext.S) - 1;
  const bool keys_whole = keys >= A::BQ;

  typename A::ScoreOp score_op;
  typename A::OutOp acc_op;
  typename A::QIn kc;
  typename A::QIn vc;
  kc.load(attn_tensor_rows(k + sq.k + hk * p.k_hs + key0 * p.k_rs, p.E, keys, p.k_rs));
  vc.load(attn_tensor_rows(v + sq.v + hk * p.v_hs + key0 * p.v_rs, p.Ev, keys, p.v_rs));
  typename A::Out dkc;
  typename A::Out dvc;
  for (ushort i = 0; i < dkc.get_capacity(); ++i) {
    dkc[i] = 0.0f;
    dvc[i] = 0.0f;
  }

  int t_begin, t_end;
  attn_query_tiles(p, ext, key0, last_key, A::BK, t_begin, t_end);
  const typename A::PTile p_tile(p_mem, extents<int32_t, A::BK, A::BQ>());
  const typename A::PTile ds_tile(ds_mem, extents<int32_t, A::BK, A::BQ>());
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
      const bool whole = whole_e && valid == A::BK;  // uniform: static slices, no edge checks
      const bool edge = valid < A::BK || !keys_whole ||
                        attn_query_edge_tile(p, ext, key0, last_key, row0, row0 + valid - 1);

      // The tile's rows' statistics, once the previous tile's operations have read the tiles.
      if (!first) threadgroup_barrier(mem_flags::mem_threadgroup);
      first = false;
      attn_tensor_stage_stats(stats, A::BK, valid, lse, delta, stat_h + row0, attn_rows(bp),
                              thread_index);
      threadgroup_barrier(mem_flags::mem_threadgroup);

      // S^T = K Q^T and dP^T = V dO^T.
      const View tq = attn_tensor_rows(q_h + row0 * p.q_rs, p.E, rows, p.q_rs);
      const View tdo = attn_tensor_rows(g_h + row0 * bp.g_rs, p.Ev, rows, bp.g_rs);
      typename A::Scores st;
      typename A::Scores dp;
      attn_tensor_run<D, A::BK>(score_op, kc, tq, st, whole);
      attn_tensor_run<D, A::BK>(score_op, vc, tdo, dp, whole);
      // (P o Z)^T into st, dS^T into dp: S^T's column is the tile's query row.
      for (ushort i = 0; i < st.get_capacity(); ++i) {
        if (!st.is_valid_element(i)) continue;
        const auto at = Index::at(st, i, thread_index);
        const int r = at[0];
        const AttnBwdScore e = attn_tensor_bwd_score<T>(
            st[i], dp[i], p, ext, row0 + r, key0 + at[1], r < valid, mask, mask_h, edge,
            stats[r], stats[A::BK + r], stats[2 * A::BK + r], bh, true);
        st[i] = e.pz;
        dp[i] = e.ds;
      }
      st.store(p_tile);
      dp.store(ds_tile);
      threadgroup_barrier(mem_flags::mem_threadgroup);

      // dV += (P o Z)^T dO, dK += dS^T Q.
      attn_tensor_run<D, A::BK>(acc_op, p_tile, tdo, dvc, whole);
      attn_tensor_run<D, A::BK>(acc_op, ds_tile, tq, dkc, whole);
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
  constant AttnParams& p = bp.fwd;
  const int row0 = int(tg.x) * A::BQ;
  const int h = int(tg.y);
  const int zb = int(tg.z);
  const AttnBwdSeq sq = attn_bwd_seq(bp, cu_q, cu_k, zb);
  const AttnExtent ext = sq.ext;
  if (attn_varlen && row0 >= ext.L) return;  // past the sequence: uniform, before any operation
  const int hk = h / p.group;
  const device T* k_h = k + sq.k + hk * p.k_hs;
  const device T* v_h = v + sq.v + hk * p.v_hs;

  typename A::OutOp acc_op;
  AttnTensorBwdRows<T, D> rb;
  rb.load(q, grad_out, lse, delta, bp, sq, h, row0, stats, thread_index);
  typename A::Out dqc;
  for (ushort i = 0; i < dqc.get_capacity(); ++i) dqc[i] = 0.0f;
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
    const bool whole = whole_e && ext.S - key0 >= A::BK;  // uniform: static slices, no checks
    const bool edge = attn_edge_tile(p, ext, row0, last_row, key0, A::BK);
    typename A::Scores ds;
    rb.template key_tile<Index>(ds, k_h, v_h, p, ext, key0, whole, edge, mask, mask_h, bh, true,
                                thread_index);

    // dS to threadgroup memory once the previous tile's dQ += dS K has read it, then dQ += dS K.
    if (t > t_begin) threadgroup_barrier(mem_flags::mem_threadgroup);
    ds.store(ds_tile);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    attn_tensor_run<D, A::BK>(acc_op, ds_tile,
                              attn_tensor_rows(k_h + key0 * p.k_rs, p.E, ext.S - key0, p.k_rs),
                              dqc, whole);
  }

  // dQ gets the softmax scale; rows past L and columns past E lie beyond the extents.
  for (ushort i = 0; i < dqc.get_capacity(); ++i) {
    if (dqc.is_valid_element(i)) dqc[i] *= bp.scale;
  }
  dqc.store(attn_tensor_out<T>(dq + attn_bwd_grad_at(zb, sq.q0, p.Hq, p.L, h, row0, p.E),
                               dextents<int32_t, 2>(p.E, rb.rows),
                               array<int32_t, 2>({1, attn_varlen ? p.Hq * p.E : p.E})));
}

// The dmask block: BQ rows (tg.x) by BK keys (tg.y) of mask entry tg.z (one element of the batch
// and head dims dmask keeps, attn_dmask_pair), or every row block / key tile along a dim the
// mask broadcasts over (STEEL_ATTN_FC_DMASK_ROWS / _KEYS). dS of every (batch, head) pair the
// entry sums is added slot by slot into `acc` (fp32) in a fixed order; blocks that see no key
// of the owned tiles are skipped (their dS is 0). `red` holds BQ x BK floats, `stats` 3 * BQ.
// Dense launches only: varlen takes no mask.
template <typename T, short D, typename Index = AttnTensorIndex>
inline void attention_bwd_tensor_dmask_block(const device T* q, const device T* k,
                                             const device T* v, const device uchar* mask,
                                             const device T* grad_out, const device float* lse,
                                             const device float* delta, device uchar* dmask,
                                             constant AttnBackwardParams& bp,
                                             threadgroup float* red, threadgroup float* stats,
                                             uint3 tg, ushort thread_index) {
  using A = AttnTensor<T, D, D>;
  constant AttnParams& p = bp.fwd;
  const AttnExtent ext = {p.L, p.S, p.shift};
  const AttnDmaskTiles own = attn_dmask_tiles(p, tg, A::BQ, A::BK);
  const bool whole_e = attn_align_e && attn_align_ev;

  typename A::Scores acc;
  for (ushort i = 0; i < acc.get_capacity(); ++i) acc[i] = 0.0f;
  steel_i64 dm_off = 0;  // the same for every pair: the entry's digits
  bool first = true;
  for (int c = 0; c < bp.dm_combos; ++c) {
    int zb, h;
    attn_dmask_pair(bp, int(tg.z), c, zb, h, dm_off);
    const AttnBwdSeq sq = attn_bwd_seq(bp, nullptr, nullptr, zb);
    const int hk = h / p.group;
    const device T* k_h = k + sq.k + hk * p.k_hs;
    const device T* v_h = v + sq.v + hk * p.v_hs;
    const steel_i64 mask_h = sq.m + h * p.m_hs;
    const uint bh = uint(zb) * uint(p.Hq) + uint(h);
    for (int rb = own.rb_begin; rb < own.rb_end; ++rb) {
      const int row0 = rb * A::BQ;
      const int last_row = min(row0 + int(A::BQ), p.L) - 1;
      int t_begin, t_end;  // the visible tiles among the owned ones
      attn_key_tiles(p, ext, row0, last_row, A::BK, t_begin, t_end);
      t_begin = max(t_begin, own.kt_begin);
      t_end = min(t_end, own.kt_end);
      if (t_begin >= t_end) continue;  // uniform

      // The rows' statistics, once the previous block's tiles have read them.
      if (!first) threadgroup_barrier(mem_flags::mem_threadgroup);
      first = false;
      AttnTensorBwdRows<T, D> rows;
      rows.load(q, grad_out, lse, delta, bp, sq, h, row0, stats, thread_index);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int t = t_begin; t < t_end; ++t) {
        const int key0 = t * A::BK;
        const bool whole = whole_e && p.S - key0 >= A::BK;  // uniform
        const bool edge = attn_edge_tile(p, ext, row0, last_row, key0, A::BK);
        typename A::Scores ds;
        rows.template key_tile<Index>(ds, k_h, v_h, p, ext, key0, whole, edge, mask, mask_h, bh,
                                      false, thread_index);
        for (ushort i = 0; i < acc.get_capacity(); ++i) {
          if (acc.is_valid_element(i)) acc[i] += ds[i];
        }
      }
    }
  }

  // The tile to threadgroup memory (rows past L and keys past S hold 0), then each stored
  // element sums its broadcast rows and keys there in order.
  acc.store(tensor<threadgroup float, extents<int32_t, A::BK, A::BQ>, tensor_inline>(
      red, extents<int32_t, A::BK, A::BQ>()));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int row_base = attn_dmask_rows ? 0 : int(tg.x) * A::BQ;
  const int key_base = attn_dmask_keys ? 0 : int(tg.y) * A::BK;
  const int out_rows = attn_dmask_rows ? 1 : min(int(A::BQ), p.L - row_base);
  const int out_keys = attn_dmask_keys ? 1 : min(int(A::BK), p.S - key_base);
  const bool f32 = attn_mask == kSteelAttnMaskAddF32;
  for (int i = thread_index; i < out_rows * out_keys; i += kAttnTensorThreads) {
    const int r = i / out_keys;
    const int col = i % out_keys;
    const int r_end = attn_dmask_rows ? A::BQ : r + 1;
    const int c_end = attn_dmask_keys ? A::BK : col + 1;
    float x = 0.0f;
    for (int rr = attn_dmask_rows ? 0 : r; rr < r_end; ++rr) {
      for (int cc = attn_dmask_keys ? 0 : col; cc < c_end; ++cc) x += red[rr * A::BK + cc];
    }
    const steel_i64 at = dm_off + (row_base + r) * bp.dm_rs + (key_base + col) * bp.dm_cs;
    if (f32) {
      ((device float*)dmask)[at] = x;
    } else {
      ((device T*)dmask)[at] = T(x);
    }
  }
}

}  // namespace steel
