// Metal Performance Primitives' tensor operations (mpp::tensor_ops): matmul2d, cooperative
// tensors and their reductions, as /work/shared/METAL4_TENSOR_OPS.md describes them.
//
// How an operation runs here. matmul2d::run and reduce_rows / reduce_columns are operations of
// an execution scope (execution_simdgroup = one simdgroup, execution_simdgroups<N> = a
// threadgroup of exactly N simdgroups): every thread of the scope must call them, at the same
// call site, which the runtime checks (runtime.h: tensor_op_gather). Each thread contributes a
// pointer to what it holds (its cooperative tensors' slots and the tensors it passes); the
// scope's first thread then does the whole operation: it reads every operand element once (so
// the checkers see each device or threadgroup read and the counters count it once), multiplies
// in binary32 in index order (C first, when accumulating), and writes every thread's slots or
// the destination tensor. The other threads wait at tensor_op_release until it is done.
//
// Cooperative tensors. Each role (a matmul's destination, left and right inputs, the row and
// column reduction results, for one descriptor, scope and element types) gets its own
// element-to-(thread, slot) map drawn at random per layout seed (runtime.h: tensor_layout).
// Fresh tensors and invalid slots hold NaN, and an invalid slot's multidimensional index names
// some real element, so a kernel must use is_valid_element / get_multidimensional_index (or
// load / store / iterators) and nothing else.
//
// Precision: exact binary32 products and sums by default; relaxed_precision rounds float
// operands to 11 significant bits first (about what M5 does; half and bfloat operands already
// have at most 11). M5's own rounding, hardware or compiler bugs and speed are not modelled.
//
// Names that the facts sheet does not spell out are the simulator's reading of the API:
// get_row_reduction_destination_cooperative_tensor / get_column_reduction_destination_...,
// reduce_rows(source, destination, op, identity), and iterators that visit the valid elements.
#pragma once

#include "tensor.h"

namespace metal {

// Execution scopes. execution_thread and the runtime-sized execution_dsimdgroups are not
// modelled: a kernel that names them does not compile here.
template <int N>
struct execution_simdgroups {
  static_assert(N >= 1 && N <= 32, "execution_simdgroups<N>: 1 to 32 simdgroups");
  static constexpr uint32_t steel_simdgroups = N;
};
using execution_simdgroup = execution_simdgroups<1>;

}  // namespace metal

namespace steel_shim {

// A type's tag in role keys and its kind for the checks.
template <typename T>
constexpr uint32_t tensor_type_code() {
  using V = metal::remove_cv_t<metal::remove_address_space_t<T>>;
  if constexpr (__is_same(V, half)) return 1;
  if constexpr (__is_same(V, bfloat)) return 2;
  if constexpr (__is_same(V, float)) return 3;
  return 0;
}

constexpr uint64_t key_mix(uint64_t h, uint64_t v) {
  return (h ^ v) * 0x100000001B3ull + 0x9E3779B97F4A7C15ull;
}

enum TensorRole : uint32_t { kRoleDest = 1, kRoleLeft = 2, kRoleRight = 3, kRoleRows = 4, kRoleCols = 5 };

// A role: `rows` x `cols` elements (element row * cols + col; multidimensional index [0] col,
// [1] row) over `threads` threads of a scope; Source is the reduced role for kRoleRows / kRoleCols
// (whose elements are its rows / columns, index [0]).
template <uint32_t kKind, int kRows, int kCols, uint32_t kSimdgroups, uint64_t kKey,
          typename Source = void>
struct CoopRole {
  using steel_source = Source;
  static constexpr uint32_t kind = kKind;
  static constexpr int rows = kRows;
  static constexpr int cols = kCols;
  static constexpr uint32_t simdgroups = kSimdgroups;
  static constexpr uint32_t threads = 32 * kSimdgroups;
  static constexpr bool reduced = kKind == kRoleRows || kKind == kRoleCols;
  static constexpr uint32_t elements = reduced ? (kKind == kRoleRows ? kRows : kCols)
                                               : uint32_t(kRows) * uint32_t(kCols);
  static constexpr uint32_t max_capacity_of() {
    if constexpr (reduced) {
      const uint32_t n = kKind == kRoleRows ? kRows : kCols;
      return (Source::max_capacity < n ? Source::max_capacity : n) + 1;
    } else {
      return (elements + threads - 1) / threads + 2;
    }
  }
  static constexpr uint32_t max_capacity = max_capacity_of();
  static constexpr uint64_t key = key_mix(key_mix(kKey, kKind), uint64_t(kRows) << 20 | kCols);

  static const steel_sim::TensorLayout* layout() {
    if constexpr (reduced) {
      return steel_sim::tensor_reduction_layout(key, Source::layout(), kRows, kCols,
                                                kKind == kRoleRows, max_capacity);
    } else {
      return steel_sim::tensor_layout(key, elements, threads, max_capacity);
    }
  }
  // This thread's index in the scope.
  static uint32_t me() {
    const steel_sim::LaneInfo& l = steel_sim::lane();
    return kSimdgroups == 1 ? l.thread_index_in_simdgroup : l.thread_index_in_threadgroup;
  }
};

template <typename T>
inline T poison() {
  return T(__builtin_nanf(""));
}

// relaxed_precision: a float rounded to 11 significant bits (to nearest, ties to even).
inline float relax(float x) {
  uint32_t b = __builtin_bit_cast(uint32_t, x);
  if ((b & 0x7f800000u) == 0x7f800000u) return x;
  b += 0x0fffu + ((b >> 13) & 1u);
  return __builtin_bit_cast(float, b & ~0x1fffu);
}

}  // namespace steel_shim

namespace metal {

template <typename T, typename Role>
struct cooperative_tensor;

template <typename Coop>
struct cooperative_tensor_iterator {
  Coop* steel_tensor;
  uint32_t steel_slot;

  auto& operator*() const { return (*steel_tensor)[steel_slot]; }
  cooperative_tensor_iterator& operator++() {
    steel_slot = steel_tensor->steel_next_valid(steel_slot + 1);
    return *this;
  }
  bool operator==(const cooperative_tensor_iterator& o) const { return steel_slot == o.steel_slot; }
  bool operator!=(const cooperative_tensor_iterator& o) const { return steel_slot != o.steel_slot; }
  array<int, 2> get_multidimensional_index() const {
    return steel_tensor->get_multidimensional_index(steel_slot);
  }
};

template <typename T, typename Role>
struct cooperative_tensor {
  static_assert(steel_shim::tensor_type_code<T>() != 0,
                "the simulator's cooperative tensors hold half, bfloat or float");
  using value_type = T;
  using steel_role = Role;
  using iterator = cooperative_tensor_iterator<cooperative_tensor>;

  T steel_slots[Role::max_capacity];
  const steel_sim::TensorLayout* steel_layout;
  uint32_t steel_me;

  // A fresh tensor holds whatever the registers held: NaN here.
  cooperative_tensor() : steel_layout(Role::layout()), steel_me(Role::me()) {
    for (uint32_t s = 0; s < Role::max_capacity; ++s) steel_slots[s] = steel_shim::poison<T>();
  }

  ushort get_capacity() const { return ushort(steel_layout->capacity); }
  int steel_element(uint32_t slot) const {
    return steel_layout->element_at[steel_me * steel_layout->capacity + slot];
  }
  void steel_check(uint32_t slot, const char* what) const {
    if (slot >= steel_layout->capacity) {
      char message[160];
      __builtin_snprintf(message, sizeof(message),
                         "cooperative_tensor::%s(%u): beyond get_capacity() = %u", what, slot,
                         steel_layout->capacity);
      steel_sim::fail(message);
    }
  }
  thread T& operator[](uint32_t slot) {
    steel_check(slot, "operator[]");
    return steel_slots[slot];
  }
  const thread T& operator[](uint32_t slot) const {
    steel_check(slot, "operator[]");
    return steel_slots[slot];
  }
  bool is_valid_element(uint32_t slot) const {
    steel_check(slot, "is_valid_element");
    return steel_element(slot) >= 0;
  }
  // [0] the column, [1] the row (reduction results: [0] their row or column). An invalid slot
  // names some real element: garbage that looks plausible.
  array<int, 2> get_multidimensional_index(uint32_t slot) const {
    steel_check(slot, "get_multidimensional_index");
    int e = steel_element(slot);
    if (e < 0) e = steel_layout->index_of_invalid[steel_me * steel_layout->capacity + slot];
    if constexpr (Role::reduced) return array<int, 2>{{e, 0}};
    return array<int, 2>{{e % Role::cols, e / Role::cols}};
  }

  uint32_t steel_next_valid(uint32_t slot) const {
    while (slot < steel_layout->capacity && steel_element(slot) < 0) ++slot;
    return slot;
  }
  iterator begin() { return iterator{this, steel_next_valid(0)}; }
  iterator end() { return iterator{this, steel_layout->capacity}; }

  // The iterator of this tensor at the element that `other` (an iterator of another
  // cooperative tensor of this thread) stands at: the same element, or for a reduction result
  // the result of the source element's row (column).
  template <typename OtherCoop>
  iterator map_iterator(cooperative_tensor_iterator<OtherCoop> other) {
    const array<int, 2> at = other.get_multidimensional_index();
    int want;
    if constexpr (Role::reduced) {
      want = Role::kind == steel_shim::kRoleRows ? at[1] : at[0];
    } else {
      want = at[1] * Role::cols + at[0];
    }
    for (uint32_t s = 0; s < steel_layout->capacity; ++s) {
      if (steel_element(s) == want) return iterator{this, s};
    }
    steel_sim::fail("cooperative_tensor::map_iterator: this thread does not hold the element "
                    "in the target tensor (its layout differs from the source's)");
  }

  // The tensor element of slot s: (column, row) of a 2-D role, (row or column) of a reduction.
  template <typename Tn>
  void steel_coords(uint32_t s, int32_t* i0, int32_t* i1) const {
    const int e = steel_element(s);
    if constexpr (Role::reduced) {
      *i0 = e;
      *i1 = 0;
    } else {
      *i0 = e % Role::cols;
      *i1 = e / Role::cols;
    }
  }

  // Each valid element from `t` (dims: [0] column, [1] row; rank 1 for reduction results):
  // past a dynamic extent zero, past the original tensor under a static extent poison.
  template <typename E, typename X, typename D>
  void load(const thread tensor<E, X, D>& t) {
    static_assert(tensor<E, X, D>::steel_rank == (Role::reduced ? 1 : 2),
                  "cooperative_tensor::load: the tensor's rank differs from the cooperative "
                  "tensor's");
    for (uint32_t s = 0; s < steel_layout->capacity; ++s) {
      if (steel_element(s) < 0) continue;
      int32_t i0, i1;
      steel_coords<E>(s, &i0, &i1);
      steel_slots[s] = steel_read(t, i0, i1);
    }
  }
  template <typename E, typename X, typename D>
  static T steel_read(const thread tensor<E, X, D>& t, int32_t i0, int32_t i1) {
    using Tn = tensor<E, X, D>;
    bool inside = i0 < t.steel_extent(0) && t.steel_inside(0, i0);
    if constexpr (Tn::steel_rank > 1) inside = inside && i1 < t.steel_extent(1) && t.steel_inside(1, i1);
    if (inside) return T(float(*t.steel_at(i0, i1)));
    bool in_view = i0 < t.steel_extent(0);
    if constexpr (Tn::steel_rank > 1) in_view = in_view && i1 < t.steel_extent(1);
    return in_view ? steel_shim::poison<T>() : T(0);
  }
  // Each valid element to `t` (held by several threads: stored by one); elements past a
  // dynamic extent are not stored; past the original tensor under a static extent: an error.
  template <typename E, typename X, typename D>
  void store(const thread tensor<E, X, D>& t) const {
    using Tn = tensor<E, X, D>;
    static_assert(Tn::steel_rank == (Role::reduced ? 1 : 2),
                  "cooperative_tensor::store: the tensor's rank differs from the cooperative "
                  "tensor's");
    using V = typename Tn::value_type;
    for (uint32_t s = 0; s < steel_layout->capacity; ++s) {
      if (steel_element(s) < 0 || !steel_layout->owner[steel_me * steel_layout->capacity + s]) {
        continue;
      }
      int32_t i0, i1;
      steel_coords<E>(s, &i0, &i1);
      bool in_view = i0 < t.steel_extent(0);
      bool inside = t.steel_inside(0, i0);
      if constexpr (Tn::steel_rank > 1) {
        in_view = in_view && i1 < t.steel_extent(1);
        inside = inside && t.steel_inside(1, i1);
      }
      if (!in_view) continue;
      if (!inside) {
        steel_sim::fail("cooperative_tensor::store past the original tensor under a static "
                        "extent (undefined on the GPU)");
      }
      *t.steel_at(i0, i1) = V(float(steel_slots[s]));
    }
  }
};

}  // namespace metal

namespace mpp::tensor_ops {

struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m;
  int n;
  int k;
  bool transpose_left;
  bool transpose_right;
  bool relaxed_precision;
  mode matmul_mode;

  // k is taken as a size_t so that metal::dynamic_extent (the default) passes unconverted.
  constexpr matmul2d_descriptor(int m_, int n_, size_t k_ = metal::dynamic_extent,
                                bool transpose_left_ = false, bool transpose_right_ = false,
                                bool relaxed_precision_ = false, mode matmul_mode_ = mode::multiply)
      : m(m_), n(n_), k(int(k_)), transpose_left(transpose_left_), transpose_right(transpose_right_),
        relaxed_precision(relaxed_precision_), matmul_mode(matmul_mode_) {}
};

enum class reduction_operation { sum, max, min };

}  // namespace mpp::tensor_ops

namespace steel_shim {

template <typename T>
struct is_coop : metal::false_type {};
template <typename T, typename R>
struct is_coop<metal::cooperative_tensor<T, R>> : metal::true_type {};
template <typename T>
struct is_mem : metal::false_type {};
template <typename E, typename X, typename D>
struct is_mem<metal::tensor<E, X, D>> : metal::true_type {};

template <typename T>
using bare = metal::remove_cv_t<__remove_reference_t(T)>;

// What one thread hands the leader: where its operands are (a cooperative tensor's slots, or a
// tensor's description, which must be the same in every thread).
struct OperandView {
  const void* slots;  // a cooperative tensor's slots in this thread, or null
  uint64_t memory[8];  // a tensor's data pointer, extents, strides and origin
};
struct Contribution {
  OperandView op[3];
};

template <typename X>
inline OperandView describe(const thread X& x) {
  OperandView v{};
  if constexpr (is_coop<X>::value) {
    v.slots = x.steel_slots;
  } else {
    v.slots = nullptr;
    v.memory[0] = uint64_t(__builtin_bit_cast(__UINTPTR_TYPE__, x.steel_data));
    for (size_t d = 0; d < X::steel_rank; ++d) {
      v.memory[1 + d] = uint64_t(uint32_t(x.steel_ext[d])) |
                        uint64_t(uint32_t(x.steel_stride[d])) << 32;
      v.memory[3 + d] = uint64_t(uint32_t(x.steel_origin[d]));
    }
  }
  return v;
}

// The leader checks every thread's operands against its own: the scope's threads must pass the
// same tensors (the GPU runs one operation for the scope).
inline void check_uniform(const Contribution* const* all, uint32_t threads, const char* op) {
  for (uint32_t t = 1; t < threads; ++t) {
    for (int i = 0; i < 3; ++i) {
      const OperandView& a = all[0]->op[i];
      const OperandView& b = all[t]->op[i];
      if ((a.slots == nullptr) != (b.slots == nullptr) ||
          (a.slots == nullptr && __builtin_memcmp(a.memory, b.memory, sizeof(a.memory)) != 0)) {
        char message[200];
        __builtin_snprintf(message, sizeof(message),
                           "%s: thread %u of the scope passes another tensor as operand %d than "
                           "thread 0 (every thread must pass the same)",
                           op, t, i);
        steel_sim::fail(message);
      }
    }
  }
}

// Element (i0, i1) of a tensor operand as a matmul reads it: zero past a dynamic extent, poison
// past the original tensor under a static one.
template <typename X>
inline float read_operand(const thread X& x, int32_t i0, int32_t i1, bool* poisoned) {
  const bool in_view = i0 < x.steel_extent(0) && i1 < x.steel_extent(1);
  if (!in_view) return 0.0f;
  if (!x.steel_inside(0, i0) || !x.steel_inside(1, i1)) {
    *poisoned = true;
    return __builtin_nanf("");
  }
  return float(*x.steel_at(i0, i1));
}

// A cooperative tensor's element e as held by thread `t` of the scope.
template <typename C>
inline float coop_element(const Contribution* const* all, int which, const steel_sim::TensorLayout* l,
                          uint32_t e) {
  const int32_t place = l->place_of[e];
  const auto* slots = static_cast<const typename C::value_type*>(all[place / l->capacity]->op[which].slots);
  return float(slots[place % l->capacity]);
}

}  // namespace steel_shim

namespace mpp::tensor_ops {

template <matmul2d_descriptor Desc, typename Scope>
struct matmul2d {
  static constexpr uint32_t kSimdgroups = Scope::steel_simdgroups;
  static_assert(Desc.m > 0 && Desc.n > 0, "matmul2d_descriptor: m and n must be positive");
  static_assert(Desc.m % 16 == 0 || Desc.n % 16 == 0,
                "matmul2d_descriptor: m or n must be a multiple of 16 (asserted by macOS 26.2+ "
                "SDKs)");
  static_assert(Desc.k == int(metal::dynamic_extent) || Desc.k > 0,
                "matmul2d_descriptor: k must be positive or dynamic_extent");

  static constexpr uint64_t kKey =
      steel_shim::key_mix(steel_shim::key_mix(steel_shim::key_mix(uint64_t(Desc.m) << 32 | uint32_t(Desc.n),
                                                                  uint32_t(Desc.k)),
                                              kSimdgroups),
                          uint64_t(Desc.transpose_left) << 1 | uint64_t(Desc.transpose_right));

  template <typename L, typename R, typename E>
  static constexpr uint64_t role_key() {
    return steel_shim::key_mix(kKey, steel_shim::tensor_type_code<typename L::value_type>() << 8 |
                                         steel_shim::tensor_type_code<typename R::value_type>() << 4 |
                                         steel_shim::tensor_type_code<E>());
  }
  // Rows x columns of an input role as its tensor lies: dims ([0] columns, [1] rows).
  static constexpr int kLeftRows = Desc.transpose_left ? Desc.k : Desc.m;
  static constexpr int kLeftCols = Desc.transpose_left ? Desc.m : Desc.k;
  static constexpr int kRightRows = Desc.transpose_right ? Desc.n : Desc.k;
  static constexpr int kRightCols = Desc.transpose_right ? Desc.k : Desc.n;

  template <typename L, typename R, typename E>
  using dest_role = steel_shim::CoopRole<steel_shim::kRoleDest, Desc.m, Desc.n, kSimdgroups,
                                         role_key<L, R, E>()>;

  template <typename L, typename R, typename E>
  auto get_destination_cooperative_tensor() const {
    return metal::cooperative_tensor<E, dest_role<L, R, E>>();
  }
  template <typename L, typename R, typename E>
  auto get_left_input_cooperative_tensor() const {
    static_assert(Desc.k > 0, "a cooperative left input needs a static k");
    return metal::cooperative_tensor<E, steel_shim::CoopRole<steel_shim::kRoleLeft, kLeftRows,
                                                             kLeftCols, kSimdgroups,
                                                             role_key<L, R, E>()>>();
  }
  template <typename L, typename R, typename E>
  auto get_right_input_cooperative_tensor() const {
    static_assert(Desc.k > 0, "a cooperative right input needs a static k");
    return metal::cooperative_tensor<E, steel_shim::CoopRole<steel_shim::kRoleRight, kRightRows,
                                                             kRightCols, kSimdgroups,
                                                             role_key<L, R, E>()>>();
  }
  template <typename L, typename R, typename E>
  auto get_row_reduction_destination_cooperative_tensor() const {
    return metal::cooperative_tensor<E, steel_shim::CoopRole<steel_shim::kRoleRows, Desc.m, Desc.n,
                                                             kSimdgroups, role_key<L, R, E>(),
                                                             dest_role<L, R, E>>>();
  }
  template <typename L, typename R, typename E>
  auto get_column_reduction_destination_cooperative_tensor() const {
    return metal::cooperative_tensor<E, steel_shim::CoopRole<steel_shim::kRoleCols, Desc.m, Desc.n,
                                                             kSimdgroups, role_key<L, R, E>(),
                                                             dest_role<L, R, E>>>();
  }

  // Compile-time shape rules of one operand: a cooperative tensor of the right role and shape;
  // a rank-2 tensor whose static extents agree with the descriptor.
  template <typename X, uint32_t kKind, int kRows, int kCols>
  static constexpr void check_operand() {
    if constexpr (steel_shim::is_coop<X>::value) {
      using Role = typename X::steel_role;
      static_assert(Role::kind == kKind && Role::rows == kRows && Role::cols == kCols &&
                        Role::simdgroups == kSimdgroups,
                    "matmul2d::run: a cooperative tensor of another role, shape or scope");
    } else {
      static_assert(steel_shim::is_mem<X>::value,
                    "matmul2d::run takes tensors or cooperative tensors");
      static_assert(X::steel_rank == 2, "matmul2d::run: operands are rank-2 tensors");
      using Ext = typename X::extents_type;
      static_assert(Ext::static_extent(0) == metal::dynamic_extent || kCols < 0 ||
                        Ext::static_extent(0) == size_t(kCols),
                    "matmul2d::run: a static extent (dimension 0) disagrees with the descriptor");
      static_assert(Ext::static_extent(1) == metal::dynamic_extent || kRows < 0 ||
                        Ext::static_extent(1) == size_t(kRows),
                    "matmul2d::run: a static extent (dimension 1) disagrees with the descriptor");
      static_assert(steel_shim::tensor_type_code<typename X::value_type>() != 0,
                    "matmul2d::run: the simulator's operands are half, bfloat or float");
      static_assert(kKind != steel_shim::kRoleDest ||
                        !__is_const(typename X::element_type),
                    "matmul2d::run: the destination tensor is read-only");
    }
  }

  // K of a dynamic-K operation: along the tensor's K dimension (dim `d`), from its origin to
  // its static extent or the original tensor's edge.
  template <typename X>
  static int k_of(const thread X& x, int d) {
    if constexpr (steel_shim::is_coop<X>::value) {
      return -1;
    } else {
      return x.steel_extent(d);
    }
  }

  template <typename LArg, typename RArg, typename DArg>
  STEEL_CONVERGENT void run(thread LArg&& left_arg, thread RArg&& right_arg,
                            thread DArg&& dest_arg) const {
    using L = steel_shim::bare<LArg>;
    using R = steel_shim::bare<RArg>;
    using D = steel_shim::bare<DArg>;
    constexpr int kK = Desc.k;
    check_operand<L, steel_shim::kRoleLeft, kLeftRows, kLeftCols>();
    check_operand<R, steel_shim::kRoleRight, kRightRows, kRightCols>();
    check_operand<D, steel_shim::kRoleDest, Desc.m, Desc.n>();
    const thread L& left = left_arg;
    const thread R& right = right_arg;
    thread D& dest = dest_arg;

    steel_shim::Contribution mine{
        {steel_shim::describe(left), steel_shim::describe(right), steel_shim::describe(dest)}};
    const auto* all = reinterpret_cast<const steel_shim::Contribution* const*>(
        steel_sim::tensor_op_gather(&mine, kSimdgroups, "matmul2d::run"));
    const uint32_t threads = 32 * kSimdgroups;
    if (steel_shim::CoopRole<0, 1, 1, kSimdgroups, 0>::me() == 0) {
      steel_shim::check_uniform(all, threads, "matmul2d::run");
      compute(left, right, dest, all);
    }
    steel_sim::tensor_op_release(kSimdgroups, "matmul2d::run");
  }

 private:
  template <typename L, typename R, typename D>
  static void compute(const thread L& left, const thread R& right, thread D& dest,
                      const steel_shim::Contribution* const* all) {
    constexpr int M = Desc.m;
    constexpr int N = Desc.n;
    // K: the descriptor's, or (dynamic) the operands' along K. When their extents differ (the
    // ragged last tile of P x V), K is the larger and each operand reads zeros past its own
    // extent, the rule for any read past a dynamic extent (read_operand): the smaller extent
    // bounds the nonzero products; the others are 0 * the other operand's element, multiplied
    // (so a NaN or infinity there shows). shim/README.md: what Apple documents of it.
    int K = Desc.k;
    if (Desc.k == int(metal::dynamic_extent)) {
      const int kl = k_of(left, Desc.transpose_left ? 1 : 0);
      const int kr = k_of(right, Desc.transpose_right ? 0 : 1);
      K = kl > kr ? kl : kr;
    }
    // Operands in binary32, each element read once: a[r * K + k], b[k * N + c].
    float* a = static_cast<float*>(
        steel_sim::tensor_op_scratch((size_t(M) * K + size_t(K) * N) * sizeof(float)));
    float* b = a + size_t(M) * K;
    bool poisoned = false;
    using LV = typename L::value_type;
    using RV = typename R::value_type;
    for (int r = 0; r < M; ++r) {
      for (int k = 0; k < K; ++k) {
        const int i0 = Desc.transpose_left ? r : k, i1 = Desc.transpose_left ? k : r;
        float v;
        if constexpr (steel_shim::is_coop<L>::value) {
          v = steel_shim::coop_element<L>(all, 0, left.steel_layout, uint32_t(i1 * kLeftCols + i0));
        } else {
          v = steel_shim::read_operand(left, i0, i1, &poisoned);
        }
        a[size_t(r) * K + k] = Desc.relaxed_precision && __is_same(LV, float) ? steel_shim::relax(v) : v;
      }
    }
    for (int k = 0; k < K; ++k) {
      for (int c = 0; c < N; ++c) {
        const int i0 = Desc.transpose_right ? k : c, i1 = Desc.transpose_right ? c : k;
        float v;
        if constexpr (steel_shim::is_coop<R>::value) {
          v = steel_shim::coop_element<R>(all, 1, right.steel_layout, uint32_t(i1 * kRightCols + i0));
        } else {
          v = steel_shim::read_operand(right, i0, i1, &poisoned);
        }
        b[size_t(k) * N + c] = Desc.relaxed_precision && __is_same(RV, float) ? steel_shim::relax(v) : v;
      }
    }
    (void)poisoned;
    const bool accumulate = Desc.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate;
    for (int r = 0; r < M; ++r) {
      for (int c = 0; c < N; ++c) {
        const uint32_t e = uint32_t(r * N + c);
        if constexpr (steel_shim::is_coop<D>::value) {
          using DV = typename D::value_type;
          const steel_sim::TensorLayout* l = dest.steel_layout;
          const int32_t place = l->place_of[e];
          auto* slots = const_cast<DV*>(static_cast<const DV*>(all[place / l->capacity]->op[2].slots));
          float acc = accumulate ? float(slots[place % l->capacity]) : 0.0f;
          for (int k = 0; k < K; ++k) acc = acc + a[size_t(r) * K + k] * b[size_t(k) * N + c];
          slots[place % l->capacity] = DV(acc);
        } else {
          using DV = typename D::value_type;
          if (c >= dest.steel_extent(0) || r >= dest.steel_extent(1)) continue;
          if (!dest.steel_inside(0, c) || !dest.steel_inside(1, r)) {
            steel_sim::fail("matmul2d::run writes past the original tensor under a static "
                            "extent of the destination (undefined on the GPU)");
          }
          float acc = accumulate ? float(*dest.steel_at(c, r)) : 0.0f;
          for (int k = 0; k < K; ++k) acc = acc + a[size_t(r) * K + k] * b[size_t(k) * N + c];
          *dest.steel_at(c, r) = DV(acc);
        }
      }
    }
    if constexpr (steel_shim::is_coop<D>::value) {
      // Invalid slots of every thread: garbage after the operation.
      using DV = typename D::value_type;
      const steel_sim::TensorLayout* l = dest.steel_layout;
      for (uint32_t t = 0; t < l->threads; ++t) {
        auto* slots = const_cast<DV*>(static_cast<const DV*>(all[t]->op[2].slots));
        for (uint32_t s = 0; s < l->capacity; ++s) {
          if (l->element_at[t * l->capacity + s] < 0) slots[s] = steel_shim::poison<DV>();
        }
      }
    }
    steel_sim::count_tensor_op(uint64_t(M) * uint64_t(N) * uint64_t(K));
  }
};

// reduce_rows(source, destination, op, identity): destination (a row reduction result of the
// source's role) = op over each row of source, starting from identity (0 by default for every
// op, as in Apple's header: pass -INFINITY for max). An operation of the source's scope.
template <typename T, typename SRole, typename U, typename DRole>
STEEL_CONVERGENT inline void steel_reduce(const thread metal::cooperative_tensor<T, SRole>& source,
                                          thread metal::cooperative_tensor<U, DRole>& destination,
                                          reduction_operation op, float identity,
                                          bool by_rows, const char* name) {
  struct Pointers {
    const void* source;
    void* destination;
  };
  Pointers mine{source.steel_slots, destination.steel_slots};
  const auto* all = reinterpret_cast<const Pointers* const*>(
      steel_sim::tensor_op_gather(&mine, SRole::simdgroups, name));
  if (SRole::me() == 0) {
    const steel_sim::TensorLayout* sl = source.steel_layout;
    const steel_sim::TensorLayout* dl = destination.steel_layout;
    const uint32_t outer = by_rows ? SRole::rows : SRole::cols;
    const uint32_t inner = by_rows ? SRole::cols : SRole::rows;
    for (uint32_t o = 0; o < outer; ++o) {
      float acc = identity;
      for (uint32_t i = 0; i < inner; ++i) {
        const uint32_t e = by_rows ? o * SRole::cols + i : i * SRole::cols + o;
        const int32_t place = sl->place_of[e];
        const float v = float(static_cast<const T*>(all[place / sl->capacity]->source)[place % sl->capacity]);
        if (op == reduction_operation::sum) {
          acc = acc + v;
        } else if (v != v || acc != acc) {
          acc = __builtin_nanf("");  // NaN propagates: an uninitialized element shows
        } else if (op == reduction_operation::max) {
          acc = v > acc ? v : acc;
        } else {
          acc = v < acc ? v : acc;
        }
      }
      for (uint32_t p = 0; p < dl->threads * dl->capacity; ++p) {
        if (dl->element_at[p] == int32_t(o)) {
          static_cast<U*>(all[p / dl->capacity]->destination)[p % dl->capacity] = U(acc);
        }
      }
    }
    for (uint32_t p = 0; p < dl->threads * dl->capacity; ++p) {
      if (dl->element_at[p] < 0) {
        static_cast<U*>(all[p / dl->capacity]->destination)[p % dl->capacity] = steel_shim::poison<U>();
      }
    }
    steel_sim::count_tensor_op(0);
  }
  steel_sim::tensor_op_release(SRole::simdgroups, name);
}

template <typename T, typename SRole, typename U, typename DRole>
STEEL_CONVERGENT inline void reduce_rows(const thread metal::cooperative_tensor<T, SRole>& source,
                                         thread metal::cooperative_tensor<U, DRole>& destination,
                                         reduction_operation op = reduction_operation::sum,
                                         T identity = T(0)) {
  static_assert(SRole::kind == steel_shim::kRoleDest,
                "reduce_rows reduces a matmul destination cooperative tensor");
  static_assert(DRole::kind == steel_shim::kRoleRows && __is_same(typename DRole::steel_source, SRole),
                "reduce_rows: the destination is not a row reduction result of the source's "
                "matmul");
  steel_reduce(source, destination, op, float(identity), true, "reduce_rows");
}

template <typename T, typename SRole, typename U, typename DRole>
STEEL_CONVERGENT inline void reduce_columns(const thread metal::cooperative_tensor<T, SRole>& source,
                                            thread metal::cooperative_tensor<U, DRole>& destination,
                                            reduction_operation op = reduction_operation::sum,
                                            T identity = T(0)) {
  static_assert(SRole::kind == steel_shim::kRoleDest,
                "reduce_columns reduces a matmul destination cooperative tensor");
  static_assert(DRole::kind == steel_shim::kRoleCols && __is_same(typename DRole::steel_source, SRole),
                "reduce_columns: the destination is not a column reduction result of the "
                "source's matmul");
  steel_reduce(source, destination, op, float(identity), false, "reduce_columns");
}

}  // namespace mpp::tensor_ops
