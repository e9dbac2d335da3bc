// metal:: math (metal_math, metal_common, metal_integer, metal_relational, metal_geometric).
//
// Scalars and vectors of half, bfloat and float. Every function is evaluated in binary32 and
// rounded once to the argument's type (what Apple GPUs do for half, up to their documented ulp
// bounds). precise:: and fast:: name the same functions: the simulator has one accuracy.
#pragma once

#include "construct.h"

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

}  // namespace steel_shim

namespace metal {

#define STEEL_SHIM_UNARY(name, expr)                                   \
  template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>           \
  inline T name(T x) {                                                 \
    return steel_shim::map1(x, [](float v) -> float { return expr; }); \
  }
STEEL_SHIM_UNARY(exp, __builtin_expf(v))
STEEL_SHIM_UNARY(exp2, __builtin_exp2f(v))
STEEL_SHIM_UNARY(exp10, __builtin_powf(10.0f, v))
STEEL_SHIM_UNARY(log, __builtin_logf(v))
STEEL_SHIM_UNARY(log2, __builtin_log2f(v))
STEEL_SHIM_UNARY(log10, __builtin_log10f(v))
STEEL_SHIM_UNARY(sqrt, __builtin_sqrtf(v))
STEEL_SHIM_UNARY(rsqrt, 1.0f / __builtin_sqrtf(v))
STEEL_SHIM_UNARY(sin, __builtin_sinf(v))
STEEL_SHIM_UNARY(cos, __builtin_cosf(v))
STEEL_SHIM_UNARY(tan, __builtin_tanf(v))
STEEL_SHIM_UNARY(asin, __builtin_asinf(v))
STEEL_SHIM_UNARY(acos, __builtin_acosf(v))
STEEL_SHIM_UNARY(atan, __builtin_atanf(v))
STEEL_SHIM_UNARY(sinh, __builtin_sinhf(v))
STEEL_SHIM_UNARY(cosh, __builtin_coshf(v))
STEEL_SHIM_UNARY(tanh, __builtin_tanhf(v))
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
    return steel_shim::map2(x, y, [](float a, float b) -> float { return expr; });              \
  }                                                                                             \
  template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T> && steel_shim::vinfo<T>::is_vector)> \
  inline T name(T x, steel_shim::elem_t<T> y) {                                                 \
    return name(x, T(y));                                                                       \
  }
STEEL_SHIM_BINARY(pow, __builtin_powf(a, b))
STEEL_SHIM_BINARY(powr, __builtin_powf(a, b))
STEEL_SHIM_BINARY(fmod, __builtin_fmodf(a, b))
STEEL_SHIM_BINARY(atan2, __builtin_atan2f(a, b))
STEEL_SHIM_BINARY(copysign, __builtin_copysignf(a, b))
STEEL_SHIM_BINARY(fmin, __builtin_fminf(a, b))
STEEL_SHIM_BINARY(fmax, __builtin_fmaxf(a, b))
STEEL_SHIM_BINARY(divide, a / b)
STEEL_SHIM_BINARY(step, b < a ? 0.0f : 1.0f)
#undef STEEL_SHIM_BINARY

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

namespace metal {

template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline T fma(T a, T b, T c) {
  return steel_shim::map3(a, b, c, [](float x, float y, float z) {
    return steel_shim::fma_rounding_once_to<steel_shim::elem_t<T>>(x, y, z);
  });
}

template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline T mix(T x, T y, T a) {
  return x + (y - x) * a;
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T> && steel_shim::vinfo<T>::is_vector)>
inline T mix(T x, T y, steel_shim::elem_t<T> a) {
  return x + (y - x) * a;
}

// min / max: IEEE minNum / maxNum for floating point (a NaN operand yields the other one).
template <typename T, STEEL_SHIM_IF(steel_shim::is_num<T>)>
inline T max(T x, T y) {
  if constexpr (steel_shim::is_fp<T>) {
    return fmax(x, y);
  } else if constexpr (steel_shim::vinfo<T>::is_vector) {
    return __builtin_elementwise_max(x, y);
  } else {
    return x < y ? y : x;
  }
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_num<T>)>
inline T min(T x, T y) {
  if constexpr (steel_shim::is_fp<T>) {
    return fmin(x, y);
  } else if constexpr (steel_shim::vinfo<T>::is_vector) {
    return __builtin_elementwise_min(x, y);
  } else {
    return y < x ? y : x;
  }
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
  return steel_shim::test1(x, [](float v) { return v != v; });
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline steel_shim::bool_of<T> isinf(T x) {
  return steel_shim::test1(x, [](float v) { return __builtin_isinf(v) != 0; });
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T>)>
inline steel_shim::bool_of<T> isfinite(T x) {
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
  steel_shim::elem_t<T> s = x[0] * y[0];
  for (int k = 1; k < steel_shim::vinfo<T>::size; ++k) s = s + x[k] * y[k];
  return s;
}
template <typename T, STEEL_SHIM_IF(steel_shim::is_fp<T> && steel_shim::vinfo<T>::is_vector)>
inline steel_shim::elem_t<T> length(T x) {
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

namespace precise {
using metal::abs, metal::acos, metal::asin, metal::atan, metal::atan2, metal::ceil, metal::clamp,
    metal::copysign, metal::cos, metal::cosh, metal::divide, metal::erf, metal::exp,
    metal::exp10, metal::exp2, metal::fabs, metal::floor, metal::fma, metal::fmax, metal::fmin,
    metal::fmod, metal::fract, metal::log, metal::log10, metal::log2, metal::max, metal::min,
    metal::pow, metal::powr, metal::rint, metal::round, metal::rsqrt, metal::saturate,
    metal::sin, metal::sinh, metal::sqrt, metal::tan, metal::tanh, metal::trunc;
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
using metal::abs, metal::acos, metal::asin, metal::atan, metal::atan2, metal::ceil,
    metal::copysign, metal::cos, metal::cosh, metal::divide, metal::erf, metal::exp,
    metal::exp10, metal::exp2, metal::fabs, metal::floor, metal::fma, metal::fmod, metal::fract,
    metal::log, metal::log10, metal::log2, metal::pow, metal::powr, metal::rint, metal::round,
    metal::rsqrt, metal::sin, metal::sinh, metal::sqrt, metal::tan, metal::tanh, metal::trunc;

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
  steel_fast::refuse_nan("fast::saturate with a NaN operand: undefined in Metal", x);
  return metal::saturate(x);
}
}  // namespace fast

}  // namespace metal
