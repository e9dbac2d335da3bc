// The GEMM block on Metal 4's matrix units (M5's neural accelerators): one threadgroup of
// kSimdgroups simdgroups computes a BM x BN block of out = act(alpha * a @ b + beta * c + bias)
// (or, split-K, the fp32 partial product over one K slice) with mpp::tensor_ops::matmul2d.
//
// The same work as the simdgroup-matrix GEMM (shaders/steel/gemm/gemm.h), with the same grid,
// swizzle, batching, split-K and epilogue; what changes is how the product is formed:
//   - a and b are MSL 4 tensors over device memory, read by the operation itself (no
//     threadgroup staging: the matrix units fetch their operands), BK elements of K a step,
//     accumulated in an fp32 cooperative destination that stays in registers for the whole K;
//   - interior steps use static-extent slices (no edge checks); a step that crosses M, N or the
//     end of the K range uses dynamic slices, which the operation edge-checks against the
//     tensors' extents (zeros past the edge; the K extent is the partition's end);
//   - the epilogue visits the destination's elements through the cooperative-tensor index API
//     (the element-to-thread layout is the driver's and differs between GPU generations).
#pragma once

#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>

#include "../params.h"
#include "../gemm/batch.h"
#include "../gemm/constants.h"
#include "../gemm/epilogue.h"

using namespace metal;

namespace steel {

template <typename T>
using gemm_tensor_view = tensor<const device T, dextents<int32_t, 2>, tensor_inline>;

// One threadgroup's block. OutT is T (epilogue applied) or float (split-K partials).
template <typename T, int BM, int BN, int BK, int kSimdgroups, bool kTransA, bool kTransB,
          typename OutT, bool kSplitK>
inline void gemm_tensor_block(const device T* a, const device T* b, const device T* c,
                              const device T* bias, device OutT* out, constant GemmParams& p,
                              uint3 tg) {
  const int swizzle = p.swizzle_log;
  const int tile_n = int(tg.x) >> swizzle;
  const int tile_m = (int(tg.y) << swizzle) + (int(tg.x) & ((1 << swizzle) - 1));
  if (tile_m >= p.tiles_m || tile_n >= p.tiles_n) return;  // the whole threadgroup leaves
  const int row0 = tile_m * BM;
  const int col0 = tile_n * BN;

  int k_begin = 0;
  int k_end = p.K;
  if (kSplitK) {
    // tg.z = batch entry * partitions + partition; the partials are [partitions, batch, M, N].
    const int part = int(tg.z) % p.partitions;
    gemm_batch_offsets(a, b, c, out, p, tg.z / uint(p.partitions));
    k_begin = part * p.k_split;
    k_end = min(k_begin + p.k_split, p.K);
    out += part * p.partial_stride;
  } else {
    gemm_batch_offsets(a, b, c, out, p, tg.z);
  }

  // a is M x K (dims (K, M)), or stored K x M when transposed (dims (M, K)); b is K x N (dims
  // (N, K)), or stored N x K (dims (K, N)). K's extent ends at this partition's end.
  const gemm_tensor_view<T> ta(a, kTransA ? dextents<int32_t, 2>(p.M, k_end)
                                          : dextents<int32_t, 2>(k_end, p.M),
                               array<int32_t, 2>({1, p.lda}));
  const gemm_tensor_view<T> tb(b, kTransB ? dextents<int32_t, 2>(k_end, p.N)
                                          : dextents<int32_t, 2>(p.N, k_end),
                               array<int32_t, 2>({1, p.ldb}));

  constexpr auto desc = mpp::tensor_ops::matmul2d_descriptor(
      BM, BN, BK, kTransA, kTransB, false,
      mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate);
  mpp::tensor_ops::matmul2d<desc, execution_simdgroups<kSimdgroups>> op;
  auto acc = op.template get_destination_cooperative_tensor<gemm_tensor_view<T>,
                                                            gemm_tensor_view<T>, float>();
  for (ushort i = 0; i < acc.get_capacity(); ++i) acc[i] = 0.0f;

  // Which steps may skip edge checks: decided once per threadgroup (uniform, as the scope's
  // operations must be), and at compile time when the planner's ALIGN constants say so.
  const bool inside = (gemm_align_m || row0 + BM <= p.M) &&
                      (gemm_align_n || col0 + BN <= p.N);
  const int k_full = gemm_align_k ? k_end : k_begin + (k_end - k_begin) / BK * BK;
  int k = k_begin;
  if (inside) {
    for (; k < k_full; k += BK) {
      // Each pairing of layouts is its own operand type (static slices are typed by extents).
      if constexpr (kTransA) {
        if constexpr (kTransB) {
          op.run(ta.template slice<BM, BK>(row0, k), tb.template slice<BK, BN>(k, col0), acc);
        } else {
          op.run(ta.template slice<BM, BK>(row0, k), tb.template slice<BN, BK>(col0, k), acc);
        }
      } else if constexpr (kTransB) {
        op.run(ta.template slice<BK, BM>(k, row0), tb.template slice<BK, BN>(k, col0), acc);
      } else {
        op.run(ta.template slice<BK, BM>(k, row0), tb.template slice<BN, BK>(col0, k), acc);
      }
    }
  }
  for (; k < k_end; k += BK) {
    op.run(kTransA ? ta.slice(row0, k) : ta.slice(k, row0),
           kTransB ? tb.slice(k, col0) : tb.slice(col0, k), acc);
  }

  // Epilogue in registers, then one store per element, visiting the elements this thread holds.
  const bool use_c = gemm_use_c;
  const bool has_bias = gemm_has_bias;
  const int activation = gemm_activation;
  for (ushort i = 0; i < acc.get_capacity(); ++i) {
    if (!acc.is_valid_element(i)) continue;
    const auto at = acc.get_multidimensional_index(i);
    const int row = row0 + at[1];
    const int col = col0 + at[0];
    if (row >= p.M || col >= p.N) continue;
    float v = acc[i];
    if (!kSplitK) v = epilogue(v, row, col, c, bias, p, use_c, has_bias, activation);
    out[row * p.ldd + col] = OutT(v);
  }
}

}  // namespace steel
