// Test-only kernels for tests/sim/test_intrinsics.py: every simd_* function (with exited lanes)
// and metal:: math.
#include <metal_stdlib>

using namespace metal;

#define SIMD_FLOAT_RESULTS 14
#define SIMD_UINT_RESULTS 6

// Lanes whose bit is set in exit_mask[simdgroup] return first; the others call every simd
// function on x[thread] and write their results (the exited lanes' slots stay untouched).
template <typename T>
[[kernel]] void lang_simd(const device T* x [[buffer(0)]], device T* out [[buffer(1)]],
                          device uint* uout [[buffer(2)]],
                          const device uint* exit_mask [[buffer(3)]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]]) {
  if ((exit_mask[sg] >> lane) & 1u) return;
  const T v = x[tid];
  device T* o = out + tid * SIMD_FLOAT_RESULTS;
  o[0] = simd_shuffle(v, ushort((lane * 7 + 3) % 32));
  o[1] = simd_shuffle_xor(v, ushort(5));
  o[2] = simd_shuffle_up(v, ushort(3));
  o[3] = simd_shuffle_down(v, ushort(3));
  o[4] = simd_shuffle_rotate_up(v, ushort(3));
  o[5] = simd_shuffle_rotate_down(v, ushort(3));
  o[6] = simd_broadcast(v, ushort(9));
  o[7] = simd_broadcast_first(v);
  o[8] = simd_sum(v);
  o[9] = simd_max(v);
  o[10] = simd_min(v);
  o[11] = simd_prefix_inclusive_sum(v);
  o[12] = simd_prefix_exclusive_sum(v);
  o[13] = simd_product(v);
  device uint* u = uout + tid * SIMD_UINT_RESULTS;
  const bool positive = v > T(0);
  u[0] = uint(ulong(simd_ballot(positive)));
  u[1] = simd_all(positive) ? 1 : 0;
  u[2] = simd_any(positive) ? 1 : 0;
  u[3] = simd_is_first() ? 1 : 0;
  u[4] = uint(ulong(simd_active_threads_mask()));
  u[5] = simd_sum(uint(lane));
}

template [[host_name("lang_simd_f32")]] [[kernel]] decltype(lang_simd<float>) lang_simd<float>;
template [[host_name("lang_simd_f16")]] [[kernel]] decltype(lang_simd<half>) lang_simd<half>;
template [[host_name("lang_simd_i32")]] [[kernel]] decltype(lang_simd<int>) lang_simd<int>;

// simd functions on vectors act per component.
[[kernel]] void lang_simd_vector(const device float2* x [[buffer(0)]],
                                 device float2* out [[buffer(1)]],
                                 uint lane [[thread_index_in_simdgroup]]) {
  const float2 v = x[lane];
  out[3 * lane] = simd_sum(v);
  out[3 * lane + 1] = simd_shuffle_xor(v, ushort(1));
  out[3 * lane + 2] = simd_max(v);
}

#define MATH_RESULTS 24

// metal:: math of x[i] (and y[i] for two-argument functions), in T.
template <typename T>
[[kernel]] void lang_math(const device T* x [[buffer(0)]], const device T* y [[buffer(1)]],
                          device T* out [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  const T a = x[i];
  const T b = y[i];
  device T* o = out + i * MATH_RESULTS;
  o[0] = exp(a);
  o[1] = exp2(a);
  o[2] = log(abs(a));
  o[3] = log2(abs(a));
  o[4] = sqrt(abs(a));
  o[5] = rsqrt(abs(a));
  o[6] = tanh(a);
  o[7] = fast::exp(a);
  o[8] = precise::tanh(a);
  o[9] = max(a, b);
  o[10] = min(a, b);
  o[11] = clamp(a, T(-1), T(1));
  o[12] = abs(a);
  o[13] = fma(a, b, a);
  o[14] = select(a, b, a < b);
  o[15] = floor(a);
  o[16] = ceil(a);
  o[17] = round(a);
  o[18] = trunc(a);
  o[19] = isnan(a) ? T(1) : T(0);
  o[20] = isinf(a) ? T(1) : T(0);
  o[21] = pow(abs(a), b);
  o[22] = isnan(a) ? b : fast::max(a, b);  // fast:: with a NaN operand is undefined
  o[23] = numeric_limits<T>::max();
}

template [[host_name("lang_math_f32")]] [[kernel]] decltype(lang_math<float>) lang_math<float>;
template [[host_name("lang_math_f16")]] [[kernel]] decltype(lang_math<half>) lang_math<half>;

// Vector math, per component, and reductions of comparisons.
[[kernel]] void lang_math_vector(const device float4* x [[buffer(0)]],
                                 device float4* out [[buffer(1)]],
                                 device uint* flags [[buffer(2)]]) {
  const float4 a = x[0];
  const float4 b = x[1];
  out[0] = max(a, b);
  out[1] = max(a, 0.0f);
  out[2] = clamp(a, -1.0f, 1.0f);
  out[3] = select(a, b, a < b);
  out[4] = exp(a);
  out[5] = fma(a, b, a);
  flags[0] = all(a < b) ? 1 : 0;
  flags[1] = any(a < b) ? 1 : 0;
  flags[2] = any(isnan(a)) ? 1 : 0;
}

// Atomics: every lane adds into device counters and a threadgroup one, and takes a maximum.
kernel void lang_atomics(device atomic_int* total [[buffer(0)]],
                         device atomic_float* ftotal [[buffer(1)]],
                         device atomic_uint* biggest [[buffer(2)]],
                         device int* per_group [[buffer(3)]],
                         uint gid [[thread_position_in_grid]],
                         uint t [[thread_index_in_threadgroup]],
                         uint tg [[threadgroup_position_in_grid]]) {
  threadgroup atomic_int group_sum;
  if (t == 0) atomic_store_explicit(&group_sum, 0, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(total, int(gid), memory_order_relaxed);
  atomic_fetch_add_explicit(ftotal, 0.5f, memory_order_relaxed);
  atomic_fetch_max_explicit(biggest, (gid * 37u) % 101u, memory_order_relaxed);
  atomic_fetch_add_explicit(&group_sum, 1, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (t == 0) per_group[tg] = atomic_load_explicit(&group_sum, memory_order_relaxed);
}

// simd_shuffle_and_fill_down/up over the whole simdgroup and within vectors of `modulo` lanes.
kernel void lang_simd_fill(const device float* x [[buffer(0)]], const device float* y [[buffer(1)]],
                           device float4* out [[buffer(2)]],
                           uint lane [[thread_index_in_simdgroup]]) {
  const float a = x[lane];
  const float b = y[lane];
  out[lane] = float4(simd_shuffle_and_fill_down(a, b, ushort(3)),
                     simd_shuffle_and_fill_up(a, b, ushort(5)),
                     simd_shuffle_and_fill_down(a, b, ushort(2), ushort(8)),
                     simd_shuffle_and_fill_up(a, b, ushort(3), ushort(16)));
}

// fast::min / max / clamp / fmin / fmax of a[i] and b[i] (`which` picks one): undefined in Metal
// for a NaN operand, an error in the simulator.
[[kernel]] void lang_fast_minmax(const device float* a [[buffer(0)]],
                                 const device float* b [[buffer(1)]],
                                 device float* out [[buffer(2)]],
                                 constant uint& which [[buffer(3)]],
                                 uint i [[thread_position_in_grid]]) {
  const float x = a[i];
  const float y = b[i];
  switch (which) {
    case 0: out[i] = fast::max(x, y); break;
    case 1: out[i] = fast::min(x, y); break;
    case 2: out[i] = fast::clamp(x, y, INFINITY); break;
    case 3: out[i] = fast::fmax(x, y); break;
    case 4: out[i] = fast::fmin(x, y); break;
    case 5: out[i] = fast::max(float2(x, 0.0f), float2(y, 0.0f)).x; break;
    default: out[i] = fast::saturate(x) + fast::saturate(y); break;
  }
}

// A shift whose delta differs between lanes (lanes >= `split` use delta + 1): Metal requires the
// same delta in every thread, so only split == 32 (or 0) is valid. `which` picks the function
// (100 + m: simd_shuffle_and_fill_down with modulo m).
[[kernel]] void lang_shuffle_delta(const device float* x [[buffer(0)]],
                                   device float* out [[buffer(1)]],
                                   constant uint2& p [[buffer(2)]],
                                   ushort lane [[thread_index_in_simdgroup]]) {
  const float v = x[lane];
  const ushort delta = ushort(lane >= p.y ? 2 : 1);
  switch (p.x) {
    case 0: out[lane] = simd_shuffle_down(v, delta); break;
    case 1: out[lane] = simd_shuffle_up(v, delta); break;
    case 2: out[lane] = simd_shuffle_rotate_down(v, delta); break;
    case 3: out[lane] = simd_shuffle_rotate_up(v, delta); break;
    case 4: out[lane] = simd_shuffle_and_fill_down(v, -v, delta); break;
    case 5: out[lane] = simd_shuffle_and_fill_up(v, -v, delta); break;
    case 6:
      out[lane] = simd_shuffle_and_fill_down(v, -v, ushort(1), ushort(lane >= p.y ? 8 : 16));
      break;
    case 7: out[lane] = simd_shuffle_xor(v, delta); break;
    case 8: out[lane] = simd_broadcast(v, delta); break;
    default: out[lane] = simd_shuffle_and_fill_down(v, -v, ushort(1), ushort(p.x - 100));
  }
}

// Votes with lanes >= `active` exited: simd_ballot(e).all() / any() look at all 32 bits, simd_all
// / simd_any at the active lanes only; the low 32 bits of the ballot are written too.
[[kernel]] void lang_votes(device uint* out [[buffer(0)]], constant uint& active [[buffer(1)]],
                           ushort lane [[thread_index_in_simdgroup]]) {
  if (lane >= active) return;
  device uint* o = out + lane * 8;
  o[0] = simd_ballot(true).all() ? 1 : 0;
  o[1] = simd_all(true) ? 1 : 0;
  o[2] = simd_ballot(lane == 0).any() ? 1 : 0;
  o[3] = simd_any(lane == 0) ? 1 : 0;
  o[4] = uint(ulong(simd_ballot(lane % 2 == 0)));
  o[5] = simd_vote(0xffffffffu).all() ? 1 : 0;
  o[6] = simd_vote(ulong(1) << 40).any() ? 1 : 0;
  o[7] = simd_active_threads_mask().all() ? 1 : 0;
}

// clamp(x, lo, hi) on a scalar and on a vector; undefined in Metal when lo > hi.
[[kernel]] void lang_clamp(const device float4* lohi [[buffer(0)]], device float* out [[buffer(1)]],
                           uint i [[thread_position_in_grid]]) {
  const float4 p = lohi[i];
  out[2 * i] = clamp(p.x, p.y, p.z);
  out[2 * i + 1] = clamp(float2(p.x, p.w), float2(p.y), float2(p.z)).y;
}
