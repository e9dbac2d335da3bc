// Test-only kernels for tests/sim/test_translate_kernels.py: the constructs the pre-pass
// rewrites, run.
#include <metal_stdlib>

using namespace metal;

constant float gain [[function_constant(0)]];
constant bool negate [[function_constant(1)]];
constant float signed_gain = negate ? -gain : gain;

// Two threadgroup arrays: shared by the lanes of a threadgroup, distinct from each other and
// between threadgroups. Lane (t, 0) writes a[t] and b[t]; after the barrier every lane reads its
// neighbour's.
kernel void lang_threadgroup_arrays(device float4* out [[buffer(0)]],
                                    ushort2 tid [[thread_position_in_threadgroup]],
                                    uint tg [[threadgroup_position_in_grid]],
                                    uint n [[threads_per_threadgroup]],
                                    uint2 gid [[thread_position_in_grid]],
                                    uint2 grid [[threads_per_grid]]) {
  threadgroup float a[64];
  threadgroup float b[64], c[2];
  if (tid.y == 0) {
    a[tid.x] = float(tg * 100 + tid.x);
    b[tid.x] = -float(tid.x);
    if (tid.x == 0) c[0] = 0.5f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint next = (tid.x + 1) % n;
  out[gid.y * grid.x + gid.x] = float4(a[next], b[next], c[0], float(tid.y)) * signed_gain;
}

// A [[threadgroup(0)]] parameter sized by the dispatch.
kernel void lang_threadgroup_param(device uint* out [[buffer(0)]],
                                   threadgroup uint* scratch [[threadgroup(0)]],
                                   uint t [[thread_index_in_threadgroup]],
                                   uint n [[threads_per_threadgroup]]) {
  scratch[t] = t * t;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[t] = scratch[n - 1 - t];
}

constant bool has_bias [[function_constant(2)]];

// A parameter that exists only when a function constant is true: nothing is bound otherwise.
kernel void lang_optional_buffer(device float* out [[buffer(0)]],
                                 const device float* bias [[buffer(1), function_constant(has_bias)]],
                                 uint i [[thread_position_in_grid]]) {
  out[i] = float(i) + (has_bias ? bias[i] : 0.0f);
}
