// Apple's own builtins, `__metal_<name>`, which the real <metal_stdlib> implements its functions
// with and which production kernels call directly (MLX's bfloat math and simd overloads do, for
// example: `__metal_exp(static_cast<float>(x), __METAL_MAYBE_FAST_MATH__)`). Each is the shim's
// metal:: function of the same name; a math builtin's last argument picks fast:: or precise::.
#pragma once

#include "math.h"
#include "simd.h"

// The math-mode argument of the math builtins. The simulator models Metal compiled with
// -fno-fast-math (mps_src/mps/build_macos.py), so the default mode is precise.
#define __METAL_FAST_MATH__ true
#define __METAL_PRECISE_MATH__ false
#define __METAL_MAYBE_FAST_MATH__ __METAL_PRECISE_MATH__

#define STEEL_SHIM_BUILTIN_MATH1(name, fn)                               \
  template <typename T>                                                  \
  inline T __metal_##name(T x, bool fast_math) {                         \
    return fast_math ? metal::fast::fn(x) : metal::precise::fn(x);       \
  }
#define STEEL_SHIM_BUILTIN_MATH2(name, fn)                               \
  template <typename T>                                                  \
  inline T __metal_##name(T x, T y, bool fast_math) {                    \
    return fast_math ? metal::fast::fn(x, y) : metal::precise::fn(x, y); \
  }
#define STEEL_SHIM_BUILTIN_MATH3(name, fn)                                     \
  template <typename T>                                                        \
  inline T __metal_##name(T x, T y, T z, bool fast_math) {                     \
    return fast_math ? metal::fast::fn(x, y, z) : metal::precise::fn(x, y, z); \
  }
STEEL_SHIM_BUILTIN_MATH1(fabs, fabs)
STEEL_SHIM_BUILTIN_MATH1(acos, acos)
STEEL_SHIM_BUILTIN_MATH1(acosh, acosh)
STEEL_SHIM_BUILTIN_MATH1(asin, asin)
STEEL_SHIM_BUILTIN_MATH1(asinh, asinh)
STEEL_SHIM_BUILTIN_MATH1(atan, atan)
STEEL_SHIM_BUILTIN_MATH1(atanh, atanh)
STEEL_SHIM_BUILTIN_MATH1(ceil, ceil)
STEEL_SHIM_BUILTIN_MATH1(cos, cos)
STEEL_SHIM_BUILTIN_MATH1(cosh, cosh)
STEEL_SHIM_BUILTIN_MATH1(cospi, cospi)
STEEL_SHIM_BUILTIN_MATH1(exp, exp)
STEEL_SHIM_BUILTIN_MATH1(exp10, exp10)
STEEL_SHIM_BUILTIN_MATH1(exp2, exp2)
STEEL_SHIM_BUILTIN_MATH1(floor, floor)
STEEL_SHIM_BUILTIN_MATH1(fract, fract)
STEEL_SHIM_BUILTIN_MATH1(log, log)
STEEL_SHIM_BUILTIN_MATH1(log10, log10)
STEEL_SHIM_BUILTIN_MATH1(log2, log2)
STEEL_SHIM_BUILTIN_MATH1(rint, rint)
STEEL_SHIM_BUILTIN_MATH1(round, round)
STEEL_SHIM_BUILTIN_MATH1(rsqrt, rsqrt)
STEEL_SHIM_BUILTIN_MATH1(sin, sin)
STEEL_SHIM_BUILTIN_MATH1(sinh, sinh)
STEEL_SHIM_BUILTIN_MATH1(sinpi, sinpi)
STEEL_SHIM_BUILTIN_MATH1(sqrt, sqrt)
STEEL_SHIM_BUILTIN_MATH1(tan, tan)
STEEL_SHIM_BUILTIN_MATH1(tanh, tanh)
STEEL_SHIM_BUILTIN_MATH1(tanpi, tanpi)
STEEL_SHIM_BUILTIN_MATH1(trunc, trunc)
STEEL_SHIM_BUILTIN_MATH2(atan2, atan2)
STEEL_SHIM_BUILTIN_MATH2(divide, divide)
STEEL_SHIM_BUILTIN_MATH2(fdim, fdim)
STEEL_SHIM_BUILTIN_MATH2(fmax, fmax)
STEEL_SHIM_BUILTIN_MATH2(fmin, fmin)
STEEL_SHIM_BUILTIN_MATH2(fmod, fmod)
STEEL_SHIM_BUILTIN_MATH2(pow, pow)
STEEL_SHIM_BUILTIN_MATH2(powr, powr)
STEEL_SHIM_BUILTIN_MATH3(fmax3, fmax3)
STEEL_SHIM_BUILTIN_MATH3(fmin3, fmin3)
STEEL_SHIM_BUILTIN_MATH3(fmedian3, fmedian3)
#undef STEEL_SHIM_BUILTIN_MATH1
#undef STEEL_SHIM_BUILTIN_MATH2
#undef STEEL_SHIM_BUILTIN_MATH3

template <typename T, typename I>
inline T __metal_ldexp(T x, I k, bool fast_math) {
  return fast_math ? metal::fast::ldexp(x, k) : metal::precise::ldexp(x, k);
}
// The builtins without a math-mode argument.
template <typename T>
inline T __metal_fma(T x, T y, T z) {
  return metal::fma(x, y, z);
}
template <typename T, typename I>
inline T __metal_frexp(T x, thread I* exponent) {
  return metal::frexp(x, *exponent);
}
template <typename T>
inline T __metal_nextafter(T x, T y) {
  return metal::nextafter(x, y);
}

// simd functions. The size argument of __metal_get_simdgroup_size only names the result type.
template <typename I>
inline I __metal_get_simdgroup_size(I) {
  return I(32);
}
#define STEEL_SHIM_BUILTIN_SIMD(name)                                        \
  template <typename... A>                                                   \
  STEEL_CONVERGENT inline auto __metal_##name(A... args) {                   \
    return metal::name(args...);                                             \
  }
STEEL_SHIM_BUILTIN_SIMD(simd_broadcast)
STEEL_SHIM_BUILTIN_SIMD(simd_shuffle)
STEEL_SHIM_BUILTIN_SIMD(simd_shuffle_and_fill_down)
STEEL_SHIM_BUILTIN_SIMD(simd_shuffle_and_fill_up)
STEEL_SHIM_BUILTIN_SIMD(simd_shuffle_down)
STEEL_SHIM_BUILTIN_SIMD(simd_shuffle_up)
STEEL_SHIM_BUILTIN_SIMD(simd_shuffle_rotate_down)
STEEL_SHIM_BUILTIN_SIMD(simd_shuffle_rotate_up)
STEEL_SHIM_BUILTIN_SIMD(simd_shuffle_xor)
STEEL_SHIM_BUILTIN_SIMD(simd_max)
STEEL_SHIM_BUILTIN_SIMD(simd_min)
STEEL_SHIM_BUILTIN_SIMD(simd_sum)
STEEL_SHIM_BUILTIN_SIMD(simd_product)
STEEL_SHIM_BUILTIN_SIMD(simd_prefix_exclusive_product)
STEEL_SHIM_BUILTIN_SIMD(simd_prefix_exclusive_sum)
STEEL_SHIM_BUILTIN_SIMD(simd_prefix_inclusive_product)
STEEL_SHIM_BUILTIN_SIMD(simd_prefix_inclusive_sum)
#undef STEEL_SHIM_BUILTIN_SIMD
// The bitwise reductions' builtins compile on any operand: Apple's compiler accepts a definition
// that passes them a float (MLX's bfloat16 simd_and/or/xor overloads do, in functions that no
// kernel calls), so a refusal at compile time would lose the whole file. What they do to a
// float is not documented: running one is an error here.
#define STEEL_SHIM_BUILTIN_SIMD_BITS(name)                                                  \
  template <typename T>                                                                     \
  STEEL_CONVERGENT inline T __metal_##name(T data) {                                        \
    if constexpr (::steel_shim::is_int<T>) {                                                \
      return metal::name(data);                                                             \
    } else {                                                                                \
      steel_sim::fail("__metal_" #name " on a non-integer operand: MSL defines " #name      \
                      " for integer types only, and what the builtin does to other types "  \
                      "is undocumented");                                                   \
    }                                                                                       \
  }
STEEL_SHIM_BUILTIN_SIMD_BITS(simd_and)
STEEL_SHIM_BUILTIN_SIMD_BITS(simd_or)
STEEL_SHIM_BUILTIN_SIMD_BITS(simd_xor)
#undef STEEL_SHIM_BUILTIN_SIMD_BITS
