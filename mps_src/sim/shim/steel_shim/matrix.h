// simdgroup_matrix<T, 8, 8> (metal_simdgroup_matrix): 64 elements spread over the 32 lanes of a
// simdgroup, two per lane, in the layout of Apple GPUs: lane l (q = l / 4) holds row
// (q & 4) + (l / 2) % 4, columns c and c + 1 with c = (q & 2) * 2 + (l % 2) * 2.
//
// Loads and stores touch only the lane's own two elements (plus a rendezvous, as they are
// simdgroup-wide operations); a multiply-accumulate is one simd_exchange of every lane's A and B
// elements, after which each lane computes its own two results: start from C, add the eight
// products in index order, all in binary32 (measured on hardware for half x half + float), then
// round to D's type.
#pragma once

#include "count.h"
#include "simd.h"

namespace steel_shim {

constexpr int frag_row(uint32_t lane) { return int((lane / 4) & 4) + int((lane / 2) % 4); }
constexpr int frag_col(uint32_t lane) { return int((lane / 4) & 2) * 2 + int(lane % 2) * 2; }

// owner[r * 8 + c]: the lane holding element (r, c); its slot in that lane is c % 2.
struct FragOwners {
  uint8_t lane[64];
  constexpr FragOwners() : lane() {
    for (uint32_t l = 0; l < 32; ++l) {
      lane[frag_row(l) * 8 + frag_col(l)] = uint8_t(l);
      lane[frag_row(l) * 8 + frag_col(l) + 1] = uint8_t(l);
    }
  }
};
inline constexpr FragOwners kFragOwners{};

}  // namespace steel_shim

namespace metal {

template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the simulator supports 8x8 simdgroup matrices");
  static_assert(__is_same(T, float) || __is_same(T, half) || __is_same(T, bfloat),
                "simdgroup_matrix holds half, bfloat or float");
  using element_type = T;

  vec<T, 2> steel_elements;

  // Uninitialized, as on the GPU, where it holds whatever the registers held: NaN here, so that a
  // kernel that forgets to clear an accumulator fails in every threadgroup, not only later ones.
  simdgroup_matrix() : steel_elements(T(__builtin_nanf(""))) {}
  // The diagonal matrix with `d` on its diagonal.
  explicit simdgroup_matrix(T d) {
    const uint32_t l = steel_shim::simd_lane();
    const int r = steel_shim::frag_row(l);
    const int c = steel_shim::frag_col(l);
    steel_elements[0] = r == c ? d : T(0);
    steel_elements[1] = r == c + 1 ? d : T(0);
  }

  thread vec<T, 2>& thread_elements() { return steel_elements; }
  const thread vec<T, 2>& thread_elements() const { return steel_elements; }
};

typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;

template <typename T, int Cols, int Rows = Cols>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.steel_elements = vec<T, 2>(value);
  return m;
}

}  // namespace metal

namespace steel_shim {

// Element (r, c) of the 8x8 matrix at `matrix_origin` (x = column, y = row, in elements, of the
// source) in a source with `elements_per_row`. The origin always addresses the source: with
// transpose_matrix the 8x8 block at (x, y) is read transposed, so the matrix's (r, c) is the
// source's (row y + c, column x + r). Metal's header hands src, elements_per_row and
// matrix_origin unchanged to the load/store builtins; Metal.jl's hardware tests (column-major
// arrays, always loaded with the transpose flag, origin (row, column) of the array) check exactly
// this for nonzero origins, and published M2 Max measurements state the same
// (reg[r][c] = mem[y * S + x + c * S + r] when transposed).
template <typename P, typename O>
inline P frag_element(P base, ulong elements_per_row, O origin, bool transpose, int r, int c) {
  const ulong x = ulong(origin[0]);
  const ulong y = ulong(origin[1]);
  return transpose ? base + (y + ulong(c)) * elements_per_row + x + ulong(r)
                   : base + (y + ulong(r)) * elements_per_row + x + ulong(c);
}

// The arguments of a simdgroup_load / simdgroup_store describe one matrix for the whole
// simdgroup: a pointer, stride, origin or transpose flag that differs between the lanes has no
// meaning on the GPU, so it is an error here rather than a per-lane gather.
struct MatrixArgs {
  ulong address;
  ulong elements_per_row;
  ulong x;
  ulong y;
  ulong transpose;
};

template <typename P, typename O>
STEEL_CONVERGENT inline void matrix_args_uniform(P p, ulong elements_per_row, O origin,
                                                 bool transpose, steel_sim::SimdKind kind,
                                                 const char* name) {
  const MatrixArgs mine{ulong(__builtin_bit_cast(__UINTPTR_TYPE__, p)), elements_per_row,
                        ulong(origin[0]), ulong(origin[1]), ulong(transpose)};
  const auto e = exchange(mine, kind);
  // The simdgroup moves all 64 elements, two from each lane: with lanes that have exited, the
  // GPU's result is undefined (as for simdgroup_multiply_accumulate).
  if (e.mask != 0xffffffffu) {
    steel_sim::fail(kind == steel_sim::SimdKind::MatrixLoad
                        ? "simdgroup_load with inactive lanes in the simdgroup"
                        : "simdgroup_store with inactive lanes in the simdgroup");
  }
  // Each lane against the first active one: all agree when every lane passes.
  const MatrixArgs first = lane_value<MatrixArgs>(e, uint32_t(__builtin_ctz(e.mask)));
  if (__builtin_memcmp(&first, &mine, sizeof(MatrixArgs)) != 0) steel_sim::fail(name);
}

template <typename T, typename P, typename O>
STEEL_CONVERGENT inline void matrix_load(metal::simdgroup_matrix<T, 8, 8>& d, P src,
                                         ulong elements_per_row, O origin, bool transpose) {
  matrix_args_uniform(src, elements_per_row, origin, transpose,
                      steel_sim::SimdKind::MatrixLoad,
                      "simdgroup_load: the lanes of the simdgroup pass different arguments "
                      "(pointer, elements_per_row, matrix_origin or transpose_matrix)");
  const uint32_t l = simd_lane();
  const int r = frag_row(l);
  const int c = frag_col(l);
  d.steel_elements[0] = *frag_element(src, elements_per_row, origin, transpose, r, c);
  d.steel_elements[1] = *frag_element(src, elements_per_row, origin, transpose, r, c + 1);
}

template <typename T, typename P, typename O>
STEEL_CONVERGENT inline void matrix_store(const metal::simdgroup_matrix<T, 8, 8>& a, P dst,
                                          ulong elements_per_row, O origin, bool transpose) {
  matrix_args_uniform(dst, elements_per_row, origin, transpose,
                      steel_sim::SimdKind::MatrixStore,
                      "simdgroup_store: the lanes of the simdgroup pass different arguments "
                      "(pointer, elements_per_row, matrix_origin or transpose_matrix)");
  const uint32_t l = simd_lane();
  const int r = frag_row(l);
  const int c = frag_col(l);
  const metal::vec<T, 2> v = a.steel_elements;
  *frag_element(dst, elements_per_row, origin, transpose, r, c) = v[0];
  *frag_element(dst, elements_per_row, origin, transpose, r, c + 1) = v[1];
}

template <typename TA, typename TB>
struct MmaOperands {
  metal::vec<TA, 2> a;
  metal::vec<TB, 2> b;
};

// d = a * b + c, this lane's two elements, after one exchange of every lane's a and b elements.
template <typename TD, typename TA, typename TB, typename TC, bool kHasC>
STEEL_CONVERGENT inline void matrix_mma(metal::simdgroup_matrix<TD, 8, 8>& d,
                       const metal::simdgroup_matrix<TA, 8, 8>& a,
                       const metal::simdgroup_matrix<TB, 8, 8>& b,
                       const metal::simdgroup_matrix<TC, 8, 8>* c) {
#pragma clang fp contract(off)
  using Ops = MmaOperands<TA, TB>;
  const Ops mine{a.steel_elements, b.steel_elements};
  const auto e = exchange(mine, steel_sim::SimdKind::MatrixMma);
  if (e.mask != 0xffffffffu) {
    steel_sim::fail("simdgroup_multiply_accumulate with inactive lanes in the simdgroup");
  }
  const Ops* all = reinterpret_cast<const Ops*>(e.all);
  const uint32_t l = simd_lane();
  const int r = frag_row(l);
  const int c0 = frag_col(l);
  float acc[2] = {0.0f, 0.0f};
  if constexpr (kHasC) {
    acc[0] = float(c->steel_elements[0]);
    acc[1] = float(c->steel_elements[1]);
  }
  for (int k = 0; k < 8; ++k) {
    const float av = float(all[kFragOwners.lane[r * 8 + k]].a[k & 1]);
    for (int j = 0; j < 2; ++j) {
      const float bv = float(all[kFragOwners.lane[k * 8 + c0 + j]].b[j]);
      const float p = av * bv;
      acc[j] = acc[j] + p;
    }
  }
  d.steel_elements[0] = TD(acc[0]);
  d.steel_elements[1] = TD(acc[1]);
}

}  // namespace steel_shim

namespace metal {

// An 8x8x8 multiply-accumulate counts by its operands' type (counters: mma_by_dtype): float if
// either is float, else bfloat if either is, else half.
#define STEEL_SHIM_MMA(TA, TB)                                              \
  do {                                                                      \
    if constexpr (__is_same(TA, float) || __is_same(TB, float)) {           \
      STEEL_SHIM_OP("mma", float);                                          \
    } else if constexpr (__is_same(TA, bfloat) || __is_same(TB, bfloat)) {  \
      STEEL_SHIM_OP("mma", bfloat);                                         \
    } else {                                                                \
      STEEL_SHIM_OP("mma", half);                                           \
    }                                                                       \
  } while (0)

#define STEEL_SHIM_MATRIX_IO(AS)                                                         \
  template <typename T>                                                                  \
  STEEL_CONVERGENT inline void simdgroup_load(                                           \
      thread simdgroup_matrix<T, 8, 8>& d, const AS T* src, ulong elements_per_row = 8,  \
      ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {                 \
    STEEL_SHIM_OP("simdgroup_load_" #AS, T);                                             \
    steel_shim::matrix_load(d, src, elements_per_row, matrix_origin, transpose_matrix);  \
  }                                                                                      \
  template <typename T>                                                                  \
  STEEL_CONVERGENT inline void simdgroup_store(                                          \
      const thread simdgroup_matrix<T, 8, 8>& a, AS T* dst, ulong elements_per_row = 8,  \
      ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {                 \
    STEEL_SHIM_OP("simdgroup_store_" #AS, T);                                            \
    steel_shim::matrix_store(a, dst, elements_per_row, matrix_origin, transpose_matrix); \
  }
STEEL_SHIM_MATRIX_IO(device)
STEEL_SHIM_MATRIX_IO(threadgroup)
#undef STEEL_SHIM_MATRIX_IO

template <typename TD, typename TA, typename TB, typename TC>
STEEL_CONVERGENT inline void simdgroup_multiply_accumulate(thread simdgroup_matrix<TD, 8, 8>& d,
                                          const thread simdgroup_matrix<TA, 8, 8>& a,
                                          const thread simdgroup_matrix<TB, 8, 8>& b,
                                          const thread simdgroup_matrix<TC, 8, 8>& c) {
  STEEL_SHIM_MMA(TA, TB);
  steel_shim::matrix_mma<TD, TA, TB, TC, true>(d, a, b, &c);
}

template <typename TD, typename TA, typename TB>
STEEL_CONVERGENT inline void simdgroup_multiply(thread simdgroup_matrix<TD, 8, 8>& d,
                               const thread simdgroup_matrix<TA, 8, 8>& a,
                               const thread simdgroup_matrix<TB, 8, 8>& b) {
  STEEL_SHIM_MMA(TA, TB);
  steel_shim::matrix_mma<TD, TA, TB, TD, false>(d, a, b, nullptr);
}

}  // namespace metal
