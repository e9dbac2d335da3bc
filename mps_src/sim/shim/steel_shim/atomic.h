// metal_atomic: atomic<T> in device and threadgroup memory, with the *_explicit functions.
//
// Every operation is a read-modify-write builtin, loads and stores included (fetch_or(0) and
// exchange), so that none of them reaches the checkers' load/store hooks: atomics are the one
// way lanes may touch the same memory without a barrier between.
#pragma once

#include "types.h"

namespace metal {

// MSL's atomic functions take memory_order_relaxed only: the other orders do not exist here.
enum memory_order {
  memory_order_relaxed = __ATOMIC_RELAXED,
};

template <typename T>
struct atomic {
  static_assert(__is_same(T, int) || __is_same(T, uint) || __is_same(T, bool) ||
                    __is_same(T, float) || __is_same(T, ulong) || __is_same(T, long),
                "MSL atomics hold int, uint, bool, float, long or ulong");
  T steel_value;
};

typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<bool> atomic_bool;
typedef atomic<float> atomic_float;
typedef atomic<ulong> atomic_ulong;
typedef atomic<long> atomic_long;

}  // namespace metal

namespace steel_shim {

// What MSL allows on each atomic type (compile-time refusals, as in the Metal compiler): bool
// only loads, stores and exchanges; 64-bit atomics only atomic_fetch_min/max_explicit on ulong;
// float only in device memory, and no min/max on it (MSL 3.1's atomic_float has load, store,
// exchange, compare_exchange, fetch_add and fetch_sub; production code such as MLX's
// atomic.h builds a float max from compare_exchange for that reason).
template <typename T, int kAS>
constexpr bool atomic_space_ok = !(__is_same(T, float) && kAS == 3);
template <typename T>
constexpr bool atomic_rmw_ok = !__is_same(T, bool) && sizeof(T) != 8;
template <typename T>
constexpr bool atomic_access_ok = sizeof(T) != 8;

// The value's bits as an integer of the same size (float atomics go through them).
template <typename T>
using atomic_bits = metal::conditional_t<sizeof(T) == 8, unsigned long long,
                                         metal::conditional_t<sizeof(T) == 4, unsigned int,
                                                              unsigned char>>;

}  // namespace steel_shim

namespace metal {

#define STEEL_SHIM_ATOMIC_ACCESS(T, AS)                                                       \
  static_assert(steel_shim::atomic_space_ok<T, metal::remove_address_space<AS int>::value>,  \
                "atomic_float is supported in device memory only (MSL)");                    \
  static_assert(steel_shim::atomic_access_ok<T>,                                             \
                "64-bit atomics support only atomic_fetch_min/max_explicit on ulong (MSL)")
#define STEEL_SHIM_ATOMIC_RMW(T, AS, kMinMax)                                                  \
  static_assert(steel_shim::atomic_space_ok<T, metal::remove_address_space<AS int>::value>,  \
                "atomic_float is supported in device memory only (MSL)");                    \
  static_assert(!__is_same(T, bool), "atomic_bool has no fetch operations (MSL)");           \
  static_assert(!(kMinMax && __is_same(T, float)),                                           \
                "atomic_float has no atomic_fetch_min/max_explicit in MSL 3.1 (only load, "  \
                "store, exchange, compare_exchange, fetch_add and fetch_sub)");              \
  static_assert(sizeof(T) != 8 || (kMinMax && __is_same(T, ulong)),                          \
                "64-bit atomics support only atomic_fetch_min/max_explicit on ulong (MSL)")
#define STEEL_SHIM_ATOMICS(AS)                                                                   \
  template <typename T>                                                                          \
  inline T steel_atomic_load(const volatile AS atomic<T>* object) {                              \
    using B = steel_shim::atomic_bits<T>;                                                        \
    volatile AS B* p = (volatile AS B*)&object->steel_value;                                     \
    return __builtin_bit_cast(T, B(__atomic_fetch_or(p, B(0), __ATOMIC_SEQ_CST)));               \
  }                                                                                              \
  template <typename T>                                                                          \
  inline T atomic_load_explicit(const volatile AS atomic<T>* object, memory_order) {             \
    STEEL_SHIM_ATOMIC_ACCESS(T, AS);                                                             \
    return steel_atomic_load(object);                                                            \
  }                                                                                              \
  template <typename T>                                                                          \
  inline T atomic_exchange_explicit(volatile AS atomic<T>* object, T desired, memory_order) {    \
    STEEL_SHIM_ATOMIC_ACCESS(T, AS);                                                             \
    using B = steel_shim::atomic_bits<T>;                                                        \
    volatile AS B* p = (volatile AS B*)&object->steel_value;                                     \
    return __builtin_bit_cast(T, B(__atomic_exchange_n(p, __builtin_bit_cast(B, desired),        \
                                                       __ATOMIC_SEQ_CST)));                      \
  }                                                                                              \
  template <typename T>                                                                          \
  inline void atomic_store_explicit(volatile AS atomic<T>* object, T desired, memory_order o) {  \
    atomic_exchange_explicit(object, desired, o);                                                \
  }                                                                                              \
  template <typename T>                                                                          \
  inline bool atomic_compare_exchange_weak_explicit(volatile AS atomic<T>* object,               \
                                                    thread T* expected, T desired,               \
                                                    memory_order, memory_order) {                \
    STEEL_SHIM_ATOMIC_ACCESS(T, AS);                                                             \
    return steel_atomic_cas(object, expected, desired);                                          \
  }                                                                                              \
  template <typename T>                                                                          \
  inline bool steel_atomic_cas(volatile AS atomic<T>* object, thread T* expected, T desired) {   \
    using B = steel_shim::atomic_bits<T>;                                                        \
    volatile AS B* p = (volatile AS B*)&object->steel_value;                                     \
    B want = __builtin_bit_cast(B, *expected);                                                   \
    const bool ok = __atomic_compare_exchange_n(p, &want, __builtin_bit_cast(B, desired), false, \
                                                __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);             \
    *expected = __builtin_bit_cast(T, want);                                                     \
    return ok;                                                                                   \
  }                                                                                              \
  template <typename T, typename F>                                                              \
  inline T steel_atomic_rmw(volatile AS atomic<T>* object, F f) {                                \
    T old = steel_atomic_load(object);                                                           \
    while (!steel_atomic_cas(object, &old, f(old))) {                                            \
    }                                                                                            \
    return old;                                                                                  \
  }                                                                                              \
  template <typename T>                                                                          \
  inline T atomic_fetch_add_explicit(volatile AS atomic<T>* o, T v, memory_order) {              \
    STEEL_SHIM_ATOMIC_RMW(T, AS, false);                                                     \
    return steel_atomic_rmw(o, [v](T x) { return T(x + v); });                                   \
  }                                                                                              \
  template <typename T>                                                                          \
  inline T atomic_fetch_sub_explicit(volatile AS atomic<T>* o, T v, memory_order) {              \
    STEEL_SHIM_ATOMIC_RMW(T, AS, false);                                                     \
    return steel_atomic_rmw(o, [v](T x) { return T(x - v); });                                   \
  }                                                                                              \
  template <typename T>                                                                          \
  inline T atomic_fetch_max_explicit(volatile AS atomic<T>* o, T v, memory_order) {              \
    STEEL_SHIM_ATOMIC_RMW(T, AS, true);                                                      \
    return steel_atomic_rmw(o, [v](T x) { return x < v ? v : x; });                              \
  }                                                                                              \
  template <typename T>                                                                          \
  inline T atomic_fetch_min_explicit(volatile AS atomic<T>* o, T v, memory_order) {              \
    STEEL_SHIM_ATOMIC_RMW(T, AS, true);                                                      \
    return steel_atomic_rmw(o, [v](T x) { return v < x ? v : x; });                              \
  }                                                                                              \
  template <typename T>                                                                          \
  inline T atomic_fetch_and_explicit(volatile AS atomic<T>* o, T v, memory_order) {              \
    STEEL_SHIM_ATOMIC_RMW(T, AS, false);                                                     \
    return steel_atomic_rmw(o, [v](T x) { return T(x & v); });                                   \
  }                                                                                              \
  template <typename T>                                                                          \
  inline T atomic_fetch_or_explicit(volatile AS atomic<T>* o, T v, memory_order) {               \
    STEEL_SHIM_ATOMIC_RMW(T, AS, false);                                                     \
    return steel_atomic_rmw(o, [v](T x) { return T(x | v); });                                   \
  }                                                                                              \
  template <typename T>                                                                          \
  inline T atomic_fetch_xor_explicit(volatile AS atomic<T>* o, T v, memory_order) {              \
    STEEL_SHIM_ATOMIC_RMW(T, AS, false);                                                     \
    return steel_atomic_rmw(o, [v](T x) { return T(x ^ v); });                                   \
  }
STEEL_SHIM_ATOMICS(device)
STEEL_SHIM_ATOMICS(threadgroup)
#undef STEEL_SHIM_ATOMICS
#undef STEEL_SHIM_ATOMIC_ACCESS
#undef STEEL_SHIM_ATOMIC_RMW

}  // namespace metal
