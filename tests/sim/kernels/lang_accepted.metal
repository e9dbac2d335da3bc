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
INSTANTIATE(int);

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

// Apple's builtins as production kernels call them (MLX's bfloat overloads, for instance): math
// with a math-mode argument, simd functions, the simdgroup size.
kernel void accepted_metal_builtins(const device float* x [[buffer(0)]],
                                    device float* out [[buffer(1)]],
                                    uint i [[thread_position_in_grid]]) {
  const float v = x[i];
  out[i * 8 + 0] = __metal_exp(v, __METAL_MAYBE_FAST_MATH__);
  out[i * 8 + 1] = __metal_fmax3(v, 0.5f, -v, __METAL_PRECISE_MATH__);
  out[i * 8 + 2] = __metal_atan2(v, 2.0f, __METAL_MAYBE_FAST_MATH__);
  out[i * 8 + 3] = __metal_fma(v, v, 1.0f);
  out[i * 8 + 4] = __metal_simd_sum(v);
  out[i * 8 + 5] = __metal_simd_shuffle_xor(v, ushort(1));
  out[i * 8 + 6] = float(__metal_get_simdgroup_size(ushort()));
  int e = 0;
  out[i * 8 + 7] = __metal_ldexp(__metal_frexp(v, &e), e + 1, __METAL_FAST_MATH__);
}

// A params struct copied whole out of constant and device memory into thread and threadgroup
// variables, and member functions qualified with an address space defined outside the class.
struct AcceptedParams {
  int n;
  float scale;
  float bias[2];
  float total() const constant;
  float total() const device;
  float total() const thread;
};
float AcceptedParams::total() const constant { return scale + bias[0] + bias[1]; }
float AcceptedParams::total() const device { return 2.0f * (scale + bias[0] + bias[1]); }
float AcceptedParams::total() const thread { return 3.0f * (scale + bias[0] + bias[1]); }

kernel void accepted_params_copy(constant AcceptedParams* cp [[buffer(0)]],
                                 const device AcceptedParams* dp [[buffer(1)]],
                                 device float* out [[buffer(2)]],
                                 uint i [[thread_index_in_threadgroup]]) {
  threadgroup AcceptedParams shared;
  const AcceptedParams a = *cp;
  AcceptedParams b = *dp;
  if (i == 0) shared = *dp;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const AcceptedParams c = shared;
  out[i * 6 + 0] = float(a.n) * a.scale + a.bias[1];
  out[i * 6 + 1] = float(b.n) * b.scale + b.bias[0];
  out[i * 6 + 2] = float(c.n) + c.bias[1];
  out[i * 6 + 3] = cp->total();
  out[i * 6 + 4] = dp->total();
  out[i * 6 + 5] = b.total();
}

// Copies out of constant, device and threadgroup memory that are not declarations: arguments
// taken by value (`*p`, `p[i]`; a template still deduces `device T&` from `*p`), values
// returned (also by a lambda), an assignment to an existing local.
static float accepted_weigh(AcceptedParams p) { return float(p.n) * p.scale + p.bias[0]; }
static float accepted_weigh_ref(constant AcceptedParams& p) { return p.bias[1]; }
static AcceptedParams accepted_fetch(const device AcceptedParams* p) { return *p; }
template <typename T>
float accepted_scale_of(const device T& p) {
  return p.scale;
}
static AcceptedParams accepted_fetch_constant(constant AcceptedParams* p, int i) { return p[i]; }

kernel void accepted_params_by_value(constant AcceptedParams* cp [[buffer(0)]],
                                     const device AcceptedParams* dp [[buffer(1)]],
                                     device float* out [[buffer(2)]],
                                     uint i [[thread_index_in_threadgroup]]) {
  threadgroup AcceptedParams shared;
  if (i == 0) shared = dp[0];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  auto from_shared = [&]() { return shared; };
  AcceptedParams q;
  q = *cp;
  out[i * 7 + 0] = accepted_weigh(*cp);
  out[i * 7 + 1] = accepted_weigh(dp[1]);
  out[i * 7 + 2] = accepted_weigh_ref(*cp);
  out[i * 7 + 3] = accepted_fetch(dp).bias[1] + accepted_scale_of(*dp);
  out[i * 7 + 4] = accepted_fetch_constant(cp, 0).scale;
  out[i * 7 + 5] = from_shared().total();
  out[i * 7 + 6] = q.total();
}
