// Steel attention backward kernels (see backward.h): the delta pre-pass, dK/dV, dQ, dmask and
// dsinks, dense or over packed variable-length sequences (STEEL_ATTN_FC_VARLEN, which also makes
// the cu_seqlens buffers of the first three present).
//
// Host names: steel_attention_bwd_delta_<dtype>, steel_attention_bwd_dkdv_<dtype>_e<DE>_v<DV>,
// steel_attention_bwd_dq_<dtype>_e<DE>_v<DV>, steel_attention_bwd_dmask_<dtype>_e<DE>_v<DV>,
// steel_attention_bwd_dsinks_<dtype>. The head-dim pairs are the forward's (attention.metal)
// (params.h's steel_attn_bwd_bk gives each its backward tile; steel_attn_bwd_shared and, for the
// dQ and dmask kernels, steel_attn_bwd_dq_shared say where its two tiles share one buffer).
#include <metal_stdlib>

#include "../params.h"
#include "backward.h"

using namespace metal;
using namespace steel;

template <typename T>
[[kernel]] void steel_attention_bwd_delta(
    const device T* q [[buffer(STEEL_ATTN_BUF_Q)]], const device T* k [[buffer(STEEL_ATTN_BUF_K)]],
    const device uchar* mask [[buffer(STEEL_ATTN_BUF_MASK)]],
    const device uchar* sinks [[buffer(STEEL_ATTN_BUF_SINKS)]],
    const device T* grad_out [[buffer(STEEL_ATTN_BUF_GRAD_OUT)]],
    const device T* out [[buffer(STEEL_ATTN_BUF_FWD_OUT)]],
    const device float* lse [[buffer(STEEL_ATTN_BUF_FWD_LSE)]],
    const device float* grad_lse [[buffer(STEEL_ATTN_BUF_GRAD_LSE)]],
    device float* delta [[buffer(STEEL_ATTN_BUF_DELTA)]],
    const device int* cu_q [[buffer(STEEL_ATTN_BUF_BWD_CU_Q), function_constant(attn_varlen)]],
    const device int* cu_k [[buffer(STEEL_ATTN_BUF_BWD_CU_K), function_constant(attn_varlen)]],
    constant AttnBackwardParams& params [[buffer(STEEL_ATTN_BUF_BWD_PARAMS)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort simdgroup [[simdgroup_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]]) {
  attention_bwd_delta<T>(q, k, mask, sinks, grad_out, out, lse, grad_lse, delta, cu_q, cu_k,
                         params, tg, simdgroup, lane);
}

template <typename T, short DE, short DV>
[[kernel]] void steel_attention_bwd_dkdv(
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
    ushort simdgroup [[simdgroup_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]]) {
  threadgroup T smem[AttnBackward<T, DE, DV>::kTileElems];
  threadgroup float stats[AttnBackward<T, DE, DV>::kStats];
  attention_bwd_dkdv_block<T, DE, DV>(q, k, v, mask, grad_out, lse, delta, dk, dv, cu_q, cu_k,
                                      params, smem, stats, tg, simdgroup, lane);
}

template <typename T, short DE, short DV>
[[kernel]] void steel_attention_bwd_dq(
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
    ushort simdgroup [[simdgroup_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]]) {
  threadgroup T smem[AttnBackward<T, DE, DV, true>::kTileElems];
  attention_bwd_dq_block<T, DE, DV>(q, k, v, mask, grad_out, lse, delta, dq, cu_q, cu_k, params,
                                    smem, tg, simdgroup, lane);
}

template <typename T, short DE, short DV>
[[kernel]] void steel_attention_bwd_dmask(
    const device T* q [[buffer(STEEL_ATTN_BUF_Q)]], const device T* k [[buffer(STEEL_ATTN_BUF_K)]],
    const device T* v [[buffer(STEEL_ATTN_BUF_V)]],
    const device uchar* mask [[buffer(STEEL_ATTN_BUF_MASK)]],
    const device T* grad_out [[buffer(STEEL_ATTN_BUF_GRAD_OUT)]],
    const device float* lse [[buffer(STEEL_ATTN_BUF_FWD_LSE)]],
    const device float* delta [[buffer(STEEL_ATTN_BUF_DELTA)]],
    device uchar* dmask [[buffer(STEEL_ATTN_BUF_DMASK)]],
    constant AttnBackwardParams& params [[buffer(STEEL_ATTN_BUF_BWD_PARAMS)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort simdgroup [[simdgroup_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]]) {
  threadgroup T smem[AttnBackward<T, DE, DV, true>::kTileElems];
  threadgroup float red[STEEL_ATTN_SIMDGROUPS * AttnBackward<T, DE, DV, true>::BK];
  attention_bwd_dmask_block<T, DE, DV>(q, k, v, mask, grad_out, lse, delta, dmask, params, smem,
                                       red, tg, simdgroup, lane);
}

template <typename T>
[[kernel]] void steel_attention_bwd_dsinks(
    const device float* lse [[buffer(STEEL_ATTN_BUF_FWD_LSE)]],
    const device float* delta [[buffer(STEEL_ATTN_BUF_DELTA)]],
    const device uchar* sinks [[buffer(STEEL_ATTN_BUF_SINKS)]],
    device uchar* dsinks [[buffer(STEEL_ATTN_BUF_DSINKS)]],
    constant AttnBackwardParams& params [[buffer(STEEL_ATTN_BUF_BWD_PARAMS)]],
    uint3 tg [[threadgroup_position_in_grid]], ushort lane [[thread_index_in_simdgroup]]) {
  attention_bwd_dsinks<T>(lse, delta, sinks, dsinks, params, tg, lane);
}

// ---- Instantiations (the planner's head-dim table picks among these) -------------------------

#define STEEL_ATTN_BWD_PAIR(tname, T, de, dv)                                              \
  template [[host_name("steel_attention_bwd_dkdv_" #tname "_e" #de "_v" #dv)]] [[kernel]] \
  decltype(steel_attention_bwd_dkdv<T, de, dv>) steel_attention_bwd_dkdv<T, de, dv>;     \
  template [[host_name("steel_attention_bwd_dq_" #tname "_e" #de "_v" #dv)]] [[kernel]]   \
  decltype(steel_attention_bwd_dq<T, de, dv>) steel_attention_bwd_dq<T, de, dv>;         \
  template [[host_name("steel_attention_bwd_dmask_" #tname "_e" #de "_v" #dv)]] [[kernel]] \
  decltype(steel_attention_bwd_dmask<T, de, dv>) steel_attention_bwd_dmask<T, de, dv>;

#define STEEL_ATTN_BWD_DTYPE(tname, T)                                                        \
  template [[host_name("steel_attention_bwd_delta_" #tname)]] [[kernel]]                      \
  decltype(steel_attention_bwd_delta<T>) steel_attention_bwd_delta<T>;                        \
  template [[host_name("steel_attention_bwd_dsinks_" #tname)]] [[kernel]]                     \
  decltype(steel_attention_bwd_dsinks<T>) steel_attention_bwd_dsinks<T>;                      \
  STEEL_ATTN_BWD_PAIR(tname, T, 32, 32)                                                       \
  STEEL_ATTN_BWD_PAIR(tname, T, 40, 40)                                                       \
  STEEL_ATTN_BWD_PAIR(tname, T, 64, 64)                                                       \
  STEEL_ATTN_BWD_PAIR(tname, T, 72, 72)                                                       \
  STEEL_ATTN_BWD_PAIR(tname, T, 80, 80)                                                       \
  STEEL_ATTN_BWD_PAIR(tname, T, 96, 96)                                                       \
  STEEL_ATTN_BWD_PAIR(tname, T, 128, 128)

#define STEEL_ATTN_BWD_WIDE(tname, T)     \
  STEEL_ATTN_BWD_PAIR(tname, T, 160, 160) \
  STEEL_ATTN_BWD_PAIR(tname, T, 192, 128) \
  STEEL_ATTN_BWD_PAIR(tname, T, 192, 192) \
  STEEL_ATTN_BWD_PAIR(tname, T, 256, 256)

STEEL_ATTN_BWD_DTYPE(f16, half)
STEEL_ATTN_BWD_WIDE(f16, half)
STEEL_ATTN_BWD_PAIR(f16, half, 512, 512)
STEEL_ATTN_BWD_DTYPE(bf16, bfloat)
STEEL_ATTN_BWD_WIDE(bf16, bfloat)
STEEL_ATTN_BWD_PAIR(bf16, bfloat, 512, 512)
STEEL_ATTN_BWD_DTYPE(f32, float)
STEEL_ATTN_BWD_WIDE(f32, float)
STEEL_ATTN_BWD_PAIR(f32, float, 512, 512)
