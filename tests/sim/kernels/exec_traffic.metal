// Test-only kernels for the cache model (tests/sim/test_traffic.py). No params buffer: sizes
// come from the grid, so that the only lines a kernel touches are those of its two tensors.
#include <metal_stdlib>
using namespace metal;

// out[gid] = 2 * in[gid]: every line of both read or written once.
kernel void exec_stream(device const float* in [[buffer(0)]],
                        device float* out [[buffer(1)]],
                        uint gid [[thread_position_in_grid]]) {
  out[gid] = 2.0f * in[gid];
}

// Threadgroup t reads chunk t % (threadgroups / 2) of `in` (one float per thread): the first half
// of the grid reads every chunk once, the second half reads them again in the same order, so a
// chunk's two readers are threadgroups / 2 apart in dispatch order.
kernel void exec_chunk_reuse(device const float* in [[buffer(0)]],
                             device float* out [[buffer(1)]],
                             uint tg [[threadgroup_position_in_grid]],
                             uint tgs [[threadgroups_per_grid]],
                             uint lid [[thread_position_in_threadgroup]],
                             uint n [[threads_per_threadgroup]],
                             uint gid [[thread_position_in_grid]]) {
  out[gid] = in[(tg % (tgs / 2)) * n + lid];
}

// Each threadgroup sums the whole of `in` (n floats, n = threads) twice, a barrier between the
// passes, and writes its sums: two reads of a small buffer per threadgroup.
kernel void exec_read_twice(device const float* in [[buffer(0)]],
                            device float* out [[buffer(1)]],
                            uint tg [[threadgroup_position_in_grid]],
                            uint lid [[thread_position_in_threadgroup]],
                            uint n [[threads_per_threadgroup]]) {
  float first = in[lid];
  threadgroup_barrier(mem_flags::mem_device);
  float second = in[(lid + 1) % n];
  out[tg * n + lid] = first + second;
}

// Threadgroup t reads chunk t % (threadgroups / 8) of `in` (one float per thread): each chunk is
// read again every threadgroups / 8 threadgroups.
kernel void exec_chunk_cycle(device const float* in [[buffer(0)]],
                             device float* out [[buffer(1)]],
                             uint tg [[threadgroup_position_in_grid]],
                             uint tgs [[threadgroups_per_grid]],
                             uint lid [[thread_position_in_threadgroup]],
                             uint n [[threads_per_threadgroup]],
                             uint gid [[thread_position_in_grid]]) {
  out[gid] = in[(tg % (tgs / 8)) * n + lid];
}
