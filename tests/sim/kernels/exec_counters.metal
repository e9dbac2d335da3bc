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

// Reductions: each of simd_max, simd_min and simd_sum on a float and on a half is one reduction
// (test_instructions_reductions_issue_no_alu); the one add joining each pair and the
// conversions in and out are the kernel's own instructions.
kernel void exec_mix_reductions(device float* x [[buffer(0)]],
                                uint i [[thread_position_in_grid]]) {
  const float v = x[i];
  const half h = half(v);
  x[i] = simd_max(v) + simd_min(v) + simd_sum(v) +
         float(simd_max(h) + simd_min(h) + simd_sum(h));
}

// The instruction counters (test_counters.py, test_instructions_*): small kernels whose
// simdgroup-issued instructions per class are known by hand. Each simdgroup issues each of its
// basic blocks once per run of the block by any of its lanes (the most runs of one lane).

// fp32 arithmetic: y = x * 3 + 1 per lane: a multiply and the add that uses it, one FMA as Metal
// compiles it (fast math contracts; the counters count so, torch_steel/sim/ir.py).
kernel void exec_mix_fp32(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  x[i] = x[i] * 3.0f + 1.0f;
}

// The same on float4: one vector load and store, each FMA four times.
kernel void exec_mix_float4(device float4* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  x[i] = x[i] * 3.0f + 1.0f;
}

// half arithmetic, and a half transcendental, which Metal issues as one instruction of its own
// (the shim computes it in binary32 with two conversions: not counted).
kernel void exec_mix_half(device half* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  x[i] = exp(x[i] * 3.0h);
}

// FMA contraction (ir.py): which multiplies fuse into the add or subtract that uses them. Each
// lane reads a, b, c, d at x[8 i ..] and writes x[8 i .. 8 i + 6]; h holds half a, b, c.
kernel void exec_mix_contract(device float* x [[buffer(0)]],
                              device half* h [[buffer(1)]],
                              device const uint* trips [[buffer(2)]],
                              uint i [[thread_position_in_grid]]) {
  device float* v = x + 8 * i;
  const float a = v[0], b = v[1], c = v[2], d = v[3];
  v[0] = a * b + c;  // one FMA
  v[1] = a * c - d;  // one FMA (a negated addend)
  v[2] = d - b * c;  // one FMA (a negated product)
  v[3] = a * d + b * b;  // an add takes one multiply: an FMA and a multiply
  const float p = c * d;  // two uses: a multiply, an add, a multiply
  v[4] = p + a;
  v[5] = p * b;
  // The product is made before the loop, its add in the body (another block): not fused.
  const float q = a * a;
  float acc = 0.0f;
#pragma clang loop unroll(disable)
  for (uint k = 0; k < trips[i]; ++k) acc += q;
  v[6] = acc;
  device half* w = h + 4 * i;
  w[3] = w[0] * w[1] + w[2];  // one half FMA
}

// Conversions: half -> float (one), float4 -> int4 (four: the shim's range checks of a vector
// conversion are not counted), and a compare and a select.
kernel void exec_mix_convert(device const half* h [[buffer(0)]],
                             device const float4* f [[buffer(1)]],
                             device float* out [[buffer(2)]],
                             device int4* iout [[buffer(3)]],
                             uint i [[thread_position_in_grid]]) {
  const float a = float(h[i]);
  out[i] = a > 0.5f ? a : 2.0f;
  iout[i] = int4(f[i]);
}

// Transcendentals and division: exp2, fast::exp2, rsqrt, log of a float4 (four) and a divide.
kernel void exec_mix_transcendental(device float* x [[buffer(0)]],
                                    device float4* v [[buffer(1)]],
                                    uint i [[thread_position_in_grid]]) {
  const float a = x[i];
  x[i] = exp2(a) + fast::exp2(a) + rsqrt(a) / a;
  v[i] = log(v[i]);
}

// Divergence: lanes whose bit of `mask` is set take one path (an exp2 stored to x), the others
// the other (a multiply stored to y). A simdgroup issues each path once if any lane takes it.
kernel void exec_mix_divergent(device float* x [[buffer(0)]],
                               device float* y [[buffer(1)]],
                               constant uint& mask [[buffer(2)]],
                               uint i [[thread_position_in_grid]],
                               uint lane [[thread_index_in_simdgroup]]) {
  if ((mask >> lane) & 1u) {
    x[i] = exp2(x[i]);
  } else {
    y[i] = y[i] * 3.0f;
  }
}

// A loop whose trip count differs per lane: the simdgroup issues its body as often as the lane
// with the most trips runs it.
kernel void exec_mix_loop(device float* x [[buffer(0)]],
                          device const uint* trips [[buffer(1)]],
                          uint i [[thread_position_in_grid]]) {
  float acc = x[i];
  const uint n = trips[i];
  // Not unrolled, so that each trip is one run of the body's block.
#pragma clang loop unroll(disable)
  for (uint k = 0; k < n; ++k) acc = acc * 1.5f + 1.0f;
  x[i] = acc;
}

// One simdgroup multiply-accumulate of each operand type, per simdgroup.
template <typename T>
kernel void exec_mma_types(device const T* a [[buffer(0)]],
                           device float* c [[buffer(1)]],
                           uint sg [[simdgroup_index_in_threadgroup]]) {
  simdgroup_matrix<T, 8, 8> A;
  simdgroup_float8x8 C = simdgroup_float8x8(0);
  simdgroup_load(A, a, 8);
  simdgroup_multiply_accumulate(C, A, A, C);
  simdgroup_store(C, c + sg * 64, 8);
}
template [[host_name("exec_mma_types_float")]] [[kernel]] decltype(exec_mma_types<float>)
    exec_mma_types<float>;
template [[host_name("exec_mma_types_half")]] [[kernel]] decltype(exec_mma_types<half>)
    exec_mma_types<half>;
template [[host_name("exec_mma_types_bfloat")]] [[kernel]] decltype(exec_mma_types<bfloat>)
    exec_mma_types<bfloat>;

// A threadgroup array in kernels whose names differ only in length: Metal lays the array out
// when it compiles the kernel, so declaring it issues nothing, whatever the kernel is called.
#define EXEC_TG_ARRAY_BODY                                   \
  {                                                          \
    threadgroup float tile[32];                              \
    tile[i] = float(i);                                      \
    threadgroup_barrier(mem_flags::mem_threadgroup);         \
    out[i] = tile[31 - i];                                   \
  }
kernel void exec_tg_name(device float* out [[buffer(0)]],
                         uint i [[thread_position_in_threadgroup]]) EXEC_TG_ARRAY_BODY
kernel void exec_tg_name_that_is_a_good_deal_longer_than_the_other_one_so_that_a_cost_per_character_of_the_function_name_would_show_in_every_class_of_the_instruction_counters(
    device float* out [[buffer(0)]], uint i [[thread_position_in_threadgroup]]) EXEC_TG_ARRAY_BODY

// Copies out of threadgroup and device memory that C++ cannot write directly and the pre-pass
// routes through the shim (a copy-initialized local of a template-dependent vector type, a
// struct copy-initialized, a struct assigned across address spaces): each is the one load and
// store of the address spaces it reads and writes, as the plain vector assignment is.
struct ExecPair {
  float a;
  float b;
};
template <typename T>
kernel void exec_copy_init_vec(device T* out [[buffer(0)]],
                               uint i [[thread_position_in_threadgroup]]) {
  threadgroup vec<T, 2> tile[32];
  tile[i] = vec<T, 2>(T(i), T(1));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const vec<T, 2> v = *(const threadgroup vec<T, 2>*)&tile[31 - i];
  out[i] = v.x + v.y;
}
template [[host_name("exec_copy_init_vec_float")]] [[kernel]] decltype(exec_copy_init_vec<float>)
    exec_copy_init_vec<float>;
template <typename T>
kernel void exec_assign_vec(device T* out [[buffer(0)]],
                            uint i [[thread_position_in_threadgroup]]) {
  threadgroup vec<T, 2> tile[32];
  tile[i] = vec<T, 2>(T(i), T(1));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  vec<T, 2> v;
  v = *(const threadgroup vec<T, 2>*)&tile[31 - i];
  out[i] = v.x + v.y;
}
template [[host_name("exec_assign_vec_float")]] [[kernel]] decltype(exec_assign_vec<float>)
    exec_assign_vec<float>;
kernel void exec_copy_struct(device float* out [[buffer(0)]],
                             device const ExecPair* in [[buffer(1)]],
                             uint i [[thread_position_in_threadgroup]]) {
  threadgroup ExecPair tile[32];
  tile[i] = in[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  ExecPair p = tile[31 - i];
  out[i] = p.a + p.b;
}

// Half2 reads of a row from device or threadgroup memory (a function constant picks), a
// pointer step a trip: per trip one load, two conversions, two FMAs and the loop's increment,
// compare and branch. clang's optimizer reads the two halves as one 32-bit integer, a shift,
// two truncations and two bitcasts: element moves, not instructions.
constant bool exec_fc_direct [[function_constant(1)]];
constant bool exec_fc_vec [[function_constant(2)]];
kernel void exec_mix_half2(device const half* h [[buffer(0)]],
                           device float* out [[buffer(1)]],
                           constant uint& trips [[buffer(2)]],
                           constant int& cols [[buffer(3)]],
                           uint i [[thread_position_in_grid]]) {
  threadgroup half tile[64];
  tile[2 * i] = h[2 * i];
  tile[2 * i + 1] = h[2 * i + 1];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const device half* row = h + 2 * i;
  float acc = 0.0f;
  for (uint t = 0; t < trips; ++t, row += 64) {
    float f[2];
    if (exec_fc_direct && exec_fc_vec) {
      const half2 x = *((const device half2*)row);
      f[0] = float(x[0]);
      f[1] = float(x[1]);
    } else if (exec_fc_direct) {
      for (short e = 0; e < 2; ++e) f[e] = int(i) * 2 + e < cols ? float(row[e]) : 0.0f;
    } else {
      const half2 x = *((const threadgroup half2*)(tile + 2 * i));
      f[0] = float(x[0]);
      f[1] = float(x[1]);
    }
    acc += f[0] * f[0] + f[1] * f[1];
  }
  out[i] = acc;
}

// simd_shuffle from the lane a loop counts, in two slots that a runtime flag each may skip (the
// vector decode kernel's rows): per trip and slot one shuffle, one FMA and the flag's branch,
// and per trip the loop's increment, compare and branch. The shim's check of the source lane
// (an id of 32 or more, an inactive lane) and its address are the simulator's, not the
// shader's: the optimizer once hoisted them above the slots' branches, out of the shim's source
// lines, and they counted as 3 integer operations and 2 compares a shuffle.
kernel void exec_mix_shuffle_loop(device float* x [[buffer(0)]],
                                  constant uint& trips [[buffer(1)]],
                                  constant uint2& flags [[buffer(2)]],
                                  uint i [[thread_position_in_grid]]) {
  const float v = x[i];
  const bool on[2] = {flags.x != 0, flags.y != 0};
  float acc[2] = {0.0f, 0.0f};
  for (ushort j = 0; j < trips; ++j) {
#pragma clang loop unroll(full)
    for (short n = 0; n < 2; ++n) {
      if (on[n]) acc[n] += simd_shuffle(v + float(n), j) * v;
    }
  }
  x[i] = acc[0] + acc[1];
}

// A select and a logical operation on a function constant, resolved when the pipeline is built
// (to 2 or `scale`, to true or `a > 0`): no instruction, so the kernel counts what its twin
// without the function constant does (a multiply, a compare and a select).
constant bool exec_fc_fixed [[function_constant(0)]];
kernel void exec_mix_constant_select(device float* x [[buffer(0)]],
                                     constant float& scale [[buffer(1)]],
                                     uint i [[thread_position_in_grid]]) {
  const float a = x[i];
  const float b = a * (exec_fc_fixed ? 2.0f : scale);
  x[i] = (exec_fc_fixed | (a > 0.0f)) ? b : 0.0f;
}
kernel void exec_mix_runtime_select(device float* x [[buffer(0)]],
                                    constant float& scale [[buffer(1)]],
                                    uint i [[thread_position_in_grid]]) {
  const float a = x[i];
  const float b = a * scale;
  x[i] = a > 0.0f ? b : 0.0f;
}
