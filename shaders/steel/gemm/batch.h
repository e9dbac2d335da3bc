// Batch offsets of the GEMM blocks (gemm.h, gemv.h, ../gemm_tensor/gemm_tensor.h): the planner
// merges the broadcast batch dims into p.batch_ndim dims of p.batch_shape, each operand with its
// own strides there (0 where it broadcasts), and the output contiguous across them.
#pragma once

#include <metal_stdlib>

#include "../params.h"
#include "constants.h"

using namespace metal;

// The element offsets of batch entry z in a, b and c: 0 for all three (compiled away) without
// the batch function constant.
struct GemmBatchOffsets {
  int a;
  int b;
  int c;
};

inline GemmBatchOffsets gemm_batch_element(constant GemmParams& p, uint z_id) {
  GemmBatchOffsets o = {0, 0, 0};
  if (!gemm_has_batch) return o;
  int z = int(z_id);
  for (int d = p.batch_ndim - 1; d >= 0; --d) {
    const int idx = z % p.batch_shape[d];
    z /= p.batch_shape[d];
    o.a += idx * p.a_batch_strides[d];
    o.b += idx * p.b_batch_strides[d];
    o.c += idx * p.c_batch_strides[d];
  }
  return o;
}

// Moves a, b and c to batch entry z and out to its z-th output matrix (split-K: the entry's
// partials in the first partition). A no-op without the batch function constant.
template <typename T, typename OutT>
inline void gemm_batch_offsets(thread const device T*& a, thread const device T*& b,
                               thread const device T*& c, thread device OutT*& out,
                               constant GemmParams& p, uint z_id) {
  if (!gemm_has_batch) return;
  const GemmBatchOffsets o = gemm_batch_element(p, z_id);
  a += o.a;
  b += o.b;
  c += o.c;
  out += int(z_id) * p.out_batch_stride;
}
