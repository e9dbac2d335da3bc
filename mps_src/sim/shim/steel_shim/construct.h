// What the source pre-pass (torch_steel/sim/translate.py) rewrites MSL into: vector
// constructors, struct copies across address spaces, function constants, threadgroup arrays
// declared in kernel bodies.
#pragma once

#include "types.h"
#include "name_hash.h"

namespace steel_shim {

template <typename T>
using vinfo = metal::steel_traits::vector_info<
    metal::remove_cv_t<metal::remove_address_space_t<metal::remove_cv_t<T>>>>;

template <typename E, typename V, typename A>
inline void put_components(V& out, int& i, A a) {
  if constexpr (vinfo<A>::is_vector) {
    for (int k = 0; k < vinfo<A>::size; ++k) out[i++] = E(a[k]);
  } else {
    out[i++] = E(a);
  }
}

// A float -> integer conversion of NaN or of a value out of the integer's range is undefined in
// MSL (Apple GPUs saturate, x86 does not): an error, as clang's -fsanitize=float-cast-overflow
// makes it for scalars (which does not look at vector conversions).
template <typename To, typename From>
inline void check_float_to_int(From x) {
  if constexpr (metal::is_floating_point_v<From> && __is_integral(To) && !__is_same(To, bool)) {
    constexpr int bits = int(sizeof(To)) * 8;
    constexpr bool is_signed = To(-1) < To(0);
    const float lo = is_signed ? -__builtin_ldexpf(1.0f, bits - 1) : 0.0f;
    const float hi = __builtin_ldexpf(1.0f, is_signed ? bits - 1 : bits);
    const float v = __builtin_truncf(float(x));
    if (!(v >= lo && v < hi)) {
      steel_sim::fail(
          "vector conversion of a floating-point value that the integer type cannot represent "
          "(NaN or out of range): undefined in MSL (Apple GPUs saturate, x86 does not); clamp "
          "before converting");
    }
  }
}

template <typename V, typename A>
inline V convert_vector(A a) {
  using To = typename vinfo<V>::element;
  using From = typename vinfo<A>::element;
  if constexpr (metal::is_floating_point_v<From> && __is_integral(To) && !__is_same(To, bool)) {
    for (int k = 0; k < vinfo<A>::size; ++k) check_float_to_int<To>(From(a[k]));
  }
  return __builtin_convertvector(a, V);
}

// MSL vector construction `floatN(...)`: no argument (zero), one scalar (splat), one vector of
// the same length (elementwise conversion, rounding to nearest even), or scalars and vectors
// whose components add up to N (each converted to the element type).
template <typename V, typename... A>
inline V vmake(A... a) {
  using E = typename vinfo<V>::element;
  constexpr int N = vinfo<V>::size;
  static_assert(vinfo<V>::is_vector, "vmake builds vector types only");
  if constexpr (sizeof...(A) == 0) {
    return V(E(0));
  } else if constexpr (sizeof...(A) == 1 && (__is_class(A) && ...)) {
    // `float2(obj)` of a class type is its conversion to float2 (of the copy made here: the
    // variant for thread objects), not a broadcast of a scalar conversion.
    return (static_cast<V>(a), ...);
  } else if constexpr (sizeof...(A) == 1 && (!vinfo<A>::is_vector && ...)) {
    return V(E(a...));
  } else if constexpr (sizeof...(A) == 1) {
    static_assert(((vinfo<A>::size == N) && ...), "vector conversion needs equal lengths");
    return convert_vector<V>(a...);
  } else {
    static_assert((vinfo<A>::size + ...) == N, "vector constructor: wrong number of components");
    V out;
    int i = 0;
    (put_components<E>(out, i, a), ...);
    return out;
  }
}

// A comparison as a vector constructor's argument (`float4(a > b)`, marked by the pre-pass): in
// MSL it is a boolN, converting to 1 where it holds; clang's comparisons give integer masks of
// -1s, turned into 1s here. Anything else (a scalar bool) passes unchanged.
template <typename A>
inline A mask01(A a) {
  using E = typename vinfo<A>::element;
  if constexpr (vinfo<A>::is_vector && __is_integral(E) && !__is_same(E, bool) && E(-1) < E(0)) {
    return A(0) - a;
  } else {
    return a;
  }
}

// A C-style cast to a pointer in an address space, `(device T*)p`: clang would convert between
// address spaces; MSL refuses that (the pre-pass turns the cast into `as_cast<T>() ->* p`).
// `*(device T*)p` reads `*as_cast<T>() ->* p`, where the unary * binds first: it yields an
// as_deref, whose ->* dereferences the converted pointer.
template <typename To>
struct as_deref {};
template <typename To>
struct as_cast {
  as_deref<To> operator*() const { return {}; }
};
template <typename To, typename From>
inline To operator->*(as_cast<To>, From x) {
  if constexpr (__is_pointer(From)) {
    static_assert(metal::remove_address_space<__remove_pointer(To)>::value ==
                      metal::remove_address_space<__remove_pointer(From)>::value,
                  "a cast between address spaces is not MSL");
  }
  return (To)x;
}
template <typename To, typename From>
inline decltype(auto) operator->*(as_deref<To>, From x) {
  return *(as_cast<To>() ->* x);
}

// A C-style cast `(floatN)x` of MSL is a value conversion, unlike clang's vector bitcast: the
// pre-pass turns it into `::steel_shim::cast<floatN>() ->* x` (also for a template's type
// parameter, which may be a vector), whose ->* binds like a cast. The operand is taken by
// const reference: that binds to an object in any address space (`(half4x4)(*device_ptr)`)
// and to a vector element.
template <typename V>
struct cast {};
template <typename V, typename A>
inline V operator->*(cast<V>, const A& a) {
  if constexpr (vinfo<V>::is_vector) {
    return vmake<V>(a);
  } else {
    return V(a);
  }
}

// `T(args)` with T a template's type parameter (the pre-pass writes it
// `::steel_shim::construct<T>(args)`): MSL's vector construction when T is a vector (llama.cpp's
// `s2_t(half2_value)`, float2 from half2, which C++ would refuse), T(args) otherwise.
template <typename V, typename... A>
constexpr V construct(const A&... a) {
  if constexpr (vinfo<V>::is_vector) {
    return vmake<V>(a...);
  } else {
    return V(a...);
  }
}

// Struct assignment across address spaces (`*(threadgroup S*)p = *(const device S*)q;`), which
// MSL allows and C++ cannot express: the pre-pass adds this to every struct and class of shader
// code. It takes part only when one side is not in the generic (thread) address space, so
// ordinary copies keep their implicit operators.
template <typename Self, typename Src, typename X>
constexpr bool as_copy_ok =
    __is_same(metal::remove_address_space_t<metal::remove_cv_t<__remove_reference_t(Self)>>, X) &&
    __is_same(metal::remove_address_space_t<metal::remove_cv_t<__remove_reference_t(Src)>>, X) &&
    (metal::remove_address_space<__remove_reference_t(Self)>::value != 0 ||
     metal::remove_address_space<__remove_reference_t(Src)>::value != 0);

// Copy-initialization from an object in another address space (`Params p = *params;` with
// `constant Params* params`), which MSL allows and C++ cannot express (a class's implicit copy
// constructor takes a generic reference): the pre-pass wraps the initializer of every local
// variable of a class type (or `auto`) in this. An object outside the thread address space is
// copied byte for byte into a thread one (a memcpy, which the checkers see like any struct
// copy); anything else passes through unchanged, keeping its value category and constness.
// The memcpy's pointers keep their address spaces (clang takes them as they are), so that the
// loads it becomes count as the threadgroup or device loads they are (torch_steel/sim/ir.py).
template <class T>
constexpr decltype(auto) as_local(T&& x) {
  using R = __remove_reference_t(T);
  if constexpr (metal::remove_address_space<R>::value != 0) {
    metal::remove_address_space_t<metal::remove_cv_t<R>> r;
    __builtin_memcpy(&r, &x, sizeof r);
    return r;
  } else {
    return static_cast<T&&>(x);
  }
}

// An argument `*p` or `p[i]` (the pre-pass writes it `(steel_shim::arg_pass(), *p)`) for a
// parameter that takes the object by value, which MSL allows from any address space and C++
// only from the generic one: an object of a class type outside the thread address space becomes
// an arg_copy, convertible into a byte copy (a memcpy, checked like any struct copy) or back
// into its reference for a parameter that takes one.
template <class R>
struct arg_copy {
  using U = metal::remove_address_space_t<metal::remove_cv_t<R>>;
  R& ref;
  operator U() const {
    U r;
    __builtin_memcpy(&r, &ref, sizeof r);
    return r;
  }
  // A template, so that it takes no part in a conversion into U (where it would make that
  // ambiguous): deduced only from a reference to the object's own address space.
  template <class X, STEEL_SHIM_IF(__is_same(metal::remove_cv_t<X>, metal::remove_cv_t<R>))>
  operator X&() const {
    return ref;
  }
};
// The comma form is what leaves every other argument untouched: C++ considers an overloaded
// comma only for operands of class type, and the one below only for a class object outside the
// thread address space; for anything else the built-in comma yields the argument itself, with
// its value category. A function call could not do that for a vector element (`accum[k]` of a
// float2), which no reference binds to, yet which MSL passes by value like any lvalue.
struct arg_pass {};
template <class T>
constexpr bool arg_needs_copy =
    __is_class(__remove_reference_t(T)) &&
    metal::remove_address_space<__remove_reference_t(T)>::value != 0;
template <class T, STEEL_SHIM_IF(arg_needs_copy<T>)>
constexpr arg_copy<__remove_reference_t(T)> operator,(arg_pass, T&& x) {
  return {x};
}

// A string literal in shader code (the pre-pass writes `"x"` as `(steel_shim::literal_pass(),
// "x")`): MSL keeps string literals in the constant address space, so that they go to
// `constant char*` parameters (logging's formats, MLX's os_log fallback); C++ makes them
// generic arrays. The pointer is to the literal's own bytes, which stay where C++ keeps them.
struct literal_pass {};
template <unsigned long N>
inline constant char* operator,(literal_pass, const char (&s)[N]) {
  return (constant char*)s;
}

}  // namespace steel_shim

#if __cplusplus > 202002L
#define STEEL_SIM_AS_COPY(X)                                                 \
  template <class SteelSelf, class SteelSrc,                                 \
            STEEL_SHIM_IF(::steel_shim::as_copy_ok<SteelSelf, SteelSrc, X>)> \
  SteelSelf&& operator=(this SteelSelf&& self, SteelSrc&& src) {             \
    __builtin_memcpy(&self, &src, sizeof(X));                                \
    return static_cast<SteelSelf&&>(self);                                   \
  }
#else
// Before C++23 (no explicit object parameters) such copies do not compile; build shaders with
// -std=c++23.
#define STEEL_SIM_AS_COPY(X)
#endif

namespace steel_shim {

template <typename T>
constexpr bool is_float_v = metal::is_floating_point_v<T>;

// `constant T name [[function_constant(I)]];` becomes a function_constant<T, I> object that
// reads the dispatch's value at each use (Metal specializes it at pipeline creation).
template <typename T, uint32_t I>
struct function_constant {
  using value_type = T;
  T get() const {
    if constexpr (is_float_v<T>) {
      return T(steel_sim::function_constant_float(I));
    } else if constexpr (__is_same(T, bool)) {
      return steel_sim::function_constant_bool(I);
    } else {
      return T(steel_sim::function_constant_int(I));
    }
  }
  operator T() const { return get(); }
};

// A namespace-scope `constant T name = <expression>;` whose expression names other constants:
// a constant expression when they are plain constants (C++23 lets a constexpr function call
// the run-time function constants too, as long as no constant expression needs it).
template <typename T, T (*F)()>
struct derived_constant {
  using value_type = T;
  constexpr T get() const { return F(); }
  constexpr operator T() const { return get(); }
};

template <typename C>
struct is_constant : metal::false_type {};
template <typename T, uint32_t I>
struct is_constant<function_constant<T, I>> : metal::true_type {};
template <typename T, T (*F)()>
struct is_constant<derived_constant<T, F>> : metal::true_type {};

}  // namespace steel_shim

// Arithmetic of a constant with a vector (the conversion operator alone cannot reach clang's
// vector operators).
namespace steel_shim {
template <typename C, typename V>
constexpr bool constant_with_vector = is_constant<C>::value && vinfo<V>::is_vector;
}  // namespace steel_shim

#define STEEL_SHIM_CONSTANT_OP(op)                                                           \
  template <typename C, typename V, STEEL_SHIM_IF(::steel_shim::constant_with_vector<C, V>)> \
  inline auto operator op(const C& c, const V& v) {                                          \
    return c.get() op v;                                                                     \
  }                                                                                          \
  template <typename C, typename V, STEEL_SHIM_IF(::steel_shim::constant_with_vector<C, V>)> \
  inline auto operator op(const V& v, const C& c) {                                          \
    return v op c.get();                                                                     \
  }
STEEL_SHIM_CONSTANT_OP(+)
STEEL_SHIM_CONSTANT_OP(-)
STEEL_SHIM_CONSTANT_OP(*)
STEEL_SHIM_CONSTANT_OP(/)
#undef STEEL_SHIM_CONSTANT_OP

namespace metal {

template <typename T, uint32_t I>
inline bool is_function_constant_defined(const steel_shim::function_constant<T, I>&) {
  return steel_sim::function_constant_defined(I);
}

template <typename T, typename U>
inline T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: sizes differ");
  return __builtin_bit_cast(T, u);
}

}  // namespace metal

namespace steel_shim {

// `threadgroup T name[N];` in a function body: storage shared by the lanes of the threadgroup.
// The declaration's id (from its file and line) is mixed with the enclosing function's name so
// that two instantiations of a template get separate storage.
template <typename T, size_t kAlign = alignof(T)>
inline threadgroup T& tg_array(uint32_t decl_id, const char* function) {
  constexpr size_t align = kAlign > alignof(T) ? kAlign : alignof(T);
  void* p =
      steel_sim::threadgroup_array(threadgroup_array_id(decl_id, function), sizeof(T), align);
  return *(threadgroup T*)p;
}

}  // namespace steel_shim
