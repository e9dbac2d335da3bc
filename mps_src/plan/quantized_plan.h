// Launch planning for attention over quantized K/V (torch_steel.kv): the planners of
// "sdpa_quantized" and "sdpa_varlen_quantized" (quantized_plan.cpp), and the function constants
// that every attention forward and decode pipeline carries (params.h, STEEL_ATTN_FC_QUANT).
#pragma once

#include <string>
#include <vector>

#include "plan.h"

namespace steel {
namespace attn {

// One operand's format, as torch_steel.kv.FORMATS names it: bits 8 (int8 codes) or 4 (two
// 4-bit codes per byte, with mins), values per scale (0: the whole row), scale dtype.
struct QuantFormat {
  int bits = 0;  // 0: not quantized
  int group = 0;
  bool scale_f32 = false;
};

// The quantization constants of a pipeline: STEEL_ATTN_FC_QUANT and K's and V's formats (all
// off for an unquantized call, k and v null). attn::dispatch appends them to every forward
// and decode pipeline; the quantized planners rewrite them.
std::vector<FunctionConstant> quant_constants(const QuantFormat* k, const QuantFormat* v,
                                              int64_t E, int64_t Ev);

}  // namespace attn

// tensors [q, k, k_scales, k_mins, v, v_scales, v_mins, attn_mask, sinks]: sdpa's, with k and
// v int8 [*batch, Hkv, S, E] (uint8 [..., E / 2] for 4-bit formats), their scales (and mins,
// absent for int8) [*batch, Hkv, S, E / group] float16 or float32; options sdpa's plus the
// strings k_format and v_format. Outputs as sdpa's.
Plan plan_attention_quantized(const TensorList& tensors, const Options& options);

// tensors [q, k, k_scales, k_mins, v, v_scales, v_mins, cu_seqlens_q, cu_seqlens_k, sinks,
// block_table, seqused_k]: sdpa_varlen's (packed, or a paged cache) with quantized k and v.
Plan plan_attention_varlen_quantized(const TensorList& tensors, const Options& options);

}  // namespace steel
