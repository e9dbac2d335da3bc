// AttnTileLoader: copies kRows x kCols of a row-major device operand (K or V rows) into
// threadgroup memory rows of kLd elements, bounded on ragged edges. Where each row lies is an
// AttnKvRows: rows a fixed stride apart (dense, varlen), or rows found through a paged KV
// cache's block table (decode.h).
//
// The tile is cut into 16-byte chunks (8 half/bfloat or 4 float elements; head dims are
// multiples of 8, so a row is whole chunks) and the threads of the threadgroup take chunks in
// turn, consecutive threads along a row, so a simdgroup reads whole rows (coalesced). Rows past
// `valid_rows` (the last key tile) and columns past `valid_cols` (a head dim below the kernel's)
// are filled with zeros: a zero key row gives a score that is masked anyway, and a zero value
// row keeps 0 * garbage (NaN when the garbage is inf or NaN) out of the fp32 accumulators.
// A row's address is computed only for rows that are read, so the block table is never read
// past the pages that hold the sequence's keys.
#pragma once

#include <metal_stdlib>

#include "../gemm/loader.h"

using namespace metal;

namespace steel {

// Where key rows key0, key0 + 1, ... of one (batch entry, KV head) lie, relative to the head's
// first element. Dense and varlen operands: `ld` apart. A paged cache (`paged`): key j is slot
// j % page_size of page table[j / page_size]; pages are `page_stride` apart and table entries
// are clamped to [0, pages), so a corrupt table reads wrong keys, never outside the pool.
struct AttnKvRows {
  steel_i64 ld;
  bool paged;
  const device int* table;  // the sequence's row of the block table (paged only)
  int key0;
  int page_size;
  int pages;
  steel_i64 page_stride;

  steel_i64 at(short r) const {
    if (!paged) return steel_i64(r) * ld;
    const int key = key0 + r;
    const int page = clamp(table[key / page_size], 0, pages - 1);
    return steel_i64(page) * page_stride + steel_i64(key % page_size) * ld;
  }
};

inline AttnKvRows attn_dense_rows(steel_i64 ld) {
  AttnKvRows rows = {ld, false, nullptr, 0, 1, 1, 0};
  return rows;
}

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
  // launches), so no element is checked. `src` is the row base of `rows`.
  static void load(threadgroup T* dst, const device T* src, AttnKvRows rows, short valid_rows,
                   short valid_cols, bool full, bool vec, ushort thread_index) {
    for (short c = short(thread_index); c < kChunks; c += kThreads) {
      const short r = c / kChunksPerRow;
      const short col = (c - r * kChunksPerRow) * kVec;
      threadgroup T* d = dst + r * kLd + col;
      if (full || (r < valid_rows && col + kVec <= valid_cols)) {
        const device T* s = src + rows.at(r) + col;
        if (vec) {
          *((threadgroup Chunk*)d) = *((const device Chunk*)s);
        } else {
#pragma clang loop unroll(full)
          for (short j = 0; j < kVec; ++j) d[j] = s[j];
        }
      } else if (r < valid_rows) {
        const device T* s = src + rows.at(r) + col;
#pragma clang loop unroll(full)
        for (short j = 0; j < kVec; ++j) d[j] = col + j < valid_cols ? s[j] : T(0);
      } else {
#pragma clang loop unroll(full)
        for (short j = 0; j < kVec; ++j) d[j] = T(0);
      }
    }
  }

  // Rows `src_ld` apart (dense and varlen operands).
  static void load(threadgroup T* dst, const device T* src, steel_i64 src_ld, short valid_rows,
                   short valid_cols, bool full, bool vec, ushort thread_index) {
    load(dst, src, attn_dense_rows(src_ld), valid_rows, valid_cols, full, vec, thread_index);
  }
};

}  // namespace steel
