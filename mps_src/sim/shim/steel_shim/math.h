// metal:: math (metal_math, metal_common, metal_integer, metal_relational, metal_geometric).
//
// Scalars and vectors of half, bfloat and float. Every function is evaluated in binary32 and
// rounded once to the argument's type (what Apple GPUs do for half, up to their documented ulp
// bounds). precise:: and fast:: give the same results unless TORCH_STEEL_SIM_FAST_MATH=worst
// (below: the pessimistic-precision mode).
#pragma once

#include "construct.h"
#include "count.h"

// The math constants of MSL (tables 6.5 to 6.7): float, half and bfloat constant expressions.
#define MAXFLOAT 0x1.fffffep127f
#define HUGE_VALF __builtin_huge_valf()
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.785398163397448309616f
#define M_1_PI_F 0.318309886183790671538f
#define M_2_PI_F 0.636619772367581343076f
#define M_2_SQRTPI_F 1.12837916709551257390f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f
#define MAXHALF 0x1.ffcp15f16
#define HUGE_VALH ((half)__builtin_inff())
#define M_E_H 2.71828182845904523536f16
#define M_LOG2E_H 1.44269504088896340736f16
#define M_LOG10E_H 0.434294481903251827651f16
#define M_LN2_H 0.693147180559945309417f16
#define M_LN10_H 2.30258509299404568402f16
#define M_PI_H 3.14159265358979323846f16
#define M_PI_2_H 1.57079632679489661923f16
#define M_PI_4_H 0.785398163397448309616f16
#define M_1_PI_H 0.318309886183790671538f16
#define M_2_PI_H 0.636619772367581343076f16
#define M_2_SQRTPI_H 1.12837916709551257390f16
#define M_SQRT2_H 1.41421356237309504880f16
#define M_SQRT1_2_H 0.707106781186547524401f16
#define MAXBFLOAT __builtin_bit_cast(bfloat, (unsigned short)0x7f7f)
// The float and half limits of MSL's Table 6.x (FLT_MAX, HALF_MAX, ...), as in C's <float.h>.
#define FLT_MAX 0x1.fffffep127f
#define FLT_MIN 0x1p-126f
#define FLT_EPSILON 0x1p-23f
#define FLT_MANT_DIG 24
#define FLT_DIG 6
#define FLT_RADIX 2
#define FLT_MAX_EXP 128
#define FLT_MIN_EXP (-125)
#define FLT_MAX_10_EXP 38
#define FLT_MIN_10_EXP (-37)
#define HALF_MAX 0x1.ffcp15f16
#define HALF_MIN 0x1p-14f16
#define HALF_EPSILON 0x1p-10f16
#define HALF_MANT_DIG 11
#define HALF_DIG 3
#define HALF_RADIX 2
#define HALF_MAX_EXP 16
#define HALF_MIN_EXP (-13)
#define HALF_MAX_10_EXP 4
#define HALF_MIN_10_EXP (-4)
#define HUGE_VALBF ((bfloat)__builtin_inff())
#define M_E_BF ((bfloat)M_E_F)
#define M_LOG2E_BF ((bfloat)M_LOG2E_F)
#define M_LOG10E_BF ((bfloat)M_LOG10E_F)
#define M_LN2_BF ((bfloat)M_LN2_F)
#define M_LN10_BF ((bfloat)M_LN10_F)
#define M_PI_BF ((bfloat)M_PI_F)
#define M_PI_2_BF ((bfloat)M_PI_2_F)
#define M_PI_4_BF ((bfloat)M_PI_4_F)
#define M_1_PI_BF ((bfloat)M_1_PI_F)
#define M_2_PI_BF ((bfloat)M_2_PI_F)
#define M_2_SQRTPI_BF ((bfloat)M_2_SQRTPI_F)
#define M_SQRT2_BF ((bfloat)M_SQRT2_F)
#define M_SQRT1_2_BF ((bfloat)M_SQRT1_2_F)

namespace steel_shim {

template <typename T>
constexpr bool is_fp_scalar = __is_same(T, float) || __is_same(T, half) || __is_same(T, bfloat);
template <typename T>
constexpr bool is_fp = is_fp_scalar<typename vinfo<T>::element>;
template <typename T>
constexpr bool is_int = __is_integral(typename vinfo<T>::element);
template <typename T>
constexpr bool is_num = is_fp<T> || is_int<T>;
template <typename T>
using elem_t = typename vinfo<T>::element;

template <typename T, typename F>
inline T map1(T x, F f) {
  using E = elem_t<T>;
  if constexpr (vinfo<T>::is_vector) {
    T r;
    for (int k = 0; k < vinfo<T>::size; ++k) r[k] = E(f(float(E(x[k]))));
    return r;
  } else {
    return T(f(float(x)));
  }
}

template <typename T, typename F>
inline T map2(T x, T y, F f) {
  using E = elem_t<T>;
  if constexpr (vinfo<T>::is_vector) {
    T r;
    for (int k = 0; k < vinfo<T>::size; ++k) r[k] = E(f(float(E(x[k])), float(E(y[k]))));
    return r;
  } else {
    return T(f(float(x), float(y)));
  }
}

template <typename T, typename F>
inline T map3(T x, T y, T z, F f) {
  using E = elem_t<T>;
  if constexpr (vinfo<T>::is_vector) {
    T r;
    for (int k = 0; k < vinfo<T>::size; ++k) {
      r[k] = E(f(float(E(x[k])), float(E(y[k])), float(E(z[k]))));
    }
    return r;
  } else {
    return T(f(float(x), float(y), float(z)));
  }
}

// Whether lo > hi (in any component).
template <typename T>
inline bool range_empty(T lo, T hi) {
  if constexpr (vinfo<T>::is_vector) {
    for (int k = 0; k < vinfo<T>::size; ++k) {
      if (lo[k] > hi[k]) return true;
    }
    return false;
  } else {
    return lo > hi;
  }
}

// A bool result per component: bool for a scalar, boolN for a vector.
template <typename T>
using bool_of = metal::conditional_t<vinfo<T>::is_vector, metal::vec<bool, vinfo<T>::size>, bool>;

template <typename T, typename F>
inline bool_of<T> test1(T x, F f) {
  if constexpr (vinfo<T>::is_vector) {
    bool_of<T> r;
    for (int k = 0; k < vinfo<T>::size; ++k) r[k] = f(float(elem_t<T>(x[k])));
    return r;
  } else {
    return f(float(x));
  }
}

// ---- the pessimistic-precision mode (runtime.h: worst_precision)
//
// Off, every function is evaluated in binary32 and rounded once to its type. With
// TORCH_STEEL_SIM_FAST_MATH=worst, the results that MSL lets a GPU compute less accurately are
// moved to the edge of the specification's bound (MSL 4 section 8.4, "ULPs and Relative
// Error", Tables 8.1 to 8.5):
// - half (Table 8.3, "Accuracy of half-precision floating-point operations and functions"):
//   exp, exp2, exp10, log, log2, log10, sin, cos, tan, sinpi, cospi, tanpi, asin, acos, atan,
//   atan2, sinh, cosh, tanh, asinh, acosh, atanh by 1 ulp of half; rsqrt and sqrt are correctly
//   rounded there and stay. pow and powr have no row in Table 8.3: the simulator assumes the
//   1 ulp of exp2 and log2 (an assumption, not the specification). bfloat: Tables 8.4 and 8.5
//   state only its arithmetic; its functions are treated as half's, 1 ulp of bfloat.
// - fast:: float (Table 8.2, "Accuracy of single-precision operations and functions with fast
//   math enabled"): exp, exp2 by 3 + floor(|2x|) ulp; log by 2^-21 absolute for x in [0.5, 2],
//   else 3 ulp; log2 by 2^-22 absolute in [0.5, 2], else 2 ulp; sin and cos by 2^-13 absolute
//   for x in [-pi, pi]; acos by 5 ulp in [-1, 1], asin by 5 ulp in [-1, 1] for |x| >= 2^-125,
//   atan by 5 ulp; rsqrt by 2 ulp; divide by 2.5 ulp and 1.0 / x by 1 ulp for a divisor in
//   [2^-126, 2^126]; sinpi and cospi by 2^-13 absolute for x in [-1, 1]. The entries the table
//   gives as an implementation are computed as it says, from those: exp10(x) =
//   exp2(x * log2(10)), log10(x) = log2(x) * log10(2), pow and powr(x, y) = exp2(y * log2(x))
//   (x > 0), sinh and cosh(x) = 0.5 * (exp(x) -/+ exp(-x)), tan(x) = sin(x) * (1.0 / cos(x)),
//   tanh(x) = (t - 1.0) / (t + 1.0) with t = exp(2.0 * x), tanpi(x) = tan(x * pi),
//   sqrt(x) = x * rsqrt(x), asinh(x) = log(x + sqrt(x * x + 1.0)), acosh(x) =
//   log(x + sqrt(x * x - 1.0)), atanh(x) = 0.5 * log((1.0 + x) / (1.0 - x)), and atan2(y, x) =
//   atan(y / x), + M_PI_F for x < 0 < y, - M_PI_F for x, y < 0. Where a formula is undefined
//   (atan2 with x or y = 0) or leaves its domain (an intermediate that is not finite, a log of
//   a non-positive value), the exact result stays.
// - Precise float (Table 8.1) is what this project's shaders use (Metal built with
//   -fno-fast-math): not perturbed.
// "Moved to the edge": the representable value farthest from the exact result (the function
// in binary64, or for half the binary32 result) that is still within the bound.
// Precise float functions, sqrt, divide outside fast:: and the correctly rounded operations
// keep their results. Zeros, infinities and NaNs are left as they are (a perturbation never
// changes a result's sign), so edge cases keep their specified values. Whether a result moves
// up or down is a hash of the seed, the function and the argument bits: deterministic, and the
// same for every lane that computes the same value.
enum class Fn : uint32_t {
  exp = 1, exp2, exp10, log, log2, log10, sin, cos, tan, asin, acos, atan, atan2, sinh, cosh,
  tanh, rsqrt, pow, powr, divide, acosh, asinh, atanh, sinpi, cospi, tanpi, recip
};

inline uint64_t precision_hash(Fn fn, float x, float y) {
  uint64_t z = steel_sim::precision_seed() ^ (uint64_t(fn) << 56) ^
               (uint64_t(__builtin_bit_cast(uint32_t, x)) << 24) ^
               uint64_t(__builtin_bit_cast(uint32_t, y));
  z += 0x9e3779b97f4a7c15ull;  // splitmix64's finalizer
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The spacing of E's values at |v| (a normal v; the smallest subnormal's below).
template <typename E>
inline double ulp_of(double v) {
  constexpr int kDigits = __is_same(E, float) ? 24 : __is_same(E, half) ? 11 : 8;
  constexpr int kMinExp = __is_same(E, half) ? -14 : -126;
  int e = 0;
  __builtin_frexp(v, &e);  // |v| = m 2^e, m in [0.5, 1)
  const int lo = kMinExp - (kDigits - 1);
  return __builtin_ldexp(1.0, (e - kDigits) > lo ? (e - kDigits) : lo);
}

// The value of type E farthest from `truth` (towards larger magnitude when `up`) within `err`
// of it, keeping its sign; `nearest` is truth rounded to E. Zeros, infinities and NaNs stay.
template <typename E>
inline E farthest_within(double truth, E nearest, bool up, double err) {
  if (truth == 0.0 || !__builtin_isfinite(truth) || !__builtin_isfinite(float(nearest))) {
    return nearest;
  }
  const double mag = __builtin_fabs(truth) + (up ? err : -err);
  if (mag <= 0.0) return nearest;
  E r = E(float(__builtin_copysign(mag, truth)));
  if (!__builtin_isfinite(float(r))) return nearest;
  // Rounded past the bound: one step back towards the truth.
  if (__builtin_fabs(double(float(r)) - truth) > err) {
    using U = metal::conditional_t<sizeof(E) == 4, uint32_t, uint16_t>;
    const U bits = __builtin_bit_cast(U, r);
    r = __builtin_bit_cast(E, U(up ? bits - 1 : bits + 1));  // one step of magnitude
  }
  return r;
}

// `nearest` (= truth rounded to E) made as wrong as `ulps` ulps of E at the truth, or `abs_err`
// when that is not 0, allow, in the direction the hash of (fn, x, y) picks.
template <typename E>
inline E worst(double truth, E nearest, Fn fn, float x, float y, double ulps, double abs_err) {
  if (!steel_sim::worst_precision()) return nearest;
  const bool up = (precision_hash(fn, x, y) >> 63) != 0;
  const double err = abs_err != 0.0 ? abs_err : ulps * ulp_of<E>(truth);
  return err == 0.0 ? nearest : farthest_within(truth, nearest, up, err);
}

// A function of the half-precision table: 1 ulp of half or bfloat from the binary32 result
// (whose own error, 2^-24 relative, is far below half's ulp); float stays as computed (precise
// float is what this project's shaders use, Metal built without fast math).
template <typename E>
inline E worst_half(float v, Fn fn, float x, float y = 0.0f) {
  if constexpr (__is_same(E, float)) {
    return v;
  } else {
    return worst(double(v), E(v), fn, x, y, 1.0, 0.0);
  }
}

template <typename T, typename F>
inline T map2_inexact(T x, T y, Fn fn, F f) {
  using E = elem_t<T>;
  if constexpr (vinfo<T>::is_vector) {
    T r;
    for (int k = 0; k < vinfo<T>::size; ++k) {
      const float a = float(E(x[k])), b = float(E(y[k]));
      r[k] = worst_half<E>(f(a, b), fn, a, b);
    }
    return r;
  } else {
    return worst_half<T>(f(float(x), float(y)), fn, float(x), float(y));
  }
}

template <typename T, typename F>
inline T map1_inexact(T x, Fn fn, F f) {
  using E = elem_t<T>;
  if constexpr (vinfo<T>::is_vector) {
    T r;
    for (int k = 0; k < vinfo<T>::size; ++k) {
      const float v = float(E(x[k]));
      r[k] = worst_half<E>(f(v), fn, v);
    }
    return r;
  } else {
    const float v = float(x);
    return worst_half<T>(f(v), fn, v);
  }
}

}  // namespace steel_shim

namespace metal {

#define STEEL_SHIM_UNARY(name, expr)                                   \
  template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>           \
  inline T name(T x) {                                                 \
    STEEL_SHIM_OP(#name, T);                                           \
    return steel_shim::map1(x, [](float v) -> float { return expr; }); \
  }
// A function whose half-precision result may be 1 ulp off (steel_shim::worst_half).
#define STEEL_SHIM_UNARY_INEXACT(name, expr)                                                 \
  template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>                                 \
  inline T name(T x) {                                                                       \
    STEEL_SHIM_OP(#name, T);                                                                 \
    return steel_shim::map1_inexact(x, steel_shim::Fn::name,                                 \
                                    [](float v) -> float { return expr; });                  \
  }
STEEL_SHIM_UNARY_INEXACT(exp, __builtin_expf(v))
STEEL_SHIM_UNARY_INEXACT(exp2, __builtin_exp2f(v))
STEEL_SHIM_UNARY_INEXACT(exp10, __builtin_powf(10.0f, v))
STEEL_SHIM_UNARY_INEXACT(log, __builtin_logf(v))
STEEL_SHIM_UNARY_INEXACT(log2, __builtin_log2f(v))
STEEL_SHIM_UNARY_INEXACT(log10, __builtin_log10f(v))
STEEL_SHIM_UNARY(sqrt, __builtin_sqrtf(v))
// Correctly rounded in every table but fast::'s (Tables 8.1, 8.3): computed in binary64.
STEEL_SHIM_UNARY(rsqrt, float(1.0 / __builtin_sqrt(double(v))))
STEEL_SHIM_UNARY_INEXACT(sin, __builtin_sinf(v))
STEEL_SHIM_UNARY_INEXACT(cos, __builtin_cosf(v))
STEEL_SHIM_UNARY_INEXACT(tan, __builtin_tanf(v))
STEEL_SHIM_UNARY_INEXACT(asin, __builtin_asinf(v))
STEEL_SHIM_UNARY_INEXACT(acos, __builtin_acosf(v))
STEEL_SHIM_UNARY_INEXACT(atan, __builtin_atanf(v))
STEEL_SHIM_UNARY_INEXACT(sinh, __builtin_sinhf(v))
STEEL_SHIM_UNARY_INEXACT(cosh, __builtin_coshf(v))
STEEL_SHIM_UNARY_INEXACT(tanh, __builtin_tanhf(v))
STEEL_SHIM_UNARY_INEXACT(asinh, __builtin_asinhf(v))
STEEL_SHIM_UNARY_INEXACT(acosh, __builtin_acoshf(v))
STEEL_SHIM_UNARY_INEXACT(atanh, __builtin_atanhf(v))
constexpr double kPi = 3.14159265358979323846;
// sin(pi x), cos(pi x), tan(pi x): x reduced modulo 2 first (exact in binary32), then in
// binary64, so that pi x is not rounded before the function.
STEEL_SHIM_UNARY_INEXACT(sinpi, float(__builtin_sin(kPi * double(__builtin_fmodf(v, 2.0f)))))
STEEL_SHIM_UNARY_INEXACT(cospi, float(__builtin_cos(kPi * double(__builtin_fmodf(v, 2.0f)))))
STEEL_SHIM_UNARY_INEXACT(tanpi, float(__builtin_tan(kPi * double(__builtin_fmodf(v, 2.0f)))))
#undef STEEL_SHIM_UNARY_INEXACT
STEEL_SHIM_UNARY(erf, __builtin_erff(v))
STEEL_SHIM_UNARY(floor, __builtin_floorf(v))
STEEL_SHIM_UNARY(ceil, __builtin_ceilf(v))
STEEL_SHIM_UNARY(round, __builtin_roundf(v))
STEEL_SHIM_UNARY(rint, __builtin_rintf(v))
STEEL_SHIM_UNARY(trunc, __builtin_truncf(v))
STEEL_SHIM_UNARY(fabs, __builtin_fabsf(v))
STEEL_SHIM_UNARY(saturate, __builtin_fminf(__builtin_fmaxf(v, 0.0f), 1.0f))
STEEL_SHIM_UNARY(sign, v > 0.0f ? 1.0f : (v < 0.0f ? -1.0f : (v == v ? v : 0.0f)))
#undef STEEL_SHIM_UNARY

// fract(x) = fmin(x - floor(x), the largest value below 1) in x's type: the clamp comes after
// rounding to half or bfloat, or fract(half(-1e-4)) would round 0.9999 up to 1.0.
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline T fract(T x) {
  STEEL_SHIM_OP("fract", T);
  using E = steel_shim::elem_t<T>;
  const E below_one = __is_same(E, float) ? E(0x1.fffffep-1f)
                      : __is_same(E, half) ? E(0x1.ffcp-1f)
                                           : E(0x1.fep-1f);
  auto one = [&](E e) -> E {
    const float v = float(e);
    const E r = E(v - __builtin_floorf(v));
    return r < below_one ? r : below_one;  // NaN: below_one, as fmin gives
  };
  if constexpr (steel_shim::vinfo<T>::is_vector) {
    T r;
    for (int k = 0; k < steel_shim::vinfo<T>::size; ++k) r[k] = one(E(x[k]));
    return r;
  } else {
    return one(x);
  }
}

#define STEEL_SHIM_BINARY(name, expr)                                                           \
  template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>                                    \
  inline T name(T x, T y) {                                                                     \
    STEEL_SHIM_OP(#name, T);                                                                    \
    return steel_shim::map2(x, y, [](float a, float b) -> float { return expr; });              \
  }                                                                                             \
  template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T> && steel_shim::vinfo<T>::is_vector)> \
  inline T name(T x, steel_shim::elem_t<T> y) {                                                 \
    return name(x, T(y));                                                                       \
  }
// Functions whose half-precision result may be 1 ulp off (steel_shim::worst_half).
#define STEEL_SHIM_BINARY_INEXACT(name, expr)                                                   \
  template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>                                    \
  inline T name(T x, T y) {                                                                     \
    STEEL_SHIM_OP(#name, T);                                                                    \
    return steel_shim::map2_inexact(x, y, steel_shim::Fn::name,                                 \
                                    [](float a, float b) -> float { return expr; });            \
  }                                                                                             \
  template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T> && steel_shim::vinfo<T>::is_vector)> \
  inline T name(T x, steel_shim::elem_t<T> y) {                                                 \
    return name(x, T(y));                                                                       \
  }                                                                                             \
  /* A floating-point scalar with an integer: Metal's overloads (float, float), (half, half)  */ \
  /* take the integer converted to the other argument's type (`pow(base, short(e))`).         */ \
  template <typename T, typename I,                                                             \
            STEEL_SHIM_IF(steel_shim::is_fp_scalar<T> && __is_integral(I))>                     \
  inline T name(T x, I y) {                                                                     \
    return name(x, T(y));                                                                       \
  }                                                                                             \
  template <typename T, typename I,                                                             \
            STEEL_SHIM_IF(steel_shim::is_fp_scalar<T> && __is_integral(I))>                     \
  inline T name(I x, T y) {                                                                     \
    return name(T(x), y);                                                                       \
  }
STEEL_SHIM_BINARY_INEXACT(pow, __builtin_powf(a, b))
STEEL_SHIM_BINARY_INEXACT(powr, __builtin_powf(a, b))
STEEL_SHIM_BINARY_INEXACT(atan2, __builtin_atan2f(a, b))
#undef STEEL_SHIM_BINARY_INEXACT
STEEL_SHIM_BINARY(fmod, __builtin_fmodf(a, b))
STEEL_SHIM_BINARY(copysign, __builtin_copysignf(a, b))
STEEL_SHIM_BINARY(fmin, __builtin_fminf(a, b))
STEEL_SHIM_BINARY(fmax, __builtin_fmaxf(a, b))
STEEL_SHIM_BINARY(divide, a / b)
STEEL_SHIM_BINARY(step, b < a ? 0.0f : 1.0f)
// x - y if x > y, else +0 (NaN operands give NaN).
STEEL_SHIM_BINARY(fdim, a != a || b != b ? a + b : (a > b ? a - b : 0.0f))
#undef STEEL_SHIM_BINARY

// The next value of x's type after x towards y (in half or bfloat, a step of that type).
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline T nextafter(T x, T y) {
  STEEL_SHIM_OP("nextafter", T);
  using E = steel_shim::elem_t<T>;
  using U = metal::conditional_t<sizeof(E) == 4, uint32_t, uint16_t>;
  auto one = [](E a, E b) -> E {
    const float fa = float(a), fb = float(b);
    if (fa != fa || fb != fb) return E(fa + fb);
    if (fa == fb) return b;
    const U sign = U(U(1) << (sizeof(E) * 8 - 1));
    if (fa == 0.0f) return __builtin_bit_cast(E, U(fb > 0.0f ? 1 : sign | 1));
    const U bits = __builtin_bit_cast(U, a);
    return __builtin_bit_cast(E, U((fa < fb) == (fa > 0.0f) ? bits + 1 : bits - 1));
  };
  if constexpr (steel_shim::vinfo<T>::is_vector) {
    T r;
    for (int k = 0; k < steel_shim::vinfo<T>::size; ++k) r[k] = one(E(x[k]), E(y[k]));
    return r;
  } else {
    return one(x, y);
  }
}

// x = m 2^e with |m| in [0.5, 1) (x's type; exact, as the tables' 0 ulp says).
template <typename T, typename I, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline T frexp(T x, thread I& exponent) {
  STEEL_SHIM_OP("frexp", T);
  if constexpr (steel_shim::vinfo<T>::is_vector) {
    T r;
    for (int k = 0; k < steel_shim::vinfo<T>::size; ++k) {
      int e = 0;
      r[k] = steel_shim::elem_t<T>(__builtin_frexpf(float(x[k]), &e));
      exponent[k] = e;
    }
    return r;
  } else {
    int e = 0;
    const T r = T(__builtin_frexpf(float(x), &e));
    exponent = e;
    return r;
  }
}

// x 2^k, correctly rounded to x's type.
template <typename T, typename I, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline T ldexp(T x, I k) {
  STEEL_SHIM_OP("ldexp", T);
  if constexpr (steel_shim::vinfo<T>::is_vector) {
    T r;
    for (int i = 0; i < steel_shim::vinfo<T>::size; ++i) {
      int e;
      if constexpr (steel_shim::vinfo<I>::is_vector) {
        e = int(k[i]);
      } else {
        e = int(k);
      }
      r[i] = steel_shim::elem_t<T>(__builtin_ldexp(double(x[i]), e));
    }
    return r;
  } else {
    return T(__builtin_ldexp(double(x), int(k)));
  }
}

}  // namespace metal

namespace steel_shim {
// fma rounds once (MSL: "the correctly rounded ... sum of c with the infinitely precise product
// of a and b"), in half and bfloat too: binary32's fmaf would round to 24 bits first and then
// again to T, which misses ties. For half and bfloat operands, a * b is exact in binary64; the
// sum is made round-to-odd in binary64 and then in binary32 (TwoSum gives its exact error), from
// where rounding to nearest even into T's 11 or 8 bits equals rounding the exact value once.
template <typename E>
inline float fma_rounding_once_to(float x, float y, float z) {
  if constexpr (__is_same(E, float)) {
    return __builtin_fmaf(x, y, z);
  } else {
    const double p = double(x) * double(y);
    const double zd = z;
    double sum = p + zd;
    if (!__builtin_isfinite(sum)) return float(sum);
    const double bv = sum - p;
    const double err = (p - (sum - bv)) + (zd - bv);
    if (err != 0.0 && !(__builtin_bit_cast(unsigned long, sum) & 1ul)) {
      sum = __builtin_nextafter(sum, err > 0.0 ? __builtin_inf() : -__builtin_inf());
    }
    float f = float(sum);
    if (double(f) != sum && !(__builtin_bit_cast(unsigned int, f) & 1u)) {
      f = __builtin_nextafterf(f, sum > double(f) ? __builtin_inff() : -__builtin_inff());
    }
    return f;
  }
}
}  // namespace steel_shim

namespace steel_shim {

// metal::max / min's values without their instruction marker (steel_shim/count.h): simd_max and
// simd_min fold their lanes with these, and the runtime counts the whole reduction as one
// (reductions), where the marked metal::max would add 31 max instructions per call.
template <typename T>
inline T max_num(T x, T y) {
  if constexpr (is_fp<T>) {
    return map2(x, y, [](float a, float b) -> float { return __builtin_fmaxf(a, b); });
  } else if constexpr (vinfo<T>::is_vector) {
    return __builtin_elementwise_max(x, y);
  } else {
    return x < y ? y : x;
  }
}
template <typename T>
inline T min_num(T x, T y) {
  if constexpr (is_fp<T>) {
    return map2(x, y, [](float a, float b) -> float { return __builtin_fminf(a, b); });
  } else if constexpr (vinfo<T>::is_vector) {
    return __builtin_elementwise_min(x, y);
  } else {
    return y < x ? y : x;
  }
}

}  // namespace steel_shim

namespace metal {

template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline T fma(T a, T b, T c) {
  STEEL_SHIM_OP("fma", T);
  return steel_shim::map3(a, b, c, [](float x, float y, float z) {
    return steel_shim::fma_rounding_once_to<steel_shim::elem_t<T>>(x, y, z);
  });
}

template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline T mix(T x, T y, T a) {
  STEEL_SHIM_OP("mix", T);
  return x + (y - x) * a;
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T> && steel_shim::vinfo<T>::is_vector)>
inline T mix(T x, T y, steel_shim::elem_t<T> a) {
  STEEL_SHIM_OP("mix", T);
  return x + (y - x) * a;
}

// min / max: IEEE minNum / maxNum for floating point (a NaN operand yields the other one).
template <typename T, STEEL_SHIM_IF(steel_shim::is_num<T>)>
inline T max(T x, T y) {
  STEEL_SHIM_OP("max", T);
  return steel_shim::max_num(x, y);
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_num<T>)>
inline T min(T x, T y) {
  STEEL_SHIM_OP("min", T);
  return steel_shim::min_num(x, y);
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_num<T> && steel_shim::vinfo<T>::is_vector)>
inline T max(T x, steel_shim::elem_t<T> y) {
  return max(x, T(y));
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_num<T> && steel_shim::vinfo<T>::is_vector)>
inline T min(T x, steel_shim::elem_t<T> y) {
  return min(x, T(y));
}
// MSL: "Results are undefined if minval > maxval" (an empty range, say clamp(i, 0, n - 1) with
// n == 0): an error here.
template <typename T, STEEL_SHIM_IF(steel_shim::is_num<T>)>
inline T clamp(T x, T lo, T hi) {
  STEEL_SHIM_OP("clamp", T);
  if (steel_shim::range_empty(lo, hi)) {
    steel_sim::fail("clamp with minval > maxval: undefined in Metal");
  }
  return min(max(x, lo), hi);
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_num<T> && steel_shim::vinfo<T>::is_vector)>
inline T clamp(T x, steel_shim::elem_t<T> lo, steel_shim::elem_t<T> hi) {
  return clamp(x, T(lo), T(hi));
}

template <typename T, STEEL_SHIM_IF(steel_shim::is_num<T>)>
inline T abs(T x) {
  STEEL_SHIM_OP("abs", T);
  if constexpr (steel_shim::is_fp<T>) {
    return fabs(x);
  } else if constexpr (steel_shim::vinfo<T>::is_vector) {
    return __builtin_elementwise_abs(x);
  } else {
    return x < T(0) ? T(-x) : x;
  }
}

template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline steel_shim::bool_of<T> isnan(T x) {
  STEEL_SHIM_OP("isnan", T);
  return steel_shim::test1(x, [](float v) { return v != v; });
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline steel_shim::bool_of<T> isinf(T x) {
  STEEL_SHIM_OP("isinf", T);
  return steel_shim::test1(x, [](float v) { return __builtin_isinf(v) != 0; });
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline steel_shim::bool_of<T> isfinite(T x) {
  STEEL_SHIM_OP("isfinite", T);
  return steel_shim::test1(x, [](float v) { return __builtin_isfinite(v) != 0; });
}

// isordered(x, y): neither is NaN; isunordered: either is.
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline steel_shim::bool_of<T> isordered(T x, T y) {
  if constexpr (steel_shim::vinfo<T>::is_vector) {
    steel_shim::bool_of<T> r;
    for (int k = 0; k < steel_shim::vinfo<T>::size; ++k) r[k] = x[k] == x[k] && y[k] == y[k];
    return r;
  } else {
    return x == x && y == y;
  }
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline steel_shim::bool_of<T> isunordered(T x, T y) {
  if constexpr (steel_shim::vinfo<T>::is_vector) {
    steel_shim::bool_of<T> r;
    for (int k = 0; k < steel_shim::vinfo<T>::size; ++k) r[k] = !(x[k] == x[k] && y[k] == y[k]);
    return r;
  } else {
    return !(x == x && y == y);
  }
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline steel_shim::bool_of<T> signbit(T x) {
  return steel_shim::test1(x, [](float v) { return __builtin_signbit(v) != 0; });
}

// select(a, b, c): c ? b : a per component. c is bool, boolN, or a comparison's integer mask.
template <typename T, typename C>
inline T select(T a, T b, C c) {
  STEEL_SHIM_OP("select", T);
  if constexpr (steel_shim::vinfo<T>::is_vector && steel_shim::vinfo<C>::is_vector) {
    T r;
    for (int k = 0; k < steel_shim::vinfo<T>::size; ++k) r[k] = c[k] ? b[k] : a[k];
    return r;
  } else {
    return c ? b : a;
  }
}

template <typename C>
inline bool all(C c) {
  if constexpr (steel_shim::vinfo<C>::is_vector) {
    for (int k = 0; k < steel_shim::vinfo<C>::size; ++k) {
      if (!c[k]) return false;
    }
    return true;
  } else {
    return bool(c);
  }
}
template <typename C>
inline bool any(C c) {
  if constexpr (steel_shim::vinfo<C>::is_vector) {
    for (int k = 0; k < steel_shim::vinfo<C>::size; ++k) {
      if (c[k]) return true;
    }
    return false;
  } else {
    return bool(c);
  }
}

// dot: products summed in index order in T's precision.
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T> && steel_shim::vinfo<T>::is_vector)>
inline steel_shim::elem_t<T> dot(T x, T y) {
  STEEL_SHIM_OP("dot", T);
  steel_shim::elem_t<T> s = x[0] * y[0];
  for (int k = 1; k < steel_shim::vinfo<T>::size; ++k) s = s + x[k] * y[k];
  return s;
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T> && steel_shim::vinfo<T>::is_vector)>
inline steel_shim::elem_t<T> length(T x) {
  STEEL_SHIM_OP("length", T);
  return sqrt(dot(x, x));
}

template <typename T, STEEL_SHIM_IF(steel_shim::is_int<T> && !steel_shim::vinfo<T>::is_vector)>
inline T popcount(T x) {
  return T(__builtin_popcountll((unsigned long long)(__make_unsigned(T))x));
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_int<T> && !steel_shim::vinfo<T>::is_vector)>
inline T ctz(T x) {
  using U = __make_unsigned(T);
  return x == 0 ? T(sizeof(T) * 8) : T(__builtin_ctzll((unsigned long long)(U)x));
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_int<T> && !steel_shim::vinfo<T>::is_vector)>
inline T clz(T x) {
  using U = __make_unsigned(T);
  return x == 0 ? T(sizeof(T) * 8)
                : T(__builtin_clzll((unsigned long long)(U)x) - (64 - int(sizeof(T)) * 8));
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_int<T> && !steel_shim::vinfo<T>::is_vector)>
inline T mulhi(T x, T y) {
  return T(((__int128)x * (__int128)y) >> (sizeof(T) * 8));
}

// Of three values (MSL 6.5): fmax3/fmin3 as two fmax/fmin, the median as
// max(min(x, y), min(max(x, y), z)) in fmax/fmin form; max3, min3 and median3 the same for any
// number type.
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline T fmax3(T x, T y, T z) {
  STEEL_SHIM_OP("fmax3", T);
  return metal::fmax(metal::fmax(x, y), z);
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline T fmin3(T x, T y, T z) {
  STEEL_SHIM_OP("fmin3", T);
  return metal::fmin(metal::fmin(x, y), z);
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline T fmedian3(T x, T y, T z) {
  STEEL_SHIM_OP("fmedian3", T);
  return metal::fmax(metal::fmin(x, y), metal::fmin(metal::fmax(x, y), z));
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_num<T>)>
inline T max3(T x, T y, T z) {
  STEEL_SHIM_OP("max3", T);
  return metal::max(metal::max(x, y), z);
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_num<T>)>
inline T min3(T x, T y, T z) {
  STEEL_SHIM_OP("min3", T);
  return metal::min(metal::min(x, y), z);
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_num<T>)>
inline T median3(T x, T y, T z) {
  STEEL_SHIM_OP("median3", T);
  return metal::max(metal::min(x, y), metal::min(metal::max(x, y), z));
}

namespace precise {
using metal::abs, metal::acos, metal::asin, metal::atan, metal::atan2, metal::ceil, metal::clamp,
    metal::copysign, metal::cos, metal::cosh, metal::divide, metal::erf, metal::exp,
    metal::exp10, metal::exp2, metal::fabs, metal::floor, metal::fma, metal::fmax, metal::fmin,
    metal::fmod, metal::fract, metal::log, metal::log10, metal::log2, metal::max, metal::min,
    metal::pow, metal::powr, metal::rint, metal::round, metal::rsqrt, metal::saturate,
    metal::sin, metal::sinh, metal::sqrt, metal::tan, metal::tanh, metal::trunc, metal::acosh,
    metal::asinh, metal::atanh, metal::sinpi, metal::cospi, metal::tanpi, metal::fdim,
    metal::nextafter, metal::frexp, metal::ldexp, metal::fmax3, metal::fmin3, metal::fmedian3,
    metal::max3, metal::min3, metal::median3;
}  // namespace precise
// fast::min, max, clamp, saturate, fmin and fmax are undefined for a NaN operand (MSL 6.2: "in
// the fast variant, the behavior of NaNs is undefined"; only precise:: is IEEE minNum/maxNum;
// metal:: is precise:: in a build without fast math, as this project's are), so a NaN operand is
// an error here instead of a plausible result.
//
// The functions are using-declarations, not `using namespace precise`: a using-directive is
// searched only when fast:: itself declares no function of the name, so a shader's own
// fast::exp2 overload (for its own bfloat type, say) would hide precise::exp2 and capture every
// fast::exp2(float) call.
namespace fast {
using metal::abs, metal::ceil, metal::copysign, metal::erf, metal::fabs, metal::floor,
    metal::fma, metal::fmod, metal::fract, metal::rint, metal::round, metal::trunc, metal::fdim,
    metal::nextafter, metal::frexp, metal::ldexp, metal::fmax3, metal::fmin3, metal::fmedian3;

// The fast-math table's bounds for float (steel_shim::worst, measured from the function in
// binary64); half and bfloat arguments get the metal:: function (fast:: changes only single
// precision). `ulps` and `abs_err` are expressions of the argument x.
#define STEEL_SHIM_FAST_INEXACT(name, exact, ulps, abs_err)                                  \
  template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>                               \
  inline T name(T x) {                                                                     \
    STEEL_SHIM_OP(#name, T);                                                               \
    if constexpr (!__is_same(steel_shim::elem_t<T>, float)) {                              \
      return metal::name(x);                                                               \
    } else if constexpr (steel_shim::vinfo<T>::is_vector) {                                \
      T r;                                                                                 \
      for (int k = 0; k < steel_shim::vinfo<T>::size; ++k) r[k] = fast::name(float(x[k])); \
      return r;                                                                            \
    } else {                                                                               \
      return steel_shim::worst(exact, metal::name(x), steel_shim::Fn::name, x, 0.0f, ulps, \
                               abs_err);                                                   \
    }                                                                                      \
  }
#define STEEL_SHIM_IN(lo, hi) (x >= (lo) && x <= (hi))
// Every bound below is a row of MSL 4's Table 8.2 ("Accuracy of single-precision operations
// and functions with fast math enabled", section 8.4).
// exp, exp2: <= 3 + floor(fabs(2 * x)) ulp.
STEEL_SHIM_FAST_INEXACT(exp, __builtin_exp(x), 3 + __builtin_floor(__builtin_fabs(2.0 * x)), 0.0)
STEEL_SHIM_FAST_INEXACT(exp2, __builtin_exp2(x), 3 + __builtin_floor(__builtin_fabs(2.0 * x)), 0.0)
// log: for x in [0.5, 2] an absolute error <= 2^-21, otherwise (x > 0) <= 3 ulp; log2: 2^-22,
// otherwise 2 ulp.
STEEL_SHIM_FAST_INEXACT(log, __builtin_log(x), 3, STEEL_SHIM_IN(0.5f, 2.0f) ? 0x1p-21 : 0.0)
STEEL_SHIM_FAST_INEXACT(log2, __builtin_log2(x), 2, STEEL_SHIM_IN(0.5f, 2.0f) ? 0x1p-22 : 0.0)
// sin, cos: for x in [-pi, pi] an absolute error <= 2^-13 ("larger otherwise", no bound: kept
// as computed there).
STEEL_SHIM_FAST_INEXACT(sin, __builtin_sin(x), 0, STEEL_SHIM_IN(-M_PI_F, M_PI_F) ? 0x1p-13 : 0.0)
STEEL_SHIM_FAST_INEXACT(cos, __builtin_cos(x), 0, STEEL_SHIM_IN(-M_PI_F, M_PI_F) ? 0x1p-13 : 0.0)
// sinpi, cospi: for x in [-1, 1] an absolute error <= 2^-13, "larger otherwise".
STEEL_SHIM_FAST_INEXACT(sinpi, __builtin_sin(kPi * x), 0,
                        STEEL_SHIM_IN(-1.0f, 1.0f) ? 0x1p-13 : 0.0)
STEEL_SHIM_FAST_INEXACT(cospi, __builtin_cos(kPi * x), 0,
                        STEEL_SHIM_IN(-1.0f, 1.0f) ? 0x1p-13 : 0.0)
// acos: <= 5 ulp in [-1, 1]; asin: <= 5 ulp in [-1, 1] for |x| >= 2^-125; atan: <= 5 ulp.
STEEL_SHIM_FAST_INEXACT(acos, __builtin_acos(x), STEEL_SHIM_IN(-1.0f, 1.0f) ? 5 : 0, 0.0)
STEEL_SHIM_FAST_INEXACT(asin, __builtin_asin(x),
                        STEEL_SHIM_IN(-1.0f, 1.0f) && __builtin_fabsf(x) >= 0x1p-125f ? 5 : 0,
                        0.0)
STEEL_SHIM_FAST_INEXACT(atan, __builtin_atan(x), 5, 0.0)
// rsqrt: <= 2 ulp.
STEEL_SHIM_FAST_INEXACT(rsqrt, 1.0 / __builtin_sqrt(x), 2, 0.0)
#undef STEEL_SHIM_IN
#undef STEEL_SHIM_FAST_INEXACT

// divide: <= 2.5 ulp for y in [2^-126, 2^126] (Table 8.2's x / y).
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline T divide(T x, T y) {
  STEEL_SHIM_OP("divide", T);
  if constexpr (!__is_same(steel_shim::elem_t<T>, float)) {
    return metal::divide(x, y);
  } else if constexpr (steel_shim::vinfo<T>::is_vector) {
    T r;
    for (int k = 0; k < steel_shim::vinfo<T>::size; ++k) {
      r[k] = fast::divide(float(x[k]), float(y[k]));
    }
    return r;
  } else {
    const float ay = __builtin_fabsf(y);
    const double ulps = ay >= 0x1p-126f && ay <= 0x1p126f ? 2.5 : 0.0;
    return steel_shim::worst(double(x) / double(y), x / y, steel_shim::Fn::divide, x, y, ulps, 0.0);
  }
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T> && steel_shim::vinfo<T>::is_vector)>
inline T divide(T x, steel_shim::elem_t<T> y) {
  return fast::divide(x, T(y));
}

// 1.0 / x: <= 1 ulp for x in [2^-126, 2^126]; MSL has no function of its own for it, it is the
// reciprocal inside tan's formula.
namespace steel_fast {
inline float recip(float x) {
  const float ax = __builtin_fabsf(x);
  const double ulps = ax >= 0x1p-126f && ax <= 0x1p126f ? 1.0 : 0.0;
  return steel_shim::worst(1.0 / double(x), 1.0f / x, steel_shim::Fn::recip, x, 0.0f, ulps, 0.0);
}
}  // namespace steel_fast

// Table 8.2's rows that give an implementation instead of a bound: in the pessimistic mode,
// that implementation over the fast:: functions above (so their errors compound as on the
// GPU); otherwise the function's exact result. `composed` is the row's formula for a float.
// `defined` (of x) says where the formula applies; elsewhere the exact result stays.
#define STEEL_SHIM_FAST_COMPOSED_IF(name, defined, composed)                              \
  template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>                            \
  inline T name(T x) {                                                                  \
    STEEL_SHIM_OP(#name, T);                                                            \
    if constexpr (!__is_same(steel_shim::elem_t<T>, float)) {                           \
      return metal::name(x);                                                            \
    } else if constexpr (steel_shim::vinfo<T>::is_vector) {                             \
      T r;                                                                              \
      for (int k = 0; k < steel_shim::vinfo<T>::size; ++k) r[k] = fast::name(float(x[k])); \
      return r;                                                                         \
    } else {                                                                            \
      return steel_sim::worst_precision() && (defined) ? float(composed) : metal::name(x); \
    }                                                                                   \
  }
#define STEEL_SHIM_FAST_COMPOSED1(name, composed) STEEL_SHIM_FAST_COMPOSED_IF(name, true, composed)
// log2(10) and log10(2) rounded to float, as the GPU's formula holds them.
STEEL_SHIM_FAST_COMPOSED1(exp10, fast::exp2(x * float(3.32192809488736234787)))
STEEL_SHIM_FAST_COMPOSED1(log10, fast::log2(x) * float(0.301029995663981195214))
STEEL_SHIM_FAST_COMPOSED1(sinh, 0.5f * (fast::exp(x) - fast::exp(-x)))
STEEL_SHIM_FAST_COMPOSED1(cosh, 0.5f * (fast::exp(x) + fast::exp(-x)))
STEEL_SHIM_FAST_COMPOSED_IF(tan, __builtin_isfinite(x),
                            fast::sin(x) * steel_fast::recip(fast::cos(x)))
STEEL_SHIM_FAST_COMPOSED_IF(tanpi, __builtin_isfinite(x), fast::tan(x * M_PI_F))
// sqrt: x * rsqrt(x) "with special cases handled correctly" (0, infinity, negative x: exact).
STEEL_SHIM_FAST_COMPOSED_IF(sqrt, x > 0.0f && __builtin_isfinite(x), x * fast::rsqrt(x))
#undef STEEL_SHIM_FAST_COMPOSED1
#undef STEEL_SHIM_FAST_COMPOSED_IF

// tanh: (t - 1.0) / (t + 1.0) with t = exp(2.0 * x), where t is finite.
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline T tanh(T x) {
  STEEL_SHIM_OP("tanh", T);
  if constexpr (!__is_same(steel_shim::elem_t<T>, float)) {
    return metal::tanh(x);
  } else if constexpr (steel_shim::vinfo<T>::is_vector) {
    T r;
    for (int k = 0; k < steel_shim::vinfo<T>::size; ++k) r[k] = fast::tanh(float(x[k]));
    return r;
  } else {
    if (!steel_sim::worst_precision()) return metal::tanh(x);
    const float t = fast::exp(2.0f * x);
    return __builtin_isfinite(t) ? fast::divide(t - 1.0f, t + 1.0f) : metal::tanh(x);
  }
}

// asinh, acosh: log(x +/- ...) over the fast sqrt and log; atanh: 0.5 * log((1.0 + x) /
// (1.0 - x)). The log is taken of a finite positive argument only (else the exact result).
// (One transcription of the row reads 0.5 * (log(1.0 + x) / (1.0 - x)), which is not atanh;
// another puts the quotient inside the log, as here.)
#define STEEL_SHIM_FAST_LOG_OF(name, defined, arg)                                         \
  template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>                             \
  inline T name(T x) {                                                                   \
    STEEL_SHIM_OP(#name, T);                                                             \
    if constexpr (!__is_same(steel_shim::elem_t<T>, float)) {                            \
      return metal::name(x);                                                             \
    } else if constexpr (steel_shim::vinfo<T>::is_vector) {                              \
      T r;                                                                               \
      for (int k = 0; k < steel_shim::vinfo<T>::size; ++k) r[k] = fast::name(float(x[k])); \
      return r;                                                                          \
    } else {                                                                             \
      if (!steel_sim::worst_precision() || !(defined)) return metal::name(x);            \
      const float u = (arg);                                                             \
      return u > 0.0f && __builtin_isfinite(u) ? fast::log(u) : metal::name(x);          \
    }                                                                                    \
  }
STEEL_SHIM_FAST_LOG_OF(asinh, __builtin_isfinite(x * x), x + fast::sqrt(x * x + 1.0f))
STEEL_SHIM_FAST_LOG_OF(acosh, x >= 1.0f && __builtin_isfinite(x * x),
                       x + fast::sqrt(x * x - 1.0f))
#undef STEEL_SHIM_FAST_LOG_OF
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline T atanh(T x) {
  STEEL_SHIM_OP("atanh", T);
  if constexpr (!__is_same(steel_shim::elem_t<T>, float)) {
    return metal::atanh(x);
  } else if constexpr (steel_shim::vinfo<T>::is_vector) {
    T r;
    for (int k = 0; k < steel_shim::vinfo<T>::size; ++k) r[k] = fast::atanh(float(x[k]));
    return r;
  } else {
    if (!steel_sim::worst_precision() || !(__builtin_fabsf(x) < 1.0f)) return metal::atanh(x);
    return 0.5f * fast::log(fast::divide(1.0f + x, 1.0f - x));
  }
}

// atan2(y, x): atan(y / x), + M_PI_F for x < 0 < y, - M_PI_F for x, y < 0; "undefined" for
// x = 0 or y = 0, where the exact result stays.
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline T atan2(T y, T x) {
  STEEL_SHIM_OP("atan2", T);
  if constexpr (!__is_same(steel_shim::elem_t<T>, float)) {
    return metal::atan2(y, x);
  } else if constexpr (steel_shim::vinfo<T>::is_vector) {
    T r;
    for (int k = 0; k < steel_shim::vinfo<T>::size; ++k) {
      r[k] = fast::atan2(float(y[k]), float(x[k]));
    }
    return r;
  } else {
    const bool composed = steel_sim::worst_precision() && x != 0.0f && y != 0.0f &&
                          __builtin_isfinite(x) && __builtin_isfinite(y);
    if (!composed) return metal::atan2(y, x);
    const float a = fast::atan(fast::divide(y, x));
    return x > 0.0f ? a : y > 0.0f ? a + M_PI_F : a - M_PI_F;
  }
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T> && steel_shim::vinfo<T>::is_vector)>
inline T atan2(T y, steel_shim::elem_t<T> x) {
  return fast::atan2(y, T(x));
}

// pow, powr: exp2(y * log2(x)) ("undefined for x = 0 and y = 0"); composed for x > 0 only,
// where log2 is defined.
#define STEEL_SHIM_FAST_POW(name)                                                           \
  template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>                              \
  inline T name(T x, T y) {                                                               \
    STEEL_SHIM_OP(#name, T);                                                              \
    if constexpr (!__is_same(steel_shim::elem_t<T>, float)) {                             \
      return metal::name(x, y);                                                           \
    } else if constexpr (steel_shim::vinfo<T>::is_vector) {                               \
      T r;                                                                                \
      for (int k = 0; k < steel_shim::vinfo<T>::size; ++k) {                              \
        r[k] = fast::name(float(x[k]), float(y[k]));                                      \
      }                                                                                   \
      return r;                                                                           \
    } else {                                                                              \
      const bool composed = steel_sim::worst_precision() && x > 0.0f && __builtin_isfinite(x); \
      return composed ? fast::exp2(y * fast::log2(x)) : metal::name(x, y);                \
    }                                                                                     \
  }                                                                                       \
  template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T> && steel_shim::vinfo<T>::is_vector)> \
  inline T name(T x, steel_shim::elem_t<T> y) {                                           \
    return fast::name(x, T(y));                                                           \
  }
STEEL_SHIM_FAST_POW(pow)
STEEL_SHIM_FAST_POW(powr)
#undef STEEL_SHIM_FAST_POW

namespace steel_fast {
template <typename T>
inline void refuse_nan(const char* what, T x) {
  if constexpr (steel_shim::is_fp<T>) {
    if (metal::any(metal::isnan(x))) {
      steel_sim::fail(what);
    }
  }
}
}  // namespace steel_fast

#define STEEL_SHIM_FAST2(name)                                                              \
  template <typename T, STEEL_SHIM_IF(steel_shim::is_num<T>)>                               \
  inline T name(T x, T y) {                                                                 \
    STEEL_SHIM_OP(#name, T);                                                                \
    steel_fast::refuse_nan("fast::" #name " with a NaN operand: undefined in Metal", x);    \
    steel_fast::refuse_nan("fast::" #name " with a NaN operand: undefined in Metal", y);    \
    return metal::name(x, y);                                                               \
  }                                                                                         \
  template <typename T,                                                                     \
            STEEL_SHIM_IF(steel_shim::is_num<T> && steel_shim::vinfo<T>::is_vector)>        \
  inline T name(T x, steel_shim::elem_t<T> y) {                                             \
    return fast::name(x, T(y));                                                             \
  }
STEEL_SHIM_FAST2(max)
STEEL_SHIM_FAST2(min)
STEEL_SHIM_FAST2(fmax)
STEEL_SHIM_FAST2(fmin)
#undef STEEL_SHIM_FAST2

template <typename T, STEEL_SHIM_IF(steel_shim::is_num<T>)>
inline T clamp(T x, T lo, T hi) {
  STEEL_SHIM_OP("clamp", T);
  steel_fast::refuse_nan("fast::clamp with a NaN operand: undefined in Metal", x);
  steel_fast::refuse_nan("fast::clamp with a NaN operand: undefined in Metal", lo);
  steel_fast::refuse_nan("fast::clamp with a NaN operand: undefined in Metal", hi);
  return metal::clamp(x, lo, hi);
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_num<T> && steel_shim::vinfo<T>::is_vector)>
inline T clamp(T x, steel_shim::elem_t<T> lo, steel_shim::elem_t<T> hi) {
  return fast::clamp(x, T(lo), T(hi));
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline T saturate(T x) {
  STEEL_SHIM_OP("saturate", T);
  steel_fast::refuse_nan("fast::saturate with a NaN operand: undefined in Metal", x);
  return metal::saturate(x);
}
}  // namespace fast

}  // namespace metal
