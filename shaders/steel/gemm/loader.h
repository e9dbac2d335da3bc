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

#include "../params.h"

using namespace metal;

namespace steel {

// The unsigned vector type of a given size: kVec elements are moved as one access of this type
// (bits, not values, so the same copy serves every dtype). Only used where the planner has
// checked that every device row start is a multiple of the access size
// (STEEL_GEMM_FC_VEC_A/B, steel_gemm_loader_vec in params.h), so each access is aligned to its
// own size.
template <int kBytes>
struct Bits;
template <>
struct Bits<2> {
  using type = ushort;
};
template <>
struct Bits<4> {
  using type = uint;
};
template <>
struct Bits<8> {
  using type = uint2;
};
template <>
struct Bits<16> {
  using type = uint4;
};

template <typename T, short BROWS, short BCOLS, short kDstLd, short kThreads>
struct BlockLoader {
  // kVec elements per access, the rule the planner checks alignment against (params.h).
  static constant constexpr short kVec =
      short(steel_gemm_loader_vec(BROWS * BCOLS, kThreads, int(sizeof(T))));
  static constant constexpr short kThreadsPerRow = BCOLS / kVec;
  static constant constexpr short kRowsPerPass = kThreads / kThreadsPerRow;
  static_assert(BROWS * BCOLS % (kThreads * kVec) == 0, "tile must split evenly over threads");
  static_assert(kRowsPerPass <= BROWS && BROWS % kRowsPerPass == 0, "tile rows vs threads");

  using Chunk = typename Bits<kVec * sizeof(T)>::type;
  // The vector stores into threadgroup memory are aligned too, given a 16-byte aligned tile start
  // (as MLX's loaders assume; the simulator allocates threadgroup arrays so): every destination
  // row starts a multiple of the access size after it.
  static_assert(kDstLd * sizeof(T) % sizeof(Chunk) == 0, "padded tile rows break alignment");

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

  // The whole tile is inside the operand. `vec`: every row start is aligned to kVec elements.
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
