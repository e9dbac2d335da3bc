// Steel GEMM kernels on Metal 4's matmul2d (M5-generation GPUs), MSL 4.0: compiled into their
// own metallib with -std=metal4.0 (mps_src/mps/build_macos.py) and planned only for devices
// that report Metal 4 and the Apple10 family (mps_src/plan/gemm_plan.cpp). The split-K
// reduction is gemm.metal's steel_gemm_splitk_reduce_<dtype>.
//
// Host names: steel_gemm_tensor_<ta><tb>_<dtype>_bm<BM>_bn<BN>_bk<BK>_sg<SG> and
// steel_gemm_tensor_splitk_... (first pass: fp32 partials of one K slice per tg.z).
#include <metal_stdlib>

#include "../params.h"
#include "gemm_tensor.h"

using namespace metal;
using namespace steel;

template <typename T, int BM, int BN, int BK, int SG, bool kTransA, bool kTransB>
[[kernel]] void steel_gemm_tensor(const device T* a [[buffer(STEEL_GEMM_BUF_A)]],
                                  const device T* b [[buffer(STEEL_GEMM_BUF_B)]],
                                  const device T* c [[buffer(STEEL_GEMM_BUF_C)]],
                                  const device T* bias [[buffer(STEEL_GEMM_BUF_BIAS)]],
                                  device T* out [[buffer(STEEL_GEMM_BUF_OUT)]],
                                  constant GemmParams& params [[buffer(STEEL_GEMM_BUF_PARAMS)]],
                                  uint3 tg [[threadgroup_position_in_grid]]) {
  gemm_tensor_block<T, BM, BN, BK, SG, kTransA, kTransB, T, false>(a, b, c, bias, out, params,
                                                                   tg);
}

template <typename T, int BM, int BN, int BK, int SG, bool kTransA, bool kTransB>
[[kernel]] void steel_gemm_tensor_splitk(const device T* a [[buffer(STEEL_GEMM_BUF_A)]],
                                         const device T* b [[buffer(STEEL_GEMM_BUF_B)]],
                                         device float* partials [[buffer(STEEL_GEMM_BUF_OUT)]],
                                         constant GemmParams& params
                                         [[buffer(STEEL_GEMM_BUF_PARAMS)]],
                                         uint3 tg [[threadgroup_position_in_grid]]) {
  // c and bias are not read without an epilogue; `a` stands in for them.
  gemm_tensor_block<T, BM, BN, BK, SG, kTransA, kTransB, float, true>(a, b, a, a, partials,
                                                                      params, tg);
}

// ---- Instantiations (gemm_plan.cpp's kTensorTile) --------------------------------------------

#define STEEL_GEMM_TENSOR_KERNEL(kernel, prefix, tname, T, tr, ta, tb, bm, bn, bk, sg)          \
  template [[host_name(prefix #tr "_" #tname "_bm" #bm "_bn" #bn "_bk" #bk "_sg" #sg)]]        \
  [[kernel]] decltype(kernel<T, bm, bn, bk, sg, ta, tb>) kernel<T, bm, bn, bk, sg, ta, tb>;

#define STEEL_GEMM_TENSOR_TRANSPOSES(kernel, prefix, tname, T, bm, bn, bk, sg)             \
  STEEL_GEMM_TENSOR_KERNEL(kernel, prefix, tname, T, nn, false, false, bm, bn, bk, sg)     \
  STEEL_GEMM_TENSOR_KERNEL(kernel, prefix, tname, T, nt, false, true, bm, bn, bk, sg)      \
  STEEL_GEMM_TENSOR_KERNEL(kernel, prefix, tname, T, tn, true, false, bm, bn, bk, sg)      \
  STEEL_GEMM_TENSOR_KERNEL(kernel, prefix, tname, T, tt, true, true, bm, bn, bk, sg)

#define STEEL_GEMM_TENSOR_DTYPE(tname, T)                                                    \
  STEEL_GEMM_TENSOR_TRANSPOSES(steel_gemm_tensor, "steel_gemm_tensor_", tname, T, 64, 64, 32, 4) \
  STEEL_GEMM_TENSOR_TRANSPOSES(steel_gemm_tensor_splitk, "steel_gemm_tensor_splitk_", tname, T, \
                               64, 64, 32, 4)

STEEL_GEMM_TENSOR_DTYPE(f16, half)
STEEL_GEMM_TENSOR_DTYPE(bf16, bfloat)
