// BlockLoader: copies a BROWS x BCOLS tile of a row-major (in device memory) operand into
// threadgroup memory whose rows are padded to kDstLd elements.
//
// Every thread of the threadgroup copies kVec consecutive elements of a row per pass, in
// BROWS / kRowsPerPass passes; consecutive threads cover consecutive columns, so a simdgroup reads
// whole rows (coalesced). The padding (16 bytes per row, chosen by the caller) shifts consecutive
// rows across threadgroup-memory banks, which the fragment loads of BlockMMA, reading down a
// column, would otherwise hit in the same bank.
#pragma once

#include <metal_stdlib>

using namespace metal;

namespace steel {

// kVec elements moved as one 16-byte-or-smaller access. Only used where the planner has checked
// that the device address is aligned to 16 bytes (see STEEL_GEMM_FC_VEC_A/B).
template <typename T, short N>
struct alignas(N * sizeof(T)) VecChunk {
  T v[N];
};

template <typename T, short BROWS, short BCOLS, short kDstLd, short kThreads>
struct BlockLoader {
  static constant constexpr short kPerThread = BROWS * BCOLS / kThreads;
  static constant constexpr short kVecMax = short(16 / sizeof(T));
  static constant constexpr short kVec = kPerThread < kVecMax ? kPerThread : kVecMax;
  static constant constexpr short kThreadsPerRow = BCOLS / kVec;
  static constant constexpr short kRowsPerPass = kThreads / kThreadsPerRow;
  static_assert(BROWS * BCOLS % (kThreads * kVec) == 0, "tile must split evenly over threads");
  static_assert(kRowsPerPass <= BROWS && BROWS % kRowsPerPass == 0, "tile rows vs threads");

  using Chunk = VecChunk<T, kVec>;

  const int src_ld;
  const short row;  // this thread's first row in the tile
  const short col;  // this thread's first column in the tile
  threadgroup T* dst;
  const device T* src;

  BlockLoader(const device T* src_tile, int ld, threadgroup T* dst_tile, ushort thread_index)
      : src_ld(ld),
        row(short(thread_index / kThreadsPerRow)),
        col(short(kVec * (thread_index % kThreadsPerRow))),
        dst(dst_tile + row * kDstLd + col),
        src(src_tile + row * ld + col) {}

  // The whole tile is inside the operand. `vec` says the rows are 16-byte aligned.
  void load_unsafe(bool vec) const {
    if (vec) {
#pragma clang loop unroll(full)
      for (short i = 0; i < BROWS; i += kRowsPerPass) {
        *((threadgroup Chunk*)(dst + i * kDstLd)) = *((const device Chunk*)(src + i * src_ld));
      }
    } else {
#pragma clang loop unroll(full)
      for (short i = 0; i < BROWS; i += kRowsPerPass) {
#pragma clang loop unroll(full)
        for (short j = 0; j < kVec; ++j) dst[i * kDstLd + j] = src[i * src_ld + j];
      }
    }
  }

  // Only rows < valid_rows and columns < valid_cols exist; the rest of the tile is filled with
  // zeros, so edge tiles run the same multiply-accumulate sequence as interior ones.
  void load_safe(short valid_rows, short valid_cols) const {
#pragma clang loop unroll(full)
    for (short i = 0; i < BROWS; i += kRowsPerPass) {
      const bool row_ok = row + i < valid_rows;
#pragma clang loop unroll(full)
      for (short j = 0; j < kVec; ++j) {
        dst[i * kDstLd + j] = (row_ok && col + j < valid_cols) ? src[i * src_ld + j] : T(0);
      }
    }
  }

  void advance(int elements) { src += elements; }
};

}  // namespace steel
