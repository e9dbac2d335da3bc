// Launch planning for the attention forward (shaders/steel/attn/attention.metal): the dense
// planner, registered as "sdpa" (attention_plan.cpp), and the packed variable-length one,
// registered as "sdpa_varlen" (varlen_plan.cpp). Both plan the same kernel; the pieces they
// decide the same way are the steel::attn helpers below. Both hand few query rows to the decode
// kernels (decode_plan.cpp); their backwards are attention_backward_plan.cpp's and
// varlen_plan.cpp's.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "../../shaders/steel/params.h"
#include "plan.h"

namespace steel {

// tensors: [q, k, v, attn_mask, sinks] (mask and sinks optional), q [*batch, Hq, L, E],
// k [*batch, Hkv, S, E], v [*batch, Hkv, S, Ev], attn_mask broadcasting to [*batch, Hq, L, S],
// sinks [Hq]; options as torch_steel.ops passes them (dropout_p, is_causal, scale, softcap,
// window_left, window_right, bottom_right, ...). Outputs: out [*batch, Hq, L, Ev] in q's dtype
// and memory layout, lse float32 [*batch, Hq, L].
Plan plan_attention(const TensorList& tensors, const Options& options);

// The backward (shaders/steel/attn/attention_backward.metal), registered as "sdpa_backward":
// tensors [grad_out, q, k, v, out, lse, attn_mask, sinks, grad_lse] (mask, sinks, grad_lse
// optional), the forward's options. Outputs dq, dk, dv in q's, k's, v's shapes and dtype, and
// dsinks in the sinks' dtype when sinks are given; an fp32 scratch of O(L).
Plan plan_attention_backward(const TensorList& tensors, const Options& options);

// tensors: [q, k, v, cu_seqlens_q, cu_seqlens_k, sinks] (sinks optional), q [total_q, Hq, E],
// k [total_k, Hkv, E], v [total_k, Hkv, Ev], cu_seqlens int32 [sequences + 1] (read by the
// kernel only); options as for sdpa plus max_seqlen_q, max_seqlen_k. Outputs: out
// [total_q, Hq, Ev] in q's dtype, lse float32 [Hq, total_q]. One dispatch for the whole batch.
Plan plan_attention_varlen(const TensorList& tensors, const Options& options);

// The varlen backward, registered as "sdpa_varlen_backward": tensors [grad_out, q, k, v, out,
// lse, cu_seqlens_q, cu_seqlens_k, sinks, grad_lse] (sinks, grad_lse optional), the varlen
// forward's options. Outputs dq, dk, dv packed like q, k, v, dsinks when sinks are given; an
// fp32 scratch of 2 * Hq * total_q.
Plan plan_attention_varlen_backward(const TensorList& tensors, const Options& options);

namespace attn {

// Threads per threadgroup of the simdgroup kernels: the forward, decode and backward ones.
constexpr int64_t kThreads = 32 * STEEL_ATTN_SIMDGROUPS;

// A (DE, DV) head-dim pair instantiated in attention.metal.
struct HeadDims {
  int de, dv;
};

// What every attention plan derives the same way from the dtypes, head dims, sinks and options.
struct Common {
  DType dtype = DType::Float32;
  HeadDims kernel = {0, 0};  // the instantiation that serves (E, Ev)
  int64_t E = 0, Ev = 0, Hq = 0, Hkv = 0;
  bool is_causal = false;
  bool bottom_right = false;
  double scale = 0.0;
  double softcap = 0.0;  // 0: off
  int64_t window_left = -1, window_right = -1;  // -1: unbounded side
  int sinks_kind = kSteelAttnOperandNone;
  double dropout_p = 0.0;  // 0: off
  uint32_t seed_lo = 0, seed_hi = 0, drop_offset = 0;
  // The prefill runs on the matmul2d kernel (shaders/steel/attn_tensor/): set by the planners
  // from tensor_serves, after the decode kernels declined.
  bool tensor_ops = false;
  // The forward stores lse (STEEL_ATTN_FC_LSE): the run option "lse" (default 1) = 0 turns it
  // off when nothing will read it.
  bool lse = true;
};

// The refusal of q, k, v dtypes that the kernels do not take ("" when they do).
std::string check_dtypes(const char* op, const TensorDesc& q, const TensorDesc& k,
                         const TensorDesc& v);

// Fills `c` from shapes already checked to make an attention, the sinks (in slot `sinks_slot`,
// listed in plan->contiguous_inputs when they need a copy) and the options, or returns the
// refusal: head dims without an instantiation, dropout, options the pipeline cannot take.
std::string common(const char* op, DType dtype, int64_t Hq, int64_t Hkv, int64_t E, int64_t Ev,
                   const std::optional<TensorDesc>& sinks, int32_t sinks_slot,
                   const Options& options, Common* c, Plan* plan);

// The kernels read q, k, v in place when their last stride is 1; otherwise the host copies the
// tensor in `slot` (listed in plan->contiguous_inputs) and `t` becomes the copy's layout.
void read_in_place(TensorDesc* t, int32_t slot, Plan* plan);

// Row i sees keys [i + shift - lo_off, i + shift + hi_off], each side where it is set.
struct Diagonals {
  bool has_hi = false, has_lo = false;
  int64_t hi_off = 0, lo_off = 0;
};
// The causal and window sides of `c`. `reach` bounds L + S of every block: a window side at
// least that wide hides nothing and is dropped, which also keeps every bound within 32 bits.
Diagonals diagonals(const Common& c, int64_t reach);

// AttnParams with the head dims, heads, diagonals, score factors (shaders/steel/attn/score.h;
// `additive`: an additive mask keeps scores in nats) and q, k, v's head and row strides (dims
// head_dim and row_dim); the caller adds L, S, shift, the batch, the mask and the output strides.
AttnParams base_params(const Common& c, const Diagonals& d, bool additive, const TensorDesc& q,
                       const TensorDesc& k, const TensorDesc& v, int64_t head_dim,
                       int64_t row_dim);

// Whether every row start of `t` (dims head_dim and row_dim, plus `more` strides) is 16-byte
// aligned, so that the tile loader moves whole chunks (STEEL_ATTN_FC_VEC_K/V, and the
// backward's STEEL_ATTN_FC_VEC_Q/G).
bool vec_rows(const Common& c, const TensorDesc& t, int64_t head_dim, int64_t row_dim,
              const int64_t* more = nullptr, size_t count = 0);
bool vec_rows(int elem_bytes, const TensorDesc& t, int64_t head_dim, int64_t row_dim,
              const int64_t* more = nullptr, size_t count = 0);

// The refusal of head dims that the backward kernels do not take ("" when they do).
std::string backward_head_dims(const char* op, int64_t E, int64_t Ev);

// Whether v is a prefix view of k, so that the kernels take their V tile from the K tile
// (STEEL_ATTN_FC_KV_ALIAS): k and v, as the kernel reads them (after any copy), view one
// storage (TensorDesc::storage) from the same offset with the same sizes and strides in every
// dim but the last, both with a last stride of 1, Ev <= E, and the kernel's DV <= DE (the V
// tile's columns lie within the K tile's rows). The simdgroup kernels only: the matmul2d
// prefill reads v itself.
bool kv_alias(const Common& c, const TensorDesc& k, const TensorDesc& v);

// The key tile and the query rows per threadgroup of the kernel that serves `c` (params.h).
int64_t key_tile(const Common& c);
int64_t row_block(const Common& c);

// Whether the matmul2d prefill kernel (shaders/steel/attn_tensor/attention_tensor_msl4.metal)
// serves `c` with params `p`: a device described as Metal 4 + Apple10 with the tensor-op library
// (device.h), float16 or bfloat16, a head-dim pair it is instantiated for, the int32 element
// offsets of its tensor views within range, and not turned off by the option "tensor_ops" = 0
// (the backward's plans, which build on the simdgroup forward's tiles). Everything else keeps
// the simdgroup kernel.
bool tensor_serves(const Common& c, const AttnParams& p, const Options& options);

// The backward on matmul2d (shaders/steel/attn_tensor/attention_backward_tensor_msl4.metal):
// its dK/dV, dQ and dmask kernels serve a backward exactly where the same call's forward runs
// on matmul2d, i.e. where `fwd` (the forward planned with the backward's options, decode off)
// dispatches the matmul2d kernel, and grad_out's rows (`g_rs` apart, Ev wide) keep its views'
// int32 offsets. The delta pre-pass and dsinks kernels stay the simdgroup ones (their work is
// per row, no product to put on matmul2d). tensor_backward_constants rewrites the backward's
// constants with the tile alignments of that forward (its tiles are the matmul2d kernel's).
bool tensor_backward(const Plan& fwd, int64_t g_rs, int64_t Ev);
std::vector<FunctionConstant> tensor_backward_constants(const Plan& fwd,
                                                        std::vector<FunctionConstant> constants);

// How the dispatch specializes the kernel, and which slots it binds.
struct Launch {
  bool align_l = false, align_s = false, vec_k = false, vec_v = false;
  int mask_kind = kSteelAttnMaskNone;
  bool has_batch = false;
  bool varlen = false, varlen_br = false;
  bool kv_alias = false;  // attn::kv_alias
  int32_t mask_slot = -1, sinks_slot = -1;  // -1: absent (q stands in)
  int32_t out_slot = -1, lse_slot = -1;
  int32_t cu_q_slot = -1, cu_k_slot = -1;  // varlen only
  uint32_t grid[3] = {1, 1, 1};  // (query blocks, Hq, batch entries or sequences)

  // The grid for `rows` query rows (a block of row_block(c) per threadgroup), `heads` query
  // heads and `count` batch entries or sequences.
  void set_grid(const Common& c, int64_t rows, int64_t heads, int64_t count) {
    grid[0] = static_cast<uint32_t>(ceil_div(rows, row_block(c)));
    grid[1] = static_cast<uint32_t>(heads);
    grid[2] = static_cast<uint32_t>(count);
  }
};
// The kernel's dispatch: host name, function constants, bindings in buffer order, threads.
Dispatch dispatch(const Common& c, const Diagonals& d, const AttnParams& p, const Launch& l);


// ---- Decode (shaders/steel/attn/decode.metal; decode_plan.cpp) ----
//
// At most STEEL_ATTN_DECODE_MAX_L query rows per (batch entry, head), no dropout: the decode
// kernels serve the call (a paged cache: any number of rows, in blocks of 32). The query heads
// of one KV head share a threadgroup (heads_per_tg of them: the largest divisor of the group
// with heads_per_tg * min(rows, 32) <= 32; for the vector kernel a smaller divisor where the
// timing model's costs say more threadgroups pay for re-reading K and V, decode_plan.cpp
// decode_layout_time; option "decode_heads_per_tg" caps it, 0 the planner's choice), and the
// keys are split into partitions when the (batch entry, KV head) threadgroups alone would not
// fill whole waves of cores x the decode threadgroups resident per core (its threads,
// threadgroup memory and registers: decode_plan.cpp), so that the grid, merge included, comes
// closest to whole waves, with at least kDecodeMinSplitKeys keys a partition and at most
// STEEL_ATTN_DECODE_MAX_SPLITS. The core count is the device description's "gpu_cores"
// (device.h: the Metal host reads the GPU's from the IORegistry, sim.predict passes its chip's);
// where it is unknown, kDecodeDefaultCores, the base M2, M3, M4 and M5 GPUs' count. The option
// "num_splits" fixes the count (1: one pass, so a sequence's result does not depend on the rest
// of the batch), and "decode" = 0 keeps the prefill kernel (the backward's plan builds on it).
constexpr int64_t kDecodeDefaultCores = 10;
constexpr int64_t kDecodeMinSplitKeys = 256;
// The vector decode's one-pass wide threadgroups against a split (decode_plan.cpp
// decode_simdgroups), from the simulator's counters of the vector kernel (f16, S = 512, one pass;
// the fp pipe's cycles, which bind there): each key set a block adds costs kDecodeKeySetWork per
// mille of a 4-simdgroup block's work (d128 1 x 4 row x key sets, 1 row: 8 and 16 simdgroups
// 1.137x and 1.426x the 4-simdgroup block's; 4 rows 1.173x, 1.528x; d64 2 x 2, 1 row 1.080x,
// 1.247x; 4 rows 1.097x, 1.294x: 4.0%, 3.6%, 4.4%, 3.5%, 4.0%, 4.1%, 4.9%, 4.9% a key set).
// The merge dispatch's 10 us of overhead (chips.json dispatch_overhead_s) is kDecodeMergeCycles
// core cycles, 12.8k to 15.8k at the table's clocks: decode_plan.cpp decode_merge_time converts
// them into keys of one 4-simdgroup block's work at full ALU efficiency by the block's cycles a
// key (decode_key_cycles: with direct reads f16 d64, 5.9 cycles, that is 2373 keys; it was a
// fixed 640 keys, the staged kernel's 21.6 cycles then, which put a split's merge at a quarter
// of its cost against direct reads' one pass).
constexpr int64_t kDecodeMergeCycles = 14000;
constexpr int64_t kDecodeKeySetWork = 40;
// With direct reads (decode_plan.cpp decode_direct) a key set's tiles are its own and only the
// combining rounds grow with the key sets: the timing model's fp pipe (sim.predict, M4 Pro, f16,
// S = 2048 one pass, one row) puts 8 and 16 simdgroups at 1.019x and 1.060x a 4-simdgroup
// block's at d64, 1.021x and 1.065x at d128: 4.9 to 5.4 per mille a key set (staged there:
// 26.5 to 31.5).
constexpr int64_t kDecodeDirectKeySetWork = 5;
// The vector decode's GQA packing (decode_plan.cpp decode_layout_time), from the same counters
// (S = 512, one pass, 4 simdgroups, 1 to 8 packed rows): each packed row past the first adds
// kDecodeRowWork per mille of a one-row block's fp-pipe cycles a key (f16 d64 / d128 / d256
// 15%, 20%, 17%; f32 17%, 18%, 16%; 16 simdgroups, f16 d128: 24%); the block reads
// kDecodeParamBytes of the params struct a key and simdgroup beside its K and V (12.5 to 20).
constexpr int64_t kDecodeRowWork = 200;
// With direct reads a key's fixed work is smaller and a row's larger in proportion: 325 (f16
// d64), 371 (f16 d128), 392 (f32 d64), 494 (f32 d128) per mille a packed row past the first (the
// timing model's fp pipe, sim.predict, M4 Pro, one pass, S = 512 -> 1024, 1 to 8 rows).
constexpr int64_t kDecodeDirectRowWork = 370;
// A direct-read block's fixed work (the prologue's q and params reads, the key sets' combining
// rounds, the epilogue), in fp-pipe cycles a simdgroup of one packed row, and per mille more a
// packed row past the first: the same fit's intercepts (S = 256 -> 512) at 4, 8 and 16
// simdgroups, 65 to 73 cycles a simdgroup at one row (f16 d64, d128, f32 d64), 81 to 99 at two.
// At a short cache it is most of a wide block's work (f16 d64 8 simdgroups: 568 cycles, 97 keys'
// worth), so decode_simdgroups and decode_layout_time count it.
constexpr int64_t kDecodeDirectSimdgroupCycles = 70;
constexpr int64_t kDecodeDirectFixedRowWork = 250;
// DRAM bytes a core-cycle, the whole GPU's bandwidth over its cores and clock: the K/V read's
// floor, the same for every packing, which decides where one packing needs a split's merge and
// another not. The named chip's rate where the plans know it (device.h,
// chip_dram_bytes_per_core_cycle: 6.25 on M3 Max, 6.4 on M3 Ultra, 6.7 on M1 to 9.3 on M4 Pro
// and 9.7 on M5 and M5 Max), else this.
constexpr int64_t kDecodeDramBytes = 8;
constexpr int64_t kDecodeParamBytes = 16;
// With direct reads the prologue reads the params struct once a lane (decode_vector.h, "read
// once"): 125 bytes a lane of the counters' constant_read (f16 d64 and d128, one packed row, at
// S = 128 and 512 alike), whatever the keys. At a short cache that is most of a wide block's
// traffic through the L2 (M5 B1 H8/2 S128 d64: 500 KB against 256 KB of K and V at 16
// simdgroups), which decode_simdgroups weighs against the wider block's ALU efficiency.
constexpr int64_t kDecodeDirectParamBytes = 125;

// Whether the decode kernels serve `rows` query rows per (batch entry, head): at most
// STEEL_ATTN_DECODE_MAX_L rows and no dropout. A call they do not serve is not refused: a
// dense or varlen call with dropout and few rows runs the prefill kernel (only a paged cache,
// which has no prefill path, refuses dropout; varlen_plan.cpp).
bool decode_serves(const Common& c, int64_t rows, const Options& options);

// What a decode launch adds to the forward's: the shape it is split over and the paged cache.
struct Decode {
  int64_t rows = 0;   // query rows per (batch entry, head): L, or max_seqlen_q (varlen)
  int64_t keys = 0;   // keys of the longest sequence: S, or max_seqlen_k (varlen, paged)
  int64_t count = 0;  // batch entries or sequences
  bool paged = false;
  bool kv_alias = false;  // Launch::kv_alias: V is K's tile (no direct reads)
  int32_t table_slot = -1, seqused_slot = -1;  // paged only
  int64_t page_size = 0, pages = 0, max_pages = 0, table_stride = 0, k_ps = 0, v_ps = 0;
};

// How a decode call is laid out: the partitions of the keys, the keys per partition (a
// multiple of the key tile), and the vector kernel's simdgroups a threadgroup
// (STEEL_ATTN_FC_DECODE_SIMDGROUPS; STEEL_ATTN_SIMDGROUPS for the MMA kernel).
struct DecodeSplit {
  int64_t splits = 1;
  int64_t split_keys = 0;
  int64_t simdgroups = STEEL_ATTN_SIMDGROUPS;
  int64_t heads_per_tg = 1;  // query heads of one KV head a threadgroup (AttnDecodeParams)
};
DecodeSplit decode_split(const Common& c, const Decode& dec, const Options& options);

// Appends the decode dispatches to `plan` (whose allocations hold out and lse, in the slots of
// `l`): one pass, or the partial kernel and the merge with their fp32 scratch of
// count * Hq * rows * splits * (Ev + 2) floats allocated after them.
void add_decode(const Common& c, const Diagonals& d, const AttnParams& p, const Launch& l,
                const Decode& dec, const Options& options, Plan* plan);

// ---- One decode plan for every key length (the plan cache, plan_cache.cpp) ----
//
// A decode stream calls sdpa with one more key per token, on views of a KV cache whose strides
// stay, or on a key and value that grow by torch.cat (row-major: their strides above the key
// dim are S times what they are for one key), with or without a mask over the keys (a view,
// or made anew per token: row-major). The plan of such a call depends on the key length S
// only through what decode_length_class puts in `cls` (the partition count and keys per
// partition, the vector kernel's width and heads a threadgroup, whether S is a multiple of the
// key tile, which window diagonals bound the rows, whether key and value are each row-major, what
// the mask is) and through fields of its
// AttnDecodeParams (S, the shift, and for row-major key, value and mask their strides above
// the key dim, which merge the same way for every S): two calls that differ only in S and
// agree on `cls` have plans that differ only there. Returns false (and the call keeps its
// exact key) for anything else: no decode kernel, a mask whose last dim is neither S nor 1,
// key or value copied before the launch (the copy's strides hold S), no keys, an empty batch,
// a refused plan.
bool decode_length_class(const TensorList& tensors, const Options& options, std::string* cls,
                         int64_t* S);
// Rewrites a decode plan that decode_length_class accepted, with the same `cls`, for the key
// length of `tensors`.
void set_decode_length(Plan* plan, const TensorList& tensors, const Options& options);

// A decode stream over a paged KV cache calls sdpa_varlen with max_seqlen_k one more per token.
// Its plan reads max_seqlen_k (`max_keys`) only for what paged_length_class puts in `cls` (the
// partition count and keys per partition, the width and heads a threadgroup, the window
// diagonals over max_seqlen_q + max_seqlen_k): two calls that differ only there and agree on
// `cls` have the same plan.
// Returns false for anything else (not a paged call, options the planner refuses).
bool paged_length_class(const TensorList& tensors, const Options& options, std::string* cls,
                        int64_t* max_keys);

}  // namespace attn
}  // namespace steel
