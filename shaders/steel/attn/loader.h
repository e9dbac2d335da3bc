// AttnTileLoader: copies kRows x kCols of a row-major device operand (K or V rows, each with its
// own row stride) into threadgroup memory rows of kLd elements, bounded on ragged edges.
//
// The tile is cut into 16-byte chunks (8 half/bfloat or 4 float elements; head dims are
// multiples of 8, so a row is whole chunks) and the threads of the threadgroup take chunks in
// turn, consecutive threads along a row, so a simdgroup reads whole rows (coalesced). Rows past
// `valid_rows` (the last key tile) and columns past `valid_cols` (a head dim below the kernel's)
// are filled with zeros: a zero key row gives a score that is masked anyway, and a zero value
// row keeps 0 * garbage (NaN when the garbage is inf or NaN) out of the fp32 accumulators.
#pragma once

#include <metal_stdlib>

#include "../gemm/loader.h"

using namespace metal;

namespace steel {

template <typename T, short kRows, short kCols, short kLd, short kThreads>
struct AttnTileLoader {
  static constant constexpr short kVec = short(16 / sizeof(T));
  static constant constexpr short kChunksPerRow = kCols / kVec;
  static constant constexpr short kChunks = kRows * kChunksPerRow;
  static_assert(kCols % kVec == 0, "head dims are multiples of 8");
  static_assert(kLd * sizeof(T) % 16 == 0, "padded rows keep 16-byte chunk alignment");
  using Chunk = typename Bits<16>::type;

  // `vec`: every row start of the operand is 16-byte aligned (STEEL_ATTN_FC_VEC_K/V), so a whole
  // chunk moves as one access. `full`: the tile has no ragged edge (compile-time true on aligned
  // launches), so no element is checked.
  static void load(threadgroup T* dst, const device T* src, steel_i64 src_ld, short valid_rows,
                   short valid_cols, bool full, bool vec, ushort thread_index) {
    for (short c = short(thread_index); c < kChunks; c += kThreads) {
      const short r = c / kChunksPerRow;
      const short col = (c - r * kChunksPerRow) * kVec;
      threadgroup T* d = dst + r * kLd + col;
      const device T* s = src + r * src_ld + col;
      if (full || (r < valid_rows && col + kVec <= valid_cols)) {
        if (vec) {
          *((threadgroup Chunk*)d) = *((const device Chunk*)s);
        } else {
#pragma clang loop unroll(full)
          for (short j = 0; j < kVec; ++j) d[j] = s[j];
        }
      } else {
#pragma clang loop unroll(full)
        for (short j = 0; j < kVec; ++j) {
          d[j] = (r < valid_rows && col + j < valid_cols) ? s[j] : T(0);
        }
      }
    }
  }
};

}  // namespace steel
