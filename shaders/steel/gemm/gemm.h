// The GEMM block: one threadgroup computes a BM x BN block of out = act(alpha * a @ b + beta * c
// + bias) for one batch entry (or, split-K, the fp32 partial product over one slice of K).
//
// Shape of the work (see gemm_plan.cpp for how the tile sizes are chosen):
//   - the grid is (tiles_n << swizzle_log, ceil(tiles_m / 2^swizzle_log), batch x partitions,
//     with one partition unless split-K); consecutive threadgroups walk a band of
//     2^swizzle_log tile rows column by column, so the A rows and B columns they share are
//     still in L2 when the neighbours ask for them;
//   - per BK step: barrier (from the second step on), BlockLoader copies the A and B tiles to
//     threadgroup memory, barrier, BlockMMA multiplies them into the fp32 accumulators;
//   - a partial last K step (K % BK) is loaded with zero fill and multiplied like the others;
//   - the epilogue runs on the accumulators in registers, then each element is stored once.
// Interior tiles take the unchecked path; on an edge tile only the operand that crosses the
// edge (A where M ends inside the tile, B where N does) pays for bounds checks, and the choice
// is made once per threadgroup, outside the K loop.
#pragma once

#include <metal_stdlib>

#include "../params.h"
#include "constants.h"
#include "batch.h"
#include "epilogue.h"
#include "loader.h"
#include "mma.h"

using namespace metal;

namespace steel {

template <typename T, short BM, short BN, short BK, short WM, short WN, bool kTransA,
          bool kTransB>
struct GemmBlock {
  static constant constexpr short kThreads = 32 * WM * WN;
  static constant constexpr short kPad = short(16 / sizeof(T));  // 16 bytes per tile row
  // The tiles are stored as they lie in device memory: A is BM x BK, or BK x BM transposed.
  static constant constexpr short kARows = kTransA ? BK : BM;
  static constant constexpr short kACols = kTransA ? BM : BK;
  static constant constexpr short kLdA = kACols + kPad;
  static constant constexpr short kBRows = kTransB ? BN : BK;
  static constant constexpr short kBCols = kTransB ? BK : BN;
  static constant constexpr short kLdB = kBCols + kPad;
  static constant constexpr int kATileElems = kARows * kLdA;
  static constant constexpr int kBTileElems = kBRows * kLdB;
  // Whole 16-byte units, so that if the compiler packs As and Bs back to back, the second still
  // starts 16-byte aligned, as the loaders' vector stores need.
  static_assert(kATileElems * sizeof(T) % 16 == 0 && kBTileElems * sizeof(T) % 16 == 0,
                "tile sizes must be multiples of 16 bytes");

  using LoaderA = BlockLoader<T, kARows, kACols, kLdA, kThreads>;
  using LoaderB = BlockLoader<T, kBRows, kBCols, kLdB, kThreads>;
  using MMA = BlockMMA<T, BM, BN, BK, WM, WN, kTransA, kTransB, kLdA, kLdB>;

  // The part of the A / B tile inside the matrix, as rows and columns of the stored tile.
  static void load_a_safe(thread const LoaderA& la, short m_valid, short k_valid) {
    if (kTransA) {
      la.load_safe(k_valid, m_valid);
    } else {
      la.load_safe(m_valid, k_valid);
    }
  }
  static void load_b_safe(thread const LoaderB& lb, short k_valid, short n_valid) {
    if (kTransB) {
      lb.load_safe(n_valid, k_valid);
    } else {
      lb.load_safe(k_valid, n_valid);
    }
  }

  // k_steps full BK steps, then one partial step of k_rem (< BK) columns of A / rows of B.
  // kInsideA: the block's BM rows of A are all inside M, so A's full steps load without bounds
  // checks (as vectors when vec_a); kInsideB the same for B's BN columns. The two are separate
  // so that a tile on the M edge (every tile of a decode GEMM, M = 1) still streams B, the big
  // operand, with unchecked vector loads, and a tile on the N edge still streams A.
  template <bool kInsideA, bool kInsideB>
  static void march_k(thread LoaderA& la, thread LoaderB& lb, thread MMA& mma,
                      threadgroup T* As, threadgroup T* Bs, int k_steps, short k_rem,
                      short m_valid, short n_valid, bool vec_a, bool vec_b) {
    const int a_step = kTransA ? BK * la.src_ld : BK;
    const int b_step = kTransB ? BK : BK * lb.src_ld;
    // Two barriers a step: before the loads overwrite the tiles (the previous step's fragment
    // reads are done; nothing was read before the first step, so it needs none) and after them.
    for (int k = 0; k < k_steps; ++k) {
      if (k > 0) threadgroup_barrier(mem_flags::mem_threadgroup);
      if (kInsideA) {
        la.load_unsafe(vec_a);
      } else {
        load_a_safe(la, m_valid, BK);
      }
      if (kInsideB) {
        lb.load_unsafe(vec_b);
      } else {
        load_b_safe(lb, BK, n_valid);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      mma.mma(As, Bs);
      la.advance(a_step);
      lb.advance(b_step);
    }
    if (k_rem > 0) {
      if (k_steps > 0) threadgroup_barrier(mem_flags::mem_threadgroup);
      load_a_safe(la, m_valid, k_rem);
      load_b_safe(lb, k_rem, n_valid);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      mma.mma(As, Bs);
    }
  }
};

// One threadgroup's block. OutT is T (epilogue applied) or float (split-K partials, no epilogue).
template <typename T, short BM, short BN, short BK, short WM, short WN, bool kTransA,
          bool kTransB, typename OutT, bool kSplitK>
inline void gemm_block(const device T* a, const device T* b, const device T* c,
                       const device T* bias, device OutT* out, constant GemmParams& p,
                       threadgroup T* As, threadgroup T* Bs, uint3 tg, ushort simdgroup,
                       ushort lane) {
  using G = GemmBlock<T, BM, BN, BK, WM, WN, kTransA, kTransB>;

  const int swizzle = p.swizzle_log;
  const int tile_n = int(tg.x) >> swizzle;
  const int tile_m = (int(tg.y) << swizzle) + (int(tg.x) & ((1 << swizzle) - 1));
  if (tile_m >= p.tiles_m || tile_n >= p.tiles_n) return;  // the whole threadgroup leaves
  const int row0 = tile_m * BM;
  const int col0 = tile_n * BN;

  int k_begin = 0;
  int k_len = p.K;
  if (kSplitK) {
    // tg.z = batch entry * partitions + partition; the partials are [partitions, batch, M, N].
    const int part = int(tg.z) % p.partitions;
    gemm_batch_offsets(a, b, c, out, p, tg.z / uint(p.partitions));
    k_begin = part * p.k_split;
    k_len = min(p.k_split, p.K - k_begin);
    out += part * p.partial_stride;
  } else {
    gemm_batch_offsets(a, b, c, out, p, tg.z);
  }
  a += kTransA ? row0 + k_begin * p.lda : row0 * p.lda + k_begin;
  b += kTransB ? col0 * p.ldb + k_begin : k_begin * p.ldb + col0;

  const ushort thread_index = simdgroup * 32 + lane;
  typename G::LoaderA la(a, p.lda, As, thread_index);
  typename G::LoaderB lb(b, p.ldb, Bs, thread_index);
  typename G::MMA mma(simdgroup, lane);

  const short m_valid = short(min(int(BM), p.M - row0));
  const short n_valid = short(min(int(BN), p.N - col0));
  // Which operand tiles lie wholly inside the matrix: decided once per threadgroup, and at
  // compile time when the planner's ALIGN constants say every tile does.
  const bool inside_a = gemm_align_m || m_valid == BM;
  const bool inside_b = gemm_align_n || n_valid == BN;
  const int k_steps = k_len / BK;
  const short k_rem = gemm_align_k ? short(0) : short(k_len - k_steps * BK);
  if (inside_a && inside_b) {
    G::template march_k<true, true>(la, lb, mma, As, Bs, k_steps, k_rem, m_valid, n_valid,
                                    gemm_vec_a, gemm_vec_b);
  } else if (inside_b) {
    G::template march_k<false, true>(la, lb, mma, As, Bs, k_steps, k_rem, m_valid, n_valid,
                                     false, gemm_vec_b);
  } else if (inside_a) {
    G::template march_k<true, false>(la, lb, mma, As, Bs, k_steps, k_rem, m_valid, n_valid,
                                     gemm_vec_a, false);
  } else {
    G::template march_k<false, false>(la, lb, mma, As, Bs, k_steps, k_rem, m_valid, n_valid,
                                      false, false);
  }

  // Epilogue in registers, then one store per element.
  const bool use_c = gemm_use_c;
  const bool has_bias = gemm_has_bias;
  const int activation = gemm_activation;
  device OutT* dst = out + row0 * p.ldd + col0;
#pragma clang loop unroll(full)
  for (short i = 0; i < G::MMA::TM; ++i) {
    const short r = mma.row + i * (8 * WM);
    if (!inside_a && r >= m_valid) continue;
#pragma clang loop unroll(full)
    for (short j = 0; j < G::MMA::TN; ++j) {
      const short cc = mma.col + j * (8 * WN);
#pragma clang loop unroll(full)
      for (short e = 0; e < 2; ++e) {
        if (!inside_b && cc + e >= n_valid) continue;
        float v = mma.acc.at(i, j).thread_elements()[e];
        if (!kSplitK) {
          v = epilogue(v, row0 + r, col0 + cc + e, c, bias, p, use_c, has_bias, activation);
        }
        dst[r * p.ldd + cc + e] = OutT(v);
      }
    }
  }
}

}  // namespace steel
