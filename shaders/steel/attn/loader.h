// AttnTileLoader: copies kRows x kCols of a row-major device operand (K or V rows) into
// threadgroup memory rows of kLd elements, bounded on ragged edges. Where each row lies is an
// AttnKvRows: rows a fixed stride apart (dense, varlen), or rows found through a paged KV
// cache's block table (decode.h).
//
// The tile is cut into 16-byte chunks (8 half/bfloat or 4 float elements; head dims are
// multiples of 8, so a row is whole chunks) and the threads of the threadgroup take chunks in
// turn, consecutive threads along a row, so a simdgroup reads whole rows (coalesced). Rows past
// `valid_rows` (the last key tile) and columns past `valid_cols` (a head dim below the kernel's)
// are filled with zeros: a zero key row gives a score that is masked anyway, and a zero value
// row keeps 0 * garbage (NaN when the garbage is inf or NaN) out of the fp32 accumulators.
// A row's address is computed only for rows that are read, so the block table is never read
// past the pages that hold the sequence's keys.
#pragma once

#include <metal_stdlib>

#include "../gemm/loader.h"

using namespace metal;

namespace steel {

// Where key rows key0, key0 + 1, ... of one (batch entry, KV head) lie, relative to the head's
// first element. Dense and varlen operands: `ld` apart. A paged cache (`paged`): key j is slot
// j % page_size of page table[j / page_size]; pages are `page_stride` apart and table entries
// are clamped to [0, pages), so a corrupt table reads wrong keys, never outside the pool.
struct AttnKvRows {
  steel_i64 ld;
  bool paged;
  const device int* table;  // the sequence's row of the block table (paged only)
  int key0;
  int page_size;
  int pages;
  steel_i64 page_stride;

  steel_i64 at(short r) const {
    if (!paged) return steel_i64(r) * ld;
    const int key = key0 + r;
    const int page = clamp(table[key / page_size], 0, pages - 1);
    return steel_i64(page) * page_stride + steel_i64(key % page_size) * ld;
  }
};

inline AttnKvRows attn_dense_rows(steel_i64 ld) {
  AttnKvRows rows = {ld, false, nullptr, 0, 1, 1, 0};
  return rows;
}

template <typename T, short kRows, short kCols, short kLd, short kThreads>
struct AttnTileLoader {
  static constant constexpr short kVec = short(16 / sizeof(T));
  static constant constexpr short kChunksPerRow = kCols / kVec;
  static constant constexpr short kChunks = kRows * kChunksPerRow;
  static_assert(kCols % kVec == 0, "head dims are multiples of 8");
  static_assert(kLd * sizeof(T) % 16 == 0, "padded rows keep 16-byte chunk alignment");
  using Chunk = typename Bits<16>::type;

  // `vec`: every row start of the operand is 16-byte aligned (STEEL_ATTN_FC_VEC_K/V), so a whole
  // chunk moves as one access. `full`: the tile has no ragged edge (compile-time true on aligned
  // launches), so no element is checked. `src` is the row base of `rows`.
  static void load(threadgroup T* dst, const device T* src, AttnKvRows rows, short valid_rows,
                   short valid_cols, bool full, bool vec, ushort thread_index) {
    for (short c = short(thread_index); c < kChunks; c += kThreads) {
      const short r = c / kChunksPerRow;
      const short col = (c - r * kChunksPerRow) * kVec;
      threadgroup T* d = dst + r * kLd + col;
      if (full || (r < valid_rows && col + kVec <= valid_cols)) {
        const device T* s = src + rows.at(r) + col;
        if (vec) {
          *((threadgroup Chunk*)d) = *((const device Chunk*)s);
        } else {
#pragma clang loop unroll(full)
          for (short j = 0; j < kVec; ++j) d[j] = s[j];
        }
      } else if (r < valid_rows) {
        const device T* s = src + rows.at(r) + col;
#pragma clang loop unroll(full)
        for (short j = 0; j < kVec; ++j) d[j] = col + j < valid_cols ? s[j] : T(0);
      } else {
#pragma clang loop unroll(full)
        for (short j = 0; j < kVec; ++j) d[j] = T(0);
      }
    }
  }

  // Rows `src_ld` apart (dense and varlen operands).
  static void load(threadgroup T* dst, const device T* src, steel_i64 src_ld, short valid_rows,
                   short valid_cols, bool full, bool vec, ushort thread_index) {
    load(dst, src, attn_dense_rows(src_ld), valid_rows, valid_cols, full, vec, thread_index);
  }
};

// Quantized K/V (torch_steel.kv): int8 codes (x = q * s) or two 4-bit codes per byte, element
// 2j in byte j's low nibble (x = q * s + m), with a scale (and a min) per group of `group`
// values along the row, in half or float. Row addresses (AttnKvRows) are in bytes for the codes
// and in scale elements for the scales and mins, which lie at the same rows of their own tensors.
struct AttnQuantFormat {
  short bits;      // 8 or 4
  short group;     // values per scale: 32, 64, 128, or the head dim (one scale per row)
  bool scale_f32;  // scales and mins are float, else half
};

inline float attn_read_scale(const device uchar* p, bool f32, steel_i64 i) {
  return f32 ? ((const device float*)p)[i] : float(((const device half*)p)[i]);
}

// Byte j (0 .. 15) of a 16-byte chunk read as four words (Apple GPUs are little-endian).
inline uint attn_chunk_byte(uint4 w, short j) { return (w[j >> 2] >> (8 * (j & 3))) & 0xFFu; }

// AttnTileLoader's tile, dequantized on the way in: the tile in threadgroup memory holds the
// compute dtype T, so everything after the load is the unquantized path's. A thread takes one
// scale group of a row (the whole row for one scale per row): it reads the group's scale (and
// min) once, so that each is read from device memory once per tile (the K/V bytes of a decode
// step are the codes plus the scales), and then its codes in 16-byte chunks (16 int8 or 32
// 4-bit values; groups are multiples of a chunk, or the whole row). Columns past `valid_cols`
// and rows past `valid_rows` are zeros, as in AttnTileLoader.
template <typename T, short kRows, short kCols, short kLd, short kThreads>
struct AttnQuantTileLoader {
  static_assert(kLd * sizeof(T) % 16 == 0, "padded rows keep 16-byte chunk alignment");

  // Values [0, n) of one chunk of codes at `s` into `d`, the first `valid` of them dequantized
  // with scale and low (the min; 0 for int8), the rest zeros. `aligned`: `s` is 16-byte aligned.
  static void chunk(threadgroup T* d, const device uchar* s, short n, short valid, float scale,
                    float low, short bits, bool aligned) {
    const short per_chunk = bits == 8 ? 16 : 32;
    uint4 w = uint4(0);
    if (aligned && valid == per_chunk) {
      w = *((const device uint4*)s);
    } else {
      const short bytes = bits == 8 ? valid : (valid + 1) / 2;
      for (short j = 0; j < bytes; ++j) w[j >> 2] |= uint(s[j]) << (8 * (j & 3));
    }
    if (bits == 8 && n == 16 && valid == 16) {
      // A whole int8 chunk: no bounds, and four 4-wide stores (d starts a multiple of 16 values
      // into a 16-byte aligned row, so it is 16-byte aligned). (4-bit chunks keep the scalar
      // loop below: this form's nibble selects cost the model more than the stores save.)
      threadgroup vec<T, 4>* d4 = (threadgroup vec<T, 4>*)d;
#pragma clang loop unroll(full)
      for (short j = 0; j < 4; ++j) {
        vec<T, 4> x;
#pragma clang loop unroll(full)
        for (short e = 0; e < 4; ++e) {
          const int code = int(attn_chunk_byte(w, 4 * j + e) ^ 0x80u) - 128;  // two's complement
          x[e] = T(float(code) * scale);
        }
        d4[j] = x;
      }
      return;
    }
    if (bits == 8) {
#pragma clang loop unroll(full)
      for (short j = 0; j < 16; ++j) {
        const int code = int(attn_chunk_byte(w, j) ^ 0x80u) - 128;  // two's complement
        const float x = float(code) * scale;
        if (j < n) d[j] = j < valid ? T(x) : T(0);
      }
    } else {
#pragma clang loop unroll(full)
      for (short j = 0; j < 16; ++j) {
        const uint b = attn_chunk_byte(w, j);
        const float x0 = float(b & 0xFu) * scale + low;
        const float x1 = float(b >> 4) * scale + low;
        if (2 * j < n) d[2 * j] = 2 * j < valid ? T(x0) : T(0);
        if (2 * j + 1 < n) d[2 * j + 1] = 2 * j + 1 < valid ? T(x1) : T(0);
      }
    }
  }

  // `vec`: every code row start is 16-byte aligned, so a whole chunk is one access.
  static void load(threadgroup T* dst, const device uchar* src, AttnKvRows rows,
                   const device uchar* scales, const device uchar* mins, AttnKvRows scale_rows,
                   short valid_rows, short valid_cols, AttnQuantFormat f, bool vec,
                   ushort thread_index) {
    const short per_chunk = f.bits == 8 ? 16 : 32;
    const short groups_per_row = (kCols + f.group - 1) / f.group;
    for (short u = short(thread_index); u < kRows * groups_per_row; u += kThreads) {
      const short r = u / groups_per_row;
      const short col0 = (u - r * groups_per_row) * f.group;
      threadgroup T* d = dst + r * kLd + col0;
      const short n = min(f.group, short(kCols - col0));  // the tile's columns in this group
      const short valid = r < valid_rows ? max(short(0), min(n, short(valid_cols - col0))) : 0;
      if (valid == 0) {  // nothing of it is read, its scale included
        for (short j = 0; j < n; ++j) d[j] = T(0);
        continue;
      }
      const steel_i64 g = scale_rows.at(r) + col0 / f.group;
      const float scale = attn_read_scale(scales, f.scale_f32, g);
      const float low = f.bits == 4 ? attn_read_scale(mins, f.scale_f32, g) : 0.0f;
      const device uchar* s = src + rows.at(r) + (f.bits == 8 ? col0 : col0 / 2);
      for (short c = 0; c < n; c += per_chunk) {
        const short cn = min(per_chunk, short(n - c));
        const short cv = max(short(0), min(cn, short(valid - c)));
        chunk(d + c, s + (f.bits == 8 ? c : c / 2), cn, cv, scale, low, f.bits, vec);
      }
    }
  }
};

}  // namespace steel
