// Steel GEMM kernels: out = act(alpha * (a @ b) + beta * c + bias), and its split-K pair
// (fp32 partials over slices of K, then a reduction that applies the epilogue).
//
// Host names: steel_gemm_<ta><tb>_<dtype>_bm<BM>_bn<BN>_bk<BK>_wm<WM>_wn<WN>, with <ta>/<tb> n
// (the operand's rows are contiguous) or t (its columns are); steel_gemm_splitk_... the same;
// steel_gemm_splitk_reduce_<dtype>; steel_gemv_rows_<dtype>, steel_gemv_cols_<dtype> and
// steel_gemv_nn_<dtype> (gemv.h).
// mps_src/plan/gemm_plan.cpp builds these names.
#include <metal_stdlib>

#include "../params.h"
#include "gemm.h"
#include "gemv.h"

using namespace metal;
using namespace steel;

template <typename T, short BM, short BN, short BK, short WM, short WN, bool kTransA,
          bool kTransB>
[[kernel]] void steel_gemm(const device T* a [[buffer(STEEL_GEMM_BUF_A)]],
                           const device T* b [[buffer(STEEL_GEMM_BUF_B)]],
                           const device T* c [[buffer(STEEL_GEMM_BUF_C)]],
                           const device T* bias [[buffer(STEEL_GEMM_BUF_BIAS)]],
                           device T* out [[buffer(STEEL_GEMM_BUF_OUT)]],
                           constant GemmParams& params [[buffer(STEEL_GEMM_BUF_PARAMS)]],
                           uint3 tg [[threadgroup_position_in_grid]],
                           ushort simdgroup [[simdgroup_index_in_threadgroup]],
                           ushort lane [[thread_index_in_simdgroup]]) {
  using G = GemmBlock<T, BM, BN, BK, WM, WN, kTransA, kTransB>;
  threadgroup T As[G::kATileElems];
  threadgroup T Bs[G::kBTileElems];
  gemm_block<T, BM, BN, BK, WM, WN, kTransA, kTransB, T, false>(a, b, c, bias, out, params, As,
                                                                Bs, tg, simdgroup, lane);
}

// Split-K, first pass: threadgroup z = entry * partitions + q multiplies batch entry `entry`'s
// K slice [q * k_split, (q + 1) * k_split) and writes fp32 partials to
// partials[q * partial_stride + entry * M * N + row * N + col]; no epilogue.
template <typename T, short BM, short BN, short BK, short WM, short WN, bool kTransA,
          bool kTransB>
[[kernel]] void steel_gemm_splitk(const device T* a [[buffer(STEEL_GEMM_BUF_A)]],
                                  const device T* b [[buffer(STEEL_GEMM_BUF_B)]],
                                  device float* partials [[buffer(STEEL_GEMM_BUF_OUT)]],
                                  constant GemmParams& params [[buffer(STEEL_GEMM_BUF_PARAMS)]],
                                  uint3 tg [[threadgroup_position_in_grid]],
                                  ushort simdgroup [[simdgroup_index_in_threadgroup]],
                                  ushort lane [[thread_index_in_simdgroup]]) {
  using G = GemmBlock<T, BM, BN, BK, WM, WN, kTransA, kTransB>;
  threadgroup T As[G::kATileElems];
  threadgroup T Bs[G::kBTileElems];
  // c and bias are not read without an epilogue; `a` stands in for them.
  gemm_block<T, BM, BN, BK, WM, WN, kTransA, kTransB, float, true>(a, b, a, a, partials, params,
                                                                   As, Bs, tg, simdgroup, lane);
}

// Split-K, second pass: one thread per output element of every batch entry (partial_stride of
// them) sums the partitions in order and applies the epilogue. Reads the partials at
// STEEL_GEMM_BUF_A.
template <typename T>
[[kernel]] void steel_gemm_splitk_reduce(const device float* partials [[buffer(STEEL_GEMM_BUF_A)]],
                                         const device T* c [[buffer(STEEL_GEMM_BUF_C)]],
                                         const device T* bias [[buffer(STEEL_GEMM_BUF_BIAS)]],
                                         device T* out [[buffer(STEEL_GEMM_BUF_OUT)]],
                                         constant GemmParams& p [[buffer(STEEL_GEMM_BUF_PARAMS)]],
                                         uint gid [[thread_position_in_grid]]) {
  const int index = int(gid);
  if (index >= p.partial_stride) return;
  const int entry = index / p.out_batch_stride;
  const int element = index - entry * p.out_batch_stride;
  const int row = element / p.N;
  const int col = element - row * p.N;
  float acc = 0.0f;
  for (int q = 0; q < p.partitions; ++q) acc += partials[q * p.partial_stride + index];
  c += gemm_batch_element(p, uint(entry)).c;
  out[entry * p.out_batch_stride + row * p.ldd + col] =
      T(epilogue(acc, row, col, c, bias, p, gemm_use_c, gemm_has_bias, gemm_activation));
}

// GEMV: out with at most 8 rows (steel_gemv_rows_: a row-major, b column by column) or 8
// columns (steel_gemv_cols_: a row-major, b column by column, by transposition). No threadgroup
// memory; the grid is (ceil(lines / (4 * simdgroups)), 1, batch).
template <typename T, bool kSwap>
[[kernel]] void steel_gemv(const device T* a [[buffer(STEEL_GEMM_BUF_A)]],
                           const device T* b [[buffer(STEEL_GEMM_BUF_B)]],
                           const device T* c [[buffer(STEEL_GEMM_BUF_C)]],
                           const device T* bias [[buffer(STEEL_GEMM_BUF_BIAS)]],
                           device T* out [[buffer(STEEL_GEMM_BUF_OUT)]],
                           constant GemmParams& params [[buffer(STEEL_GEMM_BUF_PARAMS)]],
                           uint3 tg [[threadgroup_position_in_grid]],
                           ushort simdgroup [[simdgroup_index_in_threadgroup]],
                           ushort simdgroups [[simdgroups_per_threadgroup]],
                           ushort lane [[thread_index_in_simdgroup]]) {
  gemv_block<T, kSwap>(a, b, c, bias, out, params, tg, simdgroup, lane, simdgroups);
}

// GEMV along N (steel_gemv_nn_: at most 8 rows, a and b row-major): the grid is
// (ceil(N / 32), 1, batch) of STEEL_GEMV_SIMDGROUPS simdgroups.
template <typename T>
[[kernel]] void steel_gemv_nn(const device T* a [[buffer(STEEL_GEMM_BUF_A)]],
                              const device T* b [[buffer(STEEL_GEMM_BUF_B)]],
                              const device T* c [[buffer(STEEL_GEMM_BUF_C)]],
                              const device T* bias [[buffer(STEEL_GEMM_BUF_BIAS)]],
                              device T* out [[buffer(STEEL_GEMM_BUF_OUT)]],
                              constant GemmParams& params [[buffer(STEEL_GEMM_BUF_PARAMS)]],
                              uint3 tg [[threadgroup_position_in_grid]],
                              ushort simdgroup [[simdgroup_index_in_threadgroup]],
                              ushort lane [[thread_index_in_simdgroup]]) {
  threadgroup float4 red[kGemvSimdgroups * kGemvMaxRows * kGemvNnColGroups];
  gemv_nn_block<T>(a, b, c, bias, out, params, tg, simdgroup, lane, red);
}

// ---- Instantiations (the tile table in gemm_plan.cpp picks among these) ----------------------

#define STEEL_GEMM_KERNEL(kernel, prefix, tname, T, tr, ta, tb, bm, bn, bk, wm, wn)              \
  template [[host_name(prefix #tr "_" #tname "_bm" #bm "_bn" #bn "_bk" #bk "_wm" #wm "_wn" #wn)]] \
  [[kernel]] decltype(kernel<T, bm, bn, bk, wm, wn, ta, tb>) kernel<T, bm, bn, bk, wm, wn, ta, tb>;

#define STEEL_GEMM_TRANSPOSES(kernel, prefix, tname, T, bm, bn, bk, wm, wn)                 \
  STEEL_GEMM_KERNEL(kernel, prefix, tname, T, nn, false, false, bm, bn, bk, wm, wn)         \
  STEEL_GEMM_KERNEL(kernel, prefix, tname, T, nt, false, true, bm, bn, bk, wm, wn)          \
  STEEL_GEMM_KERNEL(kernel, prefix, tname, T, tn, true, false, bm, bn, bk, wm, wn)          \
  STEEL_GEMM_KERNEL(kernel, prefix, tname, T, tt, true, true, bm, bn, bk, wm, wn)

#define STEEL_GEMM_DTYPE(tname, T)                                                            \
  STEEL_GEMM_TRANSPOSES(steel_gemm, "steel_gemm_", tname, T, 64, 64, 32, 2, 4)                \
  STEEL_GEMM_TRANSPOSES(steel_gemm, "steel_gemm_", tname, T, 64, 64, 16, 2, 2)                \
  STEEL_GEMM_TRANSPOSES(steel_gemm, "steel_gemm_", tname, T, 32, 32, 16, 2, 2)                \
  STEEL_GEMM_TRANSPOSES(steel_gemm, "steel_gemm_", tname, T, 32, 128, 16, 1, 4)               \
  STEEL_GEMM_TRANSPOSES(steel_gemm, "steel_gemm_", tname, T, 128, 32, 16, 4, 1)               \
  STEEL_GEMM_TRANSPOSES(steel_gemm_splitk, "steel_gemm_splitk_", tname, T, 32, 32, 16, 2, 2) \
  template [[host_name("steel_gemm_splitk_reduce_" #tname)]] [[kernel]]                       \
  decltype(steel_gemm_splitk_reduce<T>) steel_gemm_splitk_reduce<T>;                         \
  template [[host_name("steel_gemv_rows_" #tname)]] [[kernel]]                                \
  decltype(steel_gemv<T, false>) steel_gemv<T, false>;                                        \
  template [[host_name("steel_gemv_cols_" #tname)]] [[kernel]]                                \
  decltype(steel_gemv<T, true>) steel_gemv<T, true>;                                          \
  template [[host_name("steel_gemv_nn_" #tname)]] [[kernel]]                                  \
  decltype(steel_gemv_nn<T>) steel_gemv_nn<T>;

STEEL_GEMM_DTYPE(f16, half)
STEEL_GEMM_DTYPE(bf16, bfloat)
STEEL_GEMM_DTYPE(f32, float)
// float32's large block steps K by 16 (gemm_plan.cpp, kLarge32).
STEEL_GEMM_TRANSPOSES(steel_gemm, "steel_gemm_", f32, float, 64, 64, 16, 2, 4)
