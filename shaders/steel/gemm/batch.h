// Batch offsets of the GEMM blocks (gemm.h, gemv.h, ../gemm_tensor/gemm_tensor.h): the planner
// merges the broadcast batch dims into p.batch_ndim dims of p.batch_shape, each operand with its
// own strides there (0 where it broadcasts), and the output contiguous across them.
#pragma once

#include <metal_stdlib>

#include "../params.h"
#include "constants.h"

using namespace metal;

// Moves a, b and c to grid slice z's batch element, and out to its z-th output matrix. A no-op
// (compiled away) without the batch function constant.
template <typename T, typename OutT>
inline void gemm_batch_offsets(thread const device T*& a, thread const device T*& b,
                               thread const device T*& c, thread device OutT*& out,
                               constant GemmParams& p, uint z_id) {
  if (!gemm_has_batch) return;
  int z = int(z_id);
  for (int d = p.batch_ndim - 1; d >= 0; --d) {
    const int idx = z % p.batch_shape[d];
    z /= p.batch_shape[d];
    a += idx * p.a_batch_strides[d];
    b += idx * p.b_batch_strides[d];
    c += idx * p.c_batch_strides[d];
  }
  out += int(z_id) * p.out_batch_stride;
}
