// MSL's matrix types (metal_matrix): matrix<T, Cols, Rows> and the floatCxR and halfCxR names,
// C and R in 2..4 (MSL names no bfloat matrices; code declares `matrix<bfloat, 4, 4>` itself). As in MSL a matrix is its columns, each a vector of R
// elements (`m[i]` is column i, `m[i][j]` row j of it), laid out one after another with the
// column vector's size and alignment (a half4x4 is 32 bytes, a float3x3 48).
//
// What is here is what production kernels do with them (llama.cpp's dequantizers and flash
// attention): build one from a scalar (the diagonal), from its columns or from all its elements
// in column order, convert between element types with a cast (`(half4x4) m_float`), index,
// assign and copy across address spaces, add, subtract, and multiply by a scalar, a vector or
// another matrix.
#pragma once

#include "construct.h"
#include "math.h"

namespace metal {

template <typename T, int Cols, int Rows>
struct matrix;

}  // namespace metal

namespace steel_shim {

template <typename M>
struct matrix_info {
  static constexpr bool is_matrix = false;
};
template <typename T, int C, int R>
struct matrix_info<metal::matrix<T, C, R>> {
  static constexpr bool is_matrix = true;
  static constexpr int cols = C;
  static constexpr int rows = R;
};
template <typename M>
using bare_t = metal::remove_address_space_t<metal::remove_cv_t<__remove_reference_t(M)>>;
template <typename M, int C, int R>
constexpr bool same_shape =
    matrix_info<bare_t<M>>::is_matrix && matrix_info<bare_t<M>>::cols == C &&
    matrix_info<bare_t<M>>::rows == R;

}  // namespace steel_shim

namespace metal {

template <typename T, int Cols, int Rows>
struct matrix {
  static_assert(Cols >= 2 && Cols <= 4 && Rows >= 2 && Rows <= 4,
                "MSL matrices have 2 to 4 columns and rows");
  static_assert(__is_same(T, float) || __is_same(T, half) || __is_same(T, bfloat),
                "MSL matrices hold float, half or bfloat");
  using column_type = vec<T, Rows>;
  column_type columns[Cols];

  matrix() = default;
  // The diagonal (MSL: `float4x4(1)` is the identity).
  explicit constexpr matrix(T diagonal) {
    for (int c = 0; c < Cols; ++c) {
      columns[c] = column_type(T(0));
      if (c < Rows) columns[c][c] = diagonal;
    }
  }
  // One vector per column, or every element in column order.
  template <typename... A,
            STEEL_SHIM_IF(sizeof...(A) == Cols && (__is_same(A, column_type) && ...))>
  constexpr matrix(A... cols) : columns{cols...} {}
  template <typename... A, STEEL_SHIM_IF(sizeof...(A) == Cols * Rows)>
  constexpr matrix(A... elements) {
    const T all[] = {T(elements)...};
    for (int c = 0; c < Cols; ++c)
      for (int r = 0; r < Rows; ++r) columns[c][r] = all[c * Rows + r];
  }
  // From a matrix of the same shape in any address space, converting each element (explicit,
  // as MSL's conversions between matrix types are).
  template <typename M, STEEL_SHIM_IF(::steel_shim::same_shape<M, Cols, Rows>)>
  explicit matrix(M&& m) {
    for (int c = 0; c < Cols; ++c)
      for (int r = 0; r < Rows; ++r) columns[c][r] = T(m.columns[c][r]);
  }
  matrix(const matrix&) = default;
  matrix& operator=(const matrix&) = default;
  STEEL_SIM_AS_COPY(matrix)

  // Column i, in the matrix's own address space.
  template <typename Self>
  constexpr decltype(auto) operator[](this Self&& self, int i) {
    return (self.columns[i]);
  }
};

#define STEEL_SHIM_MATRIX_NAMES(T) \
  typedef matrix<T, 2, 2> T##2x2;  \
  typedef matrix<T, 2, 3> T##2x3;  \
  typedef matrix<T, 2, 4> T##2x4;  \
  typedef matrix<T, 3, 2> T##3x2;  \
  typedef matrix<T, 3, 3> T##3x3;  \
  typedef matrix<T, 3, 4> T##3x4;  \
  typedef matrix<T, 4, 2> T##4x2;  \
  typedef matrix<T, 4, 3> T##4x3;  \
  typedef matrix<T, 4, 4> T##4x4;
STEEL_SHIM_MATRIX_NAMES(float)
STEEL_SHIM_MATRIX_NAMES(half)
#undef STEEL_SHIM_MATRIX_NAMES

template <typename T, int C, int R>
inline matrix<T, C, R> operator+(matrix<T, C, R> a, const matrix<T, C, R>& b) {
  for (int c = 0; c < C; ++c) a.columns[c] += b.columns[c];
  return a;
}
template <typename T, int C, int R>
inline matrix<T, C, R> operator-(matrix<T, C, R> a, const matrix<T, C, R>& b) {
  for (int c = 0; c < C; ++c) a.columns[c] -= b.columns[c];
  return a;
}
template <typename T, int C, int R>
inline matrix<T, C, R> operator*(matrix<T, C, R> a, T s) {
  for (int c = 0; c < C; ++c) a.columns[c] *= s;
  return a;
}
template <typename T, int C, int R>
inline matrix<T, C, R> operator*(T s, matrix<T, C, R> a) {
  return a * s;
}
// matrix x column vector: the columns weighted by the vector's elements.
template <typename T, int C, int R>
inline vec<T, R> operator*(const matrix<T, C, R>& m, vec<T, C> v) {
  vec<T, R> out = m.columns[0] * v[0];
  for (int c = 1; c < C; ++c) out += m.columns[c] * v[c];
  return out;
}
// row vector x matrix: one dot product per column.
template <typename T, int C, int R>
inline vec<T, C> operator*(vec<T, R> v, const matrix<T, C, R>& m) {
  vec<T, C> out;
  for (int c = 0; c < C; ++c) {
    T s = T(0);
    for (int r = 0; r < R; ++r) s += v[r] * m.columns[c][r];
    out[c] = s;
  }
  return out;
}
template <typename T, int K, int C, int R>
inline matrix<T, C, R> operator*(const matrix<T, K, R>& a, const matrix<T, C, K>& b) {
  matrix<T, C, R> out;
  for (int c = 0; c < C; ++c) out.columns[c] = a * b.columns[c];
  return out;
}

}  // namespace metal
