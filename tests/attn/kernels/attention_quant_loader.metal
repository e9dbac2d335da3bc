// Test kernel: one K/V tile through AttnQuantTileLoader (shaders/steel/attn/loader.h) into
// threadgroup memory, copied out as it is, so a test can compare the dequantized tile with
// torch_steel.kv.dequantize: dense rows, or rows of a paged pool found through a block table.
#include <metal_stdlib>

#include "steel/attn/loader.h"

using namespace metal;
using namespace steel;

struct QuantLoaderParams {
  steel_i64 ld, scale_ld, page_stride, scale_page_stride;  // bytes (codes), elements (scales)
  int valid_rows, valid_cols, bits, group, scale_f32, vec, paged, key0, page_size, pages;
};

template <typename T, short kCols>
[[kernel]] void quant_loader(const device uchar* codes [[buffer(0)]],
                             const device uchar* scales [[buffer(1)]],
                             const device uchar* mins [[buffer(2)]], device T* out [[buffer(3)]],
                             constant QuantLoaderParams& tp [[buffer(4)]],
                             const device int* table [[buffer(5)]],
                             ushort tid [[thread_index_in_threadgroup]]) {
  constexpr short kRows = 16, kLd = kCols + 16 / sizeof(T);
  threadgroup T tile[kRows * kLd];
  AttnKvRows rows = attn_dense_rows(tp.ld), scale_rows = attn_dense_rows(tp.scale_ld);
  if (tp.paged) {
    rows = AttnKvRows{tp.ld, true, table, tp.key0, tp.page_size, tp.pages, tp.page_stride};
    scale_rows = AttnKvRows{tp.scale_ld, true, table, tp.key0, tp.page_size, tp.pages,
                            tp.scale_page_stride};
  }
  AttnQuantFormat f = {short(tp.bits), short(tp.group), tp.scale_f32 != 0};
  AttnQuantTileLoader<T, kRows, kCols, kLd, 128>::load(tile, codes, rows, scales, mins,
                                                        scale_rows, short(tp.valid_rows),
                                                        short(tp.valid_cols), f, tp.vec != 0,
                                                        tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = tid; i < kRows * kCols; i += 128) out[i] = tile[(i / kCols) * kLd + i % kCols];
}

#define QUANT_LOADER(tname, T, cols)                                         \
  template [[host_name("quant_loader_" #tname "_" #cols)]] [[kernel]]       \
  decltype(quant_loader<T, cols>) quant_loader<T, cols>;

QUANT_LOADER(f16, half, 128)
QUANT_LOADER(f16, half, 40)
QUANT_LOADER(bf16, bfloat, 128)
QUANT_LOADER(bf16, bfloat, 40)
QUANT_LOADER(f32, float, 40)
QUANT_LOADER(f32, float, 128)
