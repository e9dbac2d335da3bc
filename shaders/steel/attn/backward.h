// The attention backward (flash attention 2 style): probabilities are recomputed from q, k and
// the forward's log-sum-exp, never stored; no atomics, so every result is deterministic.
//
//   1. delta pre-pass: delta[row] = rowsum(dO * O) - grad_lse[row] in fp32, one simdgroup a row.
//      (dS = P * (dP - delta) is the softmax Jacobian applied to dP; a gradient on lse adds
//      P * grad_lse, which is the same as subtracting it from delta.) It also restores the
//      normaliser of rows whose lse is too large for exp(s - lse) (kAttnHugeLse).
//   2. dK/dV: a threadgroup owns BKV = 32 keys of one (batch, KV head), four simdgroups of 8
//      keys each holding their K, V and the dK, dV accumulators in registers, and streams the
//      query tiles (BK rows of Q and dO through threadgroup memory) of every query head of the
//      KV head's group: the group's sum happens in registers (GQA without expanded copies).
//      The tile's rows' lse, delta and 1 / normaliser are staged beside it once per tile.
//      Per tile: S^T = K Q^T, dP^T = V dO^T, then per element P^T = exp(S^T - lse) and
//      dS^T = P^T (dP^T o Z^T - delta), dV += (P o Z)^T dO, dK += dS^T Q (Z: dropout's
//      factors, dropout.h); two score tiles live, not four.
//      Where Q and dO tiles share one buffer (float32 at head dim 512), dO replaces Q after
//      S^T and Q is read again for dK: no order of these products needs each tile only once.
//   3. dQ: a threadgroup owns BQ = 32 query rows (as the forward), Q, dO and dQ in registers,
//      and streams the key tiles: dP = dO V^T, S = Q K^T, P, dS, dQ += dS K (in that order,
//      so that a shared buffer holds V, then K, each loaded once).
//   4. dsinks (with sinks): per head, -sum over rows of exp(sink - lse) * delta, one simdgroup.
//   5. dmask (a float attn_mask that requires grad): dS itself, summed over the dims the mask
//      broadcasts over by the threadgroup that owns each mask element.
// Causal and window bounds skip the same tiles as the forward, in both directions. Softcap
// multiplies dS by its derivative 1 - tanh^2; dQ and dK get the softmax scale when stored.
#pragma once

#include <metal_stdlib>

#include "../fragment.h"
#include "../params.h"
#include "dropout.h"
#include "forward.h"
#include "loader.h"
#include "score.h"

using namespace metal;

constant bool attn_grad_lse [[function_constant(STEEL_ATTN_FC_GRAD_LSE)]];
constant bool attn_align_q [[function_constant(STEEL_ATTN_FC_ALIGN_Q)]];
constant bool attn_dmask_rows [[function_constant(STEEL_ATTN_FC_DMASK_ROWS)]];
constant bool attn_dmask_keys [[function_constant(STEEL_ATTN_FC_DMASK_KEYS)]];
constant bool attn_vec_q [[function_constant(STEEL_ATTN_FC_VEC_Q)]];
constant bool attn_vec_g [[function_constant(STEEL_ATTN_FC_VEC_G)]];
// A log-sum-exp in nats, in the score unit (score.h).
constant float attn_units_per_nat = 1.0f / attn_unit_nats;

namespace steel {

// Tiles of the backward kernels for head dims DE, DV: query rows (dQ) and keys (dK/dV) per
// threadgroup as in the forward, and a streamed tile of BK rows (params.h's steel_attn_bwd_bk)
// of Q and dO (dK/dV) or K and V (dQ, dmask: kRows), in two buffers or, with kShared, taking
// turns in one (params.h: steel_attn_bwd_shared for the dK/dV kernel, steel_attn_bwd_dq_shared
// for the row kernels).
template <typename T, short DE, short DV, bool kRows = false>
struct AttnBackward {
  static constant constexpr short BQ = STEEL_ATTN_BQ;  // dQ: query rows per threadgroup
  static constant constexpr short BKV = 32;            // dK/dV: keys per threadgroup
  static constant constexpr short BK = short(steel_attn_bwd_bk(DE, DV, int(sizeof(T))));
  static constant constexpr bool kShared = kRows
                                                ? steel_attn_bwd_dq_shared(DE, DV, int(sizeof(T)))
                                                : steel_attn_bwd_shared(DE, DV, int(sizeof(T)));
  static constant constexpr short kThreads = 32 * STEEL_ATTN_SIMDGROUPS;
  static constant constexpr short kLdE = short(steel_attn_ld(DE, int(sizeof(T))));
  static constant constexpr short kLdV = short(steel_attn_ld(DV, int(sizeof(T))));
  // Where the second tile starts: after the first, or on it when they share the buffer.
  static constant constexpr int kEElems = kShared ? 0 : BK * kLdE;
  static constant constexpr int kTileElems =
      kShared ? BK * (kLdE > kLdV ? kLdE : kLdV) : BK * (kLdE + kLdV);
  static constant constexpr int kStats = 3 * BK;  // dK/dV: lse, delta, 1 / normaliser a row
  static constant constexpr short TD = DE / 8;
  static constant constexpr short TV = DV / 8;
  static constant constexpr short TK = BK / 8;
  static_assert(BK > 0, "no backward tile fits these head dims (the planner refuses them)");
  static_assert(BKV == 8 * STEEL_ATTN_SIMDGROUPS, "one 8-key fragment row per simdgroup");
  static_assert(kStats <= kThreads, "one thread stages one row statistic");
  static_assert(kTileElems * int(sizeof(T)) ==
                    (kRows ? steel_attn_bwd_dq_tile_bytes(DE, DV, int(sizeof(T)))
                           : steel_attn_bwd_tile_bytes(DE, DV, int(sizeof(T)))),
                "the planner's threadgroup-memory figure must match the kernel's");
  using LoaderE = AttnTileLoader<T, BK, DE, kLdE, kThreads>;
  using LoaderV = AttnTileLoader<T, BK, DV, kLdV, kThreads>;
};

// Where a threadgroup's (batch entry | sequence) `zb` lies: its extent (score.h) and the element
// offsets of its first row in q, k, v, the mask, grad_out and out, and of row 0 of head 0 in
// lse and delta ([batch, Hq, L] dense, [Hq, total_q] varlen: the head stride is L in both).
// Dense launches take the whole call's extent and the batch strides. Varlen launches
// (STEEL_ATTN_FC_VARLEN, no mask) read sequence zb's tokens from cu_seqlens as the forward does
// (forward.h), clamped to the token counts so that offsets that break the convention give wrong
// rows, never accesses outside a buffer.
struct AttnBwdSeq {
  AttnExtent ext;
  int q0, k0;  // the first query and key token (varlen; 0 dense)
  steel_i64 q, k, v, m, g, y, rows;
};

inline AttnBwdSeq attn_bwd_seq(constant AttnBackwardParams& bp, const device int* cu_q,
                               const device int* cu_k, int zb) {
  constant AttnParams& p = bp.fwd;
  AttnBwdSeq s;
  if (attn_varlen) {
    int q_begin, k_begin;
    s.ext = attn_varlen_sequence(p, cu_q, cu_k, zb, q_begin, k_begin);
    s.q0 = q_begin;
    s.k0 = k_begin;
    s.q = q_begin * p.q_rs;
    s.k = k_begin * p.k_rs;
    s.v = k_begin * p.v_rs;
    s.m = 0;
    s.g = q_begin * bp.g_rs;
    s.y = q_begin * bp.y_rs;
    s.rows = q_begin;
  } else {
    s.ext = {p.L, p.S, p.shift};
    s.q0 = 0;
    s.k0 = 0;
    s.q = attn_batch_offset(p, p.q_bs, zb);
    s.k = attn_batch_offset(p, p.k_bs, zb);
    s.v = attn_batch_offset(p, p.v_bs, zb);
    s.m = attn_batch_offset(p, p.m_bs, zb);
    s.g = attn_batch_offset(p, bp.g_bs, zb);
    s.y = attn_batch_offset(p, bp.y_bs, zb);
    s.rows = steel_i64(zb) * p.Hq * p.L;
  }
  return s;
}

// The element offset of (head, row) in dq (of dk, dv: key-value head, key), which are
// contiguous: [batch, heads, rows, dim] dense, packed [tokens, heads, dim] varlen.
inline steel_i64 attn_bwd_grad_at(int zb, int first_token, int heads, int rows, int head,
                                  int row, int dim) {
  return attn_varlen ? (steel_i64(first_token + row) * heads + head) * dim
                     : ((steel_i64(zb) * heads + head) * rows + row) * dim;
}

// The query tiles [t_begin, t_end) of `bq` rows that hold a row seeing some key of the dK/dV
// block key0 .. last_key: attn_key_tiles' causal / window bounds read the other way.
inline void attn_query_tiles(constant AttnParams& p, AttnExtent x, int key0, int last_key,
                             int bq, thread int& t_begin, thread int& t_end) {
  int row_begin = 0;
  int row_end = x.L;
  if (attn_has_hi) row_begin = max(0, key0 - x.shift - p.hi_off);
  if (attn_has_lo) row_end = min(x.L, last_key - x.shift + p.lo_off + 1);
  t_begin = row_begin / bq;
  t_end = row_end > row_begin ? (row_end + bq - 1) / bq : t_begin;
}

// Does a diagonal cross the (query tile row0 .. last_row, keys key0 .. last_key) square, so that
// some of its scores are hidden? (attn_edge_tile's test, the other way; the callers add their
// ragged edges.) Uniform per threadgroup.
inline bool attn_query_edge_tile(constant AttnParams& p, AttnExtent x, int key0, int last_key,
                                 int row0, int last_row) {
  return (attn_has_hi && last_key > row0 + x.shift + p.hi_off) ||
         (attn_has_lo && key0 < last_row + x.shift - p.lo_off);
}

// The probability of a score given its row's log-sum-exp in the score unit (lse *
// attn_units_per_nat, as the dK/dV kernel stages it and the row kernels hold it; -inf stays
// -inf): 0 for rows that saw nothing.
inline float attn_probability_units(float s, float lse_units) {
  return lse_units == -INFINITY ? 0.0f : exp2((s - lse_units) * attn_exp_unit);
}

// The same from the log-sum-exp in nats.
inline float attn_probability(float s, float lse) {
  return attn_probability_units(s, lse * attn_units_per_nat);
}

// Whether a tile's scores need no transform and no test per element: no softcap, no mask, and
// `edge` false (no key of the tile past S or hidden by a diagonal from a row of the block).
// Every row inside L then sees keys, so its lse is finite and its probability is
// exp2(s - lse_units) (scores are in log2 units without an additive mask). Uniform per
// threadgroup.
inline bool attn_bwd_plain_tile(bool edge) {
  return !attn_softcap && attn_mask == kSteelAttnMaskNone && !edge;
}

// The backward's scratch holds two [batch, Hq, L] planes: delta, then 1 / normaliser.
inline steel_i64 attn_rows(constant AttnBackwardParams& bp) {
  return steel_i64(bp.batch) * bp.fwd.Hq * bp.fwd.L;
}

// Beyond this |lse| (in nats), exp(s - lse) in fp32 no longer sums to 1 over a row: a row whose
// keys all carry a finfo.min mask (Hugging Face's padding) has every score and its lse rounded
// to the same float, and the log of the normaliser is lost. Below it the error of exp(s - lse)
// is at most 2^12 fp32 ulps of 1 (2.4e-4 relative).
constant constexpr float kAttnHugeLse = 4096.0f;

// The normaliser of query row `row` of head h from its (huge) lse `l` in nats, recomputed by the
// whole simdgroup: the sum over the visible keys of exp(s - lse) (one key a lane, scores as the
// other kernels compute them), so that the kernels' P sums to 1 as the forward's did.
template <typename T>
inline float attn_bwd_normaliser(const device T* q, const device T* k, const device uchar* mask,
                                 const device uchar* sinks, constant AttnParams& p,
                                 thread const AttnBwdSeq& sq, int h, int row, float l,
                                 ushort lane) {
  const device T* q_row = q + sq.q + h * p.q_hs + row * p.q_rs;
  const device T* k_h = k + sq.k + (h / p.group) * p.k_hs;
  const steel_i64 mask_row = sq.m + h * p.m_hs + row * p.m_rs;
  float sum = 0.0f;
  for (int key = lane; key < sq.ext.S; key += 32) {
    float x = 0.0f;
    for (int d = 0; d < p.E; ++d) x += float(q_row[d]) * float(k_h[key * p.k_rs + d]);
    float th = 0.0f;
    const float s = attn_score<T>(x * p.q_scale, p, sq.ext, row, key, true, mask,
                                  mask_row + key * p.m_cs, true, th);
    sum += attn_probability(s, l);
  }
  sum = simd_sum(sum);
  if (attn_sinks != kSteelAttnOperandNone) {
    sum += exp(attn_read<T>(sinks, attn_sinks == kSteelAttnOperandF32, h) - l);
  }
  return sum;
}

// The delta pre-pass: each simdgroup takes STEEL_ATTN_DELTA_ROWS_PER_SIMDGROUP rows, four lanes
// a row (lanes 4r .. 4r + 3 row r), so that the params and the row's lse are read by four lanes
// a row rather than by a whole simdgroup.
template <typename T>
inline void attention_bwd_delta(const device T* q, const device T* k, const device uchar* mask,
                                const device uchar* sinks, const device T* grad_out,
                                const device T* out, const device float* lse,
                                const device float* grad_lse, device float* delta,
                                const device int* cu_q, const device int* cu_k,
                                constant AttnBackwardParams& bp, uint3 tg, ushort simdgroup,
                                ushort lane) {
  constexpr short kRows = STEEL_ATTN_DELTA_ROWS_PER_SIMDGROUP;
  constexpr short kLanes = 32 / kRows;  // a row's lanes
  static_assert(kRows * kLanes == 32 && (kLanes & (kLanes - 1)) == 0,
                "a row's lanes are a power-of-two group of the simdgroup (the xor sum)");
  constant AttnParams& p = bp.fwd;
  const int row0 = (int(tg.x) * STEEL_ATTN_DELTA_SIMDGROUPS + simdgroup) * kRows;
  const int h = int(tg.y);
  const int zb = int(tg.z);
  const AttnBwdSeq sq = attn_bwd_seq(bp, cu_q, cu_k, zb);
  if (row0 >= sq.ext.L) return;  // the whole simdgroup; no barrier here
  const int row = row0 + lane / kLanes;
  const short part = short(lane % kLanes);
  const bool row_ok = row < sq.ext.L;
  float acc = 0.0f;
  if (row_ok) {
    const device T* g_row = grad_out + sq.g + h * bp.g_hs + row * bp.g_rs;
    const device T* y_row = out + sq.y + h * bp.y_hs + row * bp.y_rs;
    for (int c = part; c < p.Ev; c += kLanes) acc += float(g_row[c]) * float(y_row[c]);
  }
#pragma clang loop unroll(full)
  for (short m = 1; m < kLanes; m *= 2) acc += simd_shuffle_xor(acc, ushort(m));

  // Rows of huge |lse| get their normaliser back (attn_bwd_normaliser), one row at a time over
  // the whole simdgroup (the test is uniform: the row's lse from its first lane); every other
  // row has 1.
  const steel_i64 at = sq.rows + steel_i64(h) * p.L + row;
  const float l = row_ok ? lse[at] : -INFINITY;
  float inv_norm = 1.0f;
  for (short r = 0; r < kRows; ++r) {
    const float lr = simd_shuffle(l, ushort(r * kLanes));
    if (lr != -INFINITY && fabs(lr) >= kAttnHugeLse) {
      const float sum = attn_bwd_normaliser<T>(q, k, mask, sinks, p, sq, h, row0 + r, lr, lane);
      if (lane / kLanes == r) inv_norm = sum > 0.0f ? 1.0f / sum : 1.0f;
    }
  }
  if (row_ok && part == 0) {
    delta[at] = attn_grad_lse ? acc - grad_lse[at] : acc;
    delta[attn_rows(bp) + at] = inv_norm;
  }
}

template <typename T, short DE, short DV>
inline void attention_bwd_dkdv_block(const device T* q, const device T* k, const device T* v,
                                     const device uchar* mask, const device T* grad_out,
                                     const device float* lse, const device float* delta,
                                     device T* dk, device T* dv, const device int* cu_q,
                                     const device int* cu_k, constant AttnBackwardParams& bp,
                                     threadgroup T* smem, threadgroup float* stats, uint3 tg,
                                     ushort simdgroup, ushort lane) {
  using A = AttnBackward<T, DE, DV>;
  constant AttnParams& p = bp.fwd;
  const int key0 = int(tg.x) * A::BKV;
  const int hk = int(tg.y);
  const int zb = int(tg.z);
  const AttnBwdSeq sq = attn_bwd_seq(bp, cu_q, cu_k, zb);
  const AttnExtent ext = sq.ext;
  // Varlen: the grid covers the longest sequence; blocks past this one's keys have none to
  // write. Uniform over the threadgroup, before any barrier. (A sequence without query rows
  // still writes its keys' zero gradients below.)
  if (attn_varlen && key0 >= ext.S) return;
  const short fr = frag_row(lane);
  const short fc = frag_col(lane);
  const int key = key0 + simdgroup * 8 + fr;  // this lane's key
  const bool key_ok = key < ext.S;
  const int last_key = min(key0 + int(A::BKV), ext.S) - 1;

  // K and V of the simdgroup's 8 keys in registers, zero past S and the head dims, as MMA
  // operands of their dtype (forward.h, AttnOperandRow: exact products, one register a
  // fragment for 16-bit types, which at head dim 128 lets three threadgroups share a core).
  AttnOperandRow<T, A::TD> kf;
  AttnOperandRow<T, A::TV> vf;
  attn_load_row_operands<T, A::TD>(kf, k + sq.k + hk * p.k_hs + key * p.k_rs, key_ok, p.E,
                                   attn_align_e, lane);
  attn_load_row_operands<T, A::TV>(vf, v + sq.v + hk * p.v_hs + key * p.v_rs, key_ok, p.Ev,
                                   attn_align_ev, lane);
  FragTile<1, A::TD> dkf;
  FragTile<1, A::TV> dvf;
  dkf.clear();
  dvf.clear();

  int t_begin, t_end;
  attn_query_tiles(p, ext, key0, last_key, A::BK, t_begin, t_end);
  const bool keys_whole = key0 + A::BKV <= ext.S;

  threadgroup T* Qs = smem;
  threadgroup T* Gs = smem + A::kEElems;
  // The tile's rows' lse, delta and 1 / normaliser, read from device memory once per tile by
  // the threadgroup instead of once per lane that needs them (-inf and 0 past L).
  threadgroup float* lse_s = stats;
  threadgroup float* delta_s = stats + A::BK;
  threadgroup float* norm_s = stats + 2 * A::BK;
  const ushort thread_index = simdgroup * 32 + lane;
  // The loop's fields of p, read once (m_rs only with a mask, as the forward does), and the
  // thread's chunks of a whole Q and dO tile (the forward's load_tile).
  const float q_scale = p.q_scale;
  const steel_i64 m_rs = attn_mask != kSteelAttnMaskNone ? p.m_rs : 0;
  const steel_i64 q_rs = p.q_rs, g_rs = bp.g_rs;
  const short E = short(p.E), Ev = short(p.Ev);
  const typename A::LoaderE::Place q_place = A::LoaderE::whole_place(q_rs, thread_index);
  const typename A::LoaderV::Place g_place = A::LoaderV::whole_place(g_rs, thread_index);
  // The lane's fragment bases in the tiles: Q^T and dO^T for S^T and dP^T, dO and Q for dV, dK.
  const threadgroup T* q_bt = Qs + attn_bt_offset<A::kLdE>(lane);
  const threadgroup T* g_bt = Gs + attn_bt_offset<A::kLdV>(lane);
  const threadgroup T* g_b = Gs + attn_b_offset<A::kLdV>(lane);
  const threadgroup T* q_b = Qs + attn_b_offset<A::kLdE>(lane);
  bool first = true;
  for (int g = 0; g < p.group; ++g) {
    const int h = hk * p.group + g;
    const device T* q_h = q + sq.q + h * p.q_hs;
    const device T* g_h = grad_out + sq.g + h * bp.g_hs;
    const device float* lse_h = lse + sq.rows + steel_i64(h) * p.L;
    const device float* delta_h = delta + sq.rows + steel_i64(h) * p.L;
    const device float* norm_h = delta_h + attn_rows(bp);
    const steel_i64 mask_key = sq.m + h * p.m_hs + key * p.m_cs;
    const uint bh = uint(zb) * uint(p.Hq) + uint(h);  // dropout's batch-head index
    for (int t = t_begin; t < t_end; ++t) {
      const int row0 = t * A::BK;
      const short valid = short(min(int(A::BK), ext.L - row0));
      const bool whole = attn_align_q || valid == A::BK;
      const int last_row = row0 + valid - 1;
      const bool edge = !whole || !keys_whole ||
                        attn_query_edge_tile(p, ext, key0, last_key, row0, last_row);

      if (!first) threadgroup_barrier(mem_flags::mem_threadgroup);
      first = false;
      A::LoaderE::load_tile(Qs, q_h + row0 * q_rs, q_rs, q_place, valid, E, whole && attn_align_e,
                            attn_vec_q, thread_index);
      if (!A::kShared) {
        A::LoaderV::load_tile(Gs, g_h + row0 * g_rs, g_rs, g_place, valid, Ev,
                              whole && attn_align_ev, attn_vec_g, thread_index);
      }
      if (thread_index < A::kStats) {
        const short r = short(thread_index) % A::BK;
        const bool in = r < valid;
        const int row = row0 + r;
        if (thread_index < A::BK) {  // in the score unit (attn_probability_units)
          lse_s[r] = in ? lse_h[row] * attn_units_per_nat : -INFINITY;
        } else if (thread_index < 2 * A::BK) {
          delta_s[r] = in ? delta_h[row] : 0.0f;
        } else {
          norm_s[r] = in ? norm_h[row] : 0.0f;
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);

      // S^T = K Q^T (8 keys x BK rows) and dP^T = V dO^T first, then one pass over the
      // elements turns them into (P o Z)^T and dS^T: only these two score tiles are live
      // across the products (the softcap's slope and dropout's factors are per element).
      FragTile<1, A::TK> pt;
      pt.clear();
      attn_mma_bt_operands<T, A::kLdE>(pt, kf, q_bt, A::TK);
      if (A::kShared) {  // dO takes Q's place once every simdgroup has its scores
        threadgroup_barrier(mem_flags::mem_threadgroup);
        A::LoaderV::load_tile(Gs, g_h + row0 * g_rs, g_rs, g_place, valid, Ev,
                              whole && attn_align_ev, attn_vec_g, thread_index);
        threadgroup_barrier(mem_flags::mem_threadgroup);
      }
      FragTile<1, A::TK> ds;
      ds.clear();
      attn_mma_bt_operands<T, A::kLdV>(ds, vf, g_bt, A::TK);
      if (attn_bwd_plain_tile(edge)) {  // edge covers rows past L here
#pragma clang loop unroll(full)
        for (short j = 0; j < A::TK; ++j) {
#pragma clang loop unroll(full)
          for (short e = 0; e < 2; ++e) {
            const short r = j * 8 + fc + e;
            const float s = pt.frag[j].thread_elements()[e] * q_scale;
            const float pv = exp2(s - lse_s[r]) * norm_s[r];
            const float z = attn_dropout ? attn_dropout_one(p, bh, row0 + r, key) : 1.0f;
            ds.frag[j].thread_elements()[e] = pv * (ds.frag[j].thread_elements()[e] * z -
                                                    delta_s[r]);
            pt.frag[j].thread_elements()[e] = pv * z;
          }
        }
      } else {
#pragma clang loop unroll(full)
        for (short j = 0; j < A::TK; ++j) {
#pragma clang loop unroll(full)
          for (short e = 0; e < 2; ++e) {
            const short r = j * 8 + fc + e;
            const int row = row0 + r;
            const bool row_ok = row < ext.L;
            float th = 0.0f;  // tanh of the scaled score under softcap: d score = 1 - th^2
            const float s = attn_score<T>(pt.frag[j].thread_elements()[e] * q_scale, p, ext,
                                          row, key, row_ok, mask, mask_key + row * m_rs, edge,
                                          th);
            const float pv = row_ok ? attn_probability_units(s, lse_s[r]) * norm_s[r] : 0.0f;
            // Dropout's factor Z^T of this element (0 or 1 / (1 - p)).
            const float z = attn_dropout ? attn_dropout_one(p, bh, row, key) : 1.0f;
            const float dp = ds.frag[j].thread_elements()[e] * z;
            const float slope = attn_softcap ? 1.0f - th * th : 1.0f;
            ds.frag[j].thread_elements()[e] = pv * (dp - delta_s[r]) * slope;
            pt.frag[j].thread_elements()[e] = pv * z;  // (P o Z)^T, what dV sees
          }
        }
      }
      // dV += (P o Z)^T dO.
      attn_mma_b_pairs<T, A::kLdV>(dvf, pt, g_b);
      if (A::kShared) {  // and Q comes back for dK (a second read of the tile)
        threadgroup_barrier(mem_flags::mem_threadgroup);
        A::LoaderE::load_tile(Qs, q_h + row0 * q_rs, q_rs, q_place, valid, E,
                              whole && attn_align_e, attn_vec_q, thread_index);
        threadgroup_barrier(mem_flags::mem_threadgroup);
      }
      // dK += dS^T Q.
      attn_mma_b_pairs<T, A::kLdE>(dkf, ds, q_b);
    }
  }

  if (!key_ok) return;  // no barrier follows
  const int Hkv = p.Hq / p.group;
  attn_store_row_frags<T, A::TD>(dk + attn_bwd_grad_at(zb, sq.k0, Hkv, p.S, hk, key, p.E), dkf,
                                 p.E, attn_align_e, bp.scale, lane);
  attn_store_row_frags<T, A::TV>(dv + attn_bwd_grad_at(zb, sq.k0, Hkv, p.S, hk, key, p.Ev), dvf,
                                 p.Ev, attn_align_ev, 1.0f, lane);
}

// The lane's query row for the dQ and dmask kernels: Q (unscaled: the scores take the scale
// after Q K^T, as in the forward) and dO in registers as MMA operands of their dtype
// (AttnOperandRow), and the row's lse in the score unit (attn_probability_units), delta and
// 1 / normaliser (-inf and 0 past L).
template <typename T, short TD, short TV>
inline void attn_bwd_load_row(thread AttnOperandRow<T, TD>& qf,
                              thread AttnOperandRow<T, TV>& gf, thread float& lse_row,
                              thread float& delta_row, thread float& norm_row, const device T* q,
                              const device T* grad_out, const device float* lse,
                              const device float* delta, constant AttnBackwardParams& bp,
                              thread const AttnBwdSeq& sq, int h, int row, bool row_ok,
                              ushort lane) {
  constant AttnParams& p = bp.fwd;
  attn_load_row_operands<T, TD>(qf, q + sq.q + h * p.q_hs + row * p.q_rs, row_ok, p.E,
                                attn_align_e, lane);
  attn_load_row_operands<T, TV>(gf, grad_out + sq.g + h * bp.g_hs + row * bp.g_rs, row_ok,
                                p.Ev, attn_align_ev, lane);
  const steel_i64 at = sq.rows + steel_i64(h) * p.L + row;
  lse_row = row_ok ? lse[at] * attn_units_per_nat : -INFINITY;
  delta_row = row_ok ? delta[at] : 0.0f;
  norm_row = row_ok ? delta[attn_rows(bp) + at] : 0.0f;
}

// What the key tiles of the dQ and dmask kernels read of p (m_cs only with a mask), the
// thread's chunks of a whole K and V tile (the forward's load_tile) and the lane's fragment
// offsets in them (V^T and K^T for dP and S, K for dQ): read and found once, before the loops
// over tiles, rather than per tile and per score.
template <typename A>
struct AttnBwdKeyTiles {
  steel_i64 k_rs, v_rs, m_cs;
  short E, Ev;
  float q_scale;
  typename A::LoaderE::Place k_place;
  typename A::LoaderV::Place v_place;
  short v_bt, k_bt, k_b;
};

template <typename A>
inline AttnBwdKeyTiles<A> attn_bwd_key_tiles(constant AttnParams& p, ushort thread_index,
                                             ushort lane) {
  AttnBwdKeyTiles<A> f;
  f.k_rs = p.k_rs;
  f.v_rs = p.v_rs;
  f.m_cs = attn_mask != kSteelAttnMaskNone ? p.m_cs : 0;
  f.E = short(p.E);
  f.Ev = short(p.Ev);
  f.q_scale = p.q_scale;
  f.k_place = A::LoaderE::whole_place(f.k_rs, thread_index);
  f.v_place = A::LoaderV::whole_place(f.v_rs, thread_index);
  f.v_bt = attn_bt_offset<A::kLdV>(lane);
  f.k_bt = attn_bt_offset<A::kLdE>(lane);
  f.k_b = attn_b_offset<A::kLdE>(lane);
  return f;
}

// One key tile of the dQ and dmask kernels, dS at the score level for one lane's row (the
// forward's orientation): with Q and dO of the row in registers, loads the V and K rows of the
// tile at key0 of one (batch entry, KV head) (`k_h`, `v_h`), V first so that K can take its
// place when the two share the buffer (A::kShared), and computes dP = dO V^T, S = Q K^T and P as
// the forward computes them, dS = P (dP o Z - delta). K stays in smem for dQ += dS K. dS is the
// gradient of the additive mask (added after the softcap); with softcap, `slope` receives its
// derivative 1 - tanh^2, which dQ (and dK) take on top. `bh` is the dropout's batch-head
// index. The caller puts a barrier between two calls.
template <typename A, typename T>
inline void attn_bwd_key_tile(thread FragTile<1, A::TK>& ds, thread FragTile<1, A::TK>& slope,
                              thread const AttnOperandRow<T, A::TD>& qf,
                              thread const AttnOperandRow<T, A::TV>& gf, threadgroup T* smem,
                              const device T* k_h, const device T* v_h, constant AttnParams& p,
                              thread const AttnBwdKeyTiles<A>& f, AttnExtent ext, int row,
                              int key0, bool row_ok, const device uchar* mask,
                              steel_i64 mask_row, bool edge, float lse_row, float norm_row,
                              float delta_row, uint bh, ushort thread_index, ushort lane) {
  threadgroup T* Ks = smem;
  threadgroup T* Vs = smem + A::kEElems;
  const short valid = short(min(int(A::BK), ext.S - key0));
  const bool whole = attn_align_s || valid == A::BK;
  A::LoaderV::load_tile(Vs, v_h + key0 * f.v_rs, f.v_rs, f.v_place, valid, f.Ev,
                        whole && attn_align_ev, attn_vec_v, thread_index);
  if (!A::kShared) {
    A::LoaderE::load_tile(Ks, k_h + key0 * f.k_rs, f.k_rs, f.k_place, valid, f.E,
                          whole && attn_align_e, attn_vec_k, thread_index);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const short fc = frag_col(lane);
  // dP o Z = (dO V^T) o Z.
  ds.clear();
  attn_mma_bt_operands<T, A::kLdV>(ds, gf, Vs + f.v_bt, A::TK);
  if (attn_dropout) attn_dropout_tile<A::TK>(ds, p, bh, row, key0, fc);
  if (A::kShared) {  // K takes V's place once every simdgroup has its dP
    threadgroup_barrier(mem_flags::mem_threadgroup);
    A::LoaderE::load_tile(Ks, k_h + key0 * f.k_rs, f.k_rs, f.k_place, valid, f.E,
                          whole && attn_align_e, attn_vec_k, thread_index);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // S = Q K^T, P, then dS.
  FragTile<1, A::TK> ps;
  ps.clear();
  attn_mma_bt_operands<T, A::kLdE>(ps, qf, Ks + f.k_bt, A::TK);
  // A row past L (the last block's, lse -inf) gets no finite dS on a plain tile, but its dQ
  // row is never stored, and the dmask kernel, which sums rows, has a mask: no plain tile.
  if (attn_bwd_plain_tile(edge)) {
#pragma clang loop unroll(full)
    for (short j = 0; j < A::TK; ++j) {
#pragma clang loop unroll(full)
      for (short e = 0; e < 2; ++e) {
        const float pv = exp2(ps.frag[j].thread_elements()[e] * f.q_scale - lse_row) * norm_row;
        ds.frag[j].thread_elements()[e] = pv * (ds.frag[j].thread_elements()[e] - delta_row);
      }
    }
    return;
  }
#pragma clang loop unroll(full)
  for (short j = 0; j < A::TK; ++j) {
#pragma clang loop unroll(full)
    for (short e = 0; e < 2; ++e) {
      const int key = key0 + j * 8 + fc + e;
      float th = 0.0f;
      const float s = attn_score<T>(ps.frag[j].thread_elements()[e] * f.q_scale, p, ext, row,
                                    key, row_ok, mask, mask_row + key * f.m_cs, edge, th);
      const float pv = attn_probability_units(s, lse_row) * norm_row;
      if (attn_softcap) slope.frag[j].thread_elements()[e] = 1.0f - th * th;
      ds.frag[j].thread_elements()[e] = pv * (ds.frag[j].thread_elements()[e] - delta_row);
    }
  }
}

template <typename T, short DE, short DV>
inline void attention_bwd_dq_block(const device T* q, const device T* k, const device T* v,
                                   const device uchar* mask, const device T* grad_out,
                                   const device float* lse, const device float* delta,
                                   device T* dq, const device int* cu_q, const device int* cu_k,
                                   constant AttnBackwardParams& bp, threadgroup T* smem,
                                   uint3 tg, ushort simdgroup, ushort lane) {
  using A = AttnBackward<T, DE, DV, true>;
  constant AttnParams& p = bp.fwd;
  const int row0 = int(tg.x) * A::BQ;
  const int h = int(tg.y);
  const int zb = int(tg.z);
  const AttnBwdSeq sq = attn_bwd_seq(bp, cu_q, cu_k, zb);
  const AttnExtent ext = sq.ext;
  if (attn_varlen && row0 >= ext.L) return;  // past the sequence: uniform, before any barrier
  const int hk = h / p.group;
  const short fr = frag_row(lane);
  const short fc = frag_col(lane);
  const int row = row0 + simdgroup * 8 + fr;
  const bool row_ok = attn_align_l || row < ext.L;
  const device T* k_h = k + sq.k + hk * p.k_hs;
  const device T* v_h = v + sq.v + hk * p.v_hs;

  AttnOperandRow<T, A::TD> qf;
  AttnOperandRow<T, A::TV> gf;
  float lse_row, delta_row, norm_row;
  attn_bwd_load_row<T>(qf, gf, lse_row, delta_row, norm_row, q, grad_out, lse, delta, bp, sq, h,
                       row, row_ok, lane);
  FragTile<1, A::TD> dqf;
  dqf.clear();

  const int last_row = min(row0 + int(A::BQ), ext.L) - 1;
  int t_begin, t_end;
  attn_key_tiles(p, ext, row0, last_row, A::BK, t_begin, t_end);
  const ushort thread_index = simdgroup * 32 + lane;
  const steel_i64 mask_row = sq.m + h * p.m_hs + row * p.m_rs;
  const AttnBwdKeyTiles<A> f = attn_bwd_key_tiles<A>(p, thread_index, lane);
  const uint bh = uint(zb) * uint(p.Hq) + uint(h);

  for (int t = t_begin; t < t_end; ++t) {
    const int key0 = t * A::BK;
    const bool edge = attn_edge_tile(p, ext, row0, last_row, key0, A::BK);
    if (t > t_begin) threadgroup_barrier(mem_flags::mem_threadgroup);
    FragTile<1, A::TK> ds;
    FragTile<1, A::TK> slope;
    attn_bwd_key_tile<A>(ds, slope, qf, gf, smem, k_h, v_h, p, f, ext, row, key0, row_ok, mask,
                         mask_row, edge, lse_row, norm_row, delta_row, bh, thread_index, lane);
    if (attn_softcap) {
#pragma clang loop unroll(full)
      for (short j = 0; j < A::TK; ++j) {
        ds.frag[j].thread_elements()[0] *= slope.frag[j].thread_elements()[0];
        ds.frag[j].thread_elements()[1] *= slope.frag[j].thread_elements()[1];
      }
    }
    // dQ += dS K (K at the start of smem in both layouts).
    attn_mma_b_pairs<T, A::kLdE>(dqf, ds, smem + f.k_b);
  }

  if (!row_ok) return;  // no barrier follows
  attn_store_row_frags<T, A::TD>(dq + attn_bwd_grad_at(zb, sq.q0, p.Hq, p.L, h, row, p.E), dqf,
                                 p.E, attn_align_e, bp.scale, lane);
}

// (batch entry, head) of the pair `combo` summed into dmask's threadgroup `entry`, and dmask's
// element offset of that entry. Merged batch dims and the head dim are mixed-radix digits,
// innermost (the head) first: the digits of dims dmask keeps come from `entry`, the others from
// `combo`.
inline void attn_dmask_pair(constant AttnBackwardParams& bp, int entry, int combo,
                            thread int& zb, thread int& h, thread steel_i64& dm_off) {
  constant AttnParams& p = bp.fwd;
  const bool keep_h = bp.dm_hs != 0;
  h = keep_h ? entry % p.Hq : combo % p.Hq;
  if (keep_h) {
    entry /= p.Hq;
  } else {
    combo /= p.Hq;
  }
  dm_off = h * bp.dm_hs;
  zb = 0;
  int step = 1;
  if (attn_has_batch) {
    for (int d = p.batch_ndim - 1; d >= 0; --d) {
      const int size = p.batch_shape[d];
      const bool keep = bp.dm_bs[d] != 0;
      const int i = keep ? entry % size : combo % size;
      if (keep) {
        entry /= size;
      } else {
        combo /= size;
      }
      zb += i * step;
      step *= size;
      dm_off += i * bp.dm_bs[d];
    }
  }
}

// The row blocks [rb_begin, rb_end) of bq rows and key tiles [kt_begin, kt_end) of bk keys that
// dmask's threadgroup tg owns: its own (tg.x, tg.y), or every one along a dim the mask
// broadcasts over (STEEL_ATTN_FC_DMASK_ROWS / _KEYS). Shared with the matmul2d dmask.
struct AttnDmaskTiles {
  int rb_begin, rb_end, kt_begin, kt_end;
};

inline AttnDmaskTiles attn_dmask_tiles(constant AttnParams& p, uint3 tg, int bq, int bk) {
  AttnDmaskTiles t;
  t.rb_begin = attn_dmask_rows ? 0 : int(tg.x);
  t.rb_end = attn_dmask_rows ? (p.L + bq - 1) / bq : t.rb_begin + 1;
  t.kt_begin = attn_dmask_keys ? 0 : int(tg.y);
  t.kt_end = attn_dmask_keys ? (p.S + bk - 1) / bk : t.kt_begin + 1;
  return t;
}

// dmask, the gradient of a float attn_mask (dS at the score level, attn_bwd_key_tile), in
// the mask's own shape. A threadgroup owns BQ rows by BK keys of one element of the mask's
// batch and head dims (or every row, every key along a dim the mask broadcasts over, with
// STEEL_ATTN_FC_DMASK_ROWS / _KEYS), and adds dS of every (batch, head) pair the mask
// broadcasts over into fp32 registers in a fixed order; rows and keys are then summed across
// lanes (and, for rows, across simdgroups through `red`) in a fixed order too: no atomics,
// deterministic, and no scratch of B * H * L * S. Q and dO rows are read from device memory for
// each key tile they meet, K and V tiles for each row block: O(L S) of traffic per pair, paid
// only when the mask's gradient is asked for.
template <typename T, short DE, short DV>
inline void attention_bwd_dmask_block(const device T* q, const device T* k, const device T* v,
                                      const device uchar* mask, const device T* grad_out,
                                      const device float* lse, const device float* delta,
                                      device uchar* dmask, constant AttnBackwardParams& bp,
                                      threadgroup T* smem, threadgroup float* red, uint3 tg,
                                      ushort simdgroup, ushort lane) {
  using A = AttnBackward<T, DE, DV, true>;
  constant AttnParams& p = bp.fwd;
  const AttnExtent ext = {p.L, p.S, p.shift};  // dense launches only: varlen has no mask
  const short fr = frag_row(lane);
  const short fc = frag_col(lane);
  const AttnDmaskTiles own = attn_dmask_tiles(p, tg, A::BQ, A::BK);
  const ushort thread_index = simdgroup * 32 + lane;

  const AttnBwdKeyTiles<A> f = attn_bwd_key_tiles<A>(p, thread_index, lane);
  FragTile<1, A::TK> acc;
  acc.clear();
  steel_i64 dm_off = 0;
  bool first = true;
  for (int c = 0; c < bp.dm_combos; ++c) {
    int zb, h;
    attn_dmask_pair(bp, int(tg.z), c, zb, h, dm_off);
    const AttnBwdSeq sq = attn_bwd_seq(bp, nullptr, nullptr, zb);
    const int hk = h / p.group;
    const device T* k_h = k + sq.k + hk * p.k_hs;
    const device T* v_h = v + sq.v + hk * p.v_hs;
    for (int rb = own.rb_begin; rb < own.rb_end; ++rb) {
      const int row0 = rb * A::BQ;
      const int row = row0 + simdgroup * 8 + fr;
      const bool row_ok = attn_align_l || row < p.L;
      AttnOperandRow<T, A::TD> qf;
      AttnOperandRow<T, A::TV> gf;
      float lse_row, delta_row, norm_row;
      attn_bwd_load_row<T>(qf, gf, lse_row, delta_row, norm_row, q, grad_out, lse, delta, bp,
                           sq, h, row, row_ok, lane);
      const steel_i64 mask_row = sq.m + h * p.m_hs + row * p.m_rs;
      const int last_row = min(row0 + int(A::BQ), p.L) - 1;
      int t_begin, t_end;  // the visible tiles (the others have dS = 0) among the owned ones
      attn_key_tiles(p, ext, row0, last_row, A::BK, t_begin, t_end);
      t_begin = max(t_begin, own.kt_begin);
      t_end = min(t_end, own.kt_end);
      for (int t = t_begin; t < t_end; ++t) {
        const int key0 = t * A::BK;
        const bool edge = attn_edge_tile(p, ext, row0, last_row, key0, A::BK);
        if (!first) threadgroup_barrier(mem_flags::mem_threadgroup);
        first = false;
        FragTile<1, A::TK> ds;
        FragTile<1, A::TK> slope;
        attn_bwd_key_tile<A>(ds, slope, qf, gf, smem, k_h, v_h, p, f, ext, row, key0, row_ok,
                             mask, mask_row, edge, lse_row, norm_row, delta_row,
                             uint(zb) * uint(p.Hq) + uint(h), thread_index, lane);
#pragma clang loop unroll(full)
        for (short j = 0; j < A::TK; ++j) {
          acc.frag[j].thread_elements()[0] += ds.frag[j].thread_elements()[0];
          acc.frag[j].thread_elements()[1] += ds.frag[j].thread_elements()[1];
        }
      }
    }
  }

  // Keys broadcast: the row's sum over the lane's keys, then over the four lanes of the row
  // (lane bits 0 and 3, fragment.h's map); it goes to key 0.
  if (attn_dmask_keys) {
    float sum = 0.0f;
#pragma clang loop unroll(full)
    for (short j = 0; j < A::TK; ++j) {
      sum += acc.frag[j].thread_elements()[0] + acc.frag[j].thread_elements()[1];
    }
    sum += simd_shuffle_xor(sum, ushort(1));
    sum += simd_shuffle_xor(sum, ushort(8));
    acc.clear();
    acc.frag[0].thread_elements()[0] = sum;
  }
  // Rows broadcast: each column's sum over the simdgroup's 8 rows (lane bits 1, 2, 4), then over
  // the simdgroups in order; the sums go to row 0 of simdgroup 0.
  if (attn_dmask_rows) {
#pragma clang loop unroll(full)
    for (short j = 0; j < A::TK; ++j) {
#pragma clang loop unroll(full)
      for (short e = 0; e < 2; ++e) {
        float x = acc.frag[j].thread_elements()[e];
        x += simd_shuffle_xor(x, ushort(2));
        x += simd_shuffle_xor(x, ushort(4));
        x += simd_shuffle_xor(x, ushort(16));
        if (fr == 0) red[simdgroup * A::BK + j * 8 + fc + e] = x;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (simdgroup != 0) return;  // no barrier follows
#pragma clang loop unroll(full)
    for (short j = 0; j < A::TK; ++j) {
#pragma clang loop unroll(full)
      for (short e = 0; e < 2; ++e) {
        float x = 0.0f;
        for (short g = 0; g < STEEL_ATTN_SIMDGROUPS; ++g) x += red[g * A::BK + j * 8 + fc + e];
        acc.frag[j].thread_elements()[e] = x;
      }
    }
  }

  const int row = attn_dmask_rows ? fr : int(tg.x) * A::BQ + simdgroup * 8 + fr;
  const int rows = attn_dmask_rows ? 1 : p.L;
  const int keys = attn_dmask_keys ? 1 : p.S;
  if (row >= rows) return;
  const bool f32 = attn_mask == kSteelAttnMaskAddF32;
#pragma clang loop unroll(full)
  for (short j = 0; j < A::TK; ++j) {
#pragma clang loop unroll(full)
    for (short e = 0; e < 2; ++e) {
      const int key = (attn_dmask_keys ? 0 : int(tg.y) * A::BK) + j * 8 + fc + e;
      if (key >= keys) continue;
      const steel_i64 at = dm_off + row * bp.dm_rs + key * bp.dm_cs;
      const float x = acc.frag[j].thread_elements()[e];
      if (f32) {
        ((device float*)dmask)[at] = x;
      } else {
        ((device T*)dmask)[at] = T(x);
      }
    }
  }
}

// dsinks[h] = sum over the batch's rows of exp(sink - lse) * (grad_lse - delta'), where the
// pre-pass's delta' already holds delta - grad_lse. Lanes take rows in turn, simd_sum adds the
// lanes: a fixed order, so the result is deterministic.
template <typename T>
inline void attention_bwd_dsinks(const device float* lse, const device float* delta,
                                 const device uchar* sinks, device uchar* dsinks,
                                 constant AttnBackwardParams& bp, uint3 tg, ushort lane) {
  constant AttnParams& p = bp.fwd;
  const int h = int(tg.x);
  const bool f32 = attn_sinks == kSteelAttnOperandF32;
  const float sink = attn_read<T>(sinks, f32, h);
  float acc = 0.0f;
  const steel_i64 rows = steel_i64(bp.batch) * p.L;
  for (steel_i64 n = lane; n < rows; n += 32) {
    const steel_i64 zb = n / p.L;
    const steel_i64 at = (zb * p.Hq + h) * p.L + (n - zb * p.L);
    const float l = lse[at];
    if (l != -INFINITY) acc -= exp(sink - l) * delta[attn_rows(bp) + at] * delta[at];
  }
  acc = simd_sum(acc);
  if (lane != 0) return;
  if (f32) {
    ((device float*)dsinks)[h] = acc;
  } else {
    ((device T*)dsinks)[h] = T(acc);
  }
}

}  // namespace steel
