// Steel attention prefill forward on Metal 4's matmul2d (M5-generation GPUs), MSL 4.0: compiled
// into the tensor-op metallib with -std=metal4.0 (mps_src/mps/build_macos.py) and planned only
// for devices that report Metal 4 and the Apple10 family (mps_src/plan/attention_plan.cpp,
// attn::tensor_serves), f16 and bf16, at the head-dim pairs below; every other call keeps the
// simdgroup kernels of ../attn/attention.metal, whose buffers, function constants and
// AttnParams these kernels share (see forward_tensor.h).
//
// Host names: steel_attention_tensor_<dtype>_e<DE>_v<DV>.
#include <metal_stdlib>

#include "../params.h"
#include "forward_tensor.h"

using namespace metal;
using namespace steel;

template <typename T, short DE, short DV>
[[kernel]] void steel_attention_tensor(const device T* q [[buffer(STEEL_ATTN_BUF_Q)]],
                                       const device T* k [[buffer(STEEL_ATTN_BUF_K)]],
                                       const device T* v [[buffer(STEEL_ATTN_BUF_V)]],
                                       const device uchar* mask [[buffer(STEEL_ATTN_BUF_MASK)]],
                                       const device uchar* sinks [[buffer(STEEL_ATTN_BUF_SINKS)]],
                                       device T* out [[buffer(STEEL_ATTN_BUF_OUT)]],
                                       device float* lse [[buffer(STEEL_ATTN_BUF_LSE)]],
                                       constant AttnParams& params
                                       [[buffer(STEEL_ATTN_BUF_PARAMS)]],
                                       const device int* cu_q [[buffer(STEEL_ATTN_BUF_CU_Q),
                                                                function_constant(attn_varlen)]],
                                       const device int* cu_k [[buffer(STEEL_ATTN_BUF_CU_K),
                                                                function_constant(attn_varlen)]],
                                       uint3 tg [[threadgroup_position_in_grid]]) {
  threadgroup T p_mem[STEEL_ATTN_TENSOR_BQ * STEEL_ATTN_TENSOR_BK];
  threadgroup float row_mem[STEEL_ATTN_TENSOR_BQ];
  attention_tensor_block<T, DE, DV>(q, k, v, mask, sinks, out, lse, cu_q, cu_k, params, p_mem,
                                    row_mem, tg);
}

// ---- Instantiations (attention_plan.cpp's kTensorHeadDims) -----------------------------------

#define STEEL_ATTN_TENSOR_KERNEL(tname, T, de, dv)                                      \
  template [[host_name("steel_attention_tensor_" #tname "_e" #de "_v" #dv)]] [[kernel]] \
  decltype(steel_attention_tensor<T, de, dv>) steel_attention_tensor<T, de, dv>;

#define STEEL_ATTN_TENSOR_DTYPE(tname, T)       \
  STEEL_ATTN_TENSOR_KERNEL(tname, T, 64, 64)   \
  STEEL_ATTN_TENSOR_KERNEL(tname, T, 96, 96)   \
  STEEL_ATTN_TENSOR_KERNEL(tname, T, 128, 128) \
  STEEL_ATTN_TENSOR_KERNEL(tname, T, 256, 256)

STEEL_ATTN_TENSOR_DTYPE(f16, half)
STEEL_ATTN_TENSOR_DTYPE(bf16, bfloat)
