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
