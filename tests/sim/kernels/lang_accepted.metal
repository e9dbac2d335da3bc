// Constructs that Metal accepts and the simulator must too (tests/sim/test_accepted.py).
#include <metal_stdlib>
#include <simd/simd.h>
#include <sub/helper.h>
using namespace metal;

#ifndef __METAL__
#error "__METAL__ is predefined by the Metal compiler"
#endif

constant int kBase = 4;
constant int kDouble = kBase * 2;  // a constant expression: usable as an array bound

// An Apple-style numeric type conversion (what header code around isordered does).
inline bool accepted_ordered(float a, float b) { return isordered(a, b) && !isunordered(a, b); }

template <typename T, int N = 4>
kernel void accepted_template(device T* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  metal::array<T, N> values;
  for (int k = 0; k < N; ++k) values[k] = T(k);
  out[i] = values[i % N] + T(values.size());
}

template [[host_name("accepted_template_f32")]] kernel void accepted_template<float>(
    device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]);

#define INSTANTIATE(T) \
  template [[host_name("accepted_template_" #T)]] [[kernel]] decltype(accepted_template<T>) accepted_template<T>

INSTANTIATE(half);
INSTANTIATE(int)

kernel void accepted_forward(device float* out, uint i);

kernel void accepted_forward(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  float scratch[kDouble];
  for (int k = 0; k < kDouble; ++k) scratch[k] = float(k);
  remove_addrspace_t<device float> x = scratch[i % kDouble];
  const bool ordered = accepted_ordered(x, 1.0f);
  const signed char lo = numeric_limits<signed char>::min();
  out[i] = accepted_helper(x) + (ordered ? 0.0f : 100.0f) + float(lo);
}

inline float accepted_sum(constant float values[4]) {
  return values[0] + values[1] + values[2] + values[3];
}

constant float kTable[4] = {1.0f, 2.0f, 3.0f, 4.0f};

kernel void accepted_constant_array(device float* out [[buffer(0)]]) {
  out[0] = accepted_sum(kTable);
}

// What PyTorch's headers (c10/metal/common.h) do: a host-only branch of `#ifdef __METAL__` with
// standard-library includes, and declarations made constant by a macro of the file.
#include <metal_array>
#ifdef __METAL__
#define ACCEPTED_CONSTEXPR constant constexpr
#else
#include <array>
#define ACCEPTED_CONSTEXPR constexpr
#endif
ACCEPTED_CONSTEXPR unsigned kAcceptedLanes = 32;

// A default template argument and a threadgroup array in the body of a template kernel whose
// [[max_total_threads_per_threadgroup]] depends on its template parameters; a `for (auto ...)`.
template <typename T, int kWarps, int kWidth = kWarps * kAcceptedLanes>
[[kernel, max_total_threads_per_threadgroup(kWarps * 32)]] void accepted_limited(
    device T* out [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup T shared[kWidth];
  shared[i] = T(i);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  T sum = T(0);
  for (auto k = 0; k < 2; k++) sum += shared[(i + k) % kWidth];
  out[i] = sum;
}

template [[host_name("accepted_limited_2")]] [[kernel]] decltype(accepted_limited<float, 2>)
    accepted_limited<float, 2>;

// A default argument in a helper's parameters: the brace opens a body, not an initializer.
inline float accepted_scaled(float x, float by = 2.0f) {
  threadgroup float unused_here[1];
  (void)unused_here;
  return x * by;
}

kernel void accepted_default_argument(device float* out [[buffer(0)]],
                                      uint i [[thread_position_in_grid]]) {
  out[i] = accepted_scaled(float(i));
}

// Member functions qualified with an address space, called on objects in device memory; a
// thread overload of the same name beside the device one.
struct AcceptedPair {
  float a, b;
  operator float2() const device { return float2(a, b); }
  float sum() const device { return a + b; }
  float sum() const thread { return 10.0f * (a + b); }
  void scale(float s) device { a *= s; b *= s; }
};

kernel void accepted_device_members(device AcceptedPair* p [[buffer(0)]],
                                    device float* out [[buffer(1)]],
                                    uint i [[thread_position_in_grid]]) {
  const float2 v = p[i];
  out[i * 3 + 0] = v.x - v.y;
  out[i * 3 + 1] = p[i].sum();
  p[i].scale(2.0f);
  AcceptedPair local;
  local = p[i];
  out[i * 3 + 2] = local.sum();
}
