// Test-only kernels for the simulator's execution half (tests/sim/test_runtime.py).
#include <metal_stdlib>
using namespace metal;

// Every thread-position attribute of every thread, 16 uints per thread.
kernel void exec_lane_ids(device uint* out [[buffer(0)]],
                          uint3 gid [[thread_position_in_grid]],
                          uint3 tgid [[threadgroup_position_in_grid]],
                          uint3 tid [[thread_position_in_threadgroup]],
                          uint3 tpg [[threads_per_threadgroup]],
                          uint index [[thread_index_in_threadgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]],
                          uint3 grid_threads [[threads_per_grid]]) {
  uint flat = gid.x + grid_threads.x * (gid.y + grid_threads.y * gid.z);
  device uint* o = out + flat * 16;
  o[0] = gid.x; o[1] = gid.y; o[2] = gid.z;
  o[3] = tgid.x; o[4] = tgid.y; o[5] = tgid.z;
  o[6] = tid.x; o[7] = tid.y; o[8] = tid.z;
  o[9] = tpg.x; o[10] = tpg.y; o[11] = tpg.z;
  o[12] = index; o[13] = sg; o[14] = lane; o[15] = 1;
}

// The grid-shape attributes of every thread, 24 uints per thread (for dispatchThreads grids,
// whose last threadgroups are partial): positions, sizes, and the lanes of its simdgroup.
kernel void exec_grid_ids(device uint* out [[buffer(0)]],
                          uint3 gid [[thread_position_in_grid]],
                          uint3 tgid [[threadgroup_position_in_grid]],
                          uint3 tid [[thread_position_in_threadgroup]],
                          uint3 tpg [[threads_per_threadgroup]],
                          uint3 dtpg [[dispatch_threads_per_threadgroup]],
                          uint3 groups [[threadgroups_per_grid]],
                          uint3 grid_threads [[threads_per_grid]],
                          uint index [[thread_index_in_threadgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]],
                          uint sgs [[simdgroups_per_threadgroup]]) {
  uint flat = gid.x + grid_threads.x * (gid.y + grid_threads.y * gid.z);
  device uint* o = out + flat * 24;
  o[0] = gid.x; o[1] = gid.y; o[2] = gid.z;
  o[3] = tgid.x; o[4] = tgid.y; o[5] = tgid.z;
  o[6] = tid.x; o[7] = tid.y; o[8] = tid.z;
  o[9] = tpg.x; o[10] = tpg.y; o[11] = tpg.z;
  o[12] = dtpg.x; o[13] = dtpg.y; o[14] = dtpg.z;
  o[15] = groups.x; o[16] = groups.y; o[17] = groups.z;
  o[18] = grid_threads.x; o[19] = grid_threads.y; o[20] = grid_threads.z;
  o[21] = index; o[22] = sg * 1000 + lane; o[23] = sgs * 1000 + simd_sum(1u);
}

// Tree sum of one threadgroup's values in threadgroup memory: log2(n) barriers in a loop.
kernel void exec_tree_sum(device const float* in [[buffer(0)]],
                          device float* out [[buffer(1)]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint tg [[threadgroup_position_in_grid]],
                          uint n [[threads_per_threadgroup]]) {
  threadgroup float partial[1024];
  partial[tid] = in[tg * n + tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = n / 2; stride > 0; stride /= 2) {
    if (tid < stride) partial[tid] += partial[tid + stride];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (tid == 0) out[tg] = partial[0];
}

// Threads past `count` exit before the barrier; the others still meet there (exited lanes leave
// barriers) and each reads its neighbour's value.
kernel void exec_early_exit(device const float* in [[buffer(0)]],
                            device float* out [[buffer(1)]],
                            constant uint& count [[buffer(2)]],
                            uint gid [[thread_position_in_grid]],
                            uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float values[256];
  if (gid >= count) return;
  values[tid] = in[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint next = tid + 1 < 256 && gid + 1 < count ? tid + 1 : tid;
  out[gid] = values[next];
}

// simd_sum and simd_shuffle after some lanes of the simdgroup exited: the active ones take part.
kernel void exec_simd_after_exit(device float* out [[buffer(0)]],
                                 constant uint& active [[buffer(1)]],
                                 uint lane [[thread_index_in_simdgroup]]) {
  if (lane >= active) return;
  out[lane] = simd_sum(float(lane + 1));
}

// A barrier that only simdgroup 0 reaches, then one that all reach: divergent.
kernel void exec_divergent_barrier(device float* out [[buffer(0)]],
                                   uint sg [[simdgroup_index_in_threadgroup]],
                                   uint tid [[thread_index_in_threadgroup]]) {
  if (sg == 0) threadgroup_barrier(mem_flags::mem_none);
  threadgroup_barrier(mem_flags::mem_none);
  out[tid] = 1;
}

// Half a simdgroup at a barrier, the other half at a simd reduction (over its 16 lanes).
kernel void exec_barrier_vs_simd(device float* out [[buffer(0)]],
                                 uint lane [[thread_index_in_simdgroup]]) {
  float v = 1;
  if (lane < 16) {
    threadgroup_barrier(mem_flags::mem_none);
  } else {
    v = simd_sum(v);
  }
  out[lane] = v;
}

// simd_sum inside a branch taken by some lanes only (over those lanes), then one outside it.
kernel void exec_divergent_simd(device float* out [[buffer(0)]],
                                uint lane [[thread_index_in_simdgroup]]) {
  float v = float(lane);
  if (lane < 8) v = simd_sum(v);
  v = simd_max(v);
  out[lane] = v;
}

// The correct twin of the two above: every lane reaches the same simd operations.
kernel void exec_convergent_simd(device float* out [[buffer(0)]],
                                 uint lane [[thread_index_in_simdgroup]]) {
  float v = float(lane);
  float s = simd_sum(v);
  v = lane < 8 ? s : v;
  out[lane] = simd_max(v) + simd_shuffle_xor(v, 1u);
}

// Many simdgroups passing values around a ring through threadgroup memory for `rounds` rounds,
// with a simdgroup_barrier and a threadgroup_barrier per round: exercises the scheduler.
kernel void exec_ring(device float* out [[buffer(0)]],
                      constant uint& rounds [[buffer(1)]],
                      uint tg [[threadgroup_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint n [[threads_per_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float ring[1024];
  float v = float(tid);
  for (uint r = 0; r < rounds; ++r) {
    ring[tid] = v + simd_shuffle_down(v, 1u) * 0.0f;
    simdgroup_barrier(mem_flags::mem_threadgroup);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    v = ring[(tid + 1) % n];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[tg * n + tid] = v + float(lane) * 0.0f;
}

// Reads a function constant of each type; `has_offset` may be left undefined.
constant bool flip [[function_constant(0)]];
constant int scale [[function_constant(1)]];
constant float shift [[function_constant(2)]];
constant bool has_offset = is_function_constant_defined(flip);

kernel void exec_constants(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  float v = float(gid) * float(scale) + shift;
  out[gid] = flip ? -v : v;
}

// A stack-hungry but legal kernel: a large private array indexed at run time.
kernel void exec_private_array(device const uint* in [[buffer(0)]],
                               device uint* out [[buffer(1)]],
                               uint gid [[thread_position_in_grid]]) {
  uint a[2048];
  for (uint i = 0; i < 2048; ++i) a[i] = i * 3 + gid;
  out[gid] = a[in[gid] % 2048];
}

// Thread 0 spin-waits for a flag that thread 1 sets: no forward progress is guaranteed in Metal,
// and on the simulator's fibers thread 1 never runs, so this must be reported, not hang.
kernel void exec_spin_wait(device int* out [[buffer(0)]],
                           uint tid [[thread_index_in_threadgroup]]) {
  threadgroup int flag[1];
  if (tid == 0) flag[0] = 0;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  volatile threadgroup int* f = flag;
  if (tid == 0) {
    while (f[0] == 0) {
    }
  }
  if (tid == 1) f[0] = 1;
  out[tid] = 1;
}

// An exit condition that is never met for an odd `n`, in a loop that touches only the lane's
// own variables: the watchdog must end it.
kernel void exec_endless_loop(device uint* out [[buffer(0)]],
                              constant uint& n [[buffer(1)]],
                              uint gid [[thread_position_in_grid]]) {
  volatile uint i = 0;
  while (i != n) i = i + 2;
  out[gid] = i;
}

// A helper that the compiler does not inline, holding a barrier (or a simdgroup_barrier), reached
// from two call sites: when the lanes split between them, they are at two different barriers.
__attribute__((noinline)) void exec_helper_barrier() {
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

__attribute__((noinline)) float exec_helper_sum(float x) {
  simdgroup_barrier(mem_flags::mem_none);  // refused in divergent control flow, unlike simd_sum
  return x;
}

kernel void exec_helper_divergent(device float* out [[buffer(0)]],
                                  constant uint2& p [[buffer(1)]],
                                  uint tid [[thread_index_in_threadgroup]]) {
  // p.x: 0 threadgroup_barrier, 1 simdgroup_barrier; p.y: threads below it take the first call
  // site.
  if (tid < p.y) {
    out[tid] = 1.0f;
    if (p.x == 0) exec_helper_barrier(); else out[tid] += exec_helper_sum(1.0f);
  } else {
    if (p.x == 0) exec_helper_barrier(); else out[tid] += exec_helper_sum(2.0f);
    out[tid] += 2.0f;
  }
}

// At most 64 threads per threadgroup: a larger dispatch is refused, as by Metal's pipeline.
[[kernel, max_total_threads_per_threadgroup(64)]] void exec_max_threads(
    device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  out[gid] = float(gid);
}

// Function constants of each kind, to be set with values of the declared type only.
constant bool fc_flag [[function_constant(10)]];
constant int fc_count [[function_constant(11)]];
constant float fc_gain [[function_constant(12)]];

kernel void exec_fc_types(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  out[gid] = (fc_flag ? 1.0f : 0.0f) + float(fc_count) * fc_gain;
}

// Shuffles and reductions in divergent control flow, as MSL defines them over the active lanes:
// lanes 0-7 sum among themselves, then all 32 take the maximum; in a loop that lanes leave at
// different trip counts, each iteration's sum covers the lanes still in it.
kernel void exec_divergent_reductions(device float* out [[buffer(0)]],
                                      uint lane [[thread_index_in_simdgroup]],
                                      uint tid [[thread_index_in_threadgroup]]) {
  float v = float(lane);
  if (lane < 8) v = simd_sum(v);
  v = simd_max(v);
  float w = 0.0f;
  for (uint i = 0; i < lane % 4; ++i) w += simd_sum(1.0f);
  out[tid * 2] = v;
  out[tid * 2 + 1] = w;
}
