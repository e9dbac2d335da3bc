// The attention forward block (flash attention, prefill): one threadgroup computes BQ query rows
// of one (batch, head) against every key it may see, and stores their output and log-sum-exp.
//
// Shape of the work (mps_src/plan/attention_plan.cpp chooses the kernel and the constants):
//   - grid (ceil(L / BQ), Hq, batch); STEEL_ATTN_SIMDGROUPS simdgroups, each owning 8 query rows
//     whose Q (prescaled, fp32) and O accumulators stay in registers for the whole head dim;
//   - keys are walked in tiles of BK: the K and V tiles are copied to threadgroup memory by
//     AttnTileLoader (zero fill on the ragged last tile and past the head dim), S = Q K^T is
//     born in 8x8 fp32 fragments, transformed (score.h), turned into probabilities by the online
//     softmax (softmax.h), and O += P V without leaving registers;
//   - causal and window limits are loop bounds: tiles wholly hidden from every row of the block
//     are never visited, and only tiles that cross a boundary test elements (score.h);
//   - GQA is a stride: query head h reads key/value head h / group;
//   - varlen (STEEL_ATTN_FC_VARLEN): one launch for a packed batch, grid
//     (ceil(max_seqlen_q / BQ), Hq, sequences). A threadgroup reads its sequence's offsets from
//     cu_seqlens_q / cu_seqlens_k on the device, moves q, k, v, out and lse to the sequence's
//     first token, and takes the sequence's L, S and diagonal shift as its extent (score.h);
//     blocks past the end of their sequence leave at once. With the constant off, the extent is
//     AttnParams' and the varlen code compiles away.
// Quantized K and V (STEEL_ATTN_FC_QUANT, torch_steel.kv): int8 or 4-bit codes with their
// scales (and mins), dequantized into the same threadgroup tiles in T by AttnQuantKv, so the
// math after the load is the fp16/bf16 path's.
// Barriers: separate K and V tiles take two per key tile (before the loads overwrite the
// previous tile, after them); when K and V share one buffer (large head dims) four. When v is
// a prefix view of k (STEEL_ATTN_FC_KV_ALIAS) V is never loaded: P V reads the K tile, with two
// barriers per tile whatever the head dims.
#pragma once

#include <metal_stdlib>

#include "../fragment.h"
#include "../params.h"
#include "dropout.h"
#include "loader.h"
#include "score.h"
#include "softmax.h"

using namespace metal;

constant bool attn_align_l [[function_constant(STEEL_ATTN_FC_ALIGN_L)]];
constant bool attn_align_s [[function_constant(STEEL_ATTN_FC_ALIGN_S)]];
constant bool attn_align_e [[function_constant(STEEL_ATTN_FC_ALIGN_E)]];
constant bool attn_align_ev [[function_constant(STEEL_ATTN_FC_ALIGN_EV)]];
constant bool attn_vec_k [[function_constant(STEEL_ATTN_FC_VEC_K)]];
constant bool attn_vec_v [[function_constant(STEEL_ATTN_FC_VEC_V)]];
constant int attn_sinks [[function_constant(STEEL_ATTN_FC_SINKS)]];
constant bool attn_has_batch [[function_constant(STEEL_ATTN_FC_HAS_BATCH)]];
constant bool attn_varlen [[function_constant(STEEL_ATTN_FC_VARLEN)]];
constant bool attn_varlen_br [[function_constant(STEEL_ATTN_FC_VARLEN_BR)]];
constant bool attn_kv_alias [[function_constant(STEEL_ATTN_FC_KV_ALIAS)]];
constant bool attn_lse [[function_constant(STEEL_ATTN_FC_LSE)]];
// Quantized K and V (params.h, STEEL_ATTN_FC_QUANT): their formats.
constant bool attn_quant [[function_constant(STEEL_ATTN_FC_QUANT)]];
constant int attn_k_bits [[function_constant(STEEL_ATTN_FC_K_BITS)]];
constant int attn_k_group [[function_constant(STEEL_ATTN_FC_K_GROUP)]];
constant bool attn_k_scale_f32 [[function_constant(STEEL_ATTN_FC_K_SCALE_F32)]];
constant int attn_v_bits [[function_constant(STEEL_ATTN_FC_V_BITS)]];
constant int attn_v_group [[function_constant(STEEL_ATTN_FC_V_GROUP)]];
constant bool attn_v_scale_f32 [[function_constant(STEEL_ATTN_FC_V_SCALE_F32)]];

namespace steel {

// The lane's element of fragment (0, 0) of a tile read by attn_mma_bt (lane element (d, j) at
// tile[j * kLd + d]) and by attn_mma_b_at (element (j, n) at tile[j * kLd + n]): the offset is the
// same for every tile, so a loop over tiles forms it once.
template <short kLd>
inline short attn_bt_offset(ushort lane) { return frag_col(lane) * kLd + frag_row(lane); }
template <short kLd>
inline short attn_b_offset(ushort lane) { return frag_row(lane) * kLd + frag_col(lane); }

// Tile sizes of the kernel for head dims DE (q, k) and DV (v, out); params.h has the rules.
// kPrefill: the prefill forward's K/V buffer (steel_attn_prefill_shared_kv), with V in fp32 where
// steel_attn_prefill_v_f32 says (VT), else the decode kernels' (steel_attn_shared_kv, V in T).
// BK is the same for both.
template <typename T, short DE, short DV, bool kPrefill = false>
struct AttnForward {
  static constant constexpr short BQ = STEEL_ATTN_BQ;
  static constant constexpr short kThreads = 32 * STEEL_ATTN_SIMDGROUPS;
  static constant constexpr short BK = short(steel_attn_bk(DE, DV, int(sizeof(T))));
  static constant constexpr bool kVF32 =
      kPrefill && steel_attn_prefill_v_f32(DE, DV, int(sizeof(T)));
  using VT = conditional_t<kVF32, float, T>;  // the V tile's elements
  static constant constexpr bool kShared =
      kPrefill ? steel_attn_prefill_shared_kv(DE, DV, int(sizeof(T)))
               : steel_attn_shared_kv(DE, DV, int(sizeof(T)));
  static constant constexpr short kLdK = short(steel_attn_ld(DE, int(sizeof(T))));
  static constant constexpr short kLdV = short(steel_attn_ld(DV, int(sizeof(VT))));
  static constant constexpr int kKElems = BK * kLdK;
  static constant constexpr int kVElems = BK * kLdV;  // of VT
  static constant constexpr int kKBytes = kKElems * int(sizeof(T));
  static constant constexpr int kVBytes = kVElems * int(sizeof(VT));
  static constant constexpr int kTileElems =  // of T
      (kShared ? (kKBytes > kVBytes ? kKBytes : kVBytes) : kKBytes + kVBytes) / int(sizeof(T));
  static constant constexpr short TD = DE / 8;  // Q fragments per row block
  static constant constexpr short TV = DV / 8;  // O fragments
  static constant constexpr short TK = BK / 8;  // score fragments per key tile
  static_assert(DE % 8 == 0 && DV % 8 == 0, "head dims are instantiated in multiples of 8");
  static_assert(kTileElems * int(sizeof(T)) ==
                    (kPrefill ? steel_attn_prefill_threadgroup_bytes(DE, DV, int(sizeof(T)))
                              : steel_attn_threadgroup_bytes(DE, DV, int(sizeof(T)))),
                "the planner's threadgroup-memory figure must match the kernel's");
  // The V tile follows the K tile: keep it 16-byte aligned for the loader's chunk stores.
  static_assert(kKBytes % 16 == 0, "V tile alignment");

  using LoaderK = AttnTileLoader<T, BK, DE, kLdK, kThreads>;
  using LoaderV = AttnTileLoader<T, BK, DV, kLdV, kThreads, VT>;

  // The V tile in the buffer that holds the K tile at `smem`.
  static threadgroup VT* v_tile(threadgroup T* smem) {
    return (threadgroup VT*)(kShared ? smem : smem + kKElems);
  }

  // STEEL_ATTN_FC_KV_ALIAS: v is the first Ev columns of k's rows, so the V tile is the K tile
  // (its first DV columns, rows kLdK apart). Only where those columns lie within the K tile's
  // rows; the planner sets the constant only then (attn::kv_alias).
  static constant constexpr bool kCanAlias = DV <= DE;
  static bool alias() { return kCanAlias && attn_kv_alias; }
  // The decode kernels' O += P V (their V tile is in T), V from its own tile or from the K
  // tile: `Vb` is the lane's element of fragment (0, 0) of that tile (attn_b_offset).
  static void mma_pv(thread FragTile<1, TV>& o, thread const FragTile<1, TK>& s,
                     const threadgroup T* Vb);
  static void mma_pv(thread FragTile<1, TV>& o, thread const FragTile<1, TK>& s,
                     const threadgroup T* Ks, const threadgroup T* Vs, ushort lane) {
    mma_pv(o, s, pv_tile(Ks, Vs) + pv_offset(lane));
  }
  // The tile P V reads.
  static const threadgroup T* pv_tile(const threadgroup T* Ks, const threadgroup T* Vs) {
    return alias() ? Ks : Vs;
  }
  static short pv_offset(ushort lane) {
    return alias() ? attn_b_offset<kLdK>(lane) : attn_b_offset<kLdV>(lane);
  }
};

// The scale and min buffers of a quantized pipeline and where their rows lie (absent, never
// read, without STEEL_ATTN_FC_QUANT).
struct AttnQuantBuffers {
  const device uchar* k_scales;
  const device uchar* k_mins;  // 4-bit K only (int8: the scales stand in, never read)
  const device uchar* v_scales;
  const device uchar* v_mins;
  constant AttnQuantParams* qp;
};

// One quantized K or V operand of a threadgroup's (batch entry or sequence, KV head): its
// codes, scales and mins from the first key, where its rows lie (bytes for the codes, scale
// elements for the scales and mins) and its format. load() fills a tile of keys key0 .. through
// AttnQuantTileLoader, dequantized to T, as AttnTileLoader fills the tile of an fp16 operand.
struct AttnQuantKv {
  const device uchar* codes;
  const device uchar* scales;
  const device uchar* mins;
  AttnKvRows rows;
  AttnKvRows scale_rows;
  AttnQuantFormat f;

  template <typename T, short kRows, short kCols, short kLd, short kThreads, typename TD = T>
  void load(threadgroup TD* dst, int key0, short valid_rows, short valid_cols, bool vec,
            ushort thread_index) const {
    AttnKvRows r = rows, sr = scale_rows;
    const device uchar* c = codes;
    const device uchar* s = scales;
    const device uchar* m = mins;
    if (r.paged) {  // paged rows are found from the table, key by key
      r.key0 = key0;
      sr.key0 = key0;
    } else {
      c += key0 * r.ld;
      const steel_i64 bytes = key0 * sr.ld * (f.scale_f32 ? 4 : 2);
      s += bytes;
      m += bytes;
    }
    AttnQuantTileLoader<T, kRows, kCols, kLd, kThreads, TD>::load(dst, c, r, s, m, sr, valid_rows,
                                                                 valid_cols, f, vec, thread_index);
  }
};

// K's (`value` false) or V's operand: the codes `code_off` bytes and the scales `scale_off`
// elements past their buffers' starts, rows as `rows` (bytes) and `scale_rows` (elements).
inline AttnQuantKv attn_quant_kv(bool value, const device void* codes, steel_i64 code_off,
                                 AttnQuantBuffers b, steel_i64 scale_off, AttnKvRows rows,
                                 AttnKvRows scale_rows) {
  AttnQuantKv x;
  x.f.bits = short(value ? attn_v_bits : attn_k_bits);
  x.f.group = short(value ? attn_v_group : attn_k_group);
  x.f.scale_f32 = value ? attn_v_scale_f32 : attn_k_scale_f32;
  const steel_i64 bytes = scale_off * (x.f.scale_f32 ? 4 : 2);
  x.codes = (const device uchar*)codes + code_off;
  x.scales = (value ? b.v_scales : b.k_scales) + bytes;
  x.mins = (value ? b.v_mins : b.k_mins) + bytes;
  x.rows = rows;
  x.scale_rows = scale_rows;
  return x;
}

// The element offset of batch entry `zb` in a tensor with these merged batch strides (64-bit:
// B * H * L * E passes 2^31 in real models).
inline steel_i64 attn_batch_offset(constant AttnParams& p, constant steel_i64* strides, int zb) {
  steel_i64 off = 0;
  if (attn_has_batch) {
    int z = zb;
    for (int d = p.batch_ndim - 1; d >= 0; --d) {
      off += (z % p.batch_shape[d]) * strides[d];
      z /= p.batch_shape[d];
    }
  }
  return off;
}

// Loads the lane's elements of a row of fragments straight from device memory (the row that
// frag_row(lane) names, `row_ptr` pointing at its element 0), times `mult`; zero past the
// tensor's rows (!row_ok) and past `cols`, so padded head-dim columns add nothing.
template <typename T, short N>
inline void attn_load_row_frags(thread FragTile<1, N>& f, const device T* row_ptr, bool row_ok,
                                int cols, bool whole_cols, float mult, ushort lane) {
  const short fc = frag_col(lane);
  for (short d = 0; d < N; ++d) {
#pragma clang loop unroll(full)
    for (short e = 0; e < 2; ++e) {
      const int col = d * 8 + fc + e;
      const bool in = row_ok && (whole_cols || col < cols);
      f.frag[d].thread_elements()[e] = in ? float(row_ptr[col]) * mult : 0.0f;
    }
  }
}

// acc[j] += a[d] * tile^T over d < TA, j < TC: tile (threadgroup memory, rows of kLd) holds
// the B operand transposed, as K holds K^T for Q K^T (lane element (d, j) at tile[j * kLd + d]).
// Every product of the kernels' loops is one of these two shapes, in this order. `base` is the
// lane's element of fragment (0, 0) (attn_bt_offset); every other fragment is a compile-time
// offset from it once both loops are unrolled, so the loop forms no addresses per product.
template <typename T, short kLd, short TA, short TC>
inline void attn_mma_bt_at(thread FragTile<1, TC>& acc, thread const FragTile<1, TA>& a,
                           const threadgroup T* base) {
#pragma clang loop unroll(full)
  for (short d = 0; d < TA; ++d) {
#pragma clang loop unroll(full)
    for (short j = 0; j < TC; ++j) {
      simdgroup_matrix<float, 8, 8> b;
      frag_load(b, base + j * 8 * kLd + d * 8, kLd);
      simdgroup_multiply_accumulate(acc.frag[j], a.frag[d], b, acc.frag[j]);
    }
  }
}

template <typename T, short kLd, short TA, short TC>
inline void attn_mma_bt(thread FragTile<1, TC>& acc, thread const FragTile<1, TA>& a,
                        const threadgroup T* tile, ushort lane) {
  attn_mma_bt_at<T, kLd>(acc, a, tile + attn_bt_offset<kLd>(lane));
}

// acc[n] += a[j] * tile over j < TA, n < TC: tile holds the B operand as it lies (V for P V);
// `base` as attn_mma_bt_at's (attn_b_offset).
template <typename T, short kLd, short TA, short TC>
inline void attn_mma_b_at(thread FragTile<1, TC>& acc, thread const FragTile<1, TA>& a,
                          const threadgroup T* base) {
#pragma clang loop unroll(full)
  for (short j = 0; j < TA; ++j) {
#pragma clang loop unroll(full)
    for (short n = 0; n < TC; ++n) {
      simdgroup_matrix<float, 8, 8> b;
      frag_load(b, base + j * 8 * kLd + n * 8, short(1));
      simdgroup_multiply_accumulate(acc.frag[n], a.frag[j], b, acc.frag[n]);
    }
  }
}

// MMA operands in the inputs' dtype: the prefill's Q and K fragments (attention_forward_block),
// and the backward's K and V rows (dK/dV kernel) and Q and dO rows (dQ, dmask). They stay in
// dtype T: the MMA multiplies two half or bfloat operands into its fp32 accumulator exactly
// (a product of two 11- or 8-bit significands fits fp32's 24; the GEMM's BlockMMA does the
// same, gemm/mma.h), so S = Q K^T is what fp32 operands give, without converting each K
// element each time a fragment of it is loaded (2 a lane per MMA: at head dim 128, 128 of a
// simdgroup's 260 conversions per key tile; V's fragments took another 128) and with Q in
// half the registers.
// The probabilities stay fp32 (rounding them to T would add its roundoff to every weight), so
// the V fragments are fp32: widened as the loader stores the tile where the prefill's tile
// bytes allow (AttnForward::VT), else each read as one 2-element load and widened.
template <typename T, short N>
struct AttnOperandRow {
  simdgroup_matrix<T, 8, 8> frag[N];
};

// A row of operand fragments (Q's, or the backward's K, V, dO) straight from device memory,
// unscaled (the scores take the scale after Q K^T: scaling in T would round it); zero past the
// tensor's rows and past `cols`.
template <typename T, short N>
inline void attn_load_row_operands(thread AttnOperandRow<T, N>& f, const device T* row_ptr,
                                   bool row_ok, int cols, bool whole_cols, ushort lane) {
  const short fc = frag_col(lane);
  for (short d = 0; d < N; ++d) {
#pragma clang loop unroll(full)
    for (short e = 0; e < 2; ++e) {
      const int col = d * 8 + fc + e;
      const bool in = row_ok && (whole_cols || col < cols);
      f.frag[d].thread_elements()[e] = in ? row_ptr[col] : T(0);
    }
  }
}

// acc[j] += a[d] * tile^T as attn_mma_bt_at, with a and the tile's fragments in T, over the
// first `frags` of the TC score fragments only (uniform over the simdgroup; the rest are keys
// hidden from every row of it, attn_visible_frags). An interior tile passes frags = TC, a
// constant once inlined, so its branch folds away. Fragment j sums over d in order either way,
// so the scores it computes are the full product's.
template <typename T, short kLd, short TA, short TC>
inline void attn_mma_bt_operands(thread FragTile<1, TC>& acc,
                                 thread const AttnOperandRow<T, TA>& a, const threadgroup T* base,
                                 short frags) {
#pragma clang loop unroll(full)
  for (short j = 0; j < TC; ++j) {
    if (j < frags) {
#pragma clang loop unroll(full)
      for (short d = 0; d < TA; ++d) {
        simdgroup_matrix<T, 8, 8> b;
        const threadgroup T* src = base + j * 8 * kLd + d * 8;
        b.thread_elements()[0] = src[0];
        b.thread_elements()[1] = src[kLd];
        simdgroup_multiply_accumulate(acc.frag[j], a.frag[d], b, acc.frag[j]);
      }
    }
  }
}

// acc[n] += a[j] * tile as attn_mma_b_at, each lane's two elements of a tile fragment read as
// one 2-element load (adjacent: frag_col and every fragment offset are even, the rows 16-byte
// aligned, so the load is aligned to its size) and widened to fp32 (a tile of T); a tile
// already in fp32 (the prefill's V where steel_attn_prefill_v_f32) is read as it lies.
template <typename T, short kLd, short TA, short TC>
inline void attn_mma_b_pairs(thread FragTile<1, TC>& acc, thread const FragTile<1, TA>& a,
                             const threadgroup T* base) {
#pragma clang loop unroll(full)
  for (short j = 0; j < TA; ++j) {
#pragma clang loop unroll(full)
    for (short n = 0; n < TC; ++n) {
      simdgroup_matrix<float, 8, 8> b;
      // One conversion of the pair as a vector.
      b.thread_elements() = float2(*((const threadgroup vec<T, 2>*)(base + j * 8 * kLd + n * 8)));
      simdgroup_multiply_accumulate(acc.frag[n], a.frag[j], b, acc.frag[n]);
    }
  }
}

// attn_mma_b_pairs over the first `frags` fragments of a only: the weights of the others are
// 0 (keys hidden from every row of the simdgroup).
template <typename T, short kLd, short TA, short TC>
inline void attn_mma_b_pairs_upto(thread FragTile<1, TC>& acc, thread const FragTile<1, TA>& a,
                                  const threadgroup T* base, short frags) {
#pragma clang loop unroll(full)
  for (short j = 0; j < TA; ++j) {
    if (j < frags) {
#pragma clang loop unroll(full)
      for (short n = 0; n < TC; ++n) {
        simdgroup_matrix<float, 8, 8> b;
        b.thread_elements() =
            float2(*((const threadgroup vec<T, 2>*)(base + j * 8 * kLd + n * 8)));
        simdgroup_multiply_accumulate(acc.frag[n], a.frag[j], b, acc.frag[n]);
      }
    }
  }
}

// The score fragments of the key tile from key0 that hold a key some row of a simdgroup may
// see, counted from the first: the keys from `key_end` on (the simdgroup's causal or
// bottom-right limit, or S) are hidden from all its rows. Uniform over the simdgroup.
inline short attn_visible_frags(int key_end, int key0, short tk) {
  return short(clamp((key_end - key0 + 7) / 8, 0, int(tk)));
}

template <typename T, short DE, short DV, bool kPrefill>
inline void AttnForward<T, DE, DV, kPrefill>::mma_pv(thread FragTile<1, TV>& o,
                                           thread const FragTile<1, TK>& s,
                                           const threadgroup T* Vb) {
  if (alias()) {
    attn_mma_b_at<T, kLdK>(o, s, Vb);
  } else {
    attn_mma_b_at<T, kLdV>(o, s, Vb);
  }
}

// Stores the lane's elements of a row of fragments (the row frag_row(lane) names, `row_ptr`
// pointing at its element 0), times `mult`, up to `cols` columns: the inverse of
// attn_load_row_frags for outputs.
template <typename T, short N>
inline void attn_store_row_frags(device T* row_ptr, thread const FragTile<1, N>& f, int cols,
                                 bool whole_cols, float mult, ushort lane) {
  const short fc = frag_col(lane);
  for (short d = 0; d < N; ++d) {
#pragma clang loop unroll(full)
    for (short e = 0; e < 2; ++e) {
      const int col = d * 8 + fc + e;
      if (whole_cols || col < cols) row_ptr[col] = T(f.frag[d].thread_elements()[e] * mult);
    }
  }
}

// The key tiles [t_begin, t_end) of size bk that query rows row0 .. last_row may see (causal and
// window bounds, score.h's rule); tiles wholly hidden from every row are never visited.
inline void attn_key_tiles(constant AttnParams& p, AttnExtent x, int row0, int last_row, int bk,
                           thread int& t_begin, thread int& t_end) {
  int key_begin = 0;
  int key_end = x.S;
  if (attn_has_hi) key_end = min(key_end, last_row + x.shift + p.hi_off + 1);
  if (attn_has_lo) key_begin = max(0, row0 + x.shift - p.lo_off);
  t_begin = key_begin / bk;
  t_end = key_end > key_begin ? (key_end + bk - 1) / bk : t_begin;
}

// Does the key tile [key0, key0 + bk) cross a visibility boundary of some row in
// row0 .. last_row (or the end of S)? Uniform per threadgroup: only such tiles test elements.
inline bool attn_edge_tile(constant AttnParams& p, AttnExtent x, int row0, int last_row,
                           int key0, int bk) {
  return (!attn_align_s && key0 + bk > x.S) ||
         (attn_has_hi && key0 + bk - 1 > row0 + x.shift + p.hi_off) ||
         (attn_has_lo && key0 < last_row + x.shift - p.lo_off);
}

// Where a threadgroup's batch entry (or varlen sequence) zb starts in q, k, v, the mask, out and
// lse, and its extent. Shared by the simdgroup and the matmul2d prefill blocks.
struct AttnBlockSpan {
  AttnExtent ext;
  // 64 bits: B * H * L * E passes 2^31 in real models.
  steel_i64 q, k, v, m, o;  // element offsets of the entry (before head and row offsets)
  steel_i64 lse;            // head h's row `row` is lse[lse + row]
  int k_begin;              // the first key token (varlen; 0 for a dense batch entry)
};

// Sequence zb of a varlen launch: query tokens cu_q[zb] .. cu_q[zb + 1] and key tokens
// cu_k[zb] .. cu_k[zb + 1]. The offsets are clamped to the token counts, so that offsets that
// break the convention give wrong rows, never accesses outside the tensors. Returns its extent
// and sets its first query and key token.
inline AttnExtent attn_varlen_sequence(constant AttnParams& p, const device int* cu_q,
                                       const device int* cu_k, int zb, thread int& q_begin,
                                       thread int& k_begin) {
  q_begin = clamp(cu_q[zb], 0, p.L);
  const int q_end = clamp(cu_q[zb + 1], q_begin, p.L);
  k_begin = clamp(cu_k[zb], 0, p.S);
  const int k_end = clamp(cu_k[zb + 1], k_begin, p.S);
  AttnExtent ext;
  ext.L = q_end - q_begin;
  ext.S = k_end - k_begin;
  ext.shift = attn_varlen_br ? ext.S - ext.L : 0;
  return ext;
}

// False when the block starting at query row row0 has no rows (varlen: the grid covers the
// longest sequence). The result is uniform over the threadgroup, so callers may return before
// any barrier or tensor operation.
inline bool attn_block_span(constant AttnParams& p, const device int* cu_q, const device int* cu_k,
                            int h, int zb, int row0, thread AttnBlockSpan& s) {
  s.ext = {p.L, p.S, p.shift};
  s.m = 0;
  s.o = zb * p.o_bs;
  s.lse = (steel_i64(zb) * p.Hq + h) * p.L;
  s.k_begin = 0;
  if (attn_varlen) {
    int q_begin, k_begin;
    s.ext = attn_varlen_sequence(p, cu_q, cu_k, zb, q_begin, k_begin);
    s.q = q_begin * p.q_rs;
    s.k = k_begin * p.k_rs;
    s.v = k_begin * p.v_rs;
    s.o = q_begin * p.o_rs;
    s.lse = steel_i64(h) * p.L + q_begin;  // lse is [Hq, total_q]
    s.k_begin = k_begin;
    return row0 < s.ext.L;
  }
  s.q = attn_batch_offset(p, p.q_bs, zb);
  s.k = attn_batch_offset(p, p.k_bs, zb);
  s.v = attn_batch_offset(p, p.v_bs, zb);
  s.m = attn_batch_offset(p, p.m_bs, zb);
  return true;
}

template <typename T, short DE, short DV>
inline void attention_forward_block(const device T* q, const device T* k, const device T* v,
                                    const device uchar* mask, const device uchar* sinks,
                                    device T* out, device float* lse, const device int* cu_q,
                                    const device int* cu_k, AttnQuantBuffers qb,
                                    constant AttnParams& p, threadgroup T* smem, uint3 tg,
                                    ushort simdgroup, ushort lane) {
  using A = AttnForward<T, DE, DV, true>;
  const int row0 = int(tg.x) * A::BQ;
  const int h = int(tg.y);
  const int zb = int(tg.z);  // the flattened batch entry, or the sequence (varlen)

  AttnBlockSpan span;
  if (!attn_block_span(p, cu_q, cu_k, h, zb, row0, span)) return;
  const AttnExtent ext = span.ext;
  const int hk = h / p.group;
  q += span.q + h * p.q_hs;
  AttnQuantKv kq, vq;
  if (attn_quant) {  // k and v hold codes: their offsets are in bytes, their scales' elements
    constant AttnQuantParams& qp = *qb.qp;
    const steel_i64 ks = attn_varlen ? span.k_begin * qp.k_rs : attn_batch_offset(p, qp.k_bs, zb);
    const steel_i64 vs = attn_varlen ? span.k_begin * qp.v_rs : attn_batch_offset(p, qp.v_bs, zb);
    kq = attn_quant_kv(false, k, span.k + hk * p.k_hs, qb, ks + hk * qp.k_hs,
                       attn_dense_rows(p.k_rs), attn_dense_rows(qp.k_rs));
    vq = attn_quant_kv(true, v, span.v + hk * p.v_hs, qb, vs + hk * qp.v_hs,
                       attn_dense_rows(p.v_rs), attn_dense_rows(qp.v_rs));
  } else {
    k += span.k + hk * p.k_hs;
    v += span.v + hk * p.v_hs;
  }

  const short fr = frag_row(lane);
  const short fc = frag_col(lane);
  const int row = row0 + simdgroup * 8 + fr;  // this lane's query row
  const bool row_ok = attn_align_l || row < ext.L;

  // Q in registers, in T (AttnOperandRow); the scores take p.q_scale (score.h's units).
  AttnOperandRow<T, A::TD> qf;
  attn_load_row_operands<T, A::TD>(qf, q + row * p.q_rs, row_ok, p.E, attn_align_e, lane);

  OnlineSoftmax sm;
  if (attn_sinks != kSteelAttnOperandNone) {
    const float sink = attn_read<T>(sinks, attn_sinks == kSteelAttnOperandF32, h);
    sm.init(true, sink / attn_unit_nats);
  } else {
    sm.init(false, 0.0f);
  }
  FragTile<1, A::TV> o;
  o.clear();

  const int last_row = min(row0 + int(A::BQ), ext.L) - 1;
  int t_begin, t_end;
  attn_key_tiles(p, ext, row0, last_row, A::BK, t_begin, t_end);

  threadgroup T* Ks = smem;
  threadgroup typename A::VT* Vs = A::v_tile(smem);
  const ushort thread_index = simdgroup * 32 + lane;
  const steel_i64 mask_row = span.m + h * p.m_hs + row * p.m_rs;

  // The loop's fields of p, read once into registers: each use of the constant buffer inside
  // the loop would read its bytes again per lane and per key tile.
  const steel_i64 k_rs = p.k_rs, v_rs = p.v_rs;
  const short E = short(p.E), Ev = short(p.Ev);
  const float q_scale = p.q_scale;
  // The first key hidden from every row of this simdgroup (its last row's limit; S without a
  // causal or window limit above the diagonal): edge tiles skip the fragments from there.
  int sg_key_end = ext.S;
  if (attn_has_hi) {
    sg_key_end = min(sg_key_end, row0 + int(simdgroup) * 8 + 7 + ext.shift + p.hi_off + 1);
  }
  // The lane's fragment bases: K's for Q K^T, V's, and K's for P V when V is K's prefix.
  const threadgroup T* Kb = Ks + attn_bt_offset<A::kLdK>(lane);
  const threadgroup typename A::VT* Vb = Vs + attn_b_offset<A::kLdV>(lane);
  const threadgroup T* Kv = Ks + attn_b_offset<A::kLdK>(lane);
  const typename A::LoaderK::Place k_place = A::LoaderK::whole_place(k_rs, thread_index);
  const typename A::LoaderV::Place v_place = A::LoaderV::whole_place(v_rs, thread_index);
  for (int t = t_begin; t < t_end; ++t) {
    const int key0 = t * A::BK;
    const short valid = short(min(int(A::BK), ext.S - key0));
    const bool whole = attn_align_s || valid == A::BK;
    const bool edge = attn_edge_tile(p, ext, row0, last_row, key0, A::BK);

    if (t > t_begin) threadgroup_barrier(mem_flags::mem_threadgroup);
    if (attn_quant) {
      kq.load<T, A::BK, DE, A::kLdK, A::kThreads>(Ks, key0, valid, E, attn_vec_k, thread_index);
    } else {
      A::LoaderK::load_tile(Ks, k + key0 * k_rs, k_rs, k_place, valid, E, whole && attn_align_e,
                            attn_vec_k, thread_index);
    }
    if (!A::kShared && !A::alias()) {
      if (attn_quant) {
        vq.load<T, A::BK, DV, A::kLdV, A::kThreads, typename A::VT>(Vs, key0, valid, Ev,
                                                                     attn_vec_v, thread_index);
      } else {
        A::LoaderV::load_tile(Vs, v + key0 * v_rs, v_rs, v_place, valid, Ev, whole && attn_align_ev,
                              attn_vec_v, thread_index);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // S = Q K^T: the K tile read transposed (lane element (d, key) at Ks[key * ld + d]).
    // On a tile that crosses the diagonal or the end of S, the fragments of keys hidden from
    // every row of this simdgroup take no MMA in either product: their scores are masked to
    // -inf below and their weights are 0 (on a causal diagonal tile, 6 of the 16 fragment
    // pairs of a 32-row block). Interior tiles pass the constant TK: their products are
    // unconditional.
    const short frags = edge ? attn_visible_frags(sg_key_end, key0, A::TK) : A::TK;
    FragTile<1, A::TK> s;
    s.clear();
    if (edge) {
      attn_mma_bt_operands<T, A::kLdK>(s, qf, Kb, frags);
    } else {
      attn_mma_bt_operands<T, A::kLdK>(s, qf, Kb, A::TK);
    }
#pragma clang loop unroll(full)
    for (short j = 0; j < A::TK; ++j) {
      s.frag[j].thread_elements()[0] *= q_scale;
      s.frag[j].thread_elements()[1] *= q_scale;
    }

    // A tile that crosses no boundary, without softcap or mask, has nothing to transform:
    // skipping the call skips its per-element key and mask offsets too.
    if (attn_softcap || attn_mask != kSteelAttnMaskNone || edge) {
      attn_transform_scores<T, A::TK>(s, p, ext, row, key0, row_ok, mask, mask_row, edge, lane);
    }
    const float factor = sm.update<A::TK>(s);
    for (short n = 0; n < A::TV; ++n) {
      o.frag[n].thread_elements()[0] *= factor;
      o.frag[n].thread_elements()[1] *= factor;
    }
    if (attn_dropout) {  // weights are dropped after the softmax: l keeps the undropped sum
      const uint bh = uint(zb) * uint(p.Hq) + uint(h);
      attn_dropout_tile<A::TK>(s, p, bh, row, key0, fc);
    }

    if (A::kShared && !A::alias()) {  // V takes K's place once every simdgroup has its scores
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (attn_quant) {
        vq.load<T, A::BK, DV, A::kLdV, A::kThreads, typename A::VT>(Vs, key0, valid, Ev,
                                                                     attn_vec_v, thread_index);
      } else {
        A::LoaderV::load_tile(Vs, v + key0 * v_rs, v_rs, v_place, valid, Ev, whole && attn_align_ev,
                              attn_vec_v, thread_index);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // O += P V: the probabilities are already in the A-operand layout of a fragment.
    if (edge) {
      if (A::alias()) {
        attn_mma_b_pairs_upto<T, A::kLdK>(o, s, Kv, frags);
      } else {
        attn_mma_b_pairs_upto<typename A::VT, A::kLdV>(o, s, Vb, frags);
      }
    } else if (A::alias()) {
      attn_mma_b_pairs<T, A::kLdK>(o, s, Kv);
    } else {
      attn_mma_b_pairs<typename A::VT, A::kLdV>(o, s, Vb);
    }
  }

  if (!row_ok) return;  // no barrier follows
  const float inv = sm.inverse_sum();
  attn_store_row_frags<T, A::TV>(out + span.o + h * p.o_hs + row * p.o_rs, o, p.Ev, attn_align_ev,
                                 inv, lane);
  // One lane of the four that share a row writes its log-sum-exp.
  if (attn_lse && (lane & 9) == 0) lse[span.lse + row] = sm.lse();
}

}  // namespace steel
