// Steel attention vector decode kernel (decode_vector.h): decode.metal's launch and buffers
// without MMAs, for decode blocks of few real rows. Its split partitions go to
// steel_attention_decode_merge_<dtype> (decode.metal).
//
// Host names: steel_attention_decode_vector_<dtype>_e<DE>_v<DV> over decode.metal's head-dim
// pairs (the planner picks among them by attention_plan.cpp's table).
#include <metal_stdlib>

#include "../params.h"
#include "decode_vector.h"

using namespace metal;

// ---- Instantiations ----------------------------------------------------------------------

#define STEEL_DECODE_VECTOR_KERNEL(tname, T, de, dv)                                        \
  template [[host_name("steel_attention_decode_vector_" #tname "_e" #de "_v" #dv)]] [[kernel]] \
  decltype(steel_attention_decode_vector<T, de, dv>) steel_attention_decode_vector<T, de, dv>;

#define STEEL_DECODE_VECTOR_DTYPE(tname, T)          \
  STEEL_DECODE_VECTOR_KERNEL(tname, T, 32, 32)       \
  STEEL_DECODE_VECTOR_KERNEL(tname, T, 40, 40)       \
  STEEL_DECODE_VECTOR_KERNEL(tname, T, 64, 64)       \
  STEEL_DECODE_VECTOR_KERNEL(tname, T, 72, 72)       \
  STEEL_DECODE_VECTOR_KERNEL(tname, T, 80, 80)       \
  STEEL_DECODE_VECTOR_KERNEL(tname, T, 96, 96)       \
  STEEL_DECODE_VECTOR_KERNEL(tname, T, 128, 128)     \
  STEEL_DECODE_VECTOR_KERNEL(tname, T, 160, 160)     \
  STEEL_DECODE_VECTOR_KERNEL(tname, T, 192, 128)     \
  STEEL_DECODE_VECTOR_KERNEL(tname, T, 192, 192)     \
  STEEL_DECODE_VECTOR_KERNEL(tname, T, 256, 256)     \
  STEEL_DECODE_VECTOR_KERNEL(tname, T, 512, 512)     \
  STEEL_DECODE_VECTOR_KERNEL(tname, T, 576, 512)     \
  STEEL_DECODE_VECTOR_KERNEL(tname, T, 576, 576)

STEEL_DECODE_VECTOR_DTYPE(f16, half)
STEEL_DECODE_VECTOR_DTYPE(bf16, bfloat)
STEEL_DECODE_VECTOR_DTYPE(f32, float)
