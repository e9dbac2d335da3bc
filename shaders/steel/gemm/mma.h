// BlockMMA: a threadgroup's BM x BN block of C as WM x WN simdgroups, each holding TM x TN fp32
// fragments, fed from the A and B tiles in threadgroup memory BK columns at a time.
//
// Simdgroup (wm, wn) owns the fragments at rows 8 * (wm + i * WM), columns 8 * (wn + j * WN):
// interleaved rather than contiguous, so that on an edge tile the work that falls outside the
// matrix is spread over all simdgroups. The tiles may be stored either way round (a transposed
// operand is copied as it lies in device memory); the element strides kAStrM/kAStrK/kBStrK/kBStrN
// are compile-time constants, so a transpose costs nothing in the inner loop.
#pragma once

#include "../fragment.h"

namespace steel {

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
    simdgroup_matrix<float, 8, 8> a[TM];
    simdgroup_matrix<float, 8, 8> b[TN];
#pragma clang loop unroll(full)
    for (short kk = 0; kk < BK; kk += 8) {
#pragma clang loop unroll(full)
      for (short i = 0; i < TM; ++i) {
        frag_load(a[i], As + a_off + i * (8 * WM) * kAStrM + kk * kAStrK, kAStrK);
      }
#pragma clang loop unroll(full)
      for (short j = 0; j < TN; ++j) {
        frag_load(b[j], Bs + b_off + kk * kBStrK + j * (8 * WN) * kBStrN, kBStrN);
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
