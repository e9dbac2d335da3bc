// The attention decode kernels: few query rows (L <= STEEL_ATTN_DECODE_MAX_L) against a long KV
// cache, where a prefill block would hold 1 to 8 of its 32 rows and read K and V once per query
// head. Decode is bound by reading the cache, so:
//   - GQA packing: one threadgroup serves heads_per_tg query heads of one KV head (all of the
//     group when group * L <= 32), packed as rows r = g * R + i (head h0 + g, query row i0 + i,
//     R = row_block = min(L, 32)) of the forward block's 32 rows; every K and V tile is read
//     once for all of them. Longer query sequences (a paged cache's chunked prefill) take
//     blocks of 32 rows, one head each: grid x is then splits * row blocks;
//   - split-K: with few (batch, KV head) pairs the keys are cut into `splits` partitions of
//     split_keys keys (a multiple of the key tile), one threadgroup each, grid
//     (splits, Hkv * head chunks, batch entries or sequences). Each partition leaves its rows'
//     unnormalised output and their max and sum (STEEL_ATTN_FC_SPLIT); the merge kernel combines
//     them by log-sum-exp. With one partition the kernel normalises and stores out and lse itself;
//   - the rest is the prefill's machinery unchanged: tile loader, score transforms, online
//     softmax and the MMA helpers of forward.h, with each lane's row, head, mask row and
//     diagonals its own. Tiles outside every row's causal/window reach are never visited.
// Quantized K and V (STEEL_ATTN_FC_QUANT, torch_steel.kv): the tiles are dequantized on the way
// into threadgroup memory (AttnQuantKv, forward.h); everything after the load is unchanged.
// Varlen (STEEL_ATTN_FC_VARLEN): sequences found from cu_seqlens_q and either cu_seqlens_k or,
// paged (STEEL_ATTN_FC_PAGED), seqused_k and a block table: K and V are page pools
// [pages, page_size, Hkv, D], key j of sequence b in page block_table[b, j / page_size]. Every
// offset read from the device is clamped, so bad tables give wrong keys, never reads outside.
#pragma once

#include <metal_stdlib>

#include "../fragment.h"
#include "../params.h"
#include "forward.h"
#include "loader.h"
#include "score.h"
#include "softmax.h"

using namespace metal;

constant bool attn_split [[function_constant(STEEL_ATTN_FC_SPLIT)]];
constant bool attn_paged [[function_constant(STEEL_ATTN_FC_PAGED)]];

namespace steel {

// The query side of one batch entry (dense) or sequence (varlen): its rows, and where its out
// and lse rows start. lse row i of head h is lse[lse_off + h * lse_hs + i].
struct AttnDecodeQueries {
  int L;
  steel_i64 q_off, o_off, lse_off, lse_hs;
};

inline AttnDecodeQueries attn_decode_queries(constant AttnDecodeParams& dp,
                                             const device int* cu_q, int zb) {
  constant AttnParams& p = dp.fwd;
  AttnDecodeQueries x;
  if (attn_varlen) {
    // Clamped to the token count, as the prefill does: bad offsets give wrong rows, no more.
    const int q_begin = clamp(cu_q[zb], 0, p.L);
    const int q_end = clamp(cu_q[zb + 1], q_begin, p.L);
    x.L = min(q_end - q_begin, dp.rows);  // the partials hold dp.rows rows per sequence
    x.q_off = q_begin * p.q_rs;
    x.o_off = q_begin * p.o_rs;
    x.lse_off = q_begin;  // lse is [Hq, total_q]
    x.lse_hs = p.L;
  } else {
    x.L = p.L;
    x.q_off = attn_batch_offset(p, p.q_bs, zb);
    x.o_off = zb * p.o_bs;
    x.lse_off = steel_i64(zb) * p.Hq * p.L;
    x.lse_hs = p.L;
  }
  return x;
}

// The first partial row of (zb, h, i): partitions follow it.
inline steel_i64 attn_partial_row(constant AttnDecodeParams& dp, int zb, int h, int i) {
  return ((steel_i64(zb) * dp.fwd.Hq + h) * dp.rows + i) * dp.splits;
}

// Where one decode threadgroup's work lies, for decode.h's MMA block and decode_vector.h's alike:
// its key partition, its packed heads and first query row, the sequence's extent and mask
// offset, and K and V (dense, varlen or paged; in the compute dtype or quantized, then codes
// and scales found the same way). load_k / load_v stage one key tile through the tile loader or
// the dequantizing one.
template <typename T, short DE, short DV>
struct AttnDecodeBlock {
  using A = AttnForward<T, DE, DV>;
  int split, i0, hk, h0, zb, last_row;
  AttnDecodeQueries xq;
  AttnExtent ext;
  steel_i64 m_off;
  AttnKvRows k_rows, v_rows;
  int2 lane_slot;  // paged: the page and slot of row `lane` of the tile load_k loaded last
  const device T* k;
  const device T* v;
  AttnQuantKv kq, vq;

  // False for a block past the sequence's query rows (or a sequence without any): nothing to
  // compute or merge. Uniform over the threadgroup, so callers return before any barrier.
  bool init(const device T* k_in, const device T* v_in, const device int* cu_q,
            const device int* cu_k, const device int* table, const device int* seqused,
            AttnQuantBuffers qb, constant AttnDecodeParams& dp, uint3 tg) {
    constant AttnParams& p = dp.fwd;
    split = int(tg.x) % dp.splits;
    i0 = (int(tg.x) / dp.splits) * dp.row_block;  // the block's first query row
    const int chunks = p.group / dp.heads_per_tg;
    hk = int(tg.y) / chunks;
    h0 = hk * p.group + (int(tg.y) % chunks) * dp.heads_per_tg;
    zb = int(tg.z);
    xq = attn_decode_queries(dp, cu_q, zb);
    ext = {xq.L, p.S, p.shift};
    steel_i64 k_off = 0, v_off = 0;
    m_off = 0;
    k_rows = attn_dense_rows(p.k_rs);
    v_rows = attn_dense_rows(p.v_rs);
    // Quantized K and V: their scales' element offsets and rows, beside the codes' (in bytes).
    steel_i64 ks_off = 0, vs_off = 0;
    AttnKvRows ks_rows = attn_dense_rows(attn_quant ? qb.qp->k_rs : 0);
    AttnKvRows vs_rows = attn_dense_rows(attn_quant ? qb.qp->v_rs : 0);
    if (attn_paged) {
      // The table covers max_pages * page_size keys: seqused_k beyond that is clamped to it.
      ext.S = clamp(seqused[zb], 0, dp.max_pages * dp.page_size);
      const device int* row = table + steel_i64(zb) * dp.table_stride;
      k_rows = AttnKvRows{p.k_rs, true, row, 0, dp.page_size, dp.pages, dp.k_ps};
      v_rows = AttnKvRows{p.v_rs, true, row, 0, dp.page_size, dp.pages, dp.v_ps};
      if (attn_quant) {
        ks_rows = AttnKvRows{qb.qp->k_rs, true, row, 0, dp.page_size, dp.pages, qb.qp->k_ps};
        vs_rows = AttnKvRows{qb.qp->v_rs, true, row, 0, dp.page_size, dp.pages, qb.qp->v_ps};
      }
    } else if (attn_varlen) {  // paged varlen reads seqused_k instead of cu_seqlens_k
      const int k_begin = clamp(cu_k[zb], 0, p.S);
      ext.S = clamp(cu_k[zb + 1], k_begin, p.S) - k_begin;
      k_off = k_begin * p.k_rs;
      v_off = k_begin * p.v_rs;
      if (attn_quant) {
        ks_off = k_begin * qb.qp->k_rs;
        vs_off = k_begin * qb.qp->v_rs;
      }
    } else {
      k_off = attn_batch_offset(p, p.k_bs, zb);
      v_off = attn_batch_offset(p, p.v_bs, zb);
      m_off = attn_batch_offset(p, p.m_bs, zb);
      if (attn_quant) {
        ks_off = attn_batch_offset(p, qb.qp->k_bs, zb);
        vs_off = attn_batch_offset(p, qb.qp->v_bs, zb);
      }
    }
    if (attn_varlen) ext.shift = attn_varlen_br ? ext.S - ext.L : 0;
    if (i0 >= ext.L) return false;
    last_row = min(i0 + dp.row_block, ext.L) - 1;
    k = k_in;
    v = v_in;
    if (attn_quant) {  // k and v hold codes: their offsets are in bytes
      kq = attn_quant_kv(false, k_in, k_off + hk * p.k_hs, qb, ks_off + hk * qb.qp->k_hs, k_rows,
                         ks_rows);
      vq = attn_quant_kv(true, v_in, v_off + hk * p.v_hs, qb, vs_off + hk * qb.qp->v_hs, v_rows,
                         vs_rows);
    } else {
      k += k_off + hk * p.k_hs;
      v += v_off + hk * p.v_hs;
    }
    return true;
  }

  // K's key tile from key0 (`valid` of its rows, E columns) into Ks. Paged rows are found from
  // the table, each lane reading its row's entry (lane_slot), which load_v reuses for the same
  // tile's V rows; dense ones start key0 rows in (k_rows.ld: the row stride, read once into a
  // register, not from the constant buffer per tile).
  void load_k(threadgroup T* Ks, int key0, short valid, short E, bool whole,
              ushort thread_index) {
    if (attn_quant) {
      kq.load<T, A::BK, DE, A::kLdK, A::kThreads>(Ks, key0, valid, E, attn_vec_k,
                                                          thread_index);
    } else {
      if (attn_paged) {
        k_rows.key0 = key0;
        lane_slot = k_rows.slot(short(thread_index % 32), valid);
        A::LoaderK::load_paged(Ks, k, k_rows, lane_slot, valid, E, whole && attn_align_e,
                               attn_vec_k, thread_index);
      } else {
        A::LoaderK::load(Ks, k + key0 * k_rows.ld, k_rows, valid, E, whole && attn_align_e,
                         attn_vec_k, thread_index);
      }
    }
  }

  // V's rows of the same key tile. Paged, they are found from the lane_slot load_k found for
  // this tile (key0 is not read again): every caller loads K before V, tile by tile.
  void load_v(threadgroup T* Vs, int key0, short valid, short Ev, bool whole,
              ushort thread_index) {
    if (attn_quant) {
      vq.load<T, A::BK, DV, A::kLdV, A::kThreads>(Vs, key0, valid, Ev, attn_vec_v,
                                                          thread_index);
    } else {
      if (attn_paged) {
        A::LoaderV::load_paged(Vs, v, v_rows, lane_slot, valid, Ev, whole && attn_align_ev,
                               attn_vec_v, thread_index);
      } else {
        A::LoaderV::load(Vs, v + key0 * v_rows.ld, v_rows, valid, Ev, whole && attn_align_ev,
                         attn_vec_v, thread_index);
      }
    }
  }
};

template <typename T, short DE, short DV>
inline void attention_decode_block(const device T* q, const device T* k, const device T* v,
                                   const device uchar* mask, const device uchar* sinks,
                                   device T* out, device float* lse, const device int* cu_q,
                                   const device int* cu_k, const device int* table,
                                   const device int* seqused, device float* part_o,
                                   device float* part_ml, AttnQuantBuffers qb,
                                   constant AttnDecodeParams& dp, threadgroup T* smem, uint3 tg,
                                   ushort simdgroup, ushort lane) {
  using A = AttnForward<T, DE, DV>;
  constant AttnParams& p = dp.fwd;
  AttnDecodeBlock<T, DE, DV> b;
  if (!b.init(k, v, cu_q, cu_k, table, seqused, qb, dp, tg)) return;
  const int i0 = b.i0, last_row = b.last_row, split = b.split, zb = b.zb;
  const AttnDecodeQueries xq = b.xq;
  const AttnExtent ext = b.ext;

  // This lane's packed row: head h0 + g, query row i of the block. Lanes past the packed rows
  // keep a head and row of the block for the addresses they form but read nothing through them.
  const short fr = frag_row(lane);
  const int r = simdgroup * 8 + fr;
  const int g = r / dp.row_block;
  const int i = min(i0 + r - g * dp.row_block, last_row);
  const bool row_ok = g < dp.heads_per_tg && i0 + r - g * dp.row_block <= last_row;
  const int h = b.h0 + min(g, dp.heads_per_tg - 1);
  // A simdgroup whose 8 rows are all past the packed ones (4 heads x 4 tokens fill 16 of the
  // 32) loads its share of the tiles and meets every barrier, but runs no MMA: it saves half the
  // matrix work at 16 rows, three quarters at 8 or fewer. The packed rows end at the last head's
  // last row, which a block of fewer query rows than row_block (a varlen sequence shorter than
  // the longest, the short last block of a long query) moves forward. Runtime, not a function
  // constant: varlen's rows change from call to call, and each value would be another pipeline.
  // Uniform over the simdgroup.
  const int real_rows = (dp.heads_per_tg - 1) * dp.row_block + last_row - i0 + 1;
  const bool live = simdgroup * 8 < real_rows;

  FragTile<1, A::TD> qf;
  attn_load_row_frags<T, A::TD>(qf, q + xq.q_off + h * p.q_hs + i * p.q_rs, row_ok, p.E,
                                attn_align_e, p.q_scale, lane);

  // Split partitions leave the sink to the merge, which must count it once.
  OnlineSoftmax sm;
  if (attn_sinks != kSteelAttnOperandNone && !attn_split) {
    const float sink = attn_read<T>(sinks, attn_sinks == kSteelAttnOperandF32, h);
    sm.init(true, sink / attn_unit_nats);
  } else {
    sm.init(false, 0.0f);
  }
  FragTile<1, A::TV> o;
  o.clear();

  // The key tiles some row may see, within this partition's keys.
  int t_begin, t_end;
  attn_key_tiles(p, ext, i0, last_row, A::BK, t_begin, t_end);
  const int tiles_per_split = dp.split_keys / A::BK;
  t_begin = max(t_begin, split * tiles_per_split);
  t_end = max(t_begin, min(t_end, (split + 1) * tiles_per_split));

  threadgroup T* Ks = smem;
  threadgroup T* Vs = A::kShared ? smem : smem + A::kKElems;
  const ushort thread_index = simdgroup * 32 + lane;
  const steel_i64 mask_row = b.m_off + h * p.m_hs + i * p.m_rs;

  // The loop's fields of p, read once into registers: each use of the constant buffer inside
  // the loop would read its bytes again per lane and per key tile.
  const short E = short(p.E), Ev = short(p.Ev);
  for (int t = t_begin; t < t_end; ++t) {
    const int key0 = t * A::BK;
    const short valid = short(min(int(A::BK), ext.S - key0));
    const bool whole = attn_align_s || valid == A::BK;
    const bool edge = attn_edge_tile(p, ext, i0, last_row, key0, A::BK);

    if (t > t_begin) threadgroup_barrier(mem_flags::mem_threadgroup);
    b.load_k(Ks, key0, valid, E, whole, thread_index);
    if (!A::kShared && !A::alias()) b.load_v(Vs, key0, valid, Ev, whole, thread_index);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    FragTile<1, A::TK> s;
    if (live) {
      s.clear();
      attn_mma_bt<T, A::kLdK>(s, qf, Ks, lane);
      attn_transform_scores<T, A::TK>(s, p, ext, i, key0, row_ok, mask, mask_row, edge, lane);
      const float factor = sm.update<A::TK>(s);
      for (short n = 0; n < A::TV; ++n) {
        o.frag[n].thread_elements()[0] *= factor;
        o.frag[n].thread_elements()[1] *= factor;
      }
    }

    if (A::kShared && !A::alias()) {  // V takes K's place once every simdgroup has its scores
      threadgroup_barrier(mem_flags::mem_threadgroup);
      b.load_v(Vs, key0, valid, Ev, whole, thread_index);
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (live) A::mma_pv(o, s, Ks, Vs, lane);  // V from the K tile when v is a prefix view of k
  }

  if (!row_ok) return;  // no barrier follows
  if (attn_split) {
    // Unnormalised: the merge weighs each partition by its sum. The max goes in nats, the
    // merge's unit whatever the score unit of this pipeline.
    const steel_i64 pr = attn_partial_row(dp, zb, h, i) + split;
    attn_store_row_frags<float, A::TV>(part_o + pr * p.Ev, o, p.Ev, attn_align_ev, 1.0f, lane);
    if ((lane & 9) == 0) {
      part_ml[2 * pr] = sm.m * attn_unit_nats;
      part_ml[2 * pr + 1] = sm.l;
    }
  } else {
    attn_store_row_frags<T, A::TV>(out + xq.o_off + h * p.o_hs + i * p.o_rs, o, p.Ev,
                                   attn_align_ev, sm.inverse_sum(), lane);
    if (attn_lse && (lane & 9) == 0) lse[xq.lse_off + h * xq.lse_hs + i] = sm.lse();
  }
}

// The merge of the split partitions of one query row (one simdgroup, grid (rows, Hq, batch
// entries or sequences)): lane s holds partition s's max m_s (nats) and sum l_s; with
// M = max(m_s, sink), w_s = exp(m_s - M) and Z = sum_s w_s l_s + exp(sink - M),
//   out = sum_s w_s O_s / Z,  lse = M + log Z,
// partitions summed in index order (deterministic). A partition that saw nothing has m = -inf,
// l = 0, O = 0 and weighs 0; a row that saw nothing anywhere gives out 0 and lse -inf.
template <typename T>
inline void attention_decode_merge(const device uchar* sinks, device T* out, device float* lse,
                                   const device int* cu_q, const device float* part_o,
                                   const device float* part_ml, constant AttnDecodeParams& dp,
                                   uint3 tg, ushort lane) {
  constant AttnParams& p = dp.fwd;
  const int i = int(tg.x);
  const int h = int(tg.y);
  const int zb = int(tg.z);
  const AttnDecodeQueries xq = attn_decode_queries(dp, cu_q, zb);
  if (i >= xq.L) return;  // uniform: the grid covers the longest sequence
  const steel_i64 pr = attn_partial_row(dp, zb, h, i);
  const bool mine = int(lane) < dp.splits;
  const float m = mine ? part_ml[2 * (pr + lane)] : -INFINITY;
  const float l = mine ? part_ml[2 * (pr + lane) + 1] : 0.0f;
  const bool has_sink = attn_sinks != kSteelAttnOperandNone;
  const float sink = has_sink ? attn_read<T>(sinks, attn_sinks == kSteelAttnOperandF32, h)
                              : -INFINITY;
  const float m_all = max(simd_max(m), sink);
  const float shift = m_all == -INFINITY ? 0.0f : m_all;  // no -inf - -inf
  const float w = exp(m - shift);
  const float z = simd_sum(l * w) + (has_sink ? exp(sink - shift) : 0.0f);
  const float inv = z == 0.0f ? 0.0f : 1.0f / z;
  device T* o = out + xq.o_off + h * p.o_hs + i * p.o_rs;
  for (int c0 = 0; c0 < p.Ev; c0 += 32) {  // uniform bounds: the shuffles need every lane
    const int col = c0 + int(lane);
    float acc = 0.0f;
    for (int s = 0; s < dp.splits; ++s) {
      const float ws = simd_shuffle(w, ushort(s));
      if (col < p.Ev) acc += ws * part_o[(pr + s) * p.Ev + col];
    }
    if (col < p.Ev) o[col] = T(acc * inv);
  }
  if (attn_lse && lane == 0) lse[xq.lse_off + h * xq.lse_hs + i] = z == 0.0f ? -INFINITY : shift + log(z);
}

}  // namespace steel
