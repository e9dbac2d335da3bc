// The GEMM kernels' function constants (indices in params.h), shared by the simdgroup kernels
// (gemm.h) and the matmul2d kernels (../gemm_tensor/gemm_tensor.h): the planner sets the same
// values for both, and Metal specializes them away.
#pragma once

#include <metal_stdlib>

#include "../params.h"

using namespace metal;

constant bool gemm_has_batch [[function_constant(STEEL_GEMM_FC_HAS_BATCH)]];
constant bool gemm_use_c [[function_constant(STEEL_GEMM_FC_USE_C)]];
constant bool gemm_has_bias [[function_constant(STEEL_GEMM_FC_HAS_BIAS)]];
constant int gemm_activation [[function_constant(STEEL_GEMM_FC_ACTIVATION)]];
constant bool gemm_align_m [[function_constant(STEEL_GEMM_FC_ALIGN_M)]];
constant bool gemm_align_n [[function_constant(STEEL_GEMM_FC_ALIGN_N)]];
constant bool gemm_align_k [[function_constant(STEEL_GEMM_FC_ALIGN_K)]];
// The simdgroup kernels' vector loads only (gemm/loader.h).
constant bool gemm_vec_a [[function_constant(STEEL_GEMM_FC_VEC_A)]];
constant bool gemm_vec_b [[function_constant(STEEL_GEMM_FC_VEC_B)]];
