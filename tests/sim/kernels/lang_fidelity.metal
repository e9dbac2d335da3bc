// Test-only kernels for tests/sim/test_fidelity.py: values that must come out as on an Apple GPU
// and conversions MSL leaves undefined, which must be reported.
#include <metal_stdlib>
using namespace metal;

// A vector comparison converts to 1 where it holds (MSL boolN), not to clang's -1 mask.
kernel void lang_bool_vector_to_number(const device float4* x [[buffer(0)]],
                                       device float4* out [[buffer(1)]],
                                       device int4* iout [[buffer(2)]]) {
  out[0] = float4(x[0] > 0.0f);
  out[1] = float4(x[0] == 1.0f);
  iout[0] = int4(x[0] >= 0.5f);
  out[2] = float4(half4(x[0]) < half4(0.5h));
  out[3] = float4(int4(-1));  // a genuine int4 keeps its value
  // `>>` closing two template argument lists is no shift, and its comma splits no argument.
  const uint2 bits = as_type<uint2>(half4(x[0]));
  out[4] = float4(as_type<vec<half, 4>>(bits));
}

// fract in half: the clamp to the largest half below 1 comes after rounding.
kernel void lang_fract_half(const device half* x [[buffer(0)]], device half* out [[buffer(1)]],
                            uint i [[thread_position_in_grid]]) {
  out[i] = fract(x[i]);
}

// float -> int conversions: `which` 0 scalar int, 1 scalar uint, 2 int4, 3 half -> short.
kernel void lang_float_to_int(const device float* x [[buffer(0)]], device int* out [[buffer(1)]],
                              constant uint& which [[buffer(2)]],
                              uint i [[thread_position_in_grid]]) {
  const float v = x[i];
  if (which == 0) out[i] = int(v);
  if (which == 1) out[i] = int(uint(v));
  if (which == 2) out[i] = int4(float4(v))[1];
  if (which == 3) out[i] = short(half(v));
}

// A shader's own fast:: overload (here for half) must not capture fast::exp2(float).
namespace metal {
namespace fast {
inline half exp2(half x) { return half(metal::exp2(float(x))); }
}  // namespace fast
}  // namespace metal

kernel void lang_fast_overload(const device float* x [[buffer(0)]], device float* out [[buffer(1)]],
                               device half* hout [[buffer(2)]],
                               uint i [[thread_position_in_grid]]) {
  out[i] = fast::exp2(x[i]);
  hout[i] = fast::exp2(half(x[i]));
}

// Transcendentals that MSL lets a GPU compute inexactly (TORCH_STEEL_SIM_FAST_MATH=worst moves
// them to the edge of the specification's bounds), and some that it does not.
kernel void lang_precision(const device float* x [[buffer(0)]],
                           device float* out [[buffer(1)]],
                           device half* hout [[buffer(2)]],
                           uint i [[thread_position_in_grid]]) {
  const float v = x[i];
  const float p = fabs(v) + 0.25f;
  out[i * 9 + 0] = fast::exp(v);
  out[i * 9 + 1] = fast::exp2(v);
  out[i * 9 + 2] = fast::log(p);
  out[i * 9 + 3] = fast::log2(p);
  out[i * 9 + 4] = fast::rsqrt(p);
  out[i * 9 + 5] = fast::sin(v);
  out[i * 9 + 6] = fast::divide(v, 3.0f);
  out[i * 9 + 7] = precise::exp(v);
  out[i * 9 + 8] = sqrt(p);
  hout[i * 4 + 0] = exp(half(v));
  hout[i * 4 + 1] = log(half(p));
  hout[i * 4 + 2] = tanh(half(v));
  hout[i * 4 + 3] = sqrt(half(p));
}

// Table 8.2's rows given as implementations, and acos/asin/atan (5 ulp) and sinpi/cospi
// (2^-13 absolute), in float; Table 8.3's correctly rounded half rsqrt and the half functions
// added with the builtins.
kernel void lang_precision_composed(const device float* x [[buffer(0)]],
                                    device float* out [[buffer(1)]],
                                    device half* hout [[buffer(2)]],
                                    uint i [[thread_position_in_grid]]) {
  const float v = x[i];
  const float p = fabs(v) + 0.25f;
  out[i * 18 + 0] = fast::exp10(v);
  out[i * 18 + 1] = fast::log10(p);
  out[i * 18 + 2] = fast::pow(p, 1.5f);
  out[i * 18 + 3] = fast::sinh(v);
  out[i * 18 + 4] = fast::cosh(v);
  out[i * 18 + 5] = fast::asin(v / 4.0f);
  out[i * 18 + 6] = fast::acos(v / 4.0f);
  out[i * 18 + 7] = fast::atan(v);
  out[i * 18 + 8] = fast::tan(v / 2.0f);
  out[i * 18 + 9] = fast::tanh(v);
  out[i * 18 + 10] = fast::tanpi(v / 8.0f);
  out[i * 18 + 11] = fast::sqrt(p);
  out[i * 18 + 12] = fast::atan2((i & 1) ? 0.75f : -0.75f, v);
  out[i * 18 + 13] = fast::asinh(v);
  out[i * 18 + 14] = fast::acosh(p + 1.0f);
  out[i * 18 + 15] = fast::atanh(v / 4.0f);
  out[i * 18 + 16] = fast::sinpi(v / 3.0f);
  out[i * 18 + 17] = fast::cospi(v / 3.0f);
  hout[i * 4 + 0] = rsqrt(half(p));
  hout[i * 4 + 1] = sinpi(half(v));
  hout[i * 4 + 2] = asinh(half(v));
  hout[i * 4 + 3] = fdim(half(v), half(0.5f));
}
