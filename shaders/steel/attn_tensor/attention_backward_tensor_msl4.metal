// Steel attention backward on Metal 4's matmul2d (M5-generation GPUs), MSL 4.0: the dK/dV, dQ
// and dmask kernels of backward_tensor.h, planned (mps_src/plan/attention_backward_plan.cpp,
// varlen_plan.cpp) exactly where the forward runs on matmul2d (attn::tensor_serves): f16 and
// bf16 at the (D, D) pairs below. The delta pre-pass and dsinks stay the simdgroup kernels of
// ../attn/attention_backward.metal, whose buffers, function constants and AttnBackwardParams
// these share.
//
// Host names: steel_attention_bwd_tensor_dkdv_<dtype>_e<D>_v<D>,
// steel_attention_bwd_tensor_dq_<dtype>_e<D>_v<D>,
// steel_attention_bwd_tensor_dmask_<dtype>_e<D>_v<D>.
#include <metal_stdlib>

#include "../params.h"
#include "backward_tensor.h"

using namespace metal;
using namespace steel;

template <typename T, short D>
[[kernel]] void steel_attention_bwd_tensor_dkdv(
    const device T* q [[buffer(STEEL_ATTN_BUF_Q)]], const device T* k [[buffer(STEEL_ATTN_BUF_K)]],
    const device T* v [[buffer(STEEL_ATTN_BUF_V)]],
    const device uchar* mask [[buffer(STEEL_ATTN_BUF_MASK)]],
    const device T* grad_out [[buffer(STEEL_ATTN_BUF_GRAD_OUT)]],
    const device float* lse [[buffer(STEEL_ATTN_BUF_FWD_LSE)]],
    const device float* delta [[buffer(STEEL_ATTN_BUF_DELTA)]],
    device T* dk [[buffer(STEEL_ATTN_BUF_DK)]], device T* dv [[buffer(STEEL_ATTN_BUF_DV)]],
    const device int* cu_q [[buffer(STEEL_ATTN_BUF_BWD_CU_Q), function_constant(attn_varlen)]],
    const device int* cu_k [[buffer(STEEL_ATTN_BUF_BWD_CU_K), function_constant(attn_varlen)]],
    constant AttnBackwardParams& params [[buffer(STEEL_ATTN_BUF_BWD_PARAMS)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort thread_index [[thread_index_in_threadgroup]]) {
  threadgroup T p_mem[steel_attn_tensor_bwd_keys(D) * STEEL_ATTN_TENSOR_BK];
  threadgroup T ds_mem[steel_attn_tensor_bwd_keys(D) * STEEL_ATTN_TENSOR_BK];
  threadgroup float stats[3 * STEEL_ATTN_TENSOR_BK];
  attention_bwd_tensor_dkdv_block<T, D>(q, k, v, mask, grad_out, lse, delta, dk, dv, cu_q, cu_k,
                                        params, p_mem, ds_mem, stats, tg, thread_index);
}

template <typename T, short D>
[[kernel]] void steel_attention_bwd_tensor_dq(
    const device T* q [[buffer(STEEL_ATTN_BUF_Q)]], const device T* k [[buffer(STEEL_ATTN_BUF_K)]],
    const device T* v [[buffer(STEEL_ATTN_BUF_V)]],
    const device uchar* mask [[buffer(STEEL_ATTN_BUF_MASK)]],
    const device T* grad_out [[buffer(STEEL_ATTN_BUF_GRAD_OUT)]],
    const device float* lse [[buffer(STEEL_ATTN_BUF_FWD_LSE)]],
    const device float* delta [[buffer(STEEL_ATTN_BUF_DELTA)]],
    device T* dq [[buffer(STEEL_ATTN_BUF_DQ)]],
    const device int* cu_q [[buffer(STEEL_ATTN_BUF_BWD_CU_Q), function_constant(attn_varlen)]],
    const device int* cu_k [[buffer(STEEL_ATTN_BUF_BWD_CU_K), function_constant(attn_varlen)]],
    constant AttnBackwardParams& params [[buffer(STEEL_ATTN_BUF_BWD_PARAMS)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort thread_index [[thread_index_in_threadgroup]]) {
  threadgroup T ds_mem[STEEL_ATTN_TENSOR_BQ * STEEL_ATTN_TENSOR_BK];
  threadgroup float stats[3 * STEEL_ATTN_TENSOR_BQ];
  attention_bwd_tensor_dq_block<T, D>(q, k, v, mask, grad_out, lse, delta, dq, cu_q, cu_k, params,
                                      ds_mem, stats, tg, thread_index);
}

template <typename T, short D>
[[kernel]] void steel_attention_bwd_tensor_dmask(
    const device T* q [[buffer(STEEL_ATTN_BUF_Q)]], const device T* k [[buffer(STEEL_ATTN_BUF_K)]],
    const device T* v [[buffer(STEEL_ATTN_BUF_V)]],
    const device uchar* mask [[buffer(STEEL_ATTN_BUF_MASK)]],
    const device T* grad_out [[buffer(STEEL_ATTN_BUF_GRAD_OUT)]],
    const device float* lse [[buffer(STEEL_ATTN_BUF_FWD_LSE)]],
    const device float* delta [[buffer(STEEL_ATTN_BUF_DELTA)]],
    device uchar* dmask [[buffer(STEEL_ATTN_BUF_DMASK)]],
    constant AttnBackwardParams& params [[buffer(STEEL_ATTN_BUF_BWD_PARAMS)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort thread_index [[thread_index_in_threadgroup]]) {
  threadgroup float red[STEEL_ATTN_TENSOR_BQ * STEEL_ATTN_TENSOR_BK];
  threadgroup float stats[3 * STEEL_ATTN_TENSOR_BQ];
  attention_bwd_tensor_dmask_block<T, D>(q, k, v, mask, grad_out, lse, delta, dmask, params, red,
                                         stats, tg, thread_index);
}

// ---- Instantiations (attention_plan.cpp's kTensorHeadDims) -----------------------------------

#define STEEL_ATTN_BWD_TENSOR_KERNELS(tname, T, d)                                             \
  template [[host_name("steel_attention_bwd_tensor_dkdv_" #tname "_e" #d "_v" #d)]] [[kernel]] \
  decltype(steel_attention_bwd_tensor_dkdv<T, d>) steel_attention_bwd_tensor_dkdv<T, d>;       \
  template [[host_name("steel_attention_bwd_tensor_dq_" #tname "_e" #d "_v" #d)]] [[kernel]]   \
  decltype(steel_attention_bwd_tensor_dq<T, d>) steel_attention_bwd_tensor_dq<T, d>;           \
  template [[host_name("steel_attention_bwd_tensor_dmask_" #tname "_e" #d "_v" #d)]] [[kernel]] \
  decltype(steel_attention_bwd_tensor_dmask<T, d>) steel_attention_bwd_tensor_dmask<T, d>;

#define STEEL_ATTN_BWD_TENSOR_DTYPE(tname, T)   \
  STEEL_ATTN_BWD_TENSOR_KERNELS(tname, T, 64)  \
  STEEL_ATTN_BWD_TENSOR_KERNELS(tname, T, 96)  \
  STEEL_ATTN_BWD_TENSOR_KERNELS(tname, T, 128) \
  STEEL_ATTN_BWD_TENSOR_KERNELS(tname, T, 256)

STEEL_ATTN_BWD_TENSOR_DTYPE(f16, half)
STEEL_ATTN_BWD_TENSOR_DTYPE(bf16, bfloat)
