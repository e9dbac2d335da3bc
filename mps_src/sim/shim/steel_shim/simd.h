// Barriers and the simd_* functions (metal_simdgroup), each one rendezvous of the simdgroup
// through steel_sim::simd_exchange.
//
// Lanes that have exited take no part: reductions, prefix sums and votes cover the active lanes
// in ascending lane order. Reading the value of an inactive lane (or of a lane id >= 32) is
// undefined on the GPU; here it yields all-one bits (NaN for floating point) so that a kernel
// that depends on it shows wrong results instead of plausible ones.
#pragma once

#include "math.h"

namespace metal {

enum class mem_flags : uint {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint(a) | uint(b)); }

// A barrier orders the memory its flags name (mem_threadgroup, mem_device) and nothing else:
// with mem_none it synchronizes execution only (the runtime's race checkers follow this).
STEEL_CONVERGENT inline void threadgroup_barrier(mem_flags flags) {
  steel_sim::threadgroup_barrier_flags(uint(flags));
}
STEEL_CONVERGENT inline void simdgroup_barrier(mem_flags flags) {
  steel_sim::simdgroup_barrier_flags(uint(flags));
}

}  // namespace metal

namespace steel_shim {

inline uint32_t simd_lane() { return steel_sim::lane().thread_index_in_simdgroup; }

// Every active lane's `mine`; `mask` says which lanes are active.
struct Exchanged {
  const unsigned char* all;
  uint32_t mask;
};

template <typename T>
STEEL_CONVERGENT inline Exchanged exchange(const T& mine, steel_sim::SimdKind kind) {
  Exchanged e;
  e.all = static_cast<const unsigned char*>(
      steel_sim::simd_exchange(&mine, sizeof(T), kind, &e.mask));
  return e;
}

template <typename T>
inline T undefined_value() {
  T v;
  __builtin_memset(&v, 0xff, sizeof(T));
  return v;
}

template <typename T>
inline T lane_value(const Exchanged& e, uint32_t lane) {
  if (lane >= 32 || !((e.mask >> lane) & 1u)) return undefined_value<T>();
  T v;
  __builtin_memcpy(&v, e.all + size_t(lane) * sizeof(T), sizeof(T));
  return v;
}

// A shuffle's source lane, made to depend on the exchange's result by an empty asm, so that the
// optimizer cannot hoist lane_value's check and addressing above the exchange into the shader's
// code: there they lost the shim's source location and were counted as the shader's
// instructions (an unrolled decode loop's simd_shuffle by the key index: 3 integer operations
// and 2 compares a shuffle). Reductions' folds keep plain ids (their loops unroll).
inline uint32_t source_lane(const Exchanged& e, uint32_t lane) {
  __asm__("" : "+r"(lane) : "r"(e.all));
  return lane;
}

// Folds the active lanes' values with `op` in ascending lane order, over lanes [0, end).
template <typename T, typename Op>
inline T fold(const Exchanged& e, uint32_t end, T init, Op op) {
  T acc = init;
  bool first = true;
  for (uint32_t l = 0; l < end; ++l) {
    if (!((e.mask >> l) & 1u)) continue;
    const T v = lane_value<T>(e, l);
    acc = first ? v : op(acc, v);
    first = false;
  }
  return acc;
}

template <typename T>
inline T plus(T a, T b) {
  return a + b;
}
template <typename T>
inline T times(T a, T b) {
  return a * b;
}

// A shuffle operand with the lane's delta, which must be the same in every active lane.
template <typename T>
struct WithDelta {
  T data;
  uint32_t delta;
  uint32_t modulo;
};

// Every lane compares its own value with the first active lane's (so all agree when every lane
// passes): constant work per lane, where comparing all pairs would cost 32 per lane per call.
template <typename T>
inline void require_uniform_delta(const Exchanged& e, const char* name, const char* what) {
  const uint32_t first = uint32_t(__builtin_ctz(e.mask));
  const uint32_t l = simd_lane();
  const WithDelta<T> a = lane_value<WithDelta<T>>(e, first);
  const WithDelta<T> b = lane_value<WithDelta<T>>(e, l);
  if (b.delta != a.delta || b.modulo != a.modulo) {
    char message[220];
    __builtin_snprintf(message, sizeof(message),
                       "%s: %s differs between the lanes of the simdgroup (%u in lane %u, %u "
                       "in lane %u; modulo %u, %u); Metal requires the same in every thread",
                       name, what, a.delta, first, b.delta, l, a.modulo, b.modulo);
    steel_sim::fail(message);
  }
}

// MSL's simd_* functions take "a scalar or vector of any integer or floating-point type, except
// bool, long, ulong, void, size_t, ptrdiff_t" (size_t and ptrdiff_t are ulong and long here).
template <typename T>
constexpr bool simd_operand_ok = !__is_same(typename vinfo<T>::element, bool) &&
                                 !__is_same(typename vinfo<T>::element, long) &&
                                 !__is_same(typename vinfo<T>::element, ulong) &&
                                 !__is_same(typename vinfo<T>::element, long long) &&
                                 !__is_same(typename vinfo<T>::element, unsigned long long);
#define STEEL_SHIM_SIMD_OPERAND(T)                                               \
  static_assert(::steel_shim::simd_operand_ok<T>,                                \
                "simd_* functions take integer or floating-point scalars or vectors, " \
                "not bool, long or ulong")

// simd_shuffle_and_fill_down/up: shifts within vectors of `modulo` lanes (32 without it); the
// lanes shifted in come from `filling` (its low lanes going down, its high lanes going up).
template <typename T>
struct FillPair {
  T data;
  T filling;
};

template <typename T>
STEEL_CONVERGENT inline T shuffle_and_fill(T data, T filling, int delta, uint32_t modulo,
                                           const char* name) {
  const auto e = exchange(
      WithDelta<FillPair<T>>{FillPair<T>{data, filling}, uint32_t(delta < 0 ? -delta : delta),
                             modulo},
      steel_sim::SimdKind::Shuffle);
  require_uniform_delta<FillPair<T>>(e, name, "delta");
  if (modulo != 2 && modulo != 4 && modulo != 8 && modulo != 16 && modulo != 32) {
    steel_sim::fail("simd_shuffle_and_fill_*: modulo must be 2, 4, 8, 16 or 32");
  }
  const uint32_t me = simd_lane();
  const uint32_t base = me - me % modulo;
  const int src = int(me % modulo) + delta;
  using Lane = WithDelta<FillPair<T>>;
  if (src >= 0 && src < int(modulo)) return lane_value<Lane>(e, base + src).data.data;
  const uint32_t from = base + uint32_t(src < 0 ? src + int(modulo) : src - int(modulo));
  return lane_value<Lane>(e, from).data.filling;
}

}  // namespace steel_shim

namespace metal {

template <typename T>
STEEL_CONVERGENT inline T simd_shuffle(T data, ushort simd_lane_id) {
  STEEL_SHIM_SIMD_OPERAND(T);
  const auto e = steel_shim::exchange(data, steel_sim::SimdKind::Shuffle);
  return steel_shim::lane_value<T>(e, steel_shim::source_lane(e, uint32_t(simd_lane_id)));
}

// MSL requires these arguments to be the same in every thread of the SIMD-group ("the value for
// delta needs to be the same for all threads"; likewise the mask of simd_shuffle_xor, and
// simd_broadcast's lane is undefined otherwise): one that differs between the active lanes is an
// error, not a per-lane shift.
#define STEEL_SHIM_SHUFFLE_UNIFORM(name, arg, src_expr)                                    \
  template <typename T>                                                                    \
  STEEL_CONVERGENT inline T name(T data, ushort arg) {                                     \
    STEEL_SHIM_SIMD_OPERAND(T);                                                            \
    const auto e = steel_shim::exchange(steel_shim::WithDelta<T>{data, arg, 32},           \
                                        steel_sim::SimdKind::Shuffle);                     \
    steel_shim::require_uniform_delta<T>(e, #name, #arg);                                  \
    const uint32_t me = steel_shim::simd_lane();                                           \
    (void)me;                                                                              \
    return steel_shim::lane_value<steel_shim::WithDelta<T>>(                               \
               e, steel_shim::source_lane(e, src_expr))                                    \
        .data;                                                                             \
  }
STEEL_SHIM_SHUFFLE_UNIFORM(simd_broadcast, broadcast_lane_id, uint32_t(broadcast_lane_id))
STEEL_SHIM_SHUFFLE_UNIFORM(simd_shuffle_xor, mask, me ^ uint32_t(mask))
STEEL_SHIM_SHUFFLE_UNIFORM(simd_shuffle_up, delta, me >= delta ? me - delta : me)
STEEL_SHIM_SHUFFLE_UNIFORM(simd_shuffle_down, delta, me + delta < 32 ? me + delta : me)
STEEL_SHIM_SHUFFLE_UNIFORM(simd_shuffle_rotate_up, delta, (me + 32 - delta % 32) % 32)
STEEL_SHIM_SHUFFLE_UNIFORM(simd_shuffle_rotate_down, delta, (me + delta) % 32)
#undef STEEL_SHIM_SHUFFLE_UNIFORM

// The first (lowest) active lane's value.
template <typename T>
STEEL_CONVERGENT inline T simd_broadcast_first(T data) {
  STEEL_SHIM_SIMD_OPERAND(T);
  const auto e = steel_shim::exchange(data, steel_sim::SimdKind::Shuffle);
  return steel_shim::lane_value<T>(e, uint32_t(__builtin_ctz(e.mask)));
}

template <typename T>
STEEL_CONVERGENT inline T simd_shuffle_and_fill_down(T data, T filling, ushort delta,
                                                     ushort modulo = 32) {
  STEEL_SHIM_SIMD_OPERAND(T);
  return steel_shim::shuffle_and_fill(data, filling, int(delta), modulo,
                                      "simd_shuffle_and_fill_down");
}
template <typename T>
STEEL_CONVERGENT inline T simd_shuffle_and_fill_up(T data, T filling, ushort delta,
                                                   ushort modulo = 32) {
  STEEL_SHIM_SIMD_OPERAND(T);
  return steel_shim::shuffle_and_fill(data, filling, -int(delta), modulo,
                                      "simd_shuffle_and_fill_up");
}

#define STEEL_SHIM_REDUCE(name, op)                                         \
  template <typename T>                                                     \
  STEEL_CONVERGENT inline T name(T data) {                                  \
    STEEL_SHIM_SIMD_OPERAND(T);                                             \
    const auto e = steel_shim::exchange(data, steel_sim::SimdKind::Reduce); \
    return steel_shim::fold(e, 32, data, op);                               \
  }
STEEL_SHIM_REDUCE(simd_sum, steel_shim::plus<T>)
STEEL_SHIM_REDUCE(simd_product, steel_shim::times<T>)
STEEL_SHIM_REDUCE(simd_max, steel_shim::max_num<T>)
STEEL_SHIM_REDUCE(simd_min, steel_shim::min_num<T>)
#undef STEEL_SHIM_REDUCE

// The bitwise reductions: MSL declares them for integer scalars and vectors only, so a call on
// a float finds no overload (a compile error, as with Metal's own <metal_simdgroup>).
#define STEEL_SHIM_REDUCE_BITS(name, op)                                               \
  template <typename T>                                                                \
    requires ::steel_shim::is_int<T>                                                   \
  STEEL_CONVERGENT inline T name(T data) {                                             \
    STEEL_SHIM_SIMD_OPERAND(T);                                                        \
    const auto e = steel_shim::exchange(data, steel_sim::SimdKind::Reduce);            \
    return steel_shim::fold(e, 32, data, [](T a, T b) { return T(a op b); });          \
  }
STEEL_SHIM_REDUCE_BITS(simd_and, &)
STEEL_SHIM_REDUCE_BITS(simd_or, |)
STEEL_SHIM_REDUCE_BITS(simd_xor, ^)
#undef STEEL_SHIM_REDUCE_BITS

// Prefix sums over the active lanes below (exclusive) or up to (inclusive) this lane.
template <typename T>
STEEL_CONVERGENT inline T simd_prefix_inclusive_sum(T data) {
  STEEL_SHIM_SIMD_OPERAND(T);
  const auto e = steel_shim::exchange(data, steel_sim::SimdKind::Reduce);
  return steel_shim::fold(e, steel_shim::simd_lane() + 1, data, steel_shim::plus<T>);
}
template <typename T>
STEEL_CONVERGENT inline T simd_prefix_exclusive_sum(T data) {
  STEEL_SHIM_SIMD_OPERAND(T);
  const auto e = steel_shim::exchange(data, steel_sim::SimdKind::Reduce);
  const uint32_t me = steel_shim::simd_lane();
  if (!(e.mask & ((1u << me) - 1u))) return T(0);
  return steel_shim::fold(e, me, data, steel_shim::plus<T>);
}
template <typename T>
STEEL_CONVERGENT inline T simd_prefix_inclusive_product(T data) {
  STEEL_SHIM_SIMD_OPERAND(T);
  const auto e = steel_shim::exchange(data, steel_sim::SimdKind::Reduce);
  return steel_shim::fold(e, steel_shim::simd_lane() + 1, data, steel_shim::times<T>);
}
template <typename T>
STEEL_CONVERGENT inline T simd_prefix_exclusive_product(T data) {
  STEEL_SHIM_SIMD_OPERAND(T);
  const auto e = steel_shim::exchange(data, steel_sim::SimdKind::Reduce);
  const uint32_t me = steel_shim::simd_lane();
  if (!(e.mask & ((1u << me) - 1u))) return T(1);
  return steel_shim::fold(e, me, data, steel_shim::times<T>);
}

// A ballot: bit l is set when active lane l voted true. As MSL specifies, all() and any() look at
// the bits of the 32 threads of the simdgroup, not at which were active (simd_ballot(e).all() is
// false when a thread has exited; simd_all(e) is not), and the top 32 bits of vote_t are
// undefined on 32-wide hardware: here they are set, so code that assumes zeros shows it.
class simd_vote {
 public:
  using vote_t = ulong;
  explicit constexpr simd_vote(vote_t v = 0) : v_(v) {}
  explicit constexpr operator vote_t() const { return v_; }
  constexpr bool all() const { return (v_ & 0xffffffffu) == 0xffffffffu; }
  constexpr bool any() const { return (v_ & 0xffffffffu) != 0; }

 private:
  vote_t v_;
};

namespace steel_votes {
// (bits of the active lanes that voted true, mask of the active lanes)
struct Votes {
  uint32_t yes;
  uint32_t active;
};
STEEL_CONVERGENT inline Votes collect(bool b) {
  const unsigned char mine = b ? 1 : 0;
  const auto e = steel_shim::exchange(mine, steel_sim::SimdKind::Ballot);
  uint32_t v = 0;
  for (uint32_t l = 0; l < 32; ++l) {
    if (((e.mask >> l) & 1u) && e.all[l]) v |= 1u << l;
  }
  return Votes{v, e.mask};
}
inline simd_vote as_vote(uint32_t bits) {
  return simd_vote(ulong(bits) | (ulong(0xffffffffu) << 32));
}
}  // namespace steel_votes

STEEL_CONVERGENT inline simd_vote simd_ballot(bool b) {
  return steel_votes::as_vote(steel_votes::collect(b).yes);
}
STEEL_CONVERGENT inline simd_vote simd_active_threads_mask() {
  return steel_votes::as_vote(steel_votes::collect(true).yes);
}
STEEL_CONVERGENT inline bool simd_all(bool b) {
  const steel_votes::Votes v = steel_votes::collect(b);
  return v.yes == v.active;
}
STEEL_CONVERGENT inline bool simd_any(bool b) { return steel_votes::collect(b).yes != 0; }
STEEL_CONVERGENT inline bool simd_is_first() {
  const steel_votes::Votes v = steel_votes::collect(true);
  return steel_shim::simd_lane() == uint32_t(__builtin_ctz(v.active));
}

}  // namespace metal
