// AttnTileLoader: copies kRows x kCols of a row-major device operand (K or V rows) into
// threadgroup memory rows of kLd elements, bounded on ragged edges. Where each row lies is an
// AttnKvRows: rows a fixed stride apart (dense, varlen: load), or rows found through a paged KV
// cache's block table (decode.h: load_paged).
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

  // Row r's offset in dense and varlen rows (AttnTileLoader::load; paged rows take slot()).
  steel_i64 at(short r) const { return steel_i64(r) * ld; }

  // A row's offset in two steps, dense or paged, so that lanes can share a row's table entry
  // (AttnQuantTileLoader): the page of row r (paged only: one read of the table), and the
  // row's offset given its page.
  int page(short r) const { return clamp(table[(key0 + r) / page_size], 0, pages - 1); }
  steel_i64 at(short r, int page) const {
    if (!paged) return steel_i64(r) * ld;
    return steel_i64(page) * page_stride + steel_i64((key0 + r) % page_size) * ld;
  }

  // Paged only: row r's page and slot in it (the table read only for r < valid_rows, else (0,
  // 0)), and the offset of a row given them: AttnTileLoader::load_paged's lanes find one row
  // each and share it. K and V rows share the table and key0, so one (page, slot) serves both
  // (decode.h sets key0 on K's rows alone).
  int2 slot(short r, short valid_rows) const {
    if (r >= valid_rows) return int2(0);
    const int key = key0 + r;
    const int entry = key / page_size;
    return int2(clamp(table[entry], 0, pages - 1), key - entry * page_size);
  }
  steel_i64 at(int2 slot) const {
    return steel_i64(slot.x) * page_stride + steel_i64(slot.y) * ld;
  }
};

inline AttnKvRows attn_dense_rows(steel_i64 ld) {
  AttnKvRows rows = {ld, false, nullptr, 0, 1, 1, 0};
  return rows;
}

// One 16-byte chunk of T moved from device to threadgroup memory as one access each way
// (both 16-byte aligned); into a tile of float (TD), one load, widened and stored as two
// 16-byte halves.
template <typename T, typename TD, bool kWiden = !is_same<T, TD>::value>
struct AttnChunk {
  static void move(threadgroup TD* d, const device T* s) {
    *((threadgroup uint4*)d) = *((const device uint4*)s);
  }
};
template <typename T, typename TD>
struct AttnChunk<T, TD, true> {
  static_assert(sizeof(T) == 2 && is_same<TD, float>::value, "a float tile of a 16-bit operand");
  static void move(threadgroup float* d, const device T* s) {
    const uint4 w = *((const device uint4*)s);
    ((threadgroup float4*)d)[0] = float4(as_type<vec<T, 4>>(w.xy));
    ((threadgroup float4*)d)[1] = float4(as_type<vec<T, 4>>(w.zw));
  }
};

// The tile holds TD: T, or float for the prefill's V tile of a 16-bit operand (forward.h,
// AttnForward::VT), each element widened as it is stored (AttnChunk).
template <typename T, short kRows, short kCols, short kLd, short kThreads, typename TD = T>
struct AttnTileLoader {
  static constant constexpr short kVec = short(16 / sizeof(T));
  static constant constexpr short kChunksPerRow = kCols / kVec;
  static constant constexpr short kChunks = kRows * kChunksPerRow;
  static_assert(kCols % kVec == 0, "head dims are multiples of 8");
  static_assert(kLd * sizeof(TD) % 16 == 0, "padded rows keep 16-byte chunk alignment");
  using Chunk = AttnChunk<T, TD>;

  // `vec`: every row start of the operand is 16-byte aligned (STEEL_ATTN_FC_VEC_K/V), so a whole
  // chunk moves as one access. `full`: the tile has no ragged edge (compile-time true on aligned
  // launches), so no element is checked. `src` is the row base of `rows`.
  static void load(threadgroup TD* dst, const device T* src, AttnKvRows rows, short valid_rows,
                   short valid_cols, bool full, bool vec, ushort thread_index) {
    for (short c = short(thread_index); c < kChunks; c += kThreads) {
      const short r = c / kChunksPerRow;
      const short col = (c - r * kChunksPerRow) * kVec;
      threadgroup TD* d = dst + r * kLd + col;
      if (full || (r < valid_rows && col + kVec <= valid_cols)) {
        const device T* s = src + rows.at(r) + col;
        if (vec) {
          Chunk::move(d, s);
        } else {
#pragma clang loop unroll(full)
          for (short j = 0; j < kVec; ++j) d[j] = TD(s[j]);
        }
      } else if (r < valid_rows) {
        const device T* s = src + rows.at(r) + col;
#pragma clang loop unroll(full)
        for (short j = 0; j < kVec; ++j) d[j] = col + j < valid_cols ? TD(s[j]) : TD(0);
      } else {
#pragma clang loop unroll(full)
        for (short j = 0; j < kVec; ++j) d[j] = TD(0);
      }
    }
  }

  // load() of a paged cache's rows. `lane_slot`: where row `lane` of the tile lies (its page
  // and slot, AttnKvRows::slot; rows past the valid ones (0, 0)), found once a tile by each
  // lane, so that each chunk takes its row's by a shuffle: the block table is read once a row
  // and simdgroup, not once a chunk (at f16 head dim 128, 4 bytes for each 16-byte chunk: 25%
  // more bytes), and no chunk divides by the page size. Every thread takes every round, so a
  // simdgroup's lanes shuffle together.
  static void load_paged(threadgroup TD* dst, const device T* src, AttnKvRows rows,
                         int2 lane_slot, short valid_rows, short valid_cols, bool full, bool vec,
                         ushort thread_index) {
    static_assert(kRows <= 32, "row r's slot is lane r's");
#pragma clang loop unroll(full)
    for (short i = 0; i < kPer; ++i) {
      const short c = short(thread_index) + i * kThreads;
      const short r = c / kChunksPerRow;
      const int2 slot = simd_shuffle(lane_slot, ushort(min(r, short(kRows - 1))));
      if (c >= kChunks) continue;
      const short col = (c - r * kChunksPerRow) * kVec;
      threadgroup TD* d = dst + r * kLd + col;
      if (full || (r < valid_rows && col + kVec <= valid_cols)) {
        const device T* s = src + rows.at(slot) + col;
        if (vec) {
          Chunk::move(d, s);
        } else {
#pragma clang loop unroll(full)
          for (short j = 0; j < kVec; ++j) d[j] = TD(s[j]);
        }
      } else if (r < valid_rows) {
        const device T* s = src + rows.at(slot) + col;
#pragma clang loop unroll(full)
        for (short j = 0; j < kVec; ++j) d[j] = col + j < valid_cols ? TD(s[j]) : TD(0);
      } else {
#pragma clang loop unroll(full)
        for (short j = 0; j < kVec; ++j) d[j] = TD(0);
      }
    }
  }

  // Rows `src_ld` apart (dense and varlen operands).
  static void load(threadgroup TD* dst, const device T* src, steel_i64 src_ld, short valid_rows,
                   short valid_cols, bool full, bool vec, ushort thread_index) {
    load(dst, src, attn_dense_rows(src_ld), valid_rows, valid_cols, full, vec, thread_index);
  }

  // A thread's chunks of a whole tile (every row and column valid) of dense rows, for the
  // key tiles of the prefill forward: found once, before the loop over tiles (whole_place),
  // they are the same for every tile. Where the threads cover whole rows (kThreads a multiple
  // of kChunksPerRow) a thread's chunks stay in one column, kStep rows apart, so that the tile
  // offsets of its chunks are compile-time steps from its first and the device pointer moves by
  // one add per chunk, with no bound tested (load() forms both addresses and tests the bounds
  // per chunk). Otherwise load_whole is load() with `full`.
  static constant constexpr bool kColumns = kThreads % kChunksPerRow == 0;
  static constant constexpr short kStep = kColumns ? kThreads / kChunksPerRow : 1;
  static constant constexpr short kPer = (kChunks + kThreads - 1) / kThreads;
  struct Place {
    short r;            // the thread's first row
    short dst;          // its first chunk's tile offset
    steel_i64 src;      // and device offset
    steel_i64 step;     // device elements from one of its chunks to the next (kStep rows)
  };
  static Place whole_place(steel_i64 src_ld, ushort thread_index) {
    Place w;
    w.r = kColumns ? short(thread_index) / kChunksPerRow : 0;
    const short col = (short(thread_index) - w.r * kChunksPerRow) * kVec;
    w.dst = w.r * kLd + col;
    w.src = w.r * src_ld + col;
    w.step = kStep * src_ld;
    return w;
  }

  // `src`: the tile's first row (as load()'s).
  static void load_whole(threadgroup TD* dst, const device T* src, steel_i64 src_ld, Place w,
                         bool vec, ushort thread_index) {
    if (!kColumns) {
      load(dst, src, src_ld, kRows, kCols, true, vec, thread_index);
      return;
    }
    threadgroup TD* d = dst + w.dst;
    const device T* s = src + w.src;
#pragma clang loop unroll(full)
    for (short i = 0; i < kPer; ++i) {
      // Only when the chunks do not divide among the threads: the last round's spare threads.
      if (kChunks % kThreads == 0 || w.r + i * kStep < kRows) {
        threadgroup TD* di = d + i * kStep * kLd;
        if (vec) {
          Chunk::move(di, s);
        } else {
#pragma clang loop unroll(full)
          for (short j = 0; j < kVec; ++j) di[j] = TD(s[j]);
        }
      }
      if (i + 1 < kPer) s += w.step;
    }
  }

  // load() of dense rows, through load_whole() when `full`.
  static void load_tile(threadgroup TD* dst, const device T* src, steel_i64 src_ld, Place w,
                        short valid_rows, short valid_cols, bool full, bool vec,
                        ushort thread_index) {
    if (full) {
      load_whole(dst, src, src_ld, w, vec, thread_index);
    } else {
      load(dst, src, src_ld, valid_rows, valid_cols, false, vec, thread_index);
    }
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

// Byte j (0 .. 15) of a 16-byte chunk read as four words (Apple GPUs are little-endian).
inline uint attn_chunk_byte(uint4 w, short j) { return (w[j >> 2] >> (8 * (j & 3))) & 0xFFu; }

// The least power of two >= x (x >= 1).
inline int attn_pow2_ceil(int x) { return x <= 1 ? 1 : 1 << (32 - int(clz(uint(x - 1)))); }

// Eight values of T at a 16-byte aligned d: one 16-byte store for 2-byte types, two for float.
template <typename T, int kSize = sizeof(T)>
struct AttnStore8 {
  static void store(threadgroup T* d, vec<T, 4> a, vec<T, 4> b) {
    ((threadgroup vec<T, 4>*)d)[0] = a;
    ((threadgroup vec<T, 4>*)d)[1] = b;
  }
};
template <typename T>
struct AttnStore8<T, 2> {
  static void store(threadgroup T* d, vec<T, 4> a, vec<T, 4> b) {
    *((threadgroup uint4*)d) = uint4(as_type<uint2>(a), as_type<uint2>(b));
  }
};

// Eight 4-bit codes of a word (value 2j in byte j's low nibble) into values 0-3 (a) and 4-7
// (b), x = q * s + m by one fma in C, rounded once into T. In float: the codes' bytes converted
// (a word's low nibbles are values 0, 2, 4, 6, its high ones 1, 3, 5, 7).
template <typename T, typename C>
struct AttnDequant4 {
  static void eight(uint w, C s, C m, thread vec<T, 4>& a, thread vec<T, 4>& b) {
    const vec<C, 4> lo =
        fma(vec<C, 4>(as_type<uchar4>(w & 0x0F0F0F0Fu)), vec<C, 4>(s), vec<C, 4>(m));
    const vec<C, 4> hi =
        fma(vec<C, 4>(as_type<uchar4>((w >> 4) & 0x0F0F0F0Fu)), vec<C, 4>(s), vec<C, 4>(m));
    a = vec<T, 4>(vec<C, 4>(lo.x, hi.x, lo.y, hi.y));
    b = vec<T, 4>(vec<C, 4>(lo.z, hi.z, lo.w, hi.w));
  }
};
// In half, with no conversion: nibbles t and 4 + t of the word, moved to bits 0-3 of its two
// halves under the exponent of 1024 (0x6400), are the half2 (1024 + q_t, 1024 + q_{4+t}), and
// subtracting 1024 is exact.
template <>
struct AttnDequant4<half, half> {
  static void eight(uint w, half s, half m, thread half4& a, thread half4& b) {
    half2 x[4];
#pragma clang loop unroll(full)
    for (short t = 0; t < 4; ++t) {
      const half2 q = as_type<half2>(((w >> (4 * t)) & 0x000F000Fu) | 0x64006400u) - half2(1024);
      x[t] = fma(q, half2(s), half2(m));
    }
    a = half4(x[0].x, x[1].x, x[2].x, x[3].x);
    b = half4(x[0].y, x[1].y, x[2].y, x[3].y);
  }
};

// AttnTileLoader's tile, dequantized on the way in: the tile in threadgroup memory holds the
// compute dtype T (or, as TD = float, T's values widened: the prefill's V tile), so everything
// after the load is the unquantized path's.
//
// The work unit is one 16-byte chunk of codes (16 int8 or 32 4-bit values), consecutive
// threads along a row as in AttnTileLoader, so all 128 threads take part whatever the format.
// A scale group's chunks (a group: 32, 64 or 128 values, or a row's valid columns when there
// is one scale per row) lie on consecutive lanes, `lanes` of them (the next power of two, so a
// group never straddles two simdgroups): its first lane alone reads the group's scale and min
// (and, in a paged cache, the row's table entry) and the others take them by a shuffle, so each
// is read from device memory once per tile (the K/V bytes of a decode step are the codes plus
// the scales). A code is converted once, straight into the type the value is computed in, and
// the value rounded once into T (no step through float where T and the scales are half).
// Columns past `valid_cols` and rows past `valid_rows` are zeros, as in AttnTileLoader.
template <typename T, short kRows, short kCols, short kLd, short kThreads, typename TD = T>
struct AttnQuantTileLoader {
  static_assert(kLd * sizeof(TD) % 16 == 0, "padded rows keep 16-byte chunk alignment");
  static_assert(kCols % 8 == 0, "head dims are multiples of 8");
  // A row's units (below) are at most 128 for head dims up to 576: a pass covers whole rows.
  static_assert(kThreads >= 128 && kThreads % 32 == 0 && kCols <= 576, "a pass: whole rows");
  // Chunks a lane holds: one, but an int8 row of more than 32 chunks under one scale (head dim
  // 576) is held by 32 lanes, some of which take a second chunk 32 on.
  static constant constexpr short kLaneChunks = (kCols + 16 * 32 - 1) / (16 * 32);

  // Four codes into four values in C, rounded once into T: int8 q * s, 4-bit q * s + m (one
  // fma). C is half where T and the scales are half (a code is exact in half and an int8 code
  // times a half scale, or a 4-bit one's fma with a half min, rounds once), float otherwise.
  template <typename C>
  static vec<T, 4> int8x4(uint codes, C s) {
    return vec<T, 4>(vec<C, 4>(as_type<char4>(codes)) * s);
  }
  // Eight values rounded into T, stored as TD (a float tile takes them widened: the values are
  // the T tile's).
  static void store8(threadgroup TD* d, vec<T, 4> a, vec<T, 4> b) {
    AttnStore8<TD>::store(d, vec<TD, 4>(a), vec<TD, 4>(b));
  }
  // A whole chunk `w` (16 int8 or 32 4-bit values) into d (16-byte aligned: a multiple of 16
  // values into a 16-byte aligned row), in 16-byte stores.
  template <typename C, short kBits>
  static void whole(threadgroup TD* d, uint4 w, C s, C m) {
    if (kBits == 8) {
      store8(d, int8x4<C>(w.x, s), int8x4<C>(w.y, s));
      store8(d + 8, int8x4<C>(w.z, s), int8x4<C>(w.w, s));
      return;
    }
#pragma clang loop unroll(full)
    for (short i = 0; i < 4; ++i) {  // word i: values 8i .. 8i + 7
      vec<T, 4> a, b;
      AttnDequant4<T, C>::eight(w[i], s, m, a, b);
      store8(d + 8 * i, a, b);
    }
  }

  // Values [0, n) of a chunk whose first `valid` ones are codes (the rest zeros): a head dim's
  // ragged edge. Element by element, bounded.
  template <typename C, short kBits>
  static void ragged(threadgroup TD* d, uint4 w, short n, short valid, C s, C m) {
#pragma clang loop unroll(full)
    for (short j = 0; j < 16; ++j) {
      const uint b = attn_chunk_byte(w, j);
      if (kBits == 8) {
        const C x = C(as_type<char>(uchar(b))) * s;
        if (j < n) d[j] = j < valid ? TD(T(x)) : TD(0);
      } else {
        const C x0 = fma(C(b & 0xFu), s, m), x1 = fma(C(b >> 4), s, m);
        if (2 * j < n) d[2 * j] = 2 * j < valid ? TD(T(x0)) : TD(0);
        if (2 * j + 1 < n) d[2 * j + 1] = 2 * j + 1 < valid ? TD(T(x1)) : TD(0);
      }
    }
  }

  // `vec`: every code row start is 16-byte aligned, so a whole chunk is one access.
  static void load(threadgroup TD* dst, const device uchar* src, AttnKvRows rows,
                   const device uchar* scales, const device uchar* mins, AttnKvRows scale_rows,
                   short valid_rows, short valid_cols, AttnQuantFormat f, bool vec,
                   ushort thread_index) {
    // The format's bits, the compute type and paged rows are template arguments: Metal's
    // compiler folds the function constants they come from, and the simulator's counters then
    // see the same straight code.
    if (rows.paged) {
      load_as_bits<true>(dst, src, rows, scales, mins, scale_rows, valid_rows, valid_cols, f, vec,
                         thread_index);
    } else {
      load_as_bits<false>(dst, src, rows, scales, mins, scale_rows, valid_rows, valid_cols, f,
                          vec, thread_index);
    }
  }

  template <bool kPaged>
  static void load_as_bits(threadgroup TD* dst, const device uchar* src, AttnKvRows rows,
                           const device uchar* scales, const device uchar* mins,
                           AttnKvRows scale_rows, short valid_rows, short valid_cols,
                           AttnQuantFormat f, bool vec, ushort thread_index) {
    using CH = conditional_t<is_same<T, half>::value, half, float>;
    if (f.bits == 8 && f.scale_f32) {
      load_as<float, float, 8, kPaged>(dst, src, rows, scales, mins, scale_rows, valid_rows,
                                       valid_cols, f.group, vec, thread_index);
    } else if (f.bits == 8) {
      load_as<CH, half, 8, kPaged>(dst, src, rows, scales, mins, scale_rows, valid_rows,
                                   valid_cols, f.group, vec, thread_index);
    } else if (f.scale_f32) {
      load_as<float, float, 4, kPaged>(dst, src, rows, scales, mins, scale_rows, valid_rows,
                                       valid_cols, f.group, vec, thread_index);
    } else {
      load_as<CH, half, 4, kPaged>(dst, src, rows, scales, mins, scale_rows, valid_rows,
                                   valid_cols, f.group, vec, thread_index);
    }
  }

  // C: the type values are computed in; S: the scales' and mins' type.
  template <typename C, typename S, short kBits, bool kPaged>
  static void load_as(threadgroup TD* dst, const device uchar* src, AttnKvRows rows,
                      const device uchar* scales, const device uchar* mins,
                      AttnKvRows scale_rows, int valid_rows, int valid_cols, int group, bool vec,
                      ushort thread_index) {
    constexpr int kPer = kBits == 8 ? 16 : 32;  // values of a 16-byte chunk
    constexpr int kRowChunks = (kCols + kPer - 1) / kPer;
    // A group's chunks (with one scale per row: those of the row's valid columns; the chunks
    // past them make a second group, never read), the lanes that hold it (a power of two), and
    // a row's units, padded to a power of two so that a pass covers whole rows.
    const int group_chunks = min((group + kPer - 1) / kPer, kRowChunks);
    const int lanes = min(32, attn_pow2_ceil(group_chunks));
    const int groups = (kRowChunks + group_chunks - 1) / group_chunks;
    const int row_units = attn_pow2_ceil(groups * lanes);
    const int rows_per_pass = kThreads / row_units;
    const int passes = (kRows + rows_per_pass - 1) / rows_per_pass;
    // This thread's unit: chunk k0 (and k0 + 32) of rows row0, row0 + rows_per_pass, ...
    const int tid = thread_index;
    const int row0 = tid / row_units;
    const int g = (tid % row_units) / lanes;  // the group of the row
    const int j = tid % lanes;                // the lane's place in it
    const int k0 = g * group_chunks + j;
    const ushort lead_lane = ushort((tid % 32) & ~(lanes - 1));
    const bool lead = j == 0 && g < groups && k0 * kPer < valid_cols;
    // Dense rows: the row's codes, scale and tile row advance by a pass's rows.
    const device uchar* code = src + k0 * kPer * kBits / 8;
    steel_i64 scale_at = g;
    if (!kPaged) {
      code += row0 * rows.ld;
      scale_at += row0 * scale_rows.ld;
    }
    threadgroup TD* d = dst + row0 * kLd + k0 * kPer;
    // Every thread takes every pass, so each group's lanes shuffle together.
    for (int pass = 0; pass < passes; ++pass) {
      const int r = row0 + pass * rows_per_pass;
      const bool row_read = r < valid_rows;
      C s = C(0), m = C(0);
      int page = 0;
      if (lead && row_read) {
        if (kPaged) {
          page = rows.page(short(r));
          scale_at = scale_rows.at(short(r), page) + g;
        }
        s = C(((const device S*)scales)[scale_at]);
        if (kBits == 4) m = C(((const device S*)mins)[scale_at]);
      }
      if (lanes > 1) {
        s = simd_shuffle(s, lead_lane);
        if (kBits == 4) m = simd_shuffle(m, lead_lane);
        if (kPaged) page = simd_shuffle(page, lead_lane);
      }
      if (kPaged && row_read) code = src + rows.at(short(r), page) + k0 * kPer * kBits / 8;
      if (r < kRows && g < groups) {
#pragma clang loop unroll(full)
        for (int c = 0; c < kLaneChunks; ++c) {
          const int k = k0 + 32 * c;  // the chunk of the row
          if (j + 32 * c >= group_chunks || k >= kRowChunks) continue;
          const int n = min(kPer, kCols - k * kPer);  // the tile's columns in it
          const int valid = row_read ? clamp(valid_cols - k * kPer, 0, n) : 0;
          chunk<C, kBits>(d + 32 * c * kPer, code + 32 * c * kPer * kBits / 8, n, valid, vec, s, m);
        }
      }
      if (!kPaged) {
        code += rows_per_pass * rows.ld;
        scale_at += rows_per_pass * scale_rows.ld;
      }
      d += rows_per_pass * kLd;
    }
  }

  // One chunk: `n` tile columns at d, of which the first `valid` are the codes at p.
  template <typename C, short kBits>
  static void chunk(threadgroup TD* d, const device uchar* p, int n, int valid, bool vec, C s,
                    C m) {
    constexpr int kPer = kBits == 8 ? 16 : 32;
    if (valid == 0) {  // nothing of it is read
      for (int e = 0; e < n; e += 8) AttnStore8<TD>::store(d + e, vec<TD, 4>(0), vec<TD, 4>(0));
      return;
    }
    uint4 w = uint4(0);
    if (vec && valid == kPer) {
      w = *((const device uint4*)p);
    } else {  // each byte of the chunk's codes read once
      const int bytes = valid * kBits / 8;
      for (int b = 0; b < bytes; ++b) w[b >> 2] |= uint(p[b]) << (8 * (b & 3));
    }
    if (valid == kPer) {
      whole<C, kBits>(d, w, s, m);
    } else {
      ragged<C, kBits>(d, w, short(n), short(valid), s, m);
    }
  }
};

}  // namespace steel
