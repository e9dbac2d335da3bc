// Test-only kernels for the simulator's checkers (tests/sim/test_checkers.py): each broken
// kernel has a correct twin that the checkers must leave alone.
#include <metal_stdlib>
using namespace metal;

// Reads in[gid + shift] for every thread: out of bounds when the grid is larger than `in`.
kernel void exec_read_shifted(device const float* in [[buffer(0)]],
                              device float* out [[buffer(1)]],
                              constant int& shift [[buffer(2)]],
                              uint gid [[thread_position_in_grid]]) {
  out[gid] = in[int(gid) + shift];
}

// The guarded twin: only threads whose element exists read it.
kernel void exec_read_guarded(device const float* in [[buffer(0)]],
                              device float* out [[buffer(1)]],
                              constant int& shift [[buffer(2)]],
                              constant uint& count [[buffer(3)]],
                              uint gid [[thread_position_in_grid]]) {
  int i = int(gid) + shift;
  out[gid] = i >= 0 && uint(i) < count ? in[i] : 0.0f;
}

// Writes out[gid + shift].
kernel void exec_write_shifted(device float* out [[buffer(0)]],
                               constant int& shift [[buffer(1)]],
                               uint gid [[thread_position_in_grid]]) {
  out[int(gid) + shift] = float(gid);
}

// Reads params[index] from a small constant buffer of 4 uints.
kernel void exec_read_params(constant uint* params [[buffer(0)]],
                             device uint* out [[buffer(1)]],
                             constant uint& index [[buffer(2)]]) {
  out[0] = params[index];
}

// A pointer far outside everything bound: a segmentation fault caught as a SimulatorError.
kernel void exec_wild_pointer(device float* out [[buffer(0)]]) {
  device float* far = out + 4000000000u;
  far[0] = 1.0f;
}

// Threadgroup memory: each thread writes its slot, then reads its neighbour's, with or without
// a threadgroup barrier in between.
kernel void exec_neighbour(device float* out [[buffer(0)]],
                           constant bool& barrier [[buffer(1)]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint tg [[threadgroup_position_in_grid]],
                           uint n [[threads_per_threadgroup]]) {
  threadgroup float values[1024];
  values[tid] = float(tid);
  if (barrier) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tg * n + tid] = values[(tid + 1) % n];
}

// Neighbour within the simdgroup, ordered by simdgroup_barrier only: correct when the neighbour
// is in the same simdgroup (`wrap` = 32), a race when it is in the next simdgroup (`wrap` = n).
kernel void exec_simd_neighbour(device float* out [[buffer(0)]],
                                constant uint& wrap [[buffer(1)]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint n [[threads_per_threadgroup]]) {
  threadgroup float values[1024];
  values[tid] = float(tid);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  uint base = tid / wrap * wrap;
  out[tid] = values[base + (tid + 1 - base) % wrap];
}

// Every thread writes slot 0 (write-write race unless only thread 0 does).
kernel void exec_all_write(device float* out [[buffer(0)]],
                           constant bool& only_first [[buffer(1)]],
                           uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float value[4];
  if (!only_first || tid == 0) value[0] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = value[0];
}

// Reads a slot of another thread, then overwrites its own after a barrier: a read-then-write
// race when the barrier is skipped.
kernel void exec_read_then_write(device float* out [[buffer(0)]],
                                 constant bool& barrier [[buffer(1)]],
                                 uint tid [[thread_index_in_threadgroup]],
                                 uint n [[threads_per_threadgroup]]) {
  threadgroup float values[1024];
  values[tid] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float v = values[(tid + 1) % n];
  if (barrier) threadgroup_barrier(mem_flags::mem_threadgroup);
  values[tid] = v * 2.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = values[tid];
}

// Threadgroup memory past the 32 KiB limit (9000 floats = 36000 bytes).
kernel void exec_too_much_threadgroup(device float* out [[buffer(0)]],
                                      uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float big[9000];
  big[tid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = big[tid];
}

// Threadgroup memory from a [[threadgroup(0)]] argument; index past its length when asked.
kernel void exec_threadgroup_arg(device float* out [[buffer(0)]],
                                 constant uint& past [[buffer(1)]],
                                 threadgroup float* scratch [[threadgroup(0)]],
                                 uint tid [[thread_index_in_threadgroup]]) {
  scratch[tid + past] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = scratch[tid + past];
}

// A simd reduction: needs a whole number of simdgroups per threadgroup.
kernel void exec_simd_sum(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  out[gid] = simd_sum(1.0f);
}

// No simd operation: any threadgroup size is fine.
kernel void exec_plain(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  out[gid] = float(gid);
}

// Like exec_simd_neighbour, across a threadgroup_barrier(mem_none): an execution barrier only,
// so it orders the lanes of one simdgroup (lockstep) but not threadgroup memory across them.
kernel void exec_mem_none_neighbour(device float* out [[buffer(0)]],
                                    constant uint& wrap [[buffer(1)]],
                                    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float values[1024];
  values[tid] = float(tid);
  threadgroup_barrier(mem_flags::mem_none);
  uint base = tid / wrap * wrap;
  out[tid] = values[base + (tid + 1 - base) % wrap];
}

// Every threadgroup writes the same elements: a race between threadgroups.
kernel void exec_overlapping_tiles(device float* out [[buffer(0)]],
                                   constant uint& tile [[buffer(1)]],
                                   uint tid [[thread_index_in_threadgroup]],
                                   uint tg [[threadgroup_position_in_grid]]) {
  out[tg * tile + tid] = float(tg);
}

// Threadgroup 1 reads what threadgroup 0 wrote in the same dispatch: a race.
kernel void exec_read_other_tile(device float* data [[buffer(0)]],
                                 uint tid [[thread_index_in_threadgroup]],
                                 uint tg [[threadgroup_position_in_grid]],
                                 uint n [[threads_per_threadgroup]]) {
  if (tg == 0) {
    data[tid] = 1.0f;
  } else {
    data[n + tid] = data[tid] + 1.0f;
  }
}

// Each thread copies one float4 (16-byte loads and stores): the binding must be 16-byte aligned
// on the GPU, as it is for a tensor at a storage offset that is a multiple of 4 floats.
kernel void exec_vector_copy(const device float4* src [[buffer(0)]],
                             device float4* dst [[buffer(1)]],
                             uint tid [[thread_position_in_grid]]) {
  dst[tid] = src[tid];
}

// Function constants. Metal specializes a pipeline for its constant values: a parameter whose
// constant is false does not exist, and a read through it whose value is then unused is removed
// with it. The read comes before a barrier, so that it cannot be sunk into the branch here either.
constant bool fc_has_params [[function_constant(0)]];

struct FcParams {
  float scale;
  int offset;
};

kernel void exec_fc_dead_read(device float* out [[buffer(0)]],
                              constant FcParams& params [[buffer(1), function_constant(fc_has_params)]],
                              uint i [[thread_position_in_grid]]) {
  const float scale = params.scale;
  const int offset = params.offset;
  threadgroup_barrier(mem_flags::mem_none);
  float v = float(i);
  if (fc_has_params) v = v * scale + float(offset);
  out[i] = v;
}

// The broken twin: the disabled buffer's value reaches the result.
kernel void exec_fc_used_read(device float* out [[buffer(0)]],
                              constant FcParams& params [[buffer(1), function_constant(fc_has_params)]],
                              uint i [[thread_position_in_grid]]) {
  const float scale = params.scale;
  threadgroup_barrier(mem_flags::mem_none);
  out[i] = fc_has_params ? float(i) * scale : float(i) + scale * 0.0f + 1.0f;
}

// Writing through a disabled buffer is an error whatever happens next.
kernel void exec_fc_write(device float* out [[buffer(0)]],
                          device float* extra [[buffer(1), function_constant(fc_has_params)]],
                          uint i [[thread_position_in_grid]]) {
  extra[i] = 1.0f;
  out[i] = float(i);
}

// Memory intrinsics: clang turns the fill and copy loops into llvm.memset / llvm.memcpy at -O2
// and copies a struct with llvm.memcpy; their bytes are checked and counted like any access.
kernel void exec_fill_loop(device float* out [[buffer(0)]],
                           constant uint& n [[buffer(1)]],
                           uint gid [[thread_position_in_grid]]) {
  if (gid != 0) return;
  for (uint i = 0; i < n; ++i) out[i] = 0.0f;
}

kernel void exec_copy_loop(device float* out [[buffer(0)]],
                           const device float* in [[buffer(1)]],
                           constant uint& n [[buffer(2)]],
                           uint gid [[thread_position_in_grid]]) {
  if (gid != 0) return;
  for (uint i = 0; i < n; ++i) out[i] = in[i];
}

struct Wide {
  float4 a, b, c, d;
};

kernel void exec_struct_copy(device Wide* out [[buffer(0)]],
                             const device Wide* in [[buffer(1)]],
                             uint gid [[thread_position_in_grid]]) {
  out[gid] = in[gid];
}

// A struct copied into threadgroup memory by every lane to the same slot: a race.
kernel void exec_struct_copy_race(device Wide* out [[buffer(0)]],
                                  const device Wide* in [[buffer(1)]],
                                  uint gid [[thread_position_in_grid]]) {
  threadgroup Wide slot[1];
  slot[0] = in[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = slot[0];
}

// Device memory inside a threadgroup: each thread writes its element, then reads another
// thread's (`stride` ahead), across a barrier chosen by `kind`: 0 none, 1 mem_device,
// 2 mem_threadgroup (which does not order device memory).
kernel void exec_device_neighbour(device float* data [[buffer(0)]],
                                  device float* out [[buffer(1)]],
                                  constant uint& kind [[buffer(2)]],
                                  constant uint& stride [[buffer(3)]],
                                  uint tid [[thread_index_in_threadgroup]],
                                  uint n [[threads_per_threadgroup]]) {
  data[tid] = float(tid);
  if (kind == 1) threadgroup_barrier(mem_flags::mem_device);
  if (kind == 2) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = data[(tid + stride) % n];
}

// The other order: each thread reads another thread's element (`stride` ahead, bytes nothing has
// written yet), then writes its own, across a barrier chosen by `kind` as above.
kernel void exec_device_read_then_write(device float* data [[buffer(0)]],
                                        device float* out [[buffer(1)]],
                                        constant uint& kind [[buffer(2)]],
                                        constant uint& stride [[buffer(3)]],
                                        uint tid [[thread_index_in_threadgroup]],
                                        uint n [[threads_per_threadgroup]]) {
  out[tid] = data[(tid + stride) % n];
  if (kind == 1) threadgroup_barrier(mem_flags::mem_device);
  if (kind == 2) threadgroup_barrier(mem_flags::mem_threadgroup);
  data[tid] = float(tid);
}

// Threadgroup memory between the lanes of one simdgroup across a simd operation chosen by
// `kind`: 0 simd_sum, 1 simdgroup_barrier(mem_none), 2 simdgroup_barrier(mem_threadgroup).
// Only the last orders memory (MSL); lockstep execution is not a memory order.
kernel void exec_simd_op_neighbour(device float* out [[buffer(0)]],
                                   constant uint& kind [[buffer(1)]],
                                   uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float values[32];
  values[tid] = float(tid);
  float s = 0.0f;
  if (kind == 0) s = simd_sum(1.0f);
  if (kind == 1) simdgroup_barrier(mem_flags::mem_none);
  if (kind == 2) simdgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = values[(tid + 1) % 32] + s;
}

// An index past one threadgroup allocation that would land in the next one: A[40] on
// `threadgroup float A[32]` is B[8] when B follows A; the same for [[threadgroup(n)]] arguments.
kernel void exec_tg_overflow(device float* out [[buffer(0)]],
                             constant uint& index [[buffer(1)]],
                             uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float A[32];
  threadgroup float B[32];
  A[tid] = 1.0f;
  B[tid] = 2.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Through a pointer, which the array-bounds check does not see (A[index] itself is reported
  // as an index out of the array's bounds).
  threadgroup float* p = A;
  if (tid == 0) out[0] = p[index];
  out[tid + 1] = B[tid];
}

kernel void exec_tg_arg_overflow(device float* out [[buffer(0)]],
                                 constant uint& index [[buffer(1)]],
                                 threadgroup float* a [[threadgroup(0)]],
                                 threadgroup float* b [[threadgroup(1)]],
                                 uint tid [[thread_index_in_threadgroup]]) {
  a[tid] = 1.0f;
  b[tid] = 2.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) out[0] = a[index];
  out[tid + 1] = b[tid];
}

// A scalar loop over a view that is 4-byte aligned only: correct MSL, whatever the compiler
// would like to vectorize it into.
kernel void exec_scalar_loop(device float* out [[buffer(0)]],
                             const device float* in [[buffer(1)]],
                             constant uint& n [[buffer(2)]],
                             uint gid [[thread_position_in_grid]]) {
  if (gid != 0) return;
  for (uint i = 0; i < n; ++i) out[i] = in[i] * 2.0f + 1.0f;
}

// A thread-private array indexed out of its bounds when `index` >= 8.
kernel void exec_private_array(device float* out [[buffer(0)]],
                               constant uint& index [[buffer(1)]],
                               uint gid [[thread_position_in_grid]]) {
  float a[8];
  for (uint i = 0; i < 8; ++i) a[i] = float(i * gid);
  out[gid] = a[index];
}

// A dispatch may leave a buffer unbound that the kernel only offsets (PyTorch's decode kernels
// bind no mask when a template constant says there is none; Metal's compiler drops the mask).
template <bool kHasExtra>
kernel void exec_unbound(device float* out [[buffer(0)]],
                         const device float* extra [[buffer(1)]],
                         uint i [[thread_position_in_grid]]) {
  extra += i;
  out[i] = kHasExtra ? extra[0] : float(i);
}
template [[host_name("exec_unbound_unused")]] [[kernel]] decltype(exec_unbound<false>) exec_unbound<false>;
template [[host_name("exec_unbound_read")]] [[kernel]] decltype(exec_unbound<true>) exec_unbound<true>;

// A running maximum per simdgroup kept in threadgroup memory, as attention kernels keep a row's:
// lanes read it, combine it with their values through simd_shuffle_xor, and one lane writes the
// result. `mode` 0: that pattern (the write depends on every lane's read through the shuffles);
// 1: lane 0 writes before the shuffles (and not after: a later store would make that one dead)
// and the others read after them (a collective does not make a write visible); 2: lanes 0 and 1 both write after the shuffles; 3: every lane reads,
// only lanes 0-15 shuffle, lane 0 writes (lanes 16-31 took part in no collective with it); 4:
// only lane 5 reads, lanes 0-15 shuffle, lane 0 writes.
kernel void exec_running_max(device float* out [[buffer(0)]],
                             device const float* x [[buffer(1)]],
                             constant uint& mode [[buffer(2)]],
                             uint tid [[thread_index_in_threadgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float row_max[32];
  if (lane == 0) row_max[sg] = -INFINITY;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float v = x[tid];
  if (mode == 1 && lane == 0) row_max[sg] = v;
  if (mode != 1 && (mode != 4 || lane == 5)) v = max(v, row_max[sg]);
  if (mode < 3) {
    for (ushort offset = 16; offset > 0; offset /= 2) v = max(v, simd_shuffle_xor(v, offset));
  } else if (lane < 16) {
    for (ushort offset = 8; offset > 0; offset /= 2) v = max(v, simd_shuffle_xor(v, offset));
  }
  if (mode == 1 && lane != 0) v = max(v, row_max[sg]);
  if (mode != 1 && (lane == 0 || (mode == 2 && lane == 1))) row_max[sg] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = mode == 1 ? v : row_max[sg];  // (mode 1: so that its reads are not dead)
}
