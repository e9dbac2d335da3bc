// Launch planning for the decode kernels (shaders/steel/attn/decode.metal), which the "sdpa"
// (attention_plan.cpp) and "sdpa_varlen" (varlen_plan.cpp) planners hand a call of few query
// rows, or a paged KV cache: GQA packing, the key split and its merge, and the decode plan's
// key-length class for the plan cache (plan_cache.cpp). attention_plan.h states the rules.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attention_plan.h"
#include "device.h"

namespace steel {
namespace attn {

bool decode_serves(const Common& c, int64_t rows, const Options& options) {
  return rows <= STEEL_ATTN_DECODE_MAX_L && c.dropout_p == 0.0 &&
         options.number("decode", 1.0) != 0.0;
}

namespace {

// The cost model's times below (decode_model_time's unit) take 128 bits: a broadcast view's
// logical K/V (2^49 to 2^54 bytes in tests/plan/test_decode_plan.py's broadcast batches) times
// the units' scale (10^5 to 10^6) overflows 64 bits, and a wrapped cost would order layouts at
// random. With at most 2^63 elements a tensor, the products stay below 2^120.
__extension__ typedef __int128 Cost;

// Query rows per threadgroup block: all of them up to STEEL_ATTN_BQ (decode), else BQ.
int64_t decode_row_block(int64_t rows) {
  return std::min<int64_t>(std::max<int64_t>(rows, 1), STEEL_ATTN_BQ);
}

// The largest divisor of the group, at most `most`, whose heads' row blocks fit one
// threadgroup's BQ rows.
int64_t decode_heads_per_tg(int64_t group, int64_t rows, int64_t most = INT64_MAX) {
  int64_t best = 1;
  for (int64_t d = 1; d <= group && d <= most; ++d) {
    if (group % d == 0 && d * decode_row_block(rows) <= STEEL_ATTN_BQ) best = d;
  }
  return best;
}

// What one core of an Apple GPU holds at once, against which decode_resident counts the decode
// kernel's threadgroups: the per-core figures of torch_steel/sim/chips.json (the same on every
// chip of its table, M1 to M5), which the timing model's occupancy (timing.py _occupancy) reads.
constexpr int64_t kCoreMaxThreads = 3072;
constexpr int64_t kCoreThreadgroupBytes = 61440;
constexpr int64_t kCoreRegisterBytes = 212992;

// The vector kernel (decode_vector.h) or the MMA one (decode.h) for a block of
// group x rows packed rows. The MMA kernel's 8x8 products run on all 32 rows of its four
// simdgroups whatever the real count, so its arithmetic is 32 / (group x rows) times the real
// work; the vector kernel does the real work alone, at 2 (rows per simdgroup) simd_sums per key.
// Both read K and V once per KV head and threadgroup, so the vector kernel is taken where the
// whole group fits its STEEL_ATTN_DECODE_VECTOR_ROWS rows: one threadgroup per KV head still.
// The timing model (torch_steel/sim/timing.py) predicts it faster wherever it applies, on every
// chip of its table (docs/attention.md: M4 Pro, f16 d128, one token, H32/32 S4096 721 -> 268 us,
// the MMA block compute-bound on padded MMAs and the vector one at the K/V read; H32/8 S4096
// 195 -> 88 us; H32/4 (8 rows) 109 -> 81 us). At more rows (GQA 8 x 2 tokens) the MMA block's
// padding is at most 2x and its MMAs beat 8 rows' scalar FMAs, which cost the same per row as an
// 8-row MMA fragment. The head dim does not move the rule: both kernels' arithmetic scales with
// it alike. Option "decode_vector" = 0 keeps the MMA kernel (the tests compare the two).
bool decode_vector(int64_t group, int64_t rows, const Options& options) {
  return options.number("decode_vector", 1.0) != 0.0 &&
         group * decode_row_block(rows) <= STEEL_ATTN_DECODE_VECTOR_ROWS;
}

// The vector kernel's row sets for `packed` rows (params.h steel_attn_decode_vector_row_sets).
int64_t decode_row_sets(const Common& c, int64_t packed) {
  return steel_attn_decode_vector_row_sets(c.kernel.de, c.kernel.dv,
                                           static_cast<int>(dtype_size(c.dtype)),
                                           static_cast<int>(std::max<int64_t>(packed, 1)));
}

// Whether the vector kernel's key sets take whole tiles and read K and V rows straight from the
// device (STEEL_ATTN_FC_DECODE_DIRECT, decode_vector.h) rather than 1 / key sets of every tile
// staged in threadgroup memory. Staged, a tile's fixed work (the loaders' address arithmetic
// and bound tests, the score transform and the online softmax's simd_max, exp2 and simd_sum,
// two or three barriers) is paid by each simdgroup for its 32 / key sets keys: 2 keys at 16
// simdgroups, where the simulator's counters put 42 integer, 16 compare/select and 13 branch
// instructions a key beside its 8 FMAs (M4 Pro H8/2 S512 d128, docs/attention.md). Direct, it
// is paid once for up to 32 keys, and each row is one coalesced read of the simdgroup (the same
// device bytes: each K and V row is read by one simdgroup of the threadgroup). Taken wherever
// the kernel can: dense and varlen K/V in the compute dtype (paged and quantized K/V keep the
// tile loaders, which hold their addressing and dequantizing), one row set (two row sets would
// read each row twice) and no K/V alias (V would be read again, not taken from K's tile).
// Option "decode_direct" = 0 keeps the staged tiles (the tests run both). A wider block's added
// key sets cost kDecodeDirectKeySetWork with direct reads (decode_key_set_work), not the staged
// kDecodeKeySetWork, and a key's fp-pipe cycles are decode_key_cycles' direct fit.
// (Quantized plans are made from the dequantized call's, with the option off.)
bool decode_direct(const Common& c, const Decode& dec, int64_t packed, const Options& options) {
  return options.number("decode_direct", 1.0) != 0.0 && !dec.paged && !dec.kv_alias &&
         decode_row_sets(c, packed) == 1;
}

// The work a key set past 4 adds to a block, per mille of a 4-simdgroup block's.
int64_t decode_key_set_work(const Common& c, const Decode& dec, int64_t packed,
                            const Options& options) {
  return decode_direct(c, dec, packed, options) ? kDecodeDirectKeySetWork : kDecodeKeySetWork;
}

// 32-bit registers per thread of the decode kernel: a MODEL ASSUMPTION, the one figure here not
// read off the kernel (Apple's compiler cannot be asked off a Mac). It is the timing model's
// estimate (timing.steel_kernel_info). decode.h keeps 8x8 fp32 fragments live across its key
// loop (the Q and O rows, de / 8 and dv / 8, the score tile, key tile / 8, and one operand), two
// registers a lane each; decode_vector.h keeps per lane, for each of its live rows (the packed
// rows, STEEL_ATTN_FC_DECODE_ROWS, over its row sets, params.h: the rows past them are dead
// code in the pipeline, whose constants fold them away), its q and o elements
// (steel_attn_decode_vector_elems), the running max and sum and the score. Both add 24 scalars
// (indices, pointers, the rows' heads and indices). tests/plan/test_decode_plan.py checks the
// split against timing.py's residency so the two agree.
int64_t decode_registers(const Common& c, bool vector, int64_t packed) {
  if (vector) {
    const int64_t sets = decode_row_sets(c, packed);
    return ceil_div(std::max<int64_t>(packed, 1), sets) *
               steel_attn_decode_vector_row_registers(c.kernel.de, c.kernel.dv) +
           24;
  }
  return 2 * (c.kernel.de / 8 + c.kernel.dv / 8 + key_tile(c) / 8 + 1) + 24;
}

// Decode threadgroups of `simdgroups` simdgroups resident on one core at once: the least of
// what its threads, its threadgroup memory (params.h's K/V tiles, decode.metal's smem) and its
// registers allow; 0 when one does not fit a core's registers.
int64_t decode_resident(const Common& c, bool vector, int64_t packed, int64_t simdgroups) {
  const int64_t tg_bytes = steel_attn_threadgroup_bytes(
      c.kernel.de, c.kernel.dv, static_cast<int>(dtype_size(c.dtype)));
  const int64_t threads = 32 * simdgroups;
  const int64_t by_threads = kCoreMaxThreads / threads;
  const int64_t by_memory = kCoreThreadgroupBytes / tg_bytes;
  const int64_t by_registers =
      kCoreRegisterBytes / (decode_registers(c, vector, packed) * 4 * threads);
  return std::min({by_threads, by_memory, by_registers});
}

// The timing model's ALU efficiency of a core against the simdgroups resident on it
// (torch_steel/sim/chips.json's alu_occupancy_efficiency, the same on every chip of its table:
// 0.364 at 4, 0.625 at 8, 1 from 24), in thousandths.
int64_t decode_alu_efficiency(int64_t simdgroups) {
  constexpr int64_t kX[] = {0, 4, 8, 24};
  constexpr int64_t kY[] = {0, 364, 625, 1000};
  if (simdgroups >= kX[3]) return kY[3];
  int64_t i = 1;
  while (simdgroups > kX[i]) ++i;
  return kY[i - 1] + (kY[i] - kY[i - 1]) * (simdgroups - kX[i - 1]) / (kX[i] - kX[i - 1]);
}

// The model's time of a dispatch of `threadgroups` threadgroups of `simdgroups` simdgroups, each
// doing `work` (in keys of one 4-simdgroup threadgroup's work), `resident` a core, on `cores`:
// timing.py's per-core time, waves of cores x resident and a short last wave, each wave at the
// ALU efficiency of the simdgroups it keeps on a core. In keys x 1000 (the efficiency's unit).
Cost decode_model_time(int64_t threadgroups, int64_t simdgroups, int64_t resident,
                       int64_t cores, int64_t work) {
  const int64_t slots = cores * resident;
  const int64_t full = threadgroups / slots, rest = threadgroups % slots;
  Cost t = Cost{full} * resident * work * 1000000 / decode_alu_efficiency(resident * simdgroups);
  if (rest) {
    const int64_t last = ceil_div(rest, cores);
    t += Cost{last} * work * 1000000 / decode_alu_efficiency(last * simdgroups);
  }
  return t;
}

// The one-row 4-simdgroup vector block's fp-pipe cycles a key, in tenths, which convert its K/V
// bytes into decode_model_time's unit: the timing model's fp pipe (sim.predict, M4 Pro, one pass,
// S = 512 -> 1024, a key's share) at de + dv = 128, 256, 512, with direct reads (f16 and bf16:
// 5.9, 7.9, 12.9; f32: 4.9, 6.3, 8.8) and staged (f16 11.3, 16.3, 29.4; f32 13.3, 22.7, 37.4),
// linear between, flat below, proportional above.
int64_t decode_key_cycles(int64_t de, int64_t dv, int64_t elem, bool direct) {
  constexpr int64_t kHalf[2][3] = {{113, 163, 294}, {59, 79, 129}};
  constexpr int64_t kFloat[2][3] = {{133, 227, 374}, {49, 63, 88}};
  const int64_t* y = (elem == 4 ? kFloat : kHalf)[direct ? 1 : 0];
  const int64_t x = de + dv;
  if (x <= 128) return y[0];
  if (x <= 256) return y[0] + (y[1] - y[0]) * (x - 128) / 128;
  if (x <= 512) return y[1] + (y[2] - y[1]) * (x - 256) / 256;
  return y[2] * x / 512;
}

// A key's work for `packed` rows, per mille of a one-row block's (kDecodeRowWork a row past the
// first, kDecodeDirectRowWork with direct reads).
int64_t decode_row_factor(bool direct, int64_t packed) {
  return 1000 + (direct ? kDecodeDirectRowWork : kDecodeRowWork) * (packed - 1);
}

// A threadgroup's fixed work with direct reads (kDecodeDirectSimdgroupCycles a simdgroup), in
// keys of a one-row 4-simdgroup block's work (decode_model_time's unit); 0 staged, where the
// per-key fit holds it.
int64_t decode_fixed_keys(const Common& c, bool direct, int64_t packed, int64_t w) {
  if (!direct) return 0;
  const int64_t elem = static_cast<int64_t>(dtype_size(c.dtype));
  return kDecodeDirectSimdgroupCycles * 10 * w *
         (1000 + kDecodeDirectFixedRowWork * (packed - 1)) / 1000 /
         decode_key_cycles(c.kernel.de, c.kernel.dv, elem, true);
}

// The merge dispatch's overhead (kDecodeMergeCycles) in decode_model_time's unit.
Cost decode_merge_time(const Common& c, bool direct) {
  const int64_t elem = static_cast<int64_t>(dtype_size(c.dtype));
  return kDecodeMergeCycles * 10 * 1000 / decode_key_cycles(c.kernel.de, c.kernel.dv, elem, direct);
}

// The timing model's L2-path time of `threadgroups` threadgroups of `w` simdgroups (`resident` a
// core) each reading `keys` keys, in decode_model_time's unit: the most a core runs, each one's
// K and V bytes and params reads (kDecodeParamBytes a key and simdgroup staged,
// kDecodeDirectParamBytes a lane once with direct reads), at 32 bytes a core-cycle (chips.json
// l2_bytes_per_core_cycle, every chip of its table), over decode_key_cycles.
Cost decode_cache_time(const Common& c, bool direct, int64_t threadgroups, int64_t w,
                       int64_t resident, int64_t cores, int64_t keys) {
  const int64_t elem = static_cast<int64_t>(dtype_size(c.dtype));
  const int64_t slots = cores * resident;
  const int64_t per_core = threadgroups / slots * resident + ceil_div(threadgroups % slots, cores);
  const int64_t params = direct ? kDecodeDirectParamBytes * 32 * w : kDecodeParamBytes * w * keys;
  const int64_t bytes = keys * (c.kernel.de + c.kernel.dv) * elem + params;
  return Cost{per_core} * bytes * 10000 /
         (32 * decode_key_cycles(c.kernel.de, c.kernel.dv, elem, direct));
}

// The timing model's time of one vector decode pass, in decode_model_time's unit: `threadgroups`
// threadgroups of `w` simdgroups (`resident` a core) each over `keys` keys of `packed` rows,
// the larger of compute (a key's work for the rows, decode_row_factor, with the added key sets
// of a wider block, decode_key_set_work, and the block's fixed work, decode_fixed_keys) and the
// L2 path (decode_cache_time). decode_simdgroups and decode_layout_time both cost by it.
Cost decode_pass_time(const Common& c, const Decode& dec, const Options& options, bool direct,
                      int64_t packed, int64_t threadgroups, int64_t w, int64_t resident,
                      int64_t cores, int64_t keys) {
  const int64_t sets = decode_row_sets(c, packed);
  const int64_t added = decode_key_set_work(c, dec, packed, options) *
                        (w - STEEL_ATTN_SIMDGROUPS) / sets;
  const int64_t work = keys * decode_row_factor(direct, packed) / 1000 * (1000 + added) / 1000 +
                       decode_fixed_keys(c, direct, packed, w);
  return std::max(decode_model_time(threadgroups, w, resident, cores, work),
                  decode_cache_time(c, direct, threadgroups, w, resident, cores, keys));
}

// The vector kernel's simdgroups a threadgroup (STEEL_ATTN_FC_DECODE_SIMDGROUPS), and whether a
// split's partitions `*n` give way to one pass. A grid below one wave leaves cores idle or
// holding one or two threadgroups of 4 simdgroups, at the timing model's ALU efficiency of 4
// (0.364) or 8 (0.625) simdgroups a core; splitting the keys fills more cores, but its merge is
// a second dispatch and its overhead (dispatch_overhead_s, 10 us on every chip of chips.json)
// is the whole time of a short cache's decode. A one-pass threadgroup of 8 or 16 simdgroups
// (more key sets over the same tiles, decode_vector.h) reaches 0.625 or 0.8125 on its own core.
// Costed in the timing model's terms: each candidate's per-core time (decode_model_time), a wider
// block's work 1 + decode_key_set_work / 1000 x its added key sets times a 4-simdgroup block's
// (each key set's per-tile steps: the online softmax's reductions and rescaling, the loop; and
// the combining rounds), or its L2 path's if longer (decode_cache_time: a wider block's lanes
// each read the params, M5 H8/2 S128 d64 f16 one token: 16 simdgroups 12.0 us cache-bound, 8
// 11.3, PyTorch's kernel 11.6), and the merge's overhead (decode_merge_time); the
// cheapest is taken, the 4-simdgroup split on a tie. A wider block must fit a core (registers:
// decode_registers of its live rows) and the grid one wave of it. Option "decode_simdgroups"
// (4, 8 or 16) fixes the width (the tests run every one), "num_splits" the partitions (then the
// width stays 4 unless fixed too).
int64_t decode_simdgroups(const Common& c, const Decode& dec, const Options& options,
                          int64_t packed, int64_t threadgroups, int64_t cores, int64_t* n) {
  const int64_t sets = decode_row_sets(c, packed);
  // A pipeline may allow fewer threads than the widest block (Apple's compiler lowers
  // maxTotalThreadsPerThreadgroup for a kernel of many registers): the Metal host plans again
  // with "max_threads" set to its cap (checked_encoder.h), and no wider block is taken then.
  const int64_t max_threads = static_cast<int64_t>(options.number("max_threads", 1024));
  const int64_t fixed = static_cast<int64_t>(options.number("decode_simdgroups", 0));
  const int64_t bk = key_tile(c);
  // A width's key sets (w / sets) take a key of every tile each: at most the key tile (8 at
  // f32 d512, where one packed row is one row set).
  if ((fixed == 8 || fixed == 16) && 32 * fixed <= max_threads && fixed / sets <= bk) {
    return fixed;
  }
  if (fixed != 0 || n == nullptr) return STEEL_ATTN_SIMDGROUPS;
  const int64_t keys = std::max<int64_t>(dec.keys, 1);
  const int64_t res4 =
      std::max<int64_t>(1, decode_resident(c, true, packed, STEEL_ATTN_SIMDGROUPS));
  if (threadgroups >= cores * res4) return STEEL_ATTN_SIMDGROUPS;  // a wave or more: as planned
  const int64_t per = ceil_div(ceil_div(keys, *n), bk) * bk;
  const int64_t parts = ceil_div(keys, per);
  const bool direct = decode_direct(c, dec, packed, options);
  Cost best = decode_pass_time(c, dec, options, direct, packed, threadgroups * parts,
                               STEEL_ATTN_SIMDGROUPS, res4, cores, per) +
              (parts > 1 ? decode_merge_time(c, direct) : 0);
  int64_t width = STEEL_ATTN_SIMDGROUPS;
  const int64_t whole = ceil_div(keys, bk) * bk;
  for (int64_t w = 2 * STEEL_ATTN_SIMDGROUPS; w <= STEEL_ATTN_DECODE_VECTOR_MAX_SIMDGROUPS;
       w *= 2) {
    const int64_t res = decode_resident(c, true, packed, w);
    if (res < 1 || w / sets > bk || threadgroups > cores * res || 32 * w > max_threads) continue;
    const Cost t =
        decode_pass_time(c, dec, options, direct, packed, threadgroups, w, res, cores, whole);
    if (t < best) best = t, width = w;
  }
  if (width != STEEL_ATTN_SIMDGROUPS) *n = 1;
  return width;
}

// A layout as decode_layout derives it: the split, with the rows a threadgroup packs and the
// threadgroups before the split, which decode_layout_time costs as they are.
struct DecodeLayout {
  DecodeSplit split;
  int64_t packed = 0;
  int64_t threadgroups = 0;
};

// The partitions and the vector kernel's width for `per_tg` query heads a threadgroup; `one_pass`
// takes one partition (and the width for it) in place of the wave heuristic's count.
DecodeLayout decode_layout(const Common& c, const Decode& dec, const Options& options,
                           int64_t per_tg, bool vector, int64_t cores, bool one_pass = false) {
  DecodeLayout layout;
  DecodeSplit& out = layout.split;
  out.heads_per_tg = per_tg;
  const int64_t bk = key_tile(c);
  const int64_t keys = std::max<int64_t>(dec.keys, 1);
  const int64_t group = c.Hq / c.Hkv;
  const int64_t packed = per_tg * decode_row_block(dec.rows);
  const int64_t blocks = ceil_div(std::max<int64_t>(dec.rows, 1), decode_row_block(dec.rows));
  const int64_t threadgroups = dec.count * c.Hkv * (group / per_tg) * blocks;
  // Partitions of split_keys keys (a multiple of the key tile): rounding up may leave fewer.
  const auto partition = [&](int64_t n) { return ceil_div(ceil_div(keys, n), bk) * bk; };
  const int64_t resident =
      std::max<int64_t>(1, decode_resident(c, vector, packed, STEEL_ATTN_SIMDGROUPS));
  const int64_t wave = cores * resident;
  int64_t n = one_pass ? 1 : static_cast<int64_t>(options.number("num_splits", 0));
  if (one_pass) {
    if (vector) {
      out.simdgroups = decode_simdgroups(c, dec, options, packed, threadgroups, cores, &n);
    }
  } else if (n <= 0) {
    // The GPU runs the grid in waves of cores x resident threadgroups per core (the timing
    // model, torch_steel/sim/timing.py, quantizes a dispatch the same way), and a wave lasts as
    // long as its threadgroups' keys. Of the counts the floors allow (at most
    // STEEL_ATTN_DECODE_MAX_SPLITS, at least kDecodeMinSplitKeys keys and one key tile each),
    // take the one with the fewest waves x keys per partition: the grid closest to whole waves,
    // the fewest partitions (the least merge work) on a tie. Below one wave the partitions fill
    // slots that would idle, so keys alone are the cost. A grid of one wave or more is split
    // only where that pays for what a split adds there: each extra partition takes a slot
    // another threadgroup would use, for its prologue and epilogue (Q in, the partial O out),
    // and the merge pass is a second dispatch; costed as two key tiles a wave and one tile for
    // the merge, the least overhead at which the timing model predicts no shape slower split
    // than in one pass (M1 B2 H32/32 S1024 d128: 3 partitions, 1243 us against 1218 us at one
    // tile a wave), while grids just over whole waves split (64 threadgroups on waves of 60 ran
    // a second wave of 4 at the whole S: M2 H32/32 S4096 2609 -> 1813 us; docs/attention.md).
    // The core count is the device's (device.h), an 8-core M1 or a 40-core M4 Max,
    // kDecodeDefaultCores where unknown.
    const int64_t most = std::min<int64_t>(
        {STEEL_ATTN_DECODE_MAX_SPLITS, ceil_div(keys, kDecodeMinSplitKeys), ceil_div(keys, bk)});
    n = 1;
    int64_t best_cost = -1;
    for (int64_t m = 1; m <= most; ++m) {
      const int64_t per = partition(m);
      const int64_t parts = ceil_div(keys, per);
      const int64_t waves = ceil_div(threadgroups * parts, wave);
      const int64_t cost = threadgroups < wave ? waves * per
                                               : waves * (per + 2 * bk) + (parts > 1 ? bk : 0);
      if (best_cost < 0 || cost < best_cost) best_cost = cost, n = parts;
    }
    if (vector) {
      out.simdgroups = decode_simdgroups(c, dec, options, packed, threadgroups, cores, &n);
    }
  } else if (vector) {
    out.simdgroups = decode_simdgroups(c, dec, options, packed, threadgroups, cores, nullptr);
  }
  n = std::min<int64_t>({n, STEEL_ATTN_DECODE_MAX_SPLITS, ceil_div(keys, bk)});
  out.split_keys = partition(n);
  out.splits = ceil_div(keys, out.split_keys);
  layout.packed = packed;
  layout.threadgroups = threadgroups;
  return layout;
}

// The timing model's time of a vector decode layout (decode_layout's, for its heads_per_tg), in
// keys x 1000 of a one-row 4-simdgroup block's work (decode_model_time's unit): what
// decode_split compares across GQA packings.
//
// Why: packing the whole group into a threadgroup reads K and V once per KV head, but at few
// keys it leaves fewer threadgroups than cores (B1 H8/2: 2 threadgroups on 8 to 20 cores), each
// at the ALU efficiency of the simdgroups it keeps on its core alone, and a block's work grows
// with its rows. Fewer heads a threadgroup make group / heads_per_tg times the threadgroups,
// each of fewer rows, which read K and V that many times: device bytes through the L2 (the
// re-reads hit the cache: the DRAM bytes stay those of one read). Costed as the timing model
// costs a dispatch (timing.py predict_dispatch, the largest of its bounds), on the core count:
//   - compute: decode_model_time of the layout's threadgroups x partitions, at its width's
//     residency, each of split_keys keys x (1 + kDecodeRowWork / 1000, kDecodeDirectRowWork
//     with direct reads, a packed row past the first) x decode_simdgroups' key-set work;
//   - cache: decode_cache_time, the threadgroups a core runs x (split_keys of K and V and the
//     params reads) through the L2;
//   - DRAM: K and V read once at the named chip's DRAM bytes a core-cycle (device.h, else
//     kDecodeDramBytes), the same for every packing, a floor under which
//     one packing's split (and its merge) saves nothing (M1 Max H32/8 S16k d128: at 8 bytes one
//     head a threadgroup in one pass, re-reading K and V through the L2, tied the full packing's
//     split, 213 us against 190 in the model; at M1 Max's 9.6 the full packing is cheaper);
//   - the largest, plus the merge's overhead (decode_merge_time) when split.
// Each divisor of the group below the full packing is costed with its own split and width
// (decode_layout), and the cheapest taken, the most heads on a tie. The timing model's
// predictions with direct reads, f16 d128 B1 one token, full packing / at most 2 heads a
// threadgroup / 1, in us (PyTorch's kernel in brackets), and the pick: M4 Pro H8/2 S512 19.2 /
// 16.9 / 16.3 (17.8): 1; M1 20.6 / 18.0 / 17.8 (18.9): 1; M5 18.6 / 16.5 / 15.9 (17.2): 1; M4
// Pro H8/2 S1024 26.4 / 22.7 / 21.9 (28.7): 1; M4 Pro H32/8 S512 19.2 / 17.7 / 21.9 (25.5): 2;
// M1 H32/8 S512 41.0 / 41.0 / 52.0 (45.7): 4, a tie at the DRAM bound; M5 H32/8 S512 23.8 /
// 23.8 / 41.1 (38.9): 4 (tests/plan/test_decode_plan.py judges the pick by the model). So the best
// packing depends on chip and shape; at long caches (the grid a wave or more) the full packing
// stays. Option "decode_heads_per_tg" = n fixes the packing at the largest fitting divisor of
// the group at most n (the tests force every one); the MMA kernel keeps the full packing.
Cost decode_layout_time(const Common& c, const Decode& dec, const DecodeLayout& layout,
                        int64_t cores, const Options& options) {
  const DecodeSplit& l = layout.split;
  const int64_t packed = layout.packed;
  const int64_t threadgroups = layout.threadgroups * l.splits;
  const int64_t elem = static_cast<int64_t>(dtype_size(c.dtype));
  const int64_t w = l.simdgroups;
  const int64_t resident = std::max<int64_t>(1, decode_resident(c, true, packed, w));
  const bool direct = decode_direct(c, dec, packed, options);
  const Cost pass = decode_pass_time(c, dec, options, direct, packed, threadgroups, w, resident,
                                     cores, l.split_keys);
  const int64_t key_cycles = decode_key_cycles(c.kernel.de, c.kernel.dv, elem, direct);  // tenths
  const Cost kv_bytes = Cost{dec.count} * c.Hkv * std::max<int64_t>(dec.keys, 1) *
                        (c.kernel.de + c.kernel.dv) * elem;
  // The named chip's DRAM rate in tenths of a byte a core-cycle, else kDecodeDramBytes.
  const double described = device_desc(options).dram_bytes_per_core_cycle;
  const int64_t rate = described > 0 ? std::max<int64_t>(1, std::llround(described * 10))
                                     : kDecodeDramBytes * 10;
  const Cost dram = kv_bytes * 100000 / (rate * cores * key_cycles);
  return std::max(pass, dram) + (l.splits > 1 ? decode_merge_time(c, direct) : 0);
}

}  // namespace

DecodeSplit decode_split(const Common& c, const Decode& dec, const Options& options) {
  const int64_t group = c.Hq / c.Hkv;
  const bool vector = decode_vector(group, dec.rows, options);
  const int64_t described = device_desc(options).gpu_cores;
  const int64_t cores = described > 0 ? described : kDecodeDefaultCores;
  const int64_t fixed = static_cast<int64_t>(options.number("decode_heads_per_tg", 0));
  const int64_t most = decode_heads_per_tg(group, dec.rows, fixed > 0 ? fixed : INT64_MAX);
  if (!vector) return decode_layout(c, dec, options, most, vector, cores).split;
  // A packing's layout, costed (decode_layout_time): the wave heuristic's split, or, for the
  // most heads with direct reads (whose costs the fits above measure), one pass where that
  // costs no more (fewer heads keep the heuristic's layout, judged against the most). The
  // heuristic counts waves of compute, but a call at the DRAM floor gains nothing from more
  // partitions and pays the merge's dispatch (M5 H32/32 S512 d128 f16, one token: split 2 and
  // the merge 75.6 us, one pass 65.0, PyTorch's kernel 65.0). The staged kernel (paged and
  // quantized K/V) keeps the heuristic's split: its fixed work is not in its fit, and one pass
  // would be taken where it is slower (M5 H32/8 S4096 d128, full packing: 134.2 against 132.4).
  const bool pinned = options.number("num_splits", 0) > 0;
  const int64_t full = decode_heads_per_tg(group, dec.rows);
  const auto costed = [&](int64_t per_tg, Cost* time) {
    DecodeLayout l = decode_layout(c, dec, options, per_tg, vector, cores);
    *time = decode_layout_time(c, dec, l, cores, options);
    if (l.split.splits > 1 && !pinned && per_tg == full &&
        decode_direct(c, dec, l.packed, options)) {
      const DecodeLayout one = decode_layout(c, dec, options, per_tg, vector, cores, true);
      const Cost t = decode_layout_time(c, dec, one, cores, options);
      if (t <= *time) *time = t, l = one;
    }
    return l;
  };
  Cost best_time = 0;
  DecodeLayout best = costed(most, &best_time);
  if (fixed > 0) return best.split;
  // Fewer heads a threadgroup: the divisors of the group below the full packing, each with its
  // own split and width; the most heads on a tie (the least K/V traffic).
  for (int64_t d = most - 1; d >= 1; --d) {
    if (group % d != 0) continue;
    Cost t = 0;
    const DecodeLayout l = costed(d, &t);
    if (t < best_time) best_time = t, best = l;
  }
  return best.split;
}

void add_decode(const Common& c, const Diagonals& d, const AttnParams& p, const Launch& l,
                const Decode& dec, const Options& options, Plan* plan) {
  const DecodeSplit layout = decode_split(c, dec, options);
  const int64_t splits = layout.splits, split_keys = layout.split_keys;
  const int64_t group = c.Hq / c.Hkv;
  const int64_t per_tg = layout.heads_per_tg;
  AttnDecodeParams dp;
  std::memset(&dp, 0, sizeof(dp));
  dp.fwd = p;
  dp.splits = static_cast<int32_t>(splits);
  dp.split_keys = static_cast<int32_t>(split_keys);
  dp.heads_per_tg = static_cast<int32_t>(per_tg);
  dp.rows = static_cast<int32_t>(dec.rows);
  dp.row_block = static_cast<int32_t>(decode_row_block(dec.rows));
  if (dec.paged) {
    dp.page_size = static_cast<int32_t>(dec.page_size);
    dp.pages = static_cast<int32_t>(dec.pages);
    dp.max_pages = static_cast<int32_t>(dec.max_pages);
    dp.table_stride = static_cast<int32_t>(dec.table_stride);
    dp.k_ps = dec.k_ps;
    dp.v_ps = dec.v_ps;
  }
  const bool split = splits > 1;
  // The forward's specialization (its constants are the decode kernel's too), then decode's own.
  const Dispatch fwd = dispatch(c, d, p, l);
  std::vector<FunctionConstant> constants = fwd.constants;
  constants.push_back(fc_bool(STEEL_ATTN_FC_SPLIT, split));
  constants.push_back(fc_bool(STEEL_ATTN_FC_PAGED, dec.paged));
  const Binding params = bytes_binding(STEEL_ATTN_BUF_PARAMS, &dp, sizeof(dp));
  const int32_t q_slot = 0;
  const Binding sinks = tensor_binding(STEEL_ATTN_BUF_SINKS, l.sinks_slot >= 0 ? l.sinks_slot
                                                                              : q_slot);
  const int32_t part_o_slot = plan->inputs + static_cast<int32_t>(plan->allocations.size());
  if (split) {
    const int64_t partial_rows = dec.count * c.Hq * dec.rows * splits;
    Allocation o;
    o.name = "partial_out";
    o.dtype = DType::Float32;
    o.sizes = {partial_rows, c.Ev};
    Allocation ml = o;
    ml.name = "partial_max_sum";
    ml.sizes = {partial_rows, 2};
    plan->allocations.push_back(o);
    plan->allocations.push_back(ml);
  }

  Dispatch k;
  const bool vector = decode_vector(group, dec.rows, options);
  k.kernel = std::string(vector ? "steel_attention_decode_vector_" : "steel_attention_decode_") +
             dtype_tag(c.dtype) + "_e" + std::to_string(c.kernel.de) + "_v" +
             std::to_string(c.kernel.dv);
  k.constants = constants;
  if (vector) {
    k.constants.push_back(fc_int(STEEL_ATTN_FC_DECODE_ROWS, per_tg * decode_row_block(dec.rows)));
    k.constants.push_back(fc_int(STEEL_ATTN_FC_DECODE_SIMDGROUPS, layout.simdgroups));
    k.constants.push_back(fc_bool(STEEL_ATTN_FC_DECODE_DIRECT,
                                  decode_direct(c, dec, per_tg * decode_row_block(dec.rows),
                                                options)));
  }
  for (const Binding& b : fwd.bindings) {
    if (b.index == STEEL_ATTN_BUF_PARAMS) {
      k.bindings.push_back(params);
    } else if (b.index == STEEL_ATTN_BUF_CU_K && dec.paged) {
      // Declared by every varlen pipeline, never read by a paged one: cu_seqlens_q stands in.
      k.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_CU_K, l.cu_q_slot));
    } else {
      k.bindings.push_back(b);  // q .. lse, cu_seqlens
    }
  }
  if (dec.paged) {
    k.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_TABLE, dec.table_slot));
    k.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_SEQUSED, dec.seqused_slot));
  }
  if (split) {
    k.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_PART_O, part_o_slot));
    k.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_PART_ML, part_o_slot + 1));
  }
  k.grid[0] = static_cast<uint32_t>(splits * ceil_div(std::max<int64_t>(dec.rows, 1),
                                                       decode_row_block(dec.rows)));
  k.grid[1] = static_cast<uint32_t>(c.Hkv * (group / per_tg));
  k.grid[2] = static_cast<uint32_t>(dec.count);
  k.threads[0] = static_cast<uint32_t>(32 * layout.simdgroups);
  plan->dispatches.push_back(k);
  if (!split) return;

  Dispatch m;
  m.kernel = std::string("steel_attention_decode_merge_") + dtype_tag(c.dtype);
  m.constants = constants;
  m.bindings = {sinks, tensor_binding(STEEL_ATTN_BUF_OUT, l.out_slot),
                tensor_binding(STEEL_ATTN_BUF_LSE, l.lse_slot), params};
  if (l.varlen) m.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_CU_Q, l.cu_q_slot));
  m.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_PART_O, part_o_slot));
  m.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_PART_ML, part_o_slot + 1));
  m.grid[0] = static_cast<uint32_t>(dec.rows);
  m.grid[1] = static_cast<uint32_t>(c.Hq);
  m.grid[2] = static_cast<uint32_t>(dec.count);
  m.threads[0] = 32;
  plan->dispatches.push_back(m);
}

bool decode_length_class(const TensorList& tensors, const Options& options, std::string* cls,
                         int64_t* S) {
  if (tensors.size() != 5 || !tensors[0] || !tensors[1] || !tensors[2]) return false;
  const TensorDesc& q = *tensors[0];
  const TensorDesc& k = *tensors[1];
  const TensorDesc& v = *tensors[2];
  const int64_t nd = q.dim();
  if (nd < 3 || k.dim() != nd || v.dim() != nd || q.strides.size() != q.sizes.size() ||
      k.strides.size() != k.sizes.size() || v.strides.size() != v.sizes.size()) {
    return false;
  }
  const int64_t keys = k.sizes[nd - 2];
  if (v.sizes[nd - 2] != keys || keys < 1 || keys > kInt32Max / 2 ||
      !check_dtypes("sdpa", q, k, v).empty()) {
    return false;
  }
  for (const TensorDesc* t : {&k, &v}) {  // read in place (read_in_place copies the others)
    if (t->sizes.back() != 1 && t->strides.back() != 1) return false;
  }
  const int64_t Hkv = k.sizes[nd - 3];
  if (Hkv == 0 || q.sizes[nd - 3] % Hkv != 0 || v.sizes[nd - 3] != Hkv ||
      k.sizes[nd - 1] != q.sizes[nd - 1] || q.sizes[nd - 2] > kInt32Max / 2) {
    return false;
  }
  for (int64_t d = 0; d < nd - 3; ++d) {
    if (k.sizes[d] != q.sizes[d] || v.sizes[d] != q.sizes[d]) return false;
  }
  const std::optional<TensorDesc>& mask = tensors[3];
  if (mask && (mask->dim() == 0 || mask->strides.size() != mask->sizes.size() ||
               (mask->sizes.back() != keys && mask->sizes.back() != 1))) {
    return false;  // no mask of every length: the planner refuses it, for this call only
  }
  Common c;
  Plan scratch;
  if (!common("sdpa", q.dtype, q.sizes[nd - 3], Hkv, q.sizes[nd - 1], v.sizes[nd - 1],
              tensors[4], 4, options, &c, &scratch)
           .empty()) {
    return false;
  }
  const int64_t L = q.sizes[nd - 2];
  int64_t count = 1;
  for (int64_t d = 0; d < nd - 3; ++d) count *= q.sizes[d];
  if (L == 0 || count == 0 || c.Hq == 0 || !decode_serves(c, L, options)) return false;
  Decode dec;
  dec.rows = L;
  dec.keys = keys;
  dec.count = count;
  dec.kv_alias = kv_alias(c, k, v);
  const DecodeSplit split = decode_split(c, dec, options);
  const Diagonals diag = diagonals(c, L + keys);
  // A mask over the keys holds S in its last dim (and, row-major, in its strides above it); a
  // last dim of 1 (at S = 1 too) broadcasts, with a key stride of 0 at every S.
  const int64_t mask_class = !mask ? 0 : mask->sizes.back() == 1 ? 1 : row_major(*mask) ? 2 : 3;
  // Key and value each grown by torch.cat or each a view: one of each is a decode stream too
  // (a cat-grown key beside a value cache view), and each one's strides rescale on their own.
  const int64_t fields[] = {split.splits,      split.split_keys,        split.simdgroups,
                            split.heads_per_tg, keys % key_tile(c) == 0, diag.has_hi,
                            diag.has_lo,        row_major(k),            row_major(v),
                            mask_class};
  // Row-major key and value strides above the key dim hold S, but their alignment (what the
  // planner reads of them: vectorized loads) is their row stride's, which does not.
  cls->append(reinterpret_cast<const char*>(fields), sizeof fields);
  *S = keys;
  return true;
}

namespace {

// A row-major key's, value's or mask's stride above the key dim, made for `from` keys, for `to`
// keys: a product of dims that include the key dim (so a multiple of `from`), or 0 where
// broadcast.
steel_i64 rescaled(steel_i64 stride, int64_t from, int64_t to) { return stride / from * to; }

}  // namespace

void set_decode_length(Plan* plan, const TensorList& tensors, const Options& options) {
  const TensorDesc& k = *tensors[1];
  const int64_t S = k.sizes[k.dim() - 2];
  // Grown by torch.cat (see the header), each on its own: decode_length_class keys them apart.
  const bool k_grown = row_major(k);
  const bool v_grown = row_major(*tensors[2]);
  const std::optional<TensorDesc>& mask = tensors[3];
  const bool mask_grown = mask && mask->sizes.back() != 1 && row_major(*mask);
  const bool bottom_right = options.number("bottom_right", 0.0) != 0.0;
  for (Dispatch& d : plan->dispatches) {
    for (Binding& b : d.bindings) {
      if (b.kind != Binding::Kind::Bytes || b.index != STEEL_ATTN_BUF_PARAMS ||
          b.bytes.size() != sizeof(AttnDecodeParams)) {
        continue;
      }
      AttnDecodeParams dp;
      std::memcpy(&dp, b.bytes.data(), sizeof dp);
      const int64_t from = dp.fwd.S;
      if (k_grown) {
        for (int32_t i = 0; i < dp.fwd.batch_ndim; ++i) {
          dp.fwd.k_bs[i] = rescaled(dp.fwd.k_bs[i], from, S);
        }
        dp.fwd.k_hs = rescaled(dp.fwd.k_hs, from, S);
      }
      if (v_grown) {
        for (int32_t i = 0; i < dp.fwd.batch_ndim; ++i) {
          dp.fwd.v_bs[i] = rescaled(dp.fwd.v_bs[i], from, S);
        }
        dp.fwd.v_hs = rescaled(dp.fwd.v_hs, from, S);
      }
      if (mask_grown) {  // its strides above the key dim are multiples of S, or 0
        for (int32_t i = 0; i < dp.fwd.batch_ndim; ++i) {
          dp.fwd.m_bs[i] = rescaled(dp.fwd.m_bs[i], from, S);
        }
        dp.fwd.m_hs = rescaled(dp.fwd.m_hs, from, S);
        dp.fwd.m_rs = rescaled(dp.fwd.m_rs, from, S);
      }
      dp.fwd.S = static_cast<int32_t>(S);
      dp.fwd.shift = static_cast<int32_t>(bottom_right ? S - dp.fwd.L : 0);
      std::memcpy(b.bytes.data(), &dp, sizeof dp);
    }
  }
}

}  // namespace attn
}  // namespace steel
