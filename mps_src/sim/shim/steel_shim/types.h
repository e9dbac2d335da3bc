// Scalar and vector types of MSL, address spaces, and the type traits of metal::.
//
// Address spaces are clang address_space attributes, so that handing a device pointer to a
// function that takes a threadgroup pointer fails to compile here as it does in Metal. `thread`
// (the default) is the generic address space. `constant` memory is read-only in MSL, so the
// macro also makes the type const: a write through a constant pointer does not compile. half is
// _Float16 and bfloat is __bf16: built with -ffloat16-excess-precision=none /
// -fbfloat16-excess-precision=none they round to nearest even after every operation, as the GPU
// does.
#pragma once

#include "../../runtime.h"

#define device __attribute__((address_space(1)))
#define constant const __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread
#define threadgroup_imageblock threadgroup
#define ray_data
#define object_data device

// Metal's own helper macro; plain `inline` keeps simulator builds fast.
#define METAL_FUNC inline

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef _Float16 half;
typedef __bf16 bfloat;

#define STEEL_SHIM_VECTORS(T)                         \
  typedef T T##2 __attribute__((ext_vector_type(2))); \
  typedef T T##3 __attribute__((ext_vector_type(3))); \
  typedef T T##4 __attribute__((ext_vector_type(4)));
STEEL_SHIM_VECTORS(bool)
STEEL_SHIM_VECTORS(char)
STEEL_SHIM_VECTORS(uchar)
STEEL_SHIM_VECTORS(short)
STEEL_SHIM_VECTORS(ushort)
STEEL_SHIM_VECTORS(int)
STEEL_SHIM_VECTORS(uint)
STEEL_SHIM_VECTORS(long)
STEEL_SHIM_VECTORS(ulong)
STEEL_SHIM_VECTORS(half)
STEEL_SHIM_VECTORS(bfloat)
STEEL_SHIM_VECTORS(float)
#undef STEEL_SHIM_VECTORS
// Packed vectors (MSL: the vector's elements, aligned as one element): 2 and 4 elements are
// the vectors with that alignment (loads through them are checked against it). packed_T3 (12
// bytes, which no clang vector is) is not simulated.
#define STEEL_SHIM_PACKED(T)                                                     \
  typedef T packed_##T##2 __attribute__((ext_vector_type(2), aligned(sizeof(T)))); \
  typedef T packed_##T##4 __attribute__((ext_vector_type(4), aligned(sizeof(T))));
STEEL_SHIM_PACKED(char)
STEEL_SHIM_PACKED(uchar)
STEEL_SHIM_PACKED(short)
STEEL_SHIM_PACKED(ushort)
STEEL_SHIM_PACKED(int)
STEEL_SHIM_PACKED(uint)
STEEL_SHIM_PACKED(half)
STEEL_SHIM_PACKED(bfloat)
STEEL_SHIM_PACKED(float)
#undef STEEL_SHIM_PACKED

// Functions that reach a rendezvous (barriers, simd_* and simdgroup-matrix operations). GPU
// compilers never duplicate such a call into several paths or make it depend on more
// conditions; clang only promises that for `convergent` functions, and the runtime tells
// rendezvous apart by call site.
#define STEEL_CONVERGENT __attribute__((convergent))

// A template parameter that removes an overload unless the condition holds (C++17 SFINAE).
#define STEEL_SHIM_IF(...) ::metal::enable_if_t<(__VA_ARGS__), int> = 0

namespace metal {

template <typename T, int N>
using vec = T __attribute__((ext_vector_type(N)));

// ---- type traits (MSL's metal_type_traits) ----------------------------------------------------

template <typename T, T v>
struct integral_constant {
  static constexpr T value = v;
  using value_type = T;
  using type = integral_constant;
  constexpr operator T() const { return v; }
  constexpr T operator()() const { return v; }
};
template <bool b>
using bool_constant = integral_constant<bool, b>;
using true_type = bool_constant<true>;
using false_type = bool_constant<false>;

template <typename A, typename B>
struct is_same : bool_constant<__is_same(A, B)> {};
template <typename A, typename B>
constexpr bool is_same_v = __is_same(A, B);

template <bool C, typename A, typename B>
struct conditional {
  using type = A;
};
template <typename A, typename B>
struct conditional<false, A, B> {
  using type = B;
};
template <bool C, typename A, typename B>
using conditional_t = typename conditional<C, A, B>::type;

template <bool C, typename T = void>
struct enable_if {};
template <typename T>
struct enable_if<true, T> {
  using type = T;
};
template <bool C, typename T = void>
using enable_if_t = typename enable_if<C, T>::type;

template <typename T>
struct remove_const {
  using type = T;
};
template <typename T>
struct remove_const<const T> {
  using type = T;
};
template <typename T>
using remove_const_t = typename remove_const<T>::type;
template <typename T>
struct remove_volatile {
  using type = T;
};
template <typename T>
struct remove_volatile<volatile T> {
  using type = T;
};
template <typename T>
using remove_volatile_t = typename remove_volatile<T>::type;
template <typename T>
struct remove_cv {
  using type = remove_const_t<remove_volatile_t<T>>;
};
template <typename T>
using remove_cv_t = typename remove_cv<T>::type;
template <typename T>
struct remove_reference {
  using type = __remove_reference_t(T);
};
template <typename T>
using remove_reference_t = __remove_reference_t(T);
template <typename T>
struct remove_pointer {
  using type = __remove_pointer(T);
};
template <typename T>
using remove_pointer_t = __remove_pointer(T);

// Strips the address space (and const) of T; `value` is the address space number.
template <typename T>
struct remove_address_space {
  using type = T;
  static constexpr int value = 0;
};
template <typename T, int N>
struct remove_address_space<T __attribute__((address_space(N)))> {
  using type = T;
  static constexpr int value = N;
};
template <typename T>
struct remove_address_space<const T> {
  using type = typename remove_address_space<T>::type;
  static constexpr int value = remove_address_space<T>::value;
};
template <typename T>
using remove_address_space_t = typename remove_address_space<T>::type;
template <typename T>
using remove_addrspace_t = remove_address_space_t<T>;  // the name Apple's headers use

// metal::array<T, N>: a fixed-size array with size() and operator[] (thread objects; member
// calls on arrays in device or constant memory do not compile here, see shim/README.md).
template <typename T, unsigned long N>
struct array {
  T steel_elements[N];
  constexpr unsigned long size() const { return N; }
  constexpr bool empty() const { return N == 0; }
  constexpr T& operator[](unsigned long i) { return steel_elements[i]; }
  constexpr const T& operator[](unsigned long i) const { return steel_elements[i]; }
  constexpr T* begin() { return steel_elements; }
  constexpr T* end() { return steel_elements + N; }
  constexpr const T* begin() const { return steel_elements; }
  constexpr const T* end() const { return steel_elements + N; }
};

namespace steel_traits {
template <typename T>
struct vector_info {
  static constexpr bool is_vector = false;
  static constexpr int size = 1;
  using element = T;
};
template <typename T, int N>
struct vector_info<vec<T, N>> {
  static constexpr bool is_vector = true;
  static constexpr int size = N;
  using element = T;
};
}  // namespace steel_traits

template <typename T>
struct is_vector : bool_constant<steel_traits::vector_info<remove_cv_t<T>>::is_vector> {};
template <typename T>
constexpr bool is_vector_v = is_vector<T>::value;
template <typename T>
struct vec_elements : integral_constant<int, steel_traits::vector_info<remove_cv_t<T>>::size> {};
template <typename T>
struct make_scalar {
  using type = typename steel_traits::vector_info<remove_cv_t<T>>::element;
};
template <typename T>
using make_scalar_t = typename make_scalar<T>::type;

template <typename T>
struct is_floating_point
    : bool_constant<__is_same(remove_cv_t<T>, float) || __is_same(remove_cv_t<T>, half) ||
                    __is_same(remove_cv_t<T>, bfloat)> {};
template <typename T>
constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <typename T>
struct is_integral : bool_constant<__is_integral(T)> {};
template <typename T>
constexpr bool is_integral_v = __is_integral(T);
template <typename T>
struct is_arithmetic : bool_constant<is_integral_v<T> || is_floating_point_v<T>> {};
template <typename T>
constexpr bool is_arithmetic_v = is_arithmetic<T>::value;
template <typename T>
struct is_scalar : bool_constant<is_arithmetic_v<T>> {};
template <typename T>
constexpr bool is_scalar_v = is_scalar<T>::value;
template <typename T>
struct is_signed : bool_constant<is_floating_point_v<T> || (is_integral_v<T> && T(-1) < T(0))> {};
template <typename T>
constexpr bool is_signed_v = is_signed<T>::value;
template <typename T>
struct is_unsigned : bool_constant<is_integral_v<T> && !(T(-1) < T(0))> {};
template <typename T>
constexpr bool is_unsigned_v = is_unsigned<T>::value;
template <typename T>
struct is_pointer : bool_constant<__is_pointer(T)> {};
template <typename T>
constexpr bool is_pointer_v = __is_pointer(T);
template <typename B, typename D>
constexpr bool is_base_of_v = __is_base_of(B, D);
template <typename F, typename T>
constexpr bool is_convertible_v = __is_convertible(F, T);
template <typename T>
struct decay {
  using type = __decay(T);
};
template <typename T>
using decay_t = __decay(T);
template <typename T>
T&& declval();

// ---- numeric_limits ---------------------------------------------------------------------------

template <typename T>
struct numeric_limits;

#define STEEL_SHIM_INT_LIMITS(T, LO, HI)                     \
  template <>                                                \
  struct numeric_limits<T> {                                 \
    static constexpr bool is_specialized = true;             \
    static constexpr bool is_integer = true;                 \
    static constexpr bool is_signed = T(-1) < T(0);          \
    static constexpr int digits = sizeof(T) * 8 - is_signed; \
    static constexpr T min() { return LO; }                  \
    static constexpr T lowest() { return LO; }               \
    static constexpr T max() { return HI; }                  \
  };
STEEL_SHIM_INT_LIMITS(bool, false, true)
STEEL_SHIM_INT_LIMITS(char, -128, 127)
typedef signed char steel_shim_schar;  // a type of its own in C++, beside char
STEEL_SHIM_INT_LIMITS(steel_shim_schar, -128, 127)
STEEL_SHIM_INT_LIMITS(uchar, 0, 255)
STEEL_SHIM_INT_LIMITS(short, -32768, 32767)
STEEL_SHIM_INT_LIMITS(ushort, 0, 65535)
STEEL_SHIM_INT_LIMITS(int, -2147483647 - 1, 2147483647)
STEEL_SHIM_INT_LIMITS(uint, 0u, 4294967295u)
STEEL_SHIM_INT_LIMITS(long, -9223372036854775807l - 1, 9223372036854775807l)
STEEL_SHIM_INT_LIMITS(ulong, 0ul, 18446744073709551615ul)
#undef STEEL_SHIM_INT_LIMITS

// Floating-point limits, built from bit patterns so that they are exact for every format.
#define STEEL_SHIM_FLOAT_LIMITS(T, U, DIGITS, MAXB, MINB, EPSB, INFB, NANB, DENB) \
  template <>                                                                     \
  struct numeric_limits<T> {                                                      \
    static constexpr bool is_specialized = true;                                  \
    static constexpr bool is_integer = false;                                     \
    static constexpr bool is_signed = true;                                       \
    static constexpr bool has_infinity = true;                                    \
    static constexpr bool has_quiet_NaN = true;                                   \
    static constexpr int digits = DIGITS;                                         \
    static constexpr T max() { return __builtin_bit_cast(T, U(MAXB)); }           \
    static constexpr T lowest() { return -max(); }                                \
    static constexpr T min() { return __builtin_bit_cast(T, U(MINB)); }           \
    static constexpr T denorm_min() { return __builtin_bit_cast(T, U(DENB)); }    \
    static constexpr T epsilon() { return __builtin_bit_cast(T, U(EPSB)); }       \
    static constexpr T infinity() { return __builtin_bit_cast(T, U(INFB)); }      \
    static constexpr T quiet_NaN() { return __builtin_bit_cast(T, U(NANB)); }     \
  };
STEEL_SHIM_FLOAT_LIMITS(float, uint, 24, 0x7f7fffffu, 0x00800000u, 0x34000000u, 0x7f800000u,
                        0x7fc00000u, 0x1u)
STEEL_SHIM_FLOAT_LIMITS(half, ushort, 11, 0x7bff, 0x0400, 0x1400, 0x7c00, 0x7e00, 0x1)
STEEL_SHIM_FLOAT_LIMITS(bfloat, ushort, 8, 0x7f7f, 0x0080, 0x3c00, 0x7f80, 0x7fc0, 0x1)
#undef STEEL_SHIM_FLOAT_LIMITS

template <typename T>
struct numeric_limits<const T> : numeric_limits<T> {};

}  // namespace metal

// Type names MSL code also spells with the metal:: prefix.
namespace metal {
using ::bool2;
using ::bool3;
using ::bool4;
using ::char2;
using ::char3;
using ::char4;
using ::uchar;
using ::uchar2;
using ::uchar3;
using ::uchar4;
using ::short2;
using ::short3;
using ::short4;
using ::ushort;
using ::ushort2;
using ::ushort3;
using ::ushort4;
using ::int2;
using ::int3;
using ::int4;
using ::uint;
using ::uint2;
using ::uint3;
using ::uint4;
using ::long2;
using ::long3;
using ::long4;
using ::ulong;
using ::ulong2;
using ::ulong3;
using ::ulong4;
using ::half;
using ::half2;
using ::half3;
using ::half4;
using ::bfloat;
using ::bfloat2;
using ::bfloat3;
using ::bfloat4;
using ::float2;
using ::float3;
using ::float4;
}  // namespace metal
