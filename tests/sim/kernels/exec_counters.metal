// Test-only kernels for the simulator's counters (tests/sim/test_counters.py).
#include <metal_stdlib>
using namespace metal;

// out[i] = in[i] for i < count: count * sizeof(T) bytes read from buffer 0 and written to 1.
template <typename T>
kernel void exec_copy(device const T* in [[buffer(0)]],
                      device T* out [[buffer(1)]],
                      constant uint& count [[buffer(2)]],
                      uint gid [[thread_position_in_grid]]) {
  if (gid < count) out[gid] = in[gid];
}
template [[host_name("exec_copy_float")]] [[kernel]] decltype(exec_copy<float>) exec_copy<float>;
template [[host_name("exec_copy_half")]] [[kernel]] decltype(exec_copy<half>) exec_copy<half>;

// `rounds` simd_sum calls per simdgroup.
kernel void exec_simd_rounds(device float* out [[buffer(0)]],
                             constant uint& rounds [[buffer(1)]],
                             uint gid [[thread_position_in_grid]]) {
  float v = 1.0f;
  for (uint r = 0; r < rounds; ++r) v = simd_sum(v) / 32.0f;
  out[gid] = v;
}

// `rounds` 8x8x8 simdgroup multiply-accumulates per simdgroup on one fragment loaded from and
// stored to device memory.
kernel void exec_mma_rounds(device const float* a [[buffer(0)]],
                            device float* c [[buffer(1)]],
                            constant uint& rounds [[buffer(2)]],
                            uint tg [[threadgroup_position_in_grid]],
                            uint sgs [[simdgroups_per_threadgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]]) {
  simdgroup_float8x8 A;
  simdgroup_float8x8 C = simdgroup_float8x8(0);
  simdgroup_load(A, a, 8);
  for (uint r = 0; r < rounds; ++r) simdgroup_multiply_accumulate(C, A, A, C);
  simdgroup_store(C, c + (tg * sgs + sg) * 64, 8);
}

// Threadgroup memory traffic and simd operations of each kind: every lane stores one float to
// threadgroup memory and loads one, then each simdgroup does one shuffle, two reductions and
// one ballot.
kernel void exec_tg_and_simd_traffic(device float* out [[buffer(0)]],
                                     uint tid [[thread_index_in_threadgroup]],
                                     uint n [[threads_per_threadgroup]]) {
  threadgroup float slots[256];
  slots[tid] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float v = slots[(tid + 1) % n];
  v = simd_shuffle_xor(v, ushort(1));
  v = simd_sum(v) + simd_max(v);
  out[tid] = v + (ulong(simd_ballot(v > 0.0f)) != 0 ? 1.0f : 0.0f);
}
