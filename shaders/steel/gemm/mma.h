// BlockMMA: a threadgroup's BM x BN block of C as WM x WN simdgroups, each holding TM x TN fp32
// fragments, fed from the A and B tiles in threadgroup memory BK columns at a time.
//
// Simdgroup (wm, wn) owns the fragments at rows 8 * (wm + i * WM), columns 8 * (wn + j * WN):
// interleaved rather than contiguous, so that on an edge tile the work that falls outside the
// matrix is spread over all simdgroups. The tiles may be stored either way round (a transposed
// operand is copied as it lies in device memory); the element strides kAStrM/kAStrK/kBStrK/kBStrN
// are compile-time constants, so a transpose costs nothing in the inner loop.
//
// Operand fragments: a lane's two elements of an A fragment are (row, fc), (row, fc + 1), of a B
// fragment (fr, col), (fr, col + 1): adjacent in the tile when the operand is stored row by row
// (kAStrK, kBStrN == 1), and then read as one 2-element vector load (the tile rows start
// 16-byte aligned and fc, col and every fragment offset are even, so the load is aligned to its
// size). The operand fragments keep the tiles' dtype (half, bfloat, float): the MMA multiplies
// them into the fp32 accumulators, with no conversion in the inner loop and no rounding of the
// inputs (llama.cpp's mul_mm multiplies simdgroup_bfloat8x8 operands into float accumulators the
// same way, on every GPU family from Apple6).
#pragma once

#include "../fragment.h"

namespace steel {

// This lane's two elements of an operand fragment; kNext is the tile distance from the first to
// the second (1: one vector load).
template <short kNext, typename T>
inline void operand_load(thread simdgroup_matrix<T, 8, 8>& m, const threadgroup T* src) {
  if (kNext == 1) {
    const vec<T, 2> v = *((const threadgroup vec<T, 2>*)src);
    m.thread_elements()[0] = v[0];
    m.thread_elements()[1] = v[1];
  } else {
    m.thread_elements()[0] = src[0];
    m.thread_elements()[1] = src[kNext];
  }
}

template <typename T, short BM, short BN, short BK, short WM, short WN, bool kTransA,
          bool kTransB, short kLdA, short kLdB>
struct BlockMMA {
  static constant constexpr short TM = BM / (8 * WM);
  static constant constexpr short TN = BN / (8 * WN);
  static_assert(TM * 8 * WM == BM && TN * 8 * WN == BN, "block must split into fragments");
  static_assert(BK % 8 == 0, "K is marched in steps of 8");

  // Element (m, k) of the A tile is at m * kAStrM + k * kAStrK; (k, n) of B at k * kBStrK + ...
  static constant constexpr short kAStrM = kTransA ? 1 : kLdA;
  static constant constexpr short kAStrK = kTransA ? kLdA : 1;
  static constant constexpr short kBStrK = kTransB ? 1 : kLdB;
  static constant constexpr short kBStrN = kTransB ? kLdB : 1;
  static_assert(kLdA % 2 == 0 && kLdB % 2 == 0, "vector operand loads need even tile rows");

  FragTile<TM, TN> acc;
  short row;  // the lane's row in the block for fragment row 0 (add i * 8 * WM for row i)
  short col;  // the lane's first column for fragment column 0 (add j * 8 * WN)
  short a_off;
  short b_off;

  BlockMMA(ushort simdgroup, ushort lane) {
    const short fr = frag_row(lane);
    const short fc = frag_col(lane);
    row = 8 * short(simdgroup / WN) + fr;
    col = 8 * short(simdgroup % WN) + fc;
    // A fragment: the lane's elements are (row, fc + {0,1}); B fragment: (fr, col + {0,1}).
    a_off = row * kAStrM + fc * kAStrK;
    b_off = fr * kBStrK + col * kBStrN;
    acc.clear();
  }

  // acc += A_tile[BM x BK] * B_tile[BK x BN].
  void mma(const threadgroup T* As, const threadgroup T* Bs) {
    simdgroup_matrix<T, 8, 8> a[TM];
    simdgroup_matrix<T, 8, 8> b[TN];
    const threadgroup T* as = As + a_off;
    const threadgroup T* bs = Bs + b_off;
#pragma clang loop unroll(full)
    for (short kk = 0; kk < BK; kk += 8) {
#pragma clang loop unroll(full)
      for (short i = 0; i < TM; ++i) {
        operand_load<kAStrK>(a[i], as + i * (8 * WM) * kAStrM + kk * kAStrK);
      }
#pragma clang loop unroll(full)
      for (short j = 0; j < TN; ++j) {
        operand_load<kBStrN>(b[j], bs + kk * kBStrK + j * (8 * WN) * kBStrN);
      }
#pragma clang loop unroll(full)
      for (short i = 0; i < TM; ++i) {
#pragma clang loop unroll(full)
        for (short j = 0; j < TN; ++j) {
          simdgroup_multiply_accumulate(acc.at(i, j), a[i], b[j], acc.at(i, j));
        }
      }
    }
  }
};

}  // namespace steel
