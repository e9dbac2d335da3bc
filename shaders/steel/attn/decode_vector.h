// The vector decode kernel: decode.h's launch (grid, GQA packing, split-K partials, dense,
// varlen and paged addressing, quantized K/V: AttnDecodeBlock and AttnDecodeParams) with no MMA.
// With one token per query head a GQA-packed block of decode.h holds group x L real rows of its
// 32, and its 8x8 MMAs run on all 32: 4 in 32 real at GQA 4, 1 in 32 at MHA. Here the
// threadgroup's STEEL_ATTN_DECODE_VECTOR_ROWS packed rows (head h0 + g, query row i0 + i, as
// decode.h packs them) share every K and V tile, staged once per KV head in threadgroup memory
// by the shared tile loader (the dequantizing one for quantized K/V), so the device bytes are
// decode.h's. The simdgroups are row sets x key sets (params.h,
// steel_attn_decode_vector_row_sets): a simdgroup holds the rows r = set + sets * n and takes
// its key set's 1 / key sets of every tile, so each K and V element it reads (one vector load
// of steel_attn_decode_vector_vec elements) is converted to fp32 once for all its rows:
//   - lane c holds elements (32 * k + c) * vec + e of its rows' q (prescaled, fp32) and o;
//   - a key's score is one simd_sum of the lanes' partial dots; lane j keeps the score of the
//     simdgroup's key j of the tile, so the transforms (score.h), the tile max and sum are one
//     lane per key, and the online softmax's max correction is a simd_max across the lanes;
//   - o += p_j V_j reads p_j from lane j by a shuffle and V_j's row from the tile;
//   - after the last tile the key sets' (max, sum, o) of each row are combined in threadgroup
//     memory, half of the sets into the other half per round (log-sum-exp, in set order), and
//     key set 0 stores the rows (or their partials, split).
// Direct reads (STEEL_ATTN_FC_DECODE_DIRECT, dense and varlen K/V in the compute dtype): the key
// sets take whole tiles in turn (set s the tiles t_begin + s, + key sets, ...) and read each key
// row straight from the device, one row a step, so the tile's fixed work (the score transform,
// the online softmax's reductions, the loop) is paid once for up to 32 keys instead of once for
// 32 / key sets, and no tile is staged, loaded by address arithmetic per chunk or waited for at
// a barrier. Each K and V row is still read once by the threadgroup (the planner takes it with
// one row set only: two would read every row twice).
// Rows beyond the packed ones compute nothing. The threadgroup has STEEL_ATTN_SIMDGROUPS (4)
// simdgroups, or 8 or 16 (function constant STEEL_ATTN_FC_DECODE_SIMDGROUPS): the extra ones are
// more key sets over the same tiles, for a one-pass block that fills a GPU core on its own where
// the grid is too small for the cores and a split's merge dispatch costs more than it saves
// (decode_plan.cpp decode_simdgroups). The first STEEL_ATTN_SIMDGROUPS load the tiles (the tile
// loaders' threads); every simdgroup meets every barrier.
#pragma once

#include <metal_stdlib>

#include "../params.h"
#include "decode.h"

using namespace metal;

// The packed rows of every threadgroup of the dispatch (heads_per_tg x row_block <=
// STEEL_ATTN_DECODE_VECTOR_ROWS): the rows a simdgroup runs are known when the pipeline is made,
// so a dense call tests no row in its key loops.
constant int attn_decode_rows [[function_constant(STEEL_ATTN_FC_DECODE_ROWS)]];
// The threadgroup's simdgroups (a multiple of the row sets, at most
// STEEL_ATTN_DECODE_VECTOR_MAX_SIMDGROUPS; the plan sets it, and the dispatch's threads match).
constant int attn_decode_simdgroups [[function_constant(STEEL_ATTN_FC_DECODE_SIMDGROUPS)]];
constant bool attn_decode_direct_fc [[function_constant(STEEL_ATTN_FC_DECODE_DIRECT)]];
// Paged and quantized K/V stay on the tile loaders (their addressing and dequantizing live there),
// and an aliased V is K's staged tile.
constant bool attn_decode_direct =
    attn_decode_direct_fc && !attn_paged && !attn_quant && !attn_kv_alias;

namespace steel {

template <typename T, short DE, short DV>
struct AttnDecodeVector {
  using A = AttnForward<T, DE, DV>;
  // Row sets, a simdgroup's rows and its key sets: constants of the pipeline (from its packed
  // rows and simdgroups). Its row arrays hold kMaxRows, the most rows a simdgroup can have (at
  // one row set); the rows past row_rows() are dead code the pipeline's constants fold away.
  static constant constexpr short kMaxRows = STEEL_ATTN_DECODE_VECTOR_ROWS;
  static short row_sets() {
    return short(steel_attn_decode_vector_row_sets(DE, DV, int(sizeof(T)), attn_decode_rows));
  }
  static short row_rows() { return (short(attn_decode_rows) + row_sets() - 1) / row_sets(); }
  static short key_sets() { return short(attn_decode_simdgroups) / row_sets(); }
  static short keys() { return A::BK / key_sets(); }
  static constant constexpr short kVecE = short(steel_attn_decode_vector_vec(DE));
  static constant constexpr short kVecV = short(steel_attn_decode_vector_vec(DV));
  static constant constexpr short QE = short(steel_attn_decode_vector_elems(DE));  // per lane
  static constant constexpr short QV = short(steel_attn_decode_vector_elems(DV));
  // A combining slot: a simdgroup's rows' o, then their max and sum. The tiles' threadgroup
  // memory holds slots() of them a row set, the writers of one combining step (a round of more
  // key sets takes several steps).
  static int slot_floats() { return int(row_rows()) * (DV + 2); }
  static short slots() {
    return short(A::kTileElems * int(sizeof(T)) / (int(row_sets()) * slot_floats() * 4));
  }
  // A key of every tile for each key set: at 4 simdgroups always; a wider block only where its
  // key sets are at most the key tile (decode_plan.cpp decode_simdgroups).
  static_assert(A::BK >= STEEL_ATTN_SIMDGROUPS, "a key of every tile for each of 4 key sets");
  static_assert(A::kTileElems * int(sizeof(T)) >= kMaxRows * (DV + 2) * 4,
                "one combining slot of the most rows fits the K/V tiles' memory");
  // Slot n of row set `set` is packed row set + row_sets() * n: slots past the dispatch's rows
  // exist in no threadgroup (pipeline constants), and the others are all real unless a sequence
  // (varlen, paged) has fewer query rows than the dispatch or the row sets split the rows
  // unevenly; only then is each slot tested.
  static bool live(short n) { return n < row_rows(); }
  static bool tested() { return attn_varlen || attn_decode_rows % row_sets() != 0; }
};

// N consecutive elements of a tile row as fp32, in one load where N is 2 or 4 (the address is
// N elements aligned: tile rows start 16-byte aligned and lanes start N elements apart).
template <typename T, short N>
inline void attn_vector_read(thread float* dst, const threadgroup T* src) {
  if (N == 4) {
    const vec<T, 4> x = *((const threadgroup vec<T, 4>*)src);
#pragma clang loop unroll(full)
    for (short e = 0; e < 4; ++e) dst[e] = float(x[e]);
  } else if (N == 2) {
    const vec<T, 2> x = *((const threadgroup vec<T, 2>*)src);
    dst[0] = float(x[0]);
    dst[1] = float(x[1]);
  } else {
    dst[0] = float(src[0]);
  }
}

// This lane's elements of one tile row (D columns, vec N): element c * N + e of the lane's
// share is column (32 * c + lane) * N + e; past D (only where D is not whole 32-lane chunks,
// compile time) they read as 0.
template <typename T, short D, short N, short Q>
inline void attn_vector_row(thread float* dst, const threadgroup T* row, ushort lane) {
#pragma clang loop unroll(full)
  for (short c = 0; c < Q / N; ++c) {
    const int col = (32 * c + int(lane)) * N;
    if (D % (32 * N) == 0 || col < D) {
      attn_vector_read<T, N>(dst + c * N, row + col);
    } else {
#pragma clang loop unroll(full)
      for (short e = 0; e < N; ++e) dst[c * N + e] = 0.0f;
    }
  }
}

// This lane's elements of one device row (D columns of which `cols` are real, vec N), as
// attn_vector_row reads a tile row: `row` points at the lane's first element (column
// col0 = lane * N of the row), so chunk c is a compile-time step away. `whole` (cols == D, a
// pipeline constant) reads no bound, `vectorized` (the row starts 16-byte aligned, so N elements
// are N aligned) one load a chunk; columns past `cols` read as 0 and are not touched.
template <typename T, short D, short N, short Q>
inline void attn_vector_row(thread float* dst, const device T* row, int col0, short cols,
                            bool whole, bool vectorized) {
#pragma clang loop unroll(full)
  for (short c = 0; c < Q / N; ++c) {
    const int col = col0 + 32 * N * c;
    const device T* src = row + 32 * N * c;
    if (whole && vectorized && (D % (32 * N) == 0 || col < D)) {
      if (N == 4) {
        const vec<T, 4> x = *((const device vec<T, 4>*)src);
#pragma clang loop unroll(full)
        for (short e = 0; e < 4; ++e) dst[c * N + e] = float(x[e]);
      } else if (N == 2) {
        const vec<T, 2> x = *((const device vec<T, 2>*)src);
        dst[c * N] = float(x[0]);
        dst[c * N + 1] = float(x[1]);
      } else {
        dst[c * N] = float(src[0]);
      }
    } else {
#pragma clang loop unroll(full)
      for (short e = 0; e < N; ++e) {
        dst[c * N + e] = col + e < (whole ? int(D) : int(cols)) ? float(src[e]) : 0.0f;
      }
    }
  }
}

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
  const short row_set = short(simdgroup) % V::row_sets();
  const short key_set = short(simdgroup) / V::row_sets();

  // This simdgroup's rows: slot s = row_set + row_sets() * n is head h0 + s / R, query row
  // i0 + s % R, for the R = last_row - i0 + 1 rows of the block (so the real slots come first,
  // heads_per_tg x R of them). A slot that is not real keeps a head and query row of the block
  // for its addresses and reads nothing through them.
  const int block_rows = last_row - i0 + 1;
  int rh[V::kMaxRows], ri[V::kMaxRows];
  bool rok[V::kMaxRows];
  float qv[V::kMaxRows][V::QE], ov[V::kMaxRows][V::QV];
  OnlineSoftmax sm[V::kMaxRows];
  const short E = short(p.E), Ev = short(p.Ev);
  // Split partitions leave the sink to the merge, which must count it once; of the key sets,
  // set 0 counts it.
  const bool sink_here = attn_sinks != kSteelAttnOperandNone && !attn_split && key_set == 0;
  // Read once, not per slot or element (constant-buffer reads are lanes' loads too).
  const int heads = dp.heads_per_tg;
  const steel_i64 q_hs = p.q_hs, q_rs = p.q_rs;
  const float q_scale = p.q_scale;
  #pragma clang loop unroll(full)
  for (short n = 0; n < V::kMaxRows; ++n) {
    // A dead slot (past the pipeline's rows) is never read below: nothing to set up.
    if (!V::live(n)) continue;
    const int r = row_set + V::row_sets() * n;
    const int g = r / block_rows;
    rok[n] = g < heads;
    ri[n] = i0 + r - g * block_rows;
    rh[n] = h0 + min(g, heads - 1);
    const device T* qrow = q + xq.q_off + rh[n] * q_hs + ri[n] * q_rs;
    #pragma clang loop unroll(full)
    for (short c = 0; c < V::QE; ++c) {
      const int d = (32 * (c / V::kVecE) + lane) * V::kVecE + c % V::kVecE;
      qv[n][c] = rok[n] && d < E ? float(qrow[d]) * q_scale : 0.0f;
    }
    #pragma clang loop unroll(full)
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
  const bool loads = simdgroup < STEEL_ATTN_SIMDGROUPS;  // the tile loaders' threads
  const steel_i64 m_cs = attn_mask != kSteelAttnMaskNone ? p.m_cs : 0;
  // Tiled: every simdgroup visits every tile, taking keys j0 .. j0 + n_keys of it. Direct: key
  // set s visits the tiles t_begin + s, + key sets, ..., taking each one's valid keys.
  const short n_keys = V::keys();
  const short j0 = attn_decode_direct ? 0 : key_set * n_keys;
  const int t_step = attn_decode_direct ? V::key_sets() : 1;
  for (int t = t_begin + (attn_decode_direct ? key_set : 0); t < t_end; t += t_step) {
    const int key0 = t * A::BK;
    const short valid = short(min(int(A::BK), ext.S - key0));
    const bool whole = attn_align_s || valid == A::BK;
    const bool edge = attn_edge_tile(p, ext, i0, last_row, key0, A::BK);
    const short keys_here = attn_decode_direct ? valid : n_keys;

    if (!attn_decode_direct) {
      if (t > t_begin) threadgroup_barrier(mem_flags::mem_threadgroup);
      if (loads) {
        b.load_k(Ks, key0, valid, E, whole, thread_index);
        if (!A::kShared && !A::alias()) b.load_v(Vs, key0, valid, Ev, whole, thread_index);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // Scores: lane j ends with key key0 + j0 + j's score of each row (-inf past keys_here).
    // Each key row is read and converted once, for all rows.
    float s[V::kMaxRows];
    #pragma clang loop unroll(full)
    for (short n = 0; n < V::kMaxRows; ++n) s[n] = -INFINITY;
    // Direct: this lane's first element of the tile's first key row, one row stride a key
    // (formed, not read, when staged).
    const int k_col0 = int(lane) * V::kVecE;
    const device T* kd = b.k + steel_i64(key0) * b.k_rows.ld + k_col0;
    const threadgroup T* kj = Ks + j0 * A::kLdK;
    for (short j = 0; j < keys_here; ++j, kj += A::kLdK, kd += b.k_rows.ld) {
      float kf[V::QE];
      if (attn_decode_direct) {
        attn_vector_row<T, DE, V::kVecE, V::QE>(kf, kd, k_col0, E, attn_align_e, attn_vec_k);
      } else {
        attn_vector_row<T, DE, V::kVecE, V::QE>(kf, kj, lane);
      }
      #pragma clang loop unroll(full)
      for (short n = 0; n < V::kMaxRows; ++n) {
        if (!V::live(n) || (V::tested() && !rok[n])) continue;  // uniform
        float dot = 0.0f;
        #pragma clang loop unroll(full)
        for (short c = 0; c < V::QE; ++c) dot += qv[n][c] * kf[c];
        dot = simd_sum(dot);
        s[n] = short(lane) == j ? dot : s[n];
      }
    }
    const int key = key0 + j0 + lane;
    #pragma clang loop unroll(full)
    for (short n = 0; n < V::kMaxRows; ++n) {
      if (!V::live(n) || (V::tested() && !rok[n])) continue;
      if (lane < keys_here) {
        const steel_i64 mask_row =
            attn_mask != kSteelAttnMaskNone ? b.m_off + rh[n] * p.m_hs + ri[n] * p.m_rs : 0;
        float th = 0.0f;
        s[n] = attn_score<T>(s[n], p, ext, ri[n], key, true, mask, mask_row + key * m_cs, edge,
                             th);
      }
      // The online softmax across the simdgroup's lanes: m' = max(m, max_j s_j).
      const float m_new = max(sm[n].m, simd_max(s[n]));
      const float shift = m_new == -INFINITY ? 0.0f : m_new;
      const float factor = exp2((sm[n].m - shift) * attn_exp_unit);
      s[n] = exp2((s[n] - shift) * attn_exp_unit);
      sm[n].l = sm[n].l * factor + simd_sum(s[n]);
      sm[n].m = m_new;
      #pragma clang loop unroll(full)
      for (short c = 0; c < V::QV; ++c) ov[n][c] *= factor;
    }

    // V takes K's place once every simdgroup has its scores
    if (!attn_decode_direct && A::kShared && !A::alias()) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (loads) b.load_v(Vs, key0, valid, Ev, whole, thread_index);
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    const short ldv = A::alias() ? A::kLdK : A::kLdV;
    const threadgroup T* vj = (A::alias() ? Ks : Vs) + j0 * ldv;
    const int v_col0 = int(lane) * V::kVecV;
    const device T* vd = b.v + steel_i64(key0) * b.v_rows.ld + v_col0;
    for (short j = 0; j < keys_here; ++j, vj += ldv, vd += b.v_rows.ld) {
      float vf[V::QV];
      if (attn_decode_direct) {
        attn_vector_row<T, DV, V::kVecV, V::QV>(vf, vd, v_col0, Ev, attn_align_ev, attn_vec_v);
      } else {
        attn_vector_row<T, DV, V::kVecV, V::QV>(vf, vj, lane);
      }
      #pragma clang loop unroll(full)
      for (short n = 0; n < V::kMaxRows; ++n) {
        if (!V::live(n) || (V::tested() && !rok[n])) continue;
        const float pj = simd_shuffle(s[n], ushort(j));
        #pragma clang loop unroll(full)
        for (short c = 0; c < V::QV; ++c) ov[n][c] += pj * vf[c];
      }
    }
  }

  // The key sets' rows, combined: in each round sets [half, 2 half) leave (o, m, l) of their
  // rows in a slot and sets [0, half) fold in the slot of set + half, in steps of at most
  // slots() writers (the tiles' memory). Uniform loops: every simdgroup meets every barrier.
  threadgroup float* slots = (threadgroup float*)smem;
  for (short half = V::key_sets() / 2; half > 0; half /= 2) {
    for (short first = half; first < 2 * half; first += V::slots()) {
      const short w = key_set - first;  // this set's slot, if it writes in this step
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the tiles' (or the last step's) reads
      if (w >= 0 && w < V::slots() && key_set < 2 * half) {
        threadgroup float* slot = slots + (w * V::row_sets() + row_set) * V::slot_floats();
        #pragma clang loop unroll(full)
        for (short n = 0; n < V::kMaxRows; ++n) {
          if (!V::live(n) || (V::tested() && !rok[n])) continue;
          #pragma clang loop unroll(full)
          for (short c = 0; c < V::QV; ++c) {
            const int d = (32 * (c / V::kVecV) + lane) * V::kVecV + c % V::kVecV;
            if (DV % (32 * V::kVecV) == 0 || d < DV) slot[n * DV + d] = ov[n][c];
          }
          if (lane == 0) {
            slot[V::row_rows() * DV + 2 * n] = sm[n].m;
            slot[V::row_rows() * DV + 2 * n + 1] = sm[n].l;
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      const short r = key_set + half - first;  // the slot this set folds in, if any
      if (key_set < half && r >= 0 && r < V::slots()) {
        const threadgroup float* slot = slots + (r * V::row_sets() + row_set) * V::slot_floats();
        #pragma clang loop unroll(full)
        for (short n = 0; n < V::kMaxRows; ++n) {
          if (!V::live(n) || (V::tested() && !rok[n])) continue;
          const float m_b = slot[V::row_rows() * DV + 2 * n];
          const float l_b = slot[V::row_rows() * DV + 2 * n + 1];
          const float m_new = max(sm[n].m, m_b);
          const float shift = m_new == -INFINITY ? 0.0f : m_new;
          const float fa = exp2((sm[n].m - shift) * attn_exp_unit);
          const float fb = exp2((m_b - shift) * attn_exp_unit);
          sm[n].l = sm[n].l * fa + l_b * fb;
          sm[n].m = m_new;
          #pragma clang loop unroll(full)
          for (short c = 0; c < V::QV; ++c) {
            const int d = (32 * (c / V::kVecV) + lane) * V::kVecV + c % V::kVecV;
            const float o_b = DV % (32 * V::kVecV) == 0 || d < DV ? slot[n * DV + d] : 0.0f;
            ov[n][c] = ov[n][c] * fa + o_b * fb;
          }
        }
      }
    }
  }
  if (key_set != 0) return;  // no barrier follows

  #pragma clang loop unroll(full)

  for (short n = 0; n < V::kMaxRows; ++n) {
    if (!V::live(n) || (V::tested() && !rok[n])) continue;
    const int h = rh[n], i = ri[n];
    if (attn_split) {
      const steel_i64 pr = attn_partial_row(dp, zb, h, i) + split;
      #pragma clang loop unroll(full)
      for (short c = 0; c < V::QV; ++c) {
        const int d = (32 * (c / V::kVecV) + lane) * V::kVecV + c % V::kVecV;
        if (d < Ev) part_o[pr * p.Ev + d] = ov[n][c];
      }
      if (lane == 0) {
        part_ml[2 * pr] = sm[n].m * attn_unit_nats;
        part_ml[2 * pr + 1] = sm[n].l;
      }
    } else {
      const float inv = sm[n].inverse_sum();
      device T* orow = out + xq.o_off + h * p.o_hs + i * p.o_rs;
      #pragma clang loop unroll(full)
      for (short c = 0; c < V::QV; ++c) {
        const int d = (32 * (c / V::kVecV) + lane) * V::kVecV + c % V::kVecV;
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
