// Kernel entry points: how a translated kernel gets its arguments from the runtime and how its
// instantiations are registered under their host names.
//
// For every kernel function the pre-pass emits, after its body, a struct
// `__steel_kernel_<name>` whose `params` lists what each parameter's attribute asks for
// (plist<buffer<0>, attr<kThreadPositionInGrid>, ...>); every
// `template [[host_name("x")]] [[kernel]] decltype(f<...>) f<...>;` (and every plain kernel)
// becomes a registration of `entry<params, &f<...>>` under "x".
#pragma once

#include "types.h"

namespace steel_shim {

enum Attr : int {
  kThreadPositionInGrid,
  kThreadgroupPositionInGrid,
  kThreadPositionInThreadgroup,
  kThreadsPerThreadgroup,
  kThreadgroupsPerGrid,
  kThreadsPerGrid,
  kThreadIndexInThreadgroup,
  kSimdgroupIndexInThreadgroup,
  kThreadIndexInSimdgroup,
  kSimdgroupsPerThreadgroup,
  kThreadsPerSimdgroup,
  kDispatchThreadsPerThreadgroup,
};

template <int kAttr>
inline const uint32_t* attr_value(const steel_sim::LaneInfo& l) {
  if constexpr (kAttr == kThreadPositionInGrid) return l.thread_position_in_grid;
  if constexpr (kAttr == kThreadgroupPositionInGrid) return l.threadgroup_position_in_grid;
  if constexpr (kAttr == kThreadPositionInThreadgroup) return l.thread_position_in_threadgroup;
  if constexpr (kAttr == kThreadsPerThreadgroup) return l.threads_per_threadgroup;
  if constexpr (kAttr == kThreadgroupsPerGrid) return l.threadgroups_per_grid;
  if constexpr (kAttr == kThreadsPerGrid) return l.threads_per_grid;
  if constexpr (kAttr == kThreadIndexInThreadgroup) return &l.thread_index_in_threadgroup;
  if constexpr (kAttr == kSimdgroupIndexInThreadgroup) return &l.simdgroup_index_in_threadgroup;
  if constexpr (kAttr == kThreadIndexInSimdgroup) return &l.thread_index_in_simdgroup;
  if constexpr (kAttr == kSimdgroupsPerThreadgroup) return &l.simdgroups_per_threadgroup;
  if constexpr (kAttr == kThreadsPerSimdgroup) return &l.threads_per_simdgroup;
  if constexpr (kAttr == kDispatchThreadsPerThreadgroup) return l.dispatch_threads_per_threadgroup;
}

template <int kAttr>
constexpr int attr_dims = kAttr <= kThreadsPerGrid || kAttr == kDispatchThreadsPerThreadgroup ? 3 : 1;

// The address space (types.h: 1 device, 2 constant, 3 threadgroup) of what a pointer or
// reference parameter refers to.
template <typename Arg>
constexpr int pointee_space = metal::remove_address_space<
    __remove_pointer(__remove_reference_t(Arg))>::value;

// [[buffer(I)]]: a pointer or a reference into the bound buffer, in the device or constant
// address space, as MSL requires of buffer arguments.
template <uint32_t I>
struct buffer {
  template <typename Arg>
  static Arg get() {
    static_assert(__is_pointer(Arg) || __is_reference(Arg),
                  "a [[buffer(n)]] parameter is a pointer or a reference");
    static_assert(pointee_space<Arg> == 1 || pointee_space<Arg> == 2,
                  "a [[buffer(n)]] parameter points to device or constant memory");
    void* p = steel_sim::buffer(I);
    if constexpr (pointee_space<Arg> == 2) steel_sim::constant_buffer(I);
    if constexpr (__is_reference(Arg)) {
      return *(__remove_reference_t(Arg)*)p;
    } else {
      return (Arg)p;
    }
  }
  // Disabled by a function constant: the runtime's poison region (runtime.h).
  template <typename Arg>
  static Arg disabled() {
    void* p = steel_sim::disabled_buffer(I);
    if constexpr (__is_reference(Arg)) {
      return *(__remove_reference_t(Arg)*)p;
    } else {
      return (Arg)p;
    }
  }
};

// [[threadgroup(I)]]: a pointer into the dispatch's threadgroup memory entry I.
template <uint32_t I>
struct threadgroup_buffer {
  template <typename Arg>
  static Arg get() {
    static_assert(__is_pointer(Arg) && pointee_space<Arg> == 3,
                  "a [[threadgroup(n)]] parameter is a threadgroup pointer");
    return (Arg)steel_sim::threadgroup_buffer(I);
  }
  template <typename Arg>
  static Arg disabled() {
    return nullptr;
  }
};

// A thread-position attribute as a scalar (the x component) or a 2- or 3-vector.
template <int kAttr>
struct attr {
  template <typename Arg>
  static Arg get() {
    const uint32_t* v = attr_value<kAttr>(steel_sim::lane());
    using Info = metal::steel_traits::vector_info<metal::remove_cv_t<Arg>>;
    static_assert(__is_same(typename Info::element, uint) ||
                      __is_same(typename Info::element, ushort),
                  "a thread-position attribute is uint or ushort (or a vector of them)");
    if constexpr (Info::is_vector) {
      static_assert(Info::size <= attr_dims<kAttr>, "this attribute has fewer components");
      Arg out;
      for (int k = 0; k < Info::size; ++k) out[k] = typename Info::element(v[k]);
      return out;
    } else {
      return Arg(v[0]);
    }
  }
};

// A parameter with [[buffer(n), function_constant(c)]]: it exists only when c is true, and
// nothing needs to be bound otherwise. A disabled buffer points into poison (runtime.h:
// disabled_buffer), so that a read Metal's compiler would remove as dead does not fault here.
template <typename Source, bool (*kPresent)()>
struct present_if {
  template <typename Arg>
  static Arg get() {
    if (!kPresent()) return Source::template disabled<Arg>();
    return Source::template get<Arg>();
  }
};

template <typename... P>
struct plist {
  static constexpr uint32_t max_threads = 0;  // no [[max_total_threads_per_threadgroup]]
};

// A kernel with [[max_total_threads_per_threadgroup(N)]].
template <uint32_t N, typename List>
struct limited : List {
  static constexpr uint32_t max_threads = N;
};

template <typename... P, typename... Args>
inline void invoke(plist<P...>, void (*kernel)(Args...)) {
  static_assert(sizeof...(P) == sizeof...(Args), "kernel parameter list changed");
  kernel(P::template get<Args>()...);
}

template <typename Params, auto kKernel>
void entry() {
  invoke(Params{}, kKernel);
}

// The type in parentheses that STEEL_SIM_REGISTER is given (a template's instance names its
// arguments, whose commas the parentheses keep from the preprocessor): unwrap_t<void(T)> is T.
template <typename F>
struct unwrap;
template <typename T>
struct unwrap<void(T)> {
  using type = T;
};
template <typename F>
using unwrap_t = typename unwrap<F>::type;

template <typename Params, auto kKernel>
inline bool register_instance(const char* host_name) {
  steel_sim::register_kernel_limited(host_name, &entry<Params, kKernel>, Params::max_threads);
  return true;
}

}  // namespace steel_shim

#define STEEL_SIM_CAT2(a, b) a##b
#define STEEL_SIM_CAT(a, b) STEEL_SIM_CAT2(a, b)
// One registration per use (`params` is a parenthesized type); __COUNTER__ keeps the names apart
// when a macro instantiates many kernels from one source line.
#define STEEL_SIM_REGISTER(host_name, params, ...)                                            \
  [[maybe_unused]] static const bool STEEL_SIM_CAT(steel_sim_registered_, __COUNTER__) =      \
      ::steel_shim::register_instance<::steel_shim::unwrap_t<void params>, &__VA_ARGS__>( \
          host_name);
