// Steel attention kernels: the prefill forward (flash attention with every F.sdpa option and the
// extensions of torch_steel.sdpa; see forward.h), dense or over packed variable-length sequences
// (STEEL_ATTN_FC_VARLEN, which also makes the cu_seqlens buffers present), with K and V in the
// compute dtype or quantized (STEEL_ATTN_FC_QUANT, which makes buffers 14 .. 18 present).
//
// Host names: steel_attention_<dtype>_e<DE>_v<DV>, DE the head dim of q and k and DV that of v
// as instantiated below; other head dims run on the next larger instantiation with bounded
// head-dim loads (STEEL_ATTN_FC_ALIGN_E / _EV). mps_src/plan/attention_plan.cpp builds these
// names from the same list.
#include <metal_stdlib>

#include "../params.h"
#include "forward.h"

using namespace metal;
using namespace steel;

template <typename T, short DE, short DV>
[[kernel]] void steel_attention(const device T* q [[buffer(STEEL_ATTN_BUF_Q)]],
                                const device T* k [[buffer(STEEL_ATTN_BUF_K)]],
                                const device T* v [[buffer(STEEL_ATTN_BUF_V)]],
                                const device uchar* mask [[buffer(STEEL_ATTN_BUF_MASK)]],
                                const device uchar* sinks [[buffer(STEEL_ATTN_BUF_SINKS)]],
                                device T* out [[buffer(STEEL_ATTN_BUF_OUT)]],
                                device float* lse [[buffer(STEEL_ATTN_BUF_LSE)]],
                                constant AttnParams& params [[buffer(STEEL_ATTN_BUF_PARAMS)]],
                                const device int* cu_q [[buffer(STEEL_ATTN_BUF_CU_Q),
                                                         function_constant(attn_varlen)]],
                                const device int* cu_k [[buffer(STEEL_ATTN_BUF_CU_K),
                                                         function_constant(attn_varlen)]],
                                const device uchar* k_scales [[buffer(STEEL_ATTN_BUF_K_SCALES),
                                                               function_constant(attn_quant)]],
                                const device uchar* k_mins [[buffer(STEEL_ATTN_BUF_K_MINS),
                                                             function_constant(attn_quant)]],
                                const device uchar* v_scales [[buffer(STEEL_ATTN_BUF_V_SCALES),
                                                               function_constant(attn_quant)]],
                                const device uchar* v_mins [[buffer(STEEL_ATTN_BUF_V_MINS),
                                                             function_constant(attn_quant)]],
                                constant AttnQuantParams* qparams
                                [[buffer(STEEL_ATTN_BUF_QUANT_PARAMS),
                                  function_constant(attn_quant)]],
                                uint3 tg [[threadgroup_position_in_grid]],
                                ushort simdgroup [[simdgroup_index_in_threadgroup]],
                                ushort lane [[thread_index_in_simdgroup]]) {
  threadgroup T smem[AttnForward<T, DE, DV, true>::kTileElems];  // the prefill's K/V buffer
  const AttnQuantBuffers qb = {k_scales, k_mins, v_scales, v_mins, qparams};
  attention_forward_block<T, DE, DV>(q, k, v, mask, sinks, out, lse, cu_q, cu_k, qb, params, smem,
                                     tg, simdgroup, lane);
}

// ---- Instantiations (the head-dim table in attention_plan.cpp picks among these) -------------

#define STEEL_ATTN_KERNEL(tname, T, de, dv)                               \
  template [[host_name("steel_attention_" #tname "_e" #de "_v" #dv)]] [[kernel]] \
  decltype(steel_attention<T, de, dv>) steel_attention<T, de, dv>;

#define STEEL_ATTN_DTYPE(tname, T)      \
  STEEL_ATTN_KERNEL(tname, T, 32, 32)   \
  STEEL_ATTN_KERNEL(tname, T, 40, 40)   \
  STEEL_ATTN_KERNEL(tname, T, 64, 64)   \
  STEEL_ATTN_KERNEL(tname, T, 72, 72)   \
  STEEL_ATTN_KERNEL(tname, T, 80, 80)   \
  STEEL_ATTN_KERNEL(tname, T, 96, 96)   \
  STEEL_ATTN_KERNEL(tname, T, 128, 128) \
  STEEL_ATTN_KERNEL(tname, T, 160, 160) \
  STEEL_ATTN_KERNEL(tname, T, 192, 128) \
  STEEL_ATTN_KERNEL(tname, T, 192, 192) \
  STEEL_ATTN_KERNEL(tname, T, 256, 256) \
  STEEL_ATTN_KERNEL(tname, T, 512, 512) \
  STEEL_ATTN_KERNEL(tname, T, 576, 512) \
  STEEL_ATTN_KERNEL(tname, T, 576, 576)

STEEL_ATTN_DTYPE(f16, half)
STEEL_ATTN_DTYPE(bf16, bfloat)
STEEL_ATTN_DTYPE(f32, float)
