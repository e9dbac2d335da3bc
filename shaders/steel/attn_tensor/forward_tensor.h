// The attention prefill forward on Metal 4's matrix units (M5's neural accelerators): the same
// work and semantics as the simdgroup-matrix kernel (../attn/forward.h), one threadgroup per
// block of BQ query rows of one (batch entry or sequence, head), with S = Q K^T and O += P V
// formed by mpp::tensor_ops::matmul2d over the whole threadgroup (execution_simdgroups<N>).
//
// What changes against forward.h:
//   - Q is loaded once into the left-input cooperative tensor of the S = Q K^T operation; K and
//     V are MSL 4 tensors over device memory that the operations read themselves (no tile
//     loader, no K/V staging). A key tile inside S (and a head dim equal to the kernel's) is a
//     static-extent slice; the ragged last tile, or a smaller head dim, is a dynamic slice,
//     which the operation edge-checks (zeros past S and past E / Ev);
//   - scores are scaled after the product (q_scale: scale times the score unit, or 1 /
//     softcap), then go through score.h's attn_score element by element, visited with the
//     cooperative tensor index API: the element-to-thread layout is the driver's and differs
//     between GPU generations, so nothing here assumes one;
//   - the online softmax (OnlineSoftmaxTensor below) keeps each row's running max and sum in
//     row-reduction cooperative tensors of the score tile's role, with reduce_rows for the
//     tile's max and sum and map_iterator to find a score's row;
//   - P leaves the score tile's layout through threadgroup memory (a BQ x BK tile in the
//     inputs' dtype, the left operand of O += P V), and so do the per-row factors that the
//     output accumulator (the destination of another operation, so another layout) needs: the
//     correction exp(m - m') each tile, 1 / l at the end.
// Causal / window culling, edge tiles, masks, sinks, softcap, GQA, batch and varlen offsets,
// dropout and the lse are forward.h's, through its helpers.
// Barriers: three per key tile (before P and the row factors are overwritten, after they are
// stored; the operations order no memory), two more at the end.
#pragma once

#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>

#include "../params.h"
#include "../attn/forward.h"

using namespace metal;

namespace steel {

template <typename T>
using attn_tensor_view = tensor<const device T, dextents<int32_t, 2>, tensor_inline>;

// A view of `rows` rows of `cols` elements from `at`, one every `rs` elements (dimension 0 is
// the column): the operations' device operands and the blocks' cooperative-tensor loads.
template <typename T>
inline attn_tensor_view<T> attn_tensor_rows(const device T* at, int cols, int rows, steel_i64 rs) {
  return attn_tensor_view<T>(at, dextents<int32_t, 2>(cols, rows),
                             array<int32_t, 2>({1, int32_t(rs)}));
}

// op.run(left, the first R rows of C columns of `right`, dest), through a static-extent slice
// when `whole` (a full tile at the kernel's head dim: no edge checks) and a dynamic one, which
// the operation edge-checks (zeros past the view's extents), otherwise. `whole` is uniform.
template <short C, short R, typename Op, typename Left, typename T, typename Dest>
inline void attn_tensor_run(thread const Op& op, thread const Left& left,
                            thread const attn_tensor_view<T>& right, thread Dest& dest,
                            bool whole) {
  if (whole) {
    op.run(left, right.template slice<C, R>(0, 0), dest);
  } else {
    op.run(left, right.slice(0, 0), dest);
  }
}

// The two operations of a (T, DE, DV) kernel of ROWS rows a block and the cooperative tensors
// they define (the prefill's ROWS is STEEL_ATTN_TENSOR_BQ query rows; the backward's dK/dV
// blocks hold keys, params.h's steel_attn_tensor_bwd_keys).
template <typename T, short DE, short DV, short ROWS = STEEL_ATTN_TENSOR_BQ>
struct AttnTensor {
  static constant constexpr int BQ = ROWS;
  static constant constexpr int BK = STEEL_ATTN_TENSOR_BK;
  static constant constexpr int kSimdgroups = STEEL_ATTN_TENSOR_SIMDGROUPS;
  using Scope = execution_simdgroups<kSimdgroups>;
  using View = attn_tensor_view<T>;

  // S (BQ x BK) = Q (BQ x DE) K^T: K lies as BK rows of DE, so the right operand is transposed.
  using ScoreOp = mpp::tensor_ops::matmul2d<
      mpp::tensor_ops::matmul2d_descriptor(BQ, BK, DE, false, true, false,
                                           mpp::tensor_ops::matmul2d_descriptor::mode::multiply),
      Scope>;
  // O (BQ x DV) += P (BQ x BK) V (BK x DV).
  using OutOp = mpp::tensor_ops::matmul2d<
      mpp::tensor_ops::matmul2d_descriptor(
          BQ, DV, BK, false, false, false,
          mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate),
      Scope>;

  using Scores = decltype(ScoreOp().template get_destination_cooperative_tensor<View, View, float>());
  using Rows = decltype(
      ScoreOp().template get_row_reduction_destination_cooperative_tensor<View, View, float>());
  using QIn = decltype(ScoreOp().template get_left_input_cooperative_tensor<View, View, T>());
  using Out = decltype(OutOp().template get_destination_cooperative_tensor<View, View, float>());

  // P's tile and the per-row factors in threadgroup memory.
  using PTile = tensor<threadgroup T, extents<int32_t, BK, BQ>, tensor_inline>;
  using RowTile = tensor<threadgroup float, extents<int32_t, BQ>, tensor_inline>;
};

// The running max m and sum l of every row of the block (score units, see score.h), held in
// row-reduction cooperative tensors of the score tile: after each tile
//   m' = max(m, max_j s_j); p_j = exp(s_j - m'); l' = l * exp(m - m') + sum_j p_j,
// with 0 in place of m' while a row has seen only hidden keys (m' = -inf), as OnlineSoftmax.
template <typename T, short DE, short DV>
struct OnlineSoftmaxTensor {
  using A = AttnTensor<T, DE, DV>;
  typename A::Rows m;
  typename A::Rows l;

  // A sink logit (already in score units) is a key with no value: it starts every row.
  void init(bool has_sink, float sink) {
    for (ushort i = 0; i < m.get_capacity(); ++i) {
      m[i] = has_sink ? sink : -INFINITY;
      l[i] = has_sink ? 1.0f : 0.0f;
    }
  }

  // Turns the scores of `s` into probabilities relative to the new row max; leaves each row's
  // correction factor for the output in `factor`. Every thread of the scope calls it.
  void update(thread typename A::Scores& s, thread typename A::Rows& factor) {
    typename A::Rows shift;
    reduce_rows(s, shift, mpp::tensor_ops::reduction_operation::max, -INFINITY);
    for (ushort i = 0; i < m.get_capacity(); ++i) {
      if (!m.is_valid_element(i)) continue;
      const float m_new = max(m[i], shift[i]);
      const float sub = m_new == -INFINITY ? 0.0f : m_new;
      factor[i] = exp2((m[i] - sub) * attn_exp_unit);
      m[i] = m_new;
      shift[i] = sub;
    }
    for (auto it = s.begin(); it != s.end(); ++it) {
      *it = exp2((*it - *shift.map_iterator(it)) * attn_exp_unit);
    }
    typename A::Rows sum;
    reduce_rows(s, sum, mpp::tensor_ops::reduction_operation::sum, 0.0f);
    for (ushort i = 0; i < l.get_capacity(); ++i) {
      if (l.is_valid_element(i)) l[i] = l[i] * factor[i] + sum[i];
    }
  }
};

// Softmax: OnlineSoftmaxTensor; a parameter so that a test can show that one assuming a layout
// fails (tests/attn/kernels/attention_tensor_layout_msl4.metal).
template <typename T, short DE, short DV, typename Softmax = OnlineSoftmaxTensor<T, DE, DV>>
inline void attention_tensor_block(const device T* q, const device T* k, const device T* v,
                                   const device uchar* mask, const device uchar* sinks,
                                   device T* out, device float* lse, const device int* cu_q,
                                   const device int* cu_k, constant AttnParams& p,
                                   threadgroup T* p_mem, threadgroup float* row_mem, uint3 tg) {
  using A = AttnTensor<T, DE, DV>;
  using View = typename A::View;
  const int row0 = int(tg.x) * A::BQ;
  const int h = int(tg.y);
  const int zb = int(tg.z);  // the flattened batch entry, or the sequence (varlen)

  AttnBlockSpan span;  // forward.h: the block's extent and offsets, as the simdgroup kernel's
  if (!attn_block_span(p, cu_q, cu_k, h, zb, row0, span)) return;  // before any operation
  const AttnExtent ext = span.ext;
  const int hk = h / p.group;
  // Tensor views start at the block's first row or the tile's first key, so that their int32
  // element offsets stay below BQ (BK) rows (the planner checks that those fit).
  q += span.q + h * p.q_hs + row0 * p.q_rs;
  k += span.k + hk * p.k_hs;
  v += span.v + hk * p.v_hs;
  const int rows = ext.L - row0;  // may exceed BQ: the views' edge is the extent's

  typename A::ScoreOp score_op;
  typename A::OutOp out_op;
  typename A::QIn qc;
  qc.load(attn_tensor_rows(q, p.E, rows, p.q_rs));

  Softmax sm;
  if (attn_sinks != kSteelAttnOperandNone) {
    const float sink = attn_read<T>(sinks, attn_sinks == kSteelAttnOperandF32, h);
    sm.init(true, sink / attn_unit_nats);
  } else {
    sm.init(false, 0.0f);
  }
  typename A::Out o;
  for (ushort i = 0; i < o.get_capacity(); ++i) o[i] = 0.0f;
  typename A::Rows factor;

  const int last_row = min(row0 + A::BQ, ext.L) - 1;
  int t_begin, t_end;
  attn_key_tiles(p, ext, row0, last_row, A::BK, t_begin, t_end);
  const typename A::PTile p_tile(p_mem, extents<int32_t, A::BK, A::BQ>());
  const typename A::RowTile row_tile(row_mem, extents<int32_t, A::BQ>());
  const steel_i64 mask_head = span.m + h * p.m_hs;
  const bool whole_e = attn_align_e && attn_align_ev;

  for (int t = t_begin; t < t_end; ++t) {
    const int key0 = t * A::BK;
    const int keys = ext.S - key0;
    const bool whole = whole_e && keys >= A::BK;  // uniform: static slices need no edge checks
    const bool edge = attn_edge_tile(p, ext, row0, last_row, key0, A::BK);
    const View tk = attn_tensor_rows(k + key0 * p.k_rs, p.E, keys, p.k_rs);
    const View tv = attn_tensor_rows(v + key0 * p.v_rs, p.Ev, keys, p.v_rs);

    // S = Q K^T.
    typename A::Scores s;
    attn_tensor_run<DE, A::BK>(score_op, qc, tk, s, whole);
    for (ushort i = 0; i < s.get_capacity(); ++i) {
      if (!s.is_valid_element(i)) continue;
      const auto at = s.get_multidimensional_index(i);
      const int row = row0 + at[1];
      const int key = key0 + at[0];
      float tanh_unused = 0.0f;
      s[i] = attn_score<T>(s[i] * p.q_scale, p, ext, row, key, row < ext.L, mask,
                           mask_head + row * p.m_rs + key * p.m_cs, edge, tanh_unused);
    }
    sm.update(s, factor);
    if (attn_dropout) {  // weights are dropped after the softmax: l keeps the undropped sum
      const uint bh = uint(zb) * uint(p.Hq) + uint(h);
      for (ushort i = 0; i < s.get_capacity(); ++i) {
        if (!s.is_valid_element(i)) continue;
        const auto at = s.get_multidimensional_index(i);
        s[i] *= attn_dropout_one(p, bh, row0 + at[1], key0 + at[0]);
      }
    }

    // P and the corrections to threadgroup memory, once the previous tile's O += P V and
    // rescale have read them.
    if (t > t_begin) threadgroup_barrier(mem_flags::mem_threadgroup);
    s.store(p_tile);
    factor.store(row_tile);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (ushort i = 0; i < o.get_capacity(); ++i) {
      if (o.is_valid_element(i)) o[i] *= row_mem[o.get_multidimensional_index(i)[1]];
    }

    // O += P V.
    attn_tensor_run<DV, A::BK>(out_op, p_tile, tv, o, whole);
  }

  // 1 / l per row (0 for a row that saw nothing), through threadgroup memory to O's layout.
  for (ushort i = 0; i < factor.get_capacity(); ++i) {
    if (factor.is_valid_element(i)) factor[i] = sm.l[i] == 0.0f ? 0.0f : 1.0f / sm.l[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  factor.store(row_tile);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (ushort i = 0; i < o.get_capacity(); ++i) {
    if (o.is_valid_element(i)) o[i] *= row_mem[o.get_multidimensional_index(i)[1]];
  }
  // Rows past L and columns past Ev lie beyond the dynamic extents: not stored.
  o.store(tensor<device T, dextents<int32_t, 2>, tensor_inline>(
      out + span.o + h * p.o_hs + row0 * p.o_rs, dextents<int32_t, 2>(p.Ev, rows),
      array<int32_t, 2>({1, int32_t(p.o_rs)})));

  // The log-sum-exp in nats: -inf for a row that saw nothing.
  if (!attn_lse) return;
  for (ushort i = 0; i < factor.get_capacity(); ++i) {
    if (!factor.is_valid_element(i)) continue;
    factor[i] = sm.l[i] == 0.0f ? -INFINITY : sm.m[i] * attn_unit_nats + log(sm.l[i]);
  }
  factor.store(tensor<device float, dextents<int32_t, 1>, tensor_inline>(
      lse + span.lse + row0, dextents<int32_t, 1>(rows)));
}

}  // namespace steel
