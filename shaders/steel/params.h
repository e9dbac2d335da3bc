// Parameter structs and constants shared by the shaders and the host planners.
//
// Compiled two ways: as MSL (by the Metal compiler, and by the simulator whose shim defines
// __METAL_VERSION__) and as plain C++17 by mps_src/plan. Both must agree on every byte, hence the
// static_asserts at the end. Only fixed-width 32-bit fields: no pointers, no size_t, no padding.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstddef>
#include <cstdint>
#endif

// ---- GEMM ------------------------------------------------------------------------------------

// Batch dims of a GEMM after the planner merges the ones it can (see gemm_plan.cpp).
#define STEEL_GEMM_MAX_BATCH_DIMS 4

// Function-constant indices of the GEMM kernels ([[function_constant(N)]] in gemm.metal).
#define STEEL_GEMM_FC_HAS_BATCH 100   // bool: batch offsets are computed from tid.z
#define STEEL_GEMM_FC_USE_C 110       // bool: beta * c is added (beta != 0 and c given)
#define STEEL_GEMM_FC_HAS_BIAS 111    // bool: bias[N] is added
#define STEEL_GEMM_FC_ACTIVATION 112  // int: a SteelActivation value
#define STEEL_GEMM_FC_ALIGN_M 200     // bool: M % BM == 0 (no edge tiles along M)
#define STEEL_GEMM_FC_ALIGN_N 201     // bool: N % BN == 0
#define STEEL_GEMM_FC_ALIGN_K 202     // bool: K % BK == 0 (no partial K step)
#define STEEL_GEMM_FC_VEC_A 210       // bool: a's rows may be read as vectors (see below)
#define STEEL_GEMM_FC_VEC_B 211       // bool: b's rows may be read as vectors

// Buffer indices of the GEMM kernels. The split-K reduction reads the partials at
// STEEL_GEMM_BUF_A and writes STEEL_GEMM_BUF_OUT.
#define STEEL_GEMM_BUF_A 0
#define STEEL_GEMM_BUF_B 1
#define STEEL_GEMM_BUF_C 2
#define STEEL_GEMM_BUF_BIAS 3
#define STEEL_GEMM_BUF_OUT 4
#define STEEL_GEMM_BUF_PARAMS 5

// Elements one thread of a GEMM block loader (shaders/steel/gemm/loader.h) copies per access:
// its share of the tile (tile_elems / threads), at most 16 bytes. The loader moves them as one
// unsigned vector of vec * elem_bytes bytes, so with STEEL_GEMM_FC_VEC_A/B set every row start
// of that operand must be a multiple of vec * elem_bytes bytes; the planner checks exactly this.
constexpr int steel_gemm_loader_vec(int tile_elems, int threads, int elem_bytes) {
  return tile_elems / threads < 16 / elem_bytes ? tile_elems / threads : 16 / elem_bytes;
}

enum SteelActivation { kSteelActNone = 0, kSteelActRelu = 1, kSteelActGelu = 2,
                       kSteelActGeluTanh = 3, kSteelActSilu = 4 };

// Everything a GEMM kernel needs at run time. Offsets and strides are in elements and fit in 32
// bits (the planner refuses larger tensors), so every index is a 32-bit multiply-add.
struct GemmParams {
  int32_t M;
  int32_t N;
  int32_t K;
  int32_t lda;          // a's stride between rows (columns if transposed) in device memory
  int32_t ldb;          // b's stride between rows (columns if transposed)
  int32_t ldd;          // out's row stride (N: out is contiguous)
  int32_t tiles_m;      // number of BM row tiles
  int32_t tiles_n;      // number of BN column tiles
  int32_t swizzle_log;  // threadgroups are swizzled in bands of 2^swizzle_log tile rows
  int32_t k_split;      // K elements per split-K partition (a multiple of BK); K when not split
  int32_t partial_stride;  // split-K: elements between two partitions' partials (M * N)
  int32_t partitions;      // split-K: number of partitions (1 when not split)
  int32_t c_rs;         // c's stride along M (0 when broadcast)
  int32_t c_cs;         // c's stride along N (0 when broadcast)
  int32_t bias_stride;  // bias's element stride
  float alpha;
  float beta;
  int32_t batch_ndim;   // merged batch dims of out (0 when there is no batch)
  int32_t batch_shape[STEEL_GEMM_MAX_BATCH_DIMS];  // outermost first
  int32_t a_batch_strides[STEEL_GEMM_MAX_BATCH_DIMS];  // 0 where a is broadcast
  int32_t b_batch_strides[STEEL_GEMM_MAX_BATCH_DIMS];
  int32_t c_batch_strides[STEEL_GEMM_MAX_BATCH_DIMS];
  int32_t out_batch_stride;  // M * N
};

static_assert(sizeof(GemmParams) == 140, "GemmParams layout changed: update both sides");
#ifndef __METAL_VERSION__
static_assert(offsetof(GemmParams, alpha) == 60, "GemmParams.alpha moved");
static_assert(offsetof(GemmParams, batch_ndim) == 68, "GemmParams.batch_ndim moved");
static_assert(offsetof(GemmParams, batch_shape) == 72, "GemmParams.batch_shape moved");
static_assert(offsetof(GemmParams, c_batch_strides) == 120, "GemmParams.c_batch_strides moved");
static_assert(offsetof(GemmParams, out_batch_stride) == 136, "GemmParams.out_batch_stride moved");
#endif
