// Steel attention decode kernels (decode.h): the one-pass / split-K partial kernel with GQA
// packing, dense, varlen or over a paged KV cache, with K and V in the compute dtype or quantized
// (STEEL_ATTN_FC_QUANT: int8 / 4-bit codes, their scales and mins at buffers 14 .. 18), and the
// log-sum-exp merge of the partials.
//
// Host names: steel_attention_decode_<dtype>_e<DE>_v<DV> over the head-dim pairs of
// attention.metal (the same table in attention_plan.cpp picks among them), and
// steel_attention_decode_merge_<dtype>. The optional buffers exist only in the pipelines whose
// function constants use them (a paged pipeline has cu_seqlens_k bound, to cu_seqlens_q, and
// never reads it: a buffer's function_constant must name one constant, not an expression).
#include <metal_stdlib>

#include "../params.h"
#include "decode.h"

using namespace metal;
using namespace steel;

template <typename T, short DE, short DV>
[[kernel]] void steel_attention_decode(
    const device T* q [[buffer(STEEL_ATTN_BUF_Q)]],
    const device T* k [[buffer(STEEL_ATTN_BUF_K)]],
    const device T* v [[buffer(STEEL_ATTN_BUF_V)]],
    const device uchar* mask [[buffer(STEEL_ATTN_BUF_MASK)]],
    const device uchar* sinks [[buffer(STEEL_ATTN_BUF_SINKS)]],
    device T* out [[buffer(STEEL_ATTN_BUF_OUT)]],
    device float* lse [[buffer(STEEL_ATTN_BUF_LSE)]],
    constant AttnDecodeParams& params [[buffer(STEEL_ATTN_BUF_PARAMS)]],
    const device int* cu_q [[buffer(STEEL_ATTN_BUF_CU_Q), function_constant(attn_varlen)]],
    const device int* cu_k [[buffer(STEEL_ATTN_BUF_CU_K), function_constant(attn_varlen)]],
    const device int* table [[buffer(STEEL_ATTN_BUF_TABLE), function_constant(attn_paged)]],
    const device int* seqused [[buffer(STEEL_ATTN_BUF_SEQUSED), function_constant(attn_paged)]],
    device float* part_o [[buffer(STEEL_ATTN_BUF_PART_O), function_constant(attn_split)]],
    device float* part_ml [[buffer(STEEL_ATTN_BUF_PART_ML), function_constant(attn_split)]],
    const device uchar* k_scales [[buffer(STEEL_ATTN_BUF_K_SCALES), function_constant(attn_quant)]],
    const device uchar* k_mins [[buffer(STEEL_ATTN_BUF_K_MINS), function_constant(attn_quant)]],
    const device uchar* v_scales [[buffer(STEEL_ATTN_BUF_V_SCALES), function_constant(attn_quant)]],
    const device uchar* v_mins [[buffer(STEEL_ATTN_BUF_V_MINS), function_constant(attn_quant)]],
    constant AttnQuantParams* qparams [[buffer(STEEL_ATTN_BUF_QUANT_PARAMS),
                                        function_constant(attn_quant)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort simdgroup [[simdgroup_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]]) {
  threadgroup T smem[AttnForward<T, DE, DV>::kTileElems];
  const AttnQuantBuffers qb = {k_scales, k_mins, v_scales, v_mins, qparams};
  attention_decode_block<T, DE, DV>(q, k, v, mask, sinks, out, lse, cu_q, cu_k, table, seqused,
                                    part_o, part_ml, qb, params, smem, tg, simdgroup, lane);
}

template <typename T>
[[kernel]] void steel_attention_decode_merge(
    const device uchar* sinks [[buffer(STEEL_ATTN_BUF_SINKS)]],
    device T* out [[buffer(STEEL_ATTN_BUF_OUT)]],
    device float* lse [[buffer(STEEL_ATTN_BUF_LSE)]],
    constant AttnDecodeParams& params [[buffer(STEEL_ATTN_BUF_PARAMS)]],
    const device int* cu_q [[buffer(STEEL_ATTN_BUF_CU_Q), function_constant(attn_varlen)]],
    const device float* part_o [[buffer(STEEL_ATTN_BUF_PART_O)]],
    const device float* part_ml [[buffer(STEEL_ATTN_BUF_PART_ML)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_simdgroup]]) {
  attention_decode_merge<T>(sinks, out, lse, cu_q, part_o, part_ml, params, tg, lane);
}

// ---- Instantiations (the head-dim table in attention_plan.cpp picks among these) -------------

#define STEEL_DECODE_KERNEL(tname, T, de, dv)                                            \
  template [[host_name("steel_attention_decode_" #tname "_e" #de "_v" #dv)]] [[kernel]] \
  decltype(steel_attention_decode<T, de, dv>) steel_attention_decode<T, de, dv>;

#define STEEL_DECODE_DTYPE(tname, T)                                                \
  STEEL_DECODE_KERNEL(tname, T, 32, 32)                                             \
  STEEL_DECODE_KERNEL(tname, T, 40, 40)                                             \
  STEEL_DECODE_KERNEL(tname, T, 64, 64)                                             \
  STEEL_DECODE_KERNEL(tname, T, 72, 72)                                             \
  STEEL_DECODE_KERNEL(tname, T, 80, 80)                                             \
  STEEL_DECODE_KERNEL(tname, T, 96, 96)                                             \
  STEEL_DECODE_KERNEL(tname, T, 128, 128)                                           \
  STEEL_DECODE_KERNEL(tname, T, 160, 160)                                           \
  STEEL_DECODE_KERNEL(tname, T, 192, 128)                                           \
  STEEL_DECODE_KERNEL(tname, T, 192, 192)                                           \
  STEEL_DECODE_KERNEL(tname, T, 256, 256)                                           \
  STEEL_DECODE_KERNEL(tname, T, 512, 512)                                           \
  STEEL_DECODE_KERNEL(tname, T, 576, 512)                                           \
  STEEL_DECODE_KERNEL(tname, T, 576, 576)                                           \
  template [[host_name("steel_attention_decode_merge_" #tname)]] [[kernel]]         \
  decltype(steel_attention_decode_merge<T>) steel_attention_decode_merge<T>;

STEEL_DECODE_DTYPE(f16, half)
STEEL_DECODE_DTYPE(bf16, bfloat)
STEEL_DECODE_DTYPE(f32, float)
