// The vector decode kernel: decode.h's launch (grid, GQA packing, split-K partials, dense,
// varlen and paged addressing, quantized K/V: AttnDecodeBlock and AttnDecodeParams) with no MMA.
// With one token per query head a GQA-packed block of decode.h holds group x L real rows of its
// 32, and its 8x8 MMAs run on all 32: 4 in 32 real at GQA 4, 1 in 32 at MHA. Here each
// simdgroup owns up to kRows packed rows (head h0 + g, query row i0 + i, as decode.h packs
// them) and the threadgroup's STEEL_ATTN_DECODE_VECTOR_ROWS rows share every K and V tile, still
// staged once per KV head in threadgroup memory by the shared tile loader (the dequantizing one
// for quantized K/V), so the device bytes are decode.h's.
//   - lane c holds dims c, c + 32, ... of its rows' q (prescaled, fp32) and o accumulators;
//   - a key's score is one simd_sum of the lanes' partial dots; lane j keeps key j's score of
//     the tile (BK <= 32), so the transforms (score.h), the tile max and sum are one lane per
//     key, and the online softmax's max correction is a simd_max across the lanes;
//   - o += p_j V_j reads p_j from lane j by a shuffle and V_j's row from the tile.
// Rows beyond the packed ones (simdgroups without a row) load tiles and compute nothing.
#pragma once

#include <metal_stdlib>

#include "../params.h"
#include "decode.h"

using namespace metal;

namespace steel {

template <typename T, short DE, short DV>
struct AttnDecodeVector {
  using A = AttnForward<T, DE, DV>;
  static constant constexpr short kRows = STEEL_ATTN_DECODE_VECTOR_ROWS / STEEL_ATTN_SIMDGROUPS;
  static constant constexpr short QE = (DE + 31) / 32;  // q elements per lane and row
  static constant constexpr short QV = (DV + 31) / 32;  // o elements per lane and row
  static_assert(A::BK <= 32, "one key of the tile per lane");
};

template <typename T, short DE, short DV>
inline void attention_decode_vector_block(
    const device T* q, const device T* k, const device T* v, const device uchar* mask,
    const device uchar* sinks, device T* out, device float* lse, const device int* cu_q,
    const device int* cu_k, const device int* table, const device int* seqused,
    device float* part_o, device float* part_ml, AttnQuantBuffers qb,
    constant AttnDecodeParams& dp, threadgroup T* smem, uint3 tg, ushort simdgroup,
    ushort lane) {
  using A = AttnForward<T, DE, DV>;
  using V = AttnDecodeVector<T, DE, DV>;
  constant AttnParams& p = dp.fwd;
  AttnDecodeBlock<T, DE, DV> b;
  if (!b.init(k, v, cu_q, cu_k, table, seqused, qb, dp, tg)) return;
  const int i0 = b.i0, last_row = b.last_row, split = b.split, zb = b.zb, h0 = b.h0;
  const AttnDecodeQueries xq = b.xq;
  const AttnExtent ext = b.ext;

  // This simdgroup's rows: packed row r = simdgroup + 4 * n. A row that is not real keeps a
  // head and query row of the block for its addresses and reads nothing through them.
  int rh[V::kRows], ri[V::kRows];
  bool rok[V::kRows];
  float qv[V::kRows][V::QE], ov[V::kRows][V::QV];
  OnlineSoftmax sm[V::kRows];
  const short E = short(p.E), Ev = short(p.Ev);
  // Split partitions leave the sink to the merge, which must count it once.
  const bool sink_here = attn_sinks != kSteelAttnOperandNone && !attn_split;
  for (short n = 0; n < V::kRows; ++n) {
    const int r = simdgroup + STEEL_ATTN_SIMDGROUPS * n;
    const int g = r / dp.row_block;
    rok[n] = g < dp.heads_per_tg && i0 + r - g * dp.row_block <= last_row;
    ri[n] = min(i0 + r - g * dp.row_block, last_row);
    rh[n] = h0 + min(g, dp.heads_per_tg - 1);
    const device T* qrow = q + xq.q_off + rh[n] * p.q_hs + ri[n] * p.q_rs;
    for (short c = 0; c < V::QE; ++c) {
      const int d = c * 32 + lane;
      qv[n][c] = rok[n] && d < E ? float(qrow[d]) * p.q_scale : 0.0f;
    }
    for (short c = 0; c < V::QV; ++c) ov[n][c] = 0.0f;
    if (sink_here) {
      const float sink = attn_read<T>(sinks, attn_sinks == kSteelAttnOperandF32, rh[n]);
      sm[n].init(true, sink / attn_unit_nats);
    } else {
      sm[n].init(false, 0.0f);
    }
  }

  int t_begin, t_end;
  attn_key_tiles(p, ext, i0, last_row, A::BK, t_begin, t_end);
  const int tiles_per_split = dp.split_keys / A::BK;
  t_begin = max(t_begin, split * tiles_per_split);
  t_end = max(t_begin, min(t_end, (split + 1) * tiles_per_split));

  threadgroup T* Ks = smem;
  threadgroup T* Vs = A::kShared ? smem : smem + A::kKElems;
  const ushort thread_index = simdgroup * 32 + lane;
  const steel_i64 m_cs = attn_mask != kSteelAttnMaskNone ? p.m_cs : 0;
  for (int t = t_begin; t < t_end; ++t) {
    const int key0 = t * A::BK;
    const short valid = short(min(int(A::BK), ext.S - key0));
    const bool whole = attn_align_s || valid == A::BK;
    const bool edge = attn_edge_tile(p, ext, i0, last_row, key0, A::BK);

    if (t > t_begin) threadgroup_barrier(mem_flags::mem_threadgroup);
    b.load_k(Ks, key0, valid, E, whole, thread_index);
    if (!A::kShared && !A::alias()) b.load_v(Vs, key0, valid, Ev, whole, thread_index);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Scores: lane j ends with key key0 + j's score of each row (-inf past the tile).
    float s[V::kRows];
    const int key = key0 + lane;
    for (short n = 0; n < V::kRows; ++n) {
      s[n] = -INFINITY;
      if (!rok[n]) continue;  // uniform over the simdgroup
      // Key j's row from this lane's first dim. A bound only where the head dim is not whole
      // 32-lane chunks (compile time), and a select, not a branch, for the lane that keeps it.
      const threadgroup T* kj = Ks + lane;
      for (short j = 0; j < A::BK; ++j, kj += A::kLdK) {
        float dot = 0.0f;
        for (short c = 0; c < V::QE; ++c) {
          if (DE % 32 == 0 || c * 32 + int(lane) < DE) dot += qv[n][c] * float(kj[c * 32]);
        }
        dot = simd_sum(dot);
        s[n] = short(lane) == j ? dot : s[n];
      }
      if (lane < A::BK) {
        const steel_i64 mask_row = b.m_off + rh[n] * p.m_hs + ri[n] * p.m_rs;
        float th = 0.0f;
        s[n] = attn_score<T>(s[n], p, ext, ri[n], key, true, mask, mask_row + key * m_cs, edge,
                             th);
      }
      // The online softmax across the tile's lanes: m' = max(m, max_j s_j).
      const float m_new = max(sm[n].m, simd_max(s[n]));
      const float shift = m_new == -INFINITY ? 0.0f : m_new;
      const float factor = exp2((sm[n].m - shift) * attn_exp_unit);
      s[n] = exp2((s[n] - shift) * attn_exp_unit);
      sm[n].l = sm[n].l * factor + simd_sum(s[n]);
      sm[n].m = m_new;
      for (short c = 0; c < V::QV; ++c) ov[n][c] *= factor;
    }

    if (A::kShared && !A::alias()) {  // V takes K's place once every simdgroup has its scores
      threadgroup_barrier(mem_flags::mem_threadgroup);
      b.load_v(Vs, key0, valid, Ev, whole, thread_index);
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    const threadgroup T* Vt = A::alias() ? Ks : Vs;
    const short ldv = A::alias() ? A::kLdK : A::kLdV;
    for (short n = 0; n < V::kRows; ++n) {
      if (!rok[n]) continue;
      const threadgroup T* vj = Vt + lane;
      for (short j = 0; j < A::BK; ++j, vj += ldv) {
        const float pj = simd_shuffle(s[n], ushort(j));
        for (short c = 0; c < V::QV; ++c) {
          if (DV % 32 == 0 || c * 32 + int(lane) < DV) ov[n][c] += pj * float(vj[c * 32]);
        }
      }
    }
  }

  for (short n = 0; n < V::kRows; ++n) {
    if (!rok[n]) continue;  // no barrier follows
    const int h = rh[n], i = ri[n];
    if (attn_split) {
      const steel_i64 pr = attn_partial_row(dp, zb, h, i) + split;
      for (short c = 0; c < V::QV; ++c) {
        const int d = c * 32 + lane;
        if (d < Ev) part_o[pr * p.Ev + d] = ov[n][c];
      }
      if (lane == 0) {
        part_ml[2 * pr] = sm[n].m * attn_unit_nats;
        part_ml[2 * pr + 1] = sm[n].l;
      }
    } else {
      const float inv = sm[n].inverse_sum();
      device T* orow = out + xq.o_off + h * p.o_hs + i * p.o_rs;
      for (short c = 0; c < V::QV; ++c) {
        const int d = c * 32 + lane;
        if (d < Ev) orow[d] = T(ov[n][c] * inv);
      }
      if (attn_lse && lane == 0) lse[xq.lse_off + h * xq.lse_hs + i] = sm[n].lse();
    }
  }
}

}  // namespace steel

// The kernel (host names and instantiations in decode_vector.metal).
template <typename T, short DE, short DV>
[[kernel]] void steel_attention_decode_vector(
    const device T* q [[buffer(STEEL_ATTN_BUF_Q)]],
    const device T* k [[buffer(STEEL_ATTN_BUF_K)]],
    const device T* v [[buffer(STEEL_ATTN_BUF_V)]],
    const device uchar* mask [[buffer(STEEL_ATTN_BUF_MASK)]],
    const device uchar* sinks [[buffer(STEEL_ATTN_BUF_SINKS)]],
    device T* out [[buffer(STEEL_ATTN_BUF_OUT)]],
    device float* lse [[buffer(STEEL_ATTN_BUF_LSE)]],
    constant AttnDecodeParams& params [[buffer(STEEL_ATTN_BUF_PARAMS)]],
    const device int* cu_q [[buffer(STEEL_ATTN_BUF_CU_Q), function_constant(attn_varlen)]],
    const device int* cu_k [[buffer(STEEL_ATTN_BUF_CU_K), function_constant(attn_varlen)]],
    const device int* table [[buffer(STEEL_ATTN_BUF_TABLE), function_constant(attn_paged)]],
    const device int* seqused [[buffer(STEEL_ATTN_BUF_SEQUSED), function_constant(attn_paged)]],
    device float* part_o [[buffer(STEEL_ATTN_BUF_PART_O), function_constant(attn_split)]],
    device float* part_ml [[buffer(STEEL_ATTN_BUF_PART_ML), function_constant(attn_split)]],
    const device uchar* k_scales [[buffer(STEEL_ATTN_BUF_K_SCALES), function_constant(attn_quant)]],
    const device uchar* k_mins [[buffer(STEEL_ATTN_BUF_K_MINS), function_constant(attn_quant)]],
    const device uchar* v_scales [[buffer(STEEL_ATTN_BUF_V_SCALES), function_constant(attn_quant)]],
    const device uchar* v_mins [[buffer(STEEL_ATTN_BUF_V_MINS), function_constant(attn_quant)]],
    constant AttnQuantParams* qparams [[buffer(STEEL_ATTN_BUF_QUANT_PARAMS),
                                        function_constant(attn_quant)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort simdgroup [[simdgroup_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]]) {
  threadgroup T smem[steel::AttnForward<T, DE, DV>::kTileElems];
  const steel::AttnQuantBuffers qb = {k_scales, k_mins, v_scales, v_mins, qparams};
  steel::attention_decode_vector_block<T, DE, DV>(q, k, v, mask, sinks, out, lse, cu_q, cu_k,
                                                  table, seqused, part_o, part_ml, qb, params,
                                                  smem, tg, simdgroup, lane);
}
