// An attention-shaped test kernel (flash-attention forward, one head, head dim 64, float):
// one simdgroup per 8 query rows, keys in blocks of 8, scores and P x V as 8x8 simdgroup MMAs,
// online softmax in threadgroup memory. Used by tests/sim/test_counters.py (numerics against
// F.scaled_dot_product_attention, exact MMA count) and by bench/bench_sim.py (simulator speed).
#include <metal_stdlib>
using namespace metal;

kernel void exec_attention_d64(device const float* q [[buffer(0)]],
                               device const float* k [[buffer(1)]],
                               device const float* v [[buffer(2)]],
                               device float* o [[buffer(3)]],
                               constant uint& keys [[buffer(4)]],
                               constant float& scale [[buffer(5)]],
                               uint tg [[threadgroup_position_in_grid]],
                               uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float tile[64];  // 8x8 scores, then probabilities
  threadgroup float row_max[8];
  threadgroup float row_sum[8];
  threadgroup float row_scale[8];
  const uint row0 = tg * 8;
  // The row of this lane's two fragment elements (Apple's lane map).
  const uint r = ((lane / 4) & 4) + (lane / 2) % 4;

  simdgroup_float8x8 qf[8];
  simdgroup_float8x8 of[8];
  for (uint c = 0; c < 8; ++c) {
    simdgroup_load(qf[c], q + row0 * 64, 64, ulong2(c * 8, 0));
    of[c] = simdgroup_float8x8(0);
  }
  if (lane < 8) {
    row_max[lane] = -3.0e38f;
    row_sum[lane] = 0.0f;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);

  for (uint kb = 0; kb < keys; kb += 8) {
    simdgroup_float8x8 s = simdgroup_float8x8(0);
    for (uint c = 0; c < 8; ++c) {
      simdgroup_float8x8 kt;  // K[kb:kb+8, 8c:8c+8] transposed
      simdgroup_load(kt, k + kb * 64 + c * 8, 64, ulong2(0, 0), true);
      simdgroup_multiply_accumulate(s, qf[c], kt, s);
    }
    simdgroup_store(s, tile, 8);
    simdgroup_barrier(mem_flags::mem_threadgroup);
    if (lane < 8) {
      const float m = row_max[lane];
      float m_new = m;
      for (uint j = 0; j < 8; ++j) m_new = max(m_new, tile[lane * 8 + j] * scale);
      const float correction = exp(m - m_new);
      float sum = row_sum[lane] * correction;
      for (uint j = 0; j < 8; ++j) {
        const float p = exp(tile[lane * 8 + j] * scale - m_new);
        tile[lane * 8 + j] = p;
        sum += p;
      }
      row_max[lane] = m_new;
      row_sum[lane] = sum;
      row_scale[lane] = correction;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 p;
    simdgroup_load(p, tile, 8);
    const float correction = row_scale[r];
    for (uint c = 0; c < 8; ++c) {
      of[c].thread_elements()[0] *= correction;
      of[c].thread_elements()[1] *= correction;
      simdgroup_float8x8 vf;
      simdgroup_load(vf, v + kb * 64, 64, ulong2(c * 8, 0));
      simdgroup_multiply_accumulate(of[c], p, vf, of[c]);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }

  const float inv = 1.0f / row_sum[r];
  for (uint c = 0; c < 8; ++c) {
    of[c].thread_elements()[0] *= inv;
    of[c].thread_elements()[1] *= inv;
    simdgroup_store(of[c], o + row0 * 64, 64, ulong2(c * 8, 0));
  }
}
