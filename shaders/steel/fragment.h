// 8x8 simdgroup fragments: which elements a lane owns, and tiles of fragments in registers.
//
// A simdgroup_matrix<float, 8, 8> is spread over the 32 lanes of a simdgroup, two elements each.
// Lane l owns row (q & 4) + (l / 2) % 4 and columns c, c + 1 with c = (q & 2) * 2 + (l % 2) * 2,
// q = l / 4 (the layout Apple GPUs use; MLX and metal-flash-attention rely on the same map).
// Reading and writing a lane's two elements through thread_elements() moves data between
// threadgroup memory and registers without a simdgroup-wide load, so the only simdgroup-wide
// operation left in an inner loop is the multiply-accumulate itself.
#pragma once

#include <metal_stdlib>

using namespace metal;

namespace steel {

// The lane's place in an 8x8 fragment: its row, and the first of its two columns.
inline short frag_row(ushort lane) { return (short(lane / 4) & 4) + short((lane / 2) % 4); }
inline short frag_col(ushort lane) { return (short(lane / 4) & 2) * 2 + short(lane % 2) * 2; }

// A TM x TN grid of fp32 fragments held by one simdgroup (the accumulators of BlockMMA).
template <short TM, short TN>
struct FragTile {
  static constant constexpr short kRows = TM;
  static constant constexpr short kCols = TN;

  simdgroup_matrix<float, 8, 8> frag[TM * TN];

  void clear() {
#pragma clang loop unroll(full)
    for (short i = 0; i < TM * TN; ++i) {
      frag[i].thread_elements()[0] = 0.0f;
      frag[i].thread_elements()[1] = 0.0f;
    }
  }

  thread simdgroup_matrix<float, 8, 8>& at(short i, short j) { return frag[i * TN + j]; }
};

// Loads this lane's two elements of a fragment from threadgroup memory, converting to fp32.
// `src` points at the lane's first element; `next` is the distance to its second (the next
// column of the fragment), which is 1 or a row pitch: a transpose is only a different constant.
template <typename T>
inline void frag_load(thread simdgroup_matrix<float, 8, 8>& m, const threadgroup T* src,
                      short next) {
  m.thread_elements()[0] = float(src[0]);
  m.thread_elements()[1] = float(src[next]);
}

}  // namespace steel
