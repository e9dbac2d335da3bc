// The GEMV blocks: out = act(alpha * a @ b + beta * c + bias) when one side of the output has at
// most kGemvMaxRows (8) lines, as in decode (x[1..8, K] @ W^T; gemv_nn_block below for x @ W
// with W stored [K, N]). The tiled kernel (gemm.h) would
// run 8x8 MMAs of which 1 to 8 rows in 32 are real; here nothing is padded.
//
// Roles: the "weight" W is the operand with the long output side (J lines, each K long and
// contiguous along K); the "vector" X is the other one (R <= 8 lines, contiguous along K).
//   - kSwap false (M <= 8): X = a (row-major), W = b^T (b stored column by column, `t`: how
//     torch_steel.linear passes a weight [N, K]); R = M, J = N.
//   - kSwap true (N <= 8, by transposition: out^T = b^T a^T): X = b^T (b `t`), W = a (row-major);
//     R = N, J = M.
//
// Shape of the work: each simdgroup owns kGemvCols consecutive lines of W; its lanes walk K in
// chunks of 4 elements (lane l takes chunks l, l + 32, ...), so a simdgroup reads each W line as
// whole 256-byte (f16) runs, and W, the big operand, is read exactly once. Each lane keeps
// R x kGemvCols fp32 partial dot products; one simd_sum per output adds the 32 lanes' partials,
// and lane 0 applies the epilogue and stores. X (at most 8 lines) is re-read by every simdgroup
// from cache; it is 1/J of W's bytes per line pair.
#pragma once

#include <metal_stdlib>

#include "../params.h"
#include "constants.h"
#include "batch.h"
#include "epilogue.h"

using namespace metal;

namespace steel {

constant constexpr short kGemvCols = STEEL_GEMV_LINES;  // W lines per simdgroup
constant constexpr short kGemvVec = STEEL_GEMV_VEC;     // K elements per lane access
constant constexpr short kGemvMaxRows = STEEL_GEMV_MAX_ROWS;
static_assert(kGemvVec == 4, "gemv_load4 reads float4s");

// 4 consecutive K elements of a line as fp32. `vector_ok`: the planner checked that every line
// start is a multiple of 4 elements, so the access is one aligned vector load; otherwise (and on
// the ragged end of K) element by element with zero fill past K.
template <typename T>
inline float4 gemv_load4(const device T* line, int k, int K, bool vector_ok) {
  if (vector_ok && k + kGemvVec <= K) return float4(*((const device vec<T, 4>*)(line + k)));
  float4 v = 0.0f;
#pragma clang loop unroll(full)
  for (short e = 0; e < kGemvVec; ++e) {
    if (k + e < K) v[e] = float(line[k + e]);
  }
  return v;
}

template <typename T, bool kSwap>
inline void gemv_block(const device T* a, const device T* b, const device T* c,
                       const device T* bias, device T* out, constant GemmParams& p, uint3 tg,
                       ushort simdgroup, ushort lane, ushort simdgroups) {
  gemm_batch_offsets(a, b, c, out, p, tg.z);
  const device T* x = kSwap ? b : a;
  const device T* w = kSwap ? a : b;
  const int ldx = kSwap ? p.ldb : p.lda;
  const int ldw = kSwap ? p.lda : p.ldb;
  const bool vec_x = kSwap ? gemm_vec_b : gemm_vec_a;
  const bool vec_w = kSwap ? gemm_vec_a : gemm_vec_b;
  const int rows = kSwap ? p.N : p.M;  // <= kGemvMaxRows (the planner's rule)
  const int lines = kSwap ? p.M : p.N;
  const int j0 = (int(tg.x) * simdgroups + simdgroup) * kGemvCols;
  if (j0 >= lines) return;  // a simdgroup past the last line (no barrier follows)
  const short cols = short(min(int(kGemvCols), lines - j0));

  float acc[kGemvMaxRows][kGemvCols];
#pragma clang loop unroll(full)
  for (short r = 0; r < kGemvMaxRows; ++r) {
#pragma clang loop unroll(full)
    for (short j = 0; j < kGemvCols; ++j) acc[r][j] = 0.0f;
  }
  for (int k = lane * kGemvVec; k < p.K; k += 32 * kGemvVec) {
    float4 wv[kGemvCols];
#pragma clang loop unroll(full)
    for (short j = 0; j < kGemvCols; ++j) {
      // Lines past the last read line j0 (in bounds, their results are never stored).
      wv[j] = gemv_load4(w + (j < cols ? j0 + j : j0) * ldw, k, p.K, vec_w);
    }
#pragma clang loop unroll(full)
    for (short r = 0; r < kGemvMaxRows; ++r) {
      if (r >= rows) break;
      const float4 xv = gemv_load4(x + r * ldx, k, p.K, vec_x);
#pragma clang loop unroll(full)
      for (short j = 0; j < kGemvCols; ++j) acc[r][j] += dot(xv, wv[j]);
    }
  }

  const bool use_c = gemm_use_c;
  const bool has_bias = gemm_has_bias;
  const int activation = gemm_activation;
#pragma clang loop unroll(full)
  for (short r = 0; r < kGemvMaxRows; ++r) {
    if (r >= rows) break;
#pragma clang loop unroll(full)
    for (short j = 0; j < kGemvCols; ++j) {
      const float sum = simd_sum(acc[r][j]);
      if (lane != 0 || j >= cols) continue;
      const int row = kSwap ? j0 + j : r;
      const int col = kSwap ? r : j0 + j;
      out[row * p.ldd + col] =
          T(epilogue(sum, row, col, c, bias, p, use_c, has_bias, activation));
    }
  }
}

// The GEMV block along N (steel_gemv_nn_): M <= 8 with both operands row-major, x[R, K] @
// W[K, N], as torch.matmul(x, W) passes a weight stored [K, N]. W's contiguous lines now run
// along N, so the lanes do too: each lane owns kGemvVec consecutive columns (one vector load per
// row of W), a simdgroup's 32 lanes are kGemvNnColGroups column groups x kGemvNnKGroups K groups,
// and the threadgroup's simdgroups split K again: 16 K slots, each taking kGemvVec rows of W per
// step. A threadgroup reads its strip of kGemvNnCols columns of W (64 bytes a row in f16) once,
// and N / 32 threadgroups spread W over the cores. X is read once per threadgroup and shared
// within each K group by shuffles (below). The K groups' partial sums meet by
// two shuffles and the simdgroups' through threadgroup memory (`red`, [simdgroup][row][column
// group] float4s); the first column groups of simdgroup 0 apply the epilogue.
constant constexpr short kGemvNnCols = STEEL_GEMV_NN_COLS;  // columns a threadgroup owns
constant constexpr short kGemvNnColGroups = kGemvNnCols / kGemvVec;
constant constexpr short kGemvNnKGroups = 32 / kGemvNnColGroups;
static_assert(kGemvNnColGroups * kGemvNnKGroups == 32, "column groups x K groups = one simdgroup");
constant constexpr short kGemvSimdgroups = STEEL_GEMV_SIMDGROUPS;

template <typename T>
inline void gemv_nn_block(const device T* a, const device T* b, const device T* c,
                          const device T* bias, device T* out, constant GemmParams& p, uint3 tg,
                          ushort simdgroup, ushort lane, threadgroup float4* red) {
  gemm_batch_offsets(a, b, c, out, p, tg.z);
  const int rows = p.M;  // <= kGemvMaxRows (the planner's rule)
  const short group = short(lane % kGemvNnColGroups);
  const int n0 = int(tg.x) * kGemvNnCols + group * kGemvVec;
  const int slot = simdgroup * kGemvNnKGroups + lane / kGemvNnColGroups;
  constexpr int kStep = kGemvSimdgroups * kGemvNnKGroups * kGemvVec;

  float4 acc[kGemvMaxRows];
#pragma clang loop unroll(full)
  for (short r = 0; r < kGemvMaxRows; ++r) acc[r] = 0.0f;
  // Lane (group, K group) loads row `group` of X (kGemvNnColGroups == kGemvMaxRows: one lane
  // per row) and its K group's lanes take every row from each other by shuffles, so each X
  // element is read once per K slot instead of once per column group.
  static_assert(kGemvNnColGroups == kGemvMaxRows, "one lane of a K group per row of X");
  const ushort k_group_lane = ushort(lane - group);
  for (int k = slot * kGemvVec; k < p.K; k += kStep) {
    const float4 x_mine = group < rows ? gemv_load4(a + group * p.lda, k, p.K, gemm_vec_a)
                                       : float4(0.0f);
    float4 xv[kGemvMaxRows];
#pragma clang loop unroll(full)
    for (short r = 0; r < kGemvMaxRows; ++r) {
      if (r >= rows) break;
      xv[r] = simd_shuffle(x_mine, ushort(k_group_lane + r));
    }
#pragma clang loop unroll(full)
    for (short e = 0; e < kGemvVec; ++e) {
      if (k + e >= p.K) break;  // the ragged end of K: no row of W past it is read
      // Columns past N read as zero (gemv_load4's bound), so the last strip stays in bounds.
      const float4 wv = gemv_load4(b + (k + e) * p.ldb, n0, p.N, gemm_vec_b);
#pragma clang loop unroll(full)
      for (short r = 0; r < kGemvMaxRows; ++r) {
        if (r >= rows) break;
        acc[r] += xv[r][e] * wv;
      }
    }
  }

  // The K groups of a column group are lanes group, group + 8, group + 16, group + 24.
#pragma clang loop unroll(full)
  for (short r = 0; r < kGemvMaxRows; ++r) {
    if (r >= rows) break;
    acc[r] += simd_shuffle_xor(acc[r], ushort(kGemvNnColGroups));
    acc[r] += simd_shuffle_xor(acc[r], ushort(2 * kGemvNnColGroups));
    if (lane < kGemvNnColGroups) {
      red[(simdgroup * kGemvMaxRows + r) * kGemvNnColGroups + group] = acc[r];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (simdgroup != 0 || lane >= kGemvNnColGroups) return;

  const bool use_c = gemm_use_c;
  const bool has_bias = gemm_has_bias;
  const int activation = gemm_activation;
#pragma clang loop unroll(full)
  for (short r = 0; r < kGemvMaxRows; ++r) {
    if (r >= rows) break;
    float4 sum = 0.0f;
#pragma clang loop unroll(full)
    for (short s = 0; s < kGemvSimdgroups; ++s) {
      sum += red[(s * kGemvMaxRows + r) * kGemvNnColGroups + group];
    }
#pragma clang loop unroll(full)
    for (short j = 0; j < kGemvVec; ++j) {
      const int col = n0 + j;
      if (col >= p.N) break;
      out[r * p.ldd + col] = T(epilogue(sum[j], r, col, c, bias, p, use_c, has_bias, activation));
    }
  }
}

}  // namespace steel
