// Parameter structs and constants shared by the shaders and the host planners.
//
// Compiled two ways: as MSL (by the Metal compiler, and by the simulator whose shim defines
// __METAL_VERSION__) and as plain C++17 by mps_src/plan. Both must agree on every byte, hence the
// static_asserts at the end. Only fixed-width 32-bit fields: no pointers, no size_t, no padding.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstddef>
#include <cstdint>
#endif

// ---- GEMM ------------------------------------------------------------------------------------

// Batch dims of a GEMM after the planner merges the ones it can (see gemm_plan.cpp).
#define STEEL_GEMM_MAX_BATCH_DIMS 4
// The GEMV kernels (gemm/gemv.h) serve outputs with at most this many rows (or columns); each
// simdgroup owns STEEL_GEMV_LINES weight lines and reads STEEL_GEMV_VEC elements per access.
#define STEEL_GEMV_MAX_ROWS 8
#define STEEL_GEMV_LINES 4
#define STEEL_GEMV_VEC 4
// Simdgroups of a GEMV threadgroup (gemv_nn_block sizes its threadgroup memory by it), and the
// columns of W one threadgroup of steel_gemv_nn_ owns (8 lanes of STEEL_GEMV_VEC columns).
#define STEEL_GEMV_SIMDGROUPS 4
#define STEEL_GEMV_NN_COLS 32

// Function-constant indices of the GEMM kernels ([[function_constant(N)]] in gemm.metal).
#define STEEL_GEMM_FC_HAS_BATCH 100   // bool: batch offsets are computed from tid.z
#define STEEL_GEMM_FC_USE_C 110       // bool: beta * c is added (beta != 0 and c given)
#define STEEL_GEMM_FC_HAS_BIAS 111    // bool: bias[N] is added
#define STEEL_GEMM_FC_ACTIVATION 112  // int: a SteelActivation value
#define STEEL_GEMM_FC_ALIGN_M 200     // bool: M % BM == 0 (no edge tiles along M)
#define STEEL_GEMM_FC_ALIGN_N 201     // bool: N % BN == 0
#define STEEL_GEMM_FC_ALIGN_K 202     // bool: K % BK == 0 (no partial K step)
#define STEEL_GEMM_FC_VEC_A 210       // bool: a's rows may be read as vectors (see below)
#define STEEL_GEMM_FC_VEC_B 211       // bool: b's rows may be read as vectors

// Buffer indices of the GEMM kernels. The split-K reduction reads the partials at
// STEEL_GEMM_BUF_A and writes STEEL_GEMM_BUF_OUT.
#define STEEL_GEMM_BUF_A 0
#define STEEL_GEMM_BUF_B 1
#define STEEL_GEMM_BUF_C 2
#define STEEL_GEMM_BUF_BIAS 3
#define STEEL_GEMM_BUF_OUT 4
#define STEEL_GEMM_BUF_PARAMS 5

// Elements one thread of a GEMM block loader (shaders/steel/gemm/loader.h) copies per access:
// its share of the tile (tile_elems / threads), at most 16 bytes. The loader moves them as one
// unsigned vector of vec * elem_bytes bytes, so with STEEL_GEMM_FC_VEC_A/B set every row start
// of that operand must be a multiple of vec * elem_bytes bytes; the planner checks exactly this.
constexpr int steel_gemm_loader_vec(int tile_elems, int threads, int elem_bytes) {
  return tile_elems / threads < 16 / elem_bytes ? tile_elems / threads : 16 / elem_bytes;
}

enum SteelActivation { kSteelActNone = 0, kSteelActRelu = 1, kSteelActGelu = 2,
                       kSteelActGeluTanh = 3, kSteelActSilu = 4 };

// Everything a GEMM kernel needs at run time. Offsets and strides are in elements and fit in 32
// bits (the planner refuses larger tensors), so every index is a 32-bit multiply-add.
struct GemmParams {
  int32_t M;
  int32_t N;
  int32_t K;
  int32_t lda;          // a's stride between rows (columns if transposed) in device memory
  int32_t ldb;          // b's stride between rows (columns if transposed)
  int32_t ldd;          // out's row stride (N: out is contiguous)
  int32_t tiles_m;      // number of BM row tiles
  int32_t tiles_n;      // number of BN column tiles
  int32_t swizzle_log;  // threadgroups are swizzled in bands of 2^swizzle_log tile rows
  int32_t k_split;      // K elements per split-K partition (a multiple of BK); K when not split
  int32_t partial_stride;  // split-K: elements between two partitions' partials (batch * M * N)
  int32_t partitions;      // split-K: number of partitions (1 when not split)
  int32_t c_rs;         // c's stride along M (0 when broadcast)
  int32_t c_cs;         // c's stride along N (0 when broadcast)
  int32_t bias_stride;  // bias's element stride
  float alpha;
  float beta;
  int32_t batch_ndim;   // merged batch dims of out (0 when there is no batch)
  int32_t batch_shape[STEEL_GEMM_MAX_BATCH_DIMS];  // outermost first
  int32_t a_batch_strides[STEEL_GEMM_MAX_BATCH_DIMS];  // 0 where a is broadcast
  int32_t b_batch_strides[STEEL_GEMM_MAX_BATCH_DIMS];
  int32_t c_batch_strides[STEEL_GEMM_MAX_BATCH_DIMS];
  int32_t out_batch_stride;  // M * N
};

static_assert(sizeof(GemmParams) == 140, "GemmParams layout changed: update both sides");
#ifndef __METAL_VERSION__
static_assert(offsetof(GemmParams, alpha) == 60, "GemmParams.alpha moved");
static_assert(offsetof(GemmParams, batch_ndim) == 68, "GemmParams.batch_ndim moved");
static_assert(offsetof(GemmParams, batch_shape) == 72, "GemmParams.batch_shape moved");
static_assert(offsetof(GemmParams, c_batch_strides) == 120, "GemmParams.c_batch_strides moved");
static_assert(offsetof(GemmParams, out_batch_stride) == 136, "GemmParams.out_batch_stride moved");
#endif

// ---- Attention (prefill forward) -------------------------------------------------------------

// 64-bit fields: attention offsets are products of batch, heads, length and head dim, which pass
// 2^31 elements in real models (PyTorch's MPS kernels corrupt output silently there).
#ifdef __METAL_VERSION__
typedef long steel_i64;
#else
typedef int64_t steel_i64;
#endif

// Batch dims of an attention call after the planner merges the ones it can.
#define STEEL_ATTN_MAX_BATCH_DIMS 4

// Function-constant indices of the attention kernels (shaders/steel/attn/attention.metal).
#define STEEL_ATTN_FC_ALIGN_L 300    // bool: L % BQ == 0 (no query rows past L in any block)
#define STEEL_ATTN_FC_ALIGN_S 301    // bool: S % BK == 0 (no partial key tile)
#define STEEL_ATTN_FC_ALIGN_E 302    // bool: E == the kernel's head dim (no head-dim bound)
#define STEEL_ATTN_FC_ALIGN_EV 303   // bool: Ev == the kernel's value head dim
#define STEEL_ATTN_FC_VEC_K 304      // bool: every key row start is 16-byte aligned
#define STEEL_ATTN_FC_VEC_V 305      // bool: every value row start is 16-byte aligned
#define STEEL_ATTN_FC_MASK 310       // int: a SteelAttnMask value
#define STEEL_ATTN_FC_HAS_HI 311     // bool: keys beyond a diagonal are hidden (causal, right window)
#define STEEL_ATTN_FC_HAS_LO 312     // bool: keys before a diagonal are hidden (left window)
#define STEEL_ATTN_FC_SINKS 313      // int: a SteelAttnOperand value for the sinks buffer (0: none)
#define STEEL_ATTN_FC_SOFTCAP 314    // bool: scores pass through softcap * tanh(s / softcap)
#define STEEL_ATTN_FC_HAS_BATCH 315  // bool: batch offsets are computed from tg.z
#define STEEL_ATTN_FC_VARLEN 316     // bool: packed sequences, each found from cu_seqlens (tg.z)
#define STEEL_ATTN_FC_VARLEN_BR 317  // bool: varlen diagonals align bottom-right per sequence
#define STEEL_ATTN_FC_DROPOUT 318    // bool: attention weights are dropped (dropout.h)
// bool: v is the first Ev columns of k's rows (the same storage, offset and strides, Ev <= E:
// multi-head latent attention's cache), so the kernel takes its V tile from the K tile it has
// loaded and never reads v's buffer. The planner sets it (attn::kv_alias), never the caller.
#define STEEL_ATTN_FC_KV_ALIAS 319
// bool: the forward stores lse (out's log-sum-exp per row). Off when nothing reads it (no
// backward will, return_lse is off): the op's run option "lse" = 0. The split decode's partial
// maxima and sums, which the merge needs, are stored either way.
#define STEEL_ATTN_FC_LSE 326

// Buffer indices of the attention kernels.
#define STEEL_ATTN_BUF_Q 0
#define STEEL_ATTN_BUF_K 1
#define STEEL_ATTN_BUF_V 2
#define STEEL_ATTN_BUF_MASK 3
#define STEEL_ATTN_BUF_SINKS 4
#define STEEL_ATTN_BUF_OUT 5
#define STEEL_ATTN_BUF_LSE 6
#define STEEL_ATTN_BUF_PARAMS 7
#define STEEL_ATTN_BUF_CU_Q 8  // varlen only: int32 [sequences + 1] query offsets
#define STEEL_ATTN_BUF_CU_K 9  // varlen only: int32 [sequences + 1] key/value offsets

// What the mask buffer holds. Additive masks are the query's dtype or float32, as F.sdpa takes
// them; the kernel reads the buffer as bytes and converts (one kernel serves every mask dtype).
enum SteelAttnMask { kSteelAttnMaskNone = 0, kSteelAttnMaskBool = 1, kSteelAttnMaskAdd = 2,
                     kSteelAttnMaskAddF32 = 3 };
// The element type of a small float operand (sinks): the query's dtype or float32.
enum SteelAttnOperand { kSteelAttnOperandNone = 0, kSteelAttnOperandT = 1,
                        kSteelAttnOperandF32 = 2 };

// The tiling of the prefill forward. A threadgroup owns BQ = 8 * kSteelAttnSimdgroups query
// rows (8 per simdgroup, every simdgroup holding its rows' Q and O fragments for the whole head
// dim in registers) and streams K and V through threadgroup memory BK keys at a time. Rows of
// the K and V tiles are padded by 16 bytes against bank conflicts of the column-wise fragment
// reads. BK is the largest of 32 and 16 for which separate K and V tiles fit the budget (two
// barriers per key tile); failing that, K and V share one buffer (four barriers per tile) with
// the largest BK of 32, 16, 8 that fits. The budget keeps two threadgroups per GPU core.
#define STEEL_ATTN_SIMDGROUPS 4
#define STEEL_ATTN_BQ (8 * STEEL_ATTN_SIMDGROUPS)
#define STEEL_ATTN_TG_BUDGET 20480

constexpr int steel_attn_ld(int d, int elem_bytes) { return d + 16 / elem_bytes; }
constexpr int steel_attn_separate_bytes(int bk, int de, int dv, int elem_bytes) {
  return bk * (steel_attn_ld(de, elem_bytes) + steel_attn_ld(dv, elem_bytes)) * elem_bytes;
}
constexpr int steel_attn_shared_bytes(int bk, int de, int dv, int elem_bytes) {
  return bk * (de > dv ? steel_attn_ld(de, elem_bytes) : steel_attn_ld(dv, elem_bytes)) *
         elem_bytes;
}
// True when K and V take turns in one buffer.
constexpr bool steel_attn_shared_kv(int de, int dv, int elem_bytes) {
  return steel_attn_separate_bytes(16, de, dv, elem_bytes) > STEEL_ATTN_TG_BUDGET;
}
constexpr int steel_attn_bk(int de, int dv, int elem_bytes) {
  return !steel_attn_shared_kv(de, dv, elem_bytes)
             ? (steel_attn_separate_bytes(32, de, dv, elem_bytes) <= STEEL_ATTN_TG_BUDGET ? 32 : 16)
         : steel_attn_shared_bytes(32, de, dv, elem_bytes) <= STEEL_ATTN_TG_BUDGET ? 32
         : steel_attn_shared_bytes(16, de, dv, elem_bytes) <= STEEL_ATTN_TG_BUDGET ? 16
                                                                                  : 8;
}
// Threadgroup memory of one threadgroup of the kernel for (de, dv, elem_bytes).
constexpr int steel_attn_threadgroup_bytes(int de, int dv, int elem_bytes) {
  return steel_attn_shared_kv(de, dv, elem_bytes)
             ? steel_attn_shared_bytes(steel_attn_bk(de, dv, elem_bytes), de, dv, elem_bytes)
             : steel_attn_separate_bytes(steel_attn_bk(de, dv, elem_bytes), de, dv, elem_bytes);
}

// The prefill forward's K/V buffer (forward.h, AttnForward<..., true>; the decode kernels keep
// the rule above). A prefill threadgroup is compute-bound, and a core runs it faster the more
// simdgroups it holds (the timing model's ALU efficiency: 0.72 at 12 simdgroups, 1.0 from 24).
// Separate K and V tiles cap residency at f16 head dim 128 to 3 threadgroups (17408 bytes each)
// where its registers allow 5, and at 64 to 6 where they allow 7. So the prefill shares one
// buffer between K and V (two more barriers per key tile, which the timing model does not
// charge: with more threadgroups resident, a core has other simdgroups to run while one waits)
// whenever sharing, at the same BK, lets more threadgroups reside on a core. BK never changes,
// so the plan's key tile (attn::key_tile) is the same for the prefill and the decode kernels.
//
// Residency is the least of a core's 3072 threads, 61440 bytes of threadgroup memory and
// 212992 bytes of registers (torch_steel/sim/chips.json, every chip of the table) over the
// threadgroup's 128 threads. Registers a thread: a MODEL ASSUMPTION (no compiler to ask here),
// mirrored by timing.steel_kernel_info: the prefill keeps Q in operand fragments of the
// inputs' dtype (one 32-bit register a lane for 16-bit types: two halves; two for float), the
// O and score fragments in fp32 (two each), one fp32 operand fragment, and 24 scalars.
constexpr int steel_attn_prefill_registers(int de, int dv, int elem_bytes) {
  return (elem_bytes == 4 ? 2 : 1) * (de / 8) +
         2 * (dv / 8 + steel_attn_bk(de, dv, elem_bytes) / 8 + 1) + 24;
}
constexpr int steel_attn_min(int a, int b) { return a < b ? a : b; }
constexpr int steel_attn_prefill_residency(int tg_bytes, int registers) {
  return steel_attn_min(steel_attn_min(3072 / (32 * STEEL_ATTN_SIMDGROUPS), 61440 / tg_bytes),
                        212992 / (registers * 4 * 32 * STEEL_ATTN_SIMDGROUPS));
}
// The prefill's K and V tiles, K in the inputs' dtype and V in `v_bytes` elements, shared or
// separate.
constexpr int steel_attn_prefill_tile_bytes(int de, int dv, int elem_bytes, int v_bytes,
                                            bool shared) {
  const int bk = steel_attn_bk(de, dv, elem_bytes);
  const int k = bk * steel_attn_ld(de, elem_bytes) * elem_bytes;
  const int v = bk * steel_attn_ld(dv, v_bytes) * v_bytes;
  return shared ? (k > v ? k : v) : k + v;
}
constexpr int steel_attn_prefill_layout_residency(int de, int dv, int elem_bytes, int v_bytes,
                                                  bool shared) {
  return steel_attn_prefill_residency(
      steel_attn_prefill_tile_bytes(de, dv, elem_bytes, v_bytes, shared),
      steel_attn_prefill_registers(de, dv, elem_bytes));
}
// K and V share one buffer, V in `v_bytes` elements.
constexpr bool steel_attn_prefill_shared_as(int de, int dv, int elem_bytes, int v_bytes) {
  return steel_attn_shared_kv(de, dv, elem_bytes) ||
         steel_attn_prefill_layout_residency(de, dv, elem_bytes, v_bytes, true) >
             steel_attn_prefill_layout_residency(de, dv, elem_bytes, v_bytes, false);
}
constexpr int steel_attn_prefill_residency_as(int de, int dv, int elem_bytes, int v_bytes) {
  return steel_attn_prefill_layout_residency(
      de, dv, elem_bytes, v_bytes, steel_attn_prefill_shared_as(de, dv, elem_bytes, v_bytes));
}
// The V tile in fp32 (16-bit inputs): P V multiplies fp32 probabilities, so V's fragments are
// fp32 operands. Widened once, as the loader stores the tile, each element is converted once a
// threadgroup; a tile of the inputs' dtype is widened by each of the four simdgroups, two
// elements a lane per fragment (at f16 head dim 64, 4% of the FP pipe). The tile's bytes grow
// (V's twice), so fp32 only where a core still holds as many threadgroups and within the
// threadgroup-memory budget: at f16 and bf16 head dims 32, 40, 64, 72, 160, 192 and 256 (the
// last three hold as many threadgroups as their registers allow either way).
constexpr bool steel_attn_prefill_v_f32(int de, int dv, int elem_bytes) {
  return elem_bytes < 4 &&
         steel_attn_prefill_tile_bytes(de, dv, elem_bytes, 4,
                                       steel_attn_prefill_shared_as(de, dv, elem_bytes, 4)) <=
             STEEL_ATTN_TG_BUDGET &&
         steel_attn_prefill_residency_as(de, dv, elem_bytes, 4) >=
             steel_attn_prefill_residency_as(de, dv, elem_bytes, elem_bytes);
}
constexpr int steel_attn_prefill_v_bytes(int de, int dv, int elem_bytes) {
  return steel_attn_prefill_v_f32(de, dv, elem_bytes) ? 4 : elem_bytes;
}
constexpr bool steel_attn_prefill_shared_kv(int de, int dv, int elem_bytes) {
  return steel_attn_prefill_shared_as(de, dv, elem_bytes,
                                      steel_attn_prefill_v_bytes(de, dv, elem_bytes));
}
constexpr int steel_attn_prefill_threadgroup_bytes(int de, int dv, int elem_bytes) {
  return steel_attn_prefill_tile_bytes(de, dv, elem_bytes,
                                       steel_attn_prefill_v_bytes(de, dv, elem_bytes),
                                       steel_attn_prefill_shared_kv(de, dv, elem_bytes));
}

// The prefill forward on Metal 4's matmul2d (shaders/steel/attn_tensor/, M5-generation GPUs):
// one threadgroup of STEEL_ATTN_TENSOR_SIMDGROUPS simdgroups, the scope of every tensor
// operation, computes STEEL_ATTN_TENSOR_BQ query rows against key tiles of STEEL_ATTN_TENSOR_BK.
// The operations read Q, K and V from device memory themselves; threadgroup memory holds only
// the probability tile (the left operand of P V, in the inputs' dtype) and one float per row.
#define STEEL_ATTN_TENSOR_SIMDGROUPS 4
#define STEEL_ATTN_TENSOR_BQ 64
#define STEEL_ATTN_TENSOR_BK 32
// The backward's matmul2d dK/dV block (attention_backward_tensor_msl4.metal) holds K and V in
// left-input cooperative tensors and dK, dV in fp32 destination ones, 1.5 * D 32-bit registers
// per thread for every 64 keys of the block (timing.steel_kernel_info's estimate): with 64 keys
// at D = 256 one threadgroup needs 440 registers per thread, more than a core's register file
// holds (212992 bytes, chips.json) for 128 threads; 32 keys need 232 and fit. The dQ and dmask
// blocks stay at STEEL_ATTN_TENSOR_BQ rows (312 registers at D = 256: one threadgroup fits).
constexpr int steel_attn_tensor_bwd_keys(int d) { return d > 128 ? 32 : STEEL_ATTN_TENSOR_BQ; }

// The backward kernels' streamed tiles: Q and dO rows in the dK/dV kernel, K and V rows in the
// dQ and dmask kernels. The dK/dV kernel also stages the tile's rows' lse, delta and
// 1 / normaliser (three floats a row) beside them. Of 32, 16 and 8 rows whose two separate
// tiles and row statistics fit the forward's budget, the tile is the most rows among those
// that let a core hold the most dK/dV threadgroups (steel_attn_bwd_occupancy): fewer rows
// cost the kernel more barriers and loop steps per key, but its score tiles shrink with them,
// and where that frees registers for one more threadgroup the timing model's ALU efficiency
// gains more (f16 L2048 d64 causal on M3 Max, dK/dV 1203 -> 1061 us at 16 rows). Every
// choice divides the forward's key tile (steel_attn_bk), whose STEEL_ATTN_FC_ALIGN_S the dQ
// and dmask kernels take for their own key tiles (tests/sim/test_timing.py). Where not
// even 8 rows fit (float32 at head dim 512), the two take turns in one buffer of 8 rows (the
// dQ and dmask kernels load V, then K; the dK/dV kernel Q, then dO, then Q again) and 0 where
// that does not fit either.
constexpr int steel_attn_bwd_stats_bytes(int bk) { return 3 * bk * 4; }
constexpr bool steel_attn_bwd_fits(int bk, int de, int dv, int elem_bytes) {
  return steel_attn_separate_bytes(bk, de, dv, elem_bytes) + steel_attn_bwd_stats_bytes(bk) <=
         STEEL_ATTN_TG_BUDGET;
}
constexpr bool steel_attn_bwd_shared(int de, int dv, int elem_bytes) {
  return !steel_attn_bwd_fits(8, de, dv, elem_bytes);
}
// Registers a thread of the dK/dV kernel with tiles of bk rows, a MODEL ASSUMPTION mirrored by
// timing.steel_kernel_info: K and V rows as MMA operands of the inputs' dtype (one 32-bit
// register a fragment for 16-bit types, two for float), the dK and dV rows and two score tiles
// of bk keys in fp32 fragments (two each), and 24 scalars.
constexpr int steel_attn_bwd_dkdv_registers(int bk, int de, int dv, int elem_bytes) {
  return (elem_bytes == 4 ? 2 : 1) * (de / 8 + dv / 8) + 2 * (de / 8 + dv / 8 + 2 * (bk / 8)) +
         24;
}
// dK/dV threadgroups a core holds with separate tiles of bk rows (steel_attn_prefill_residency
// of the tiles, their row statistics and the register estimate); 0 where the tiles do not fit,
// 1 where the estimate passes the register file (the compiler would spill), and at most the 24
// simdgroups (768 threads) from which the timing model's ALU efficiency is flat (chips.json's
// alu_occupancy_efficiency): more buys nothing for the shorter tiles' cost.
constexpr int steel_attn_bwd_residency(int bk, int de, int dv, int elem_bytes) {
  return steel_attn_prefill_residency(
      steel_attn_separate_bytes(bk, de, dv, elem_bytes) + steel_attn_bwd_stats_bytes(bk),
      steel_attn_bwd_dkdv_registers(bk, de, dv, elem_bytes));
}
constexpr int steel_attn_bwd_occupancy(int bk, int de, int dv, int elem_bytes) {
  return !steel_attn_bwd_fits(bk, de, dv, elem_bytes) ? 0
         : steel_attn_bwd_residency(bk, de, dv, elem_bytes) < 1
             ? 1
             : steel_attn_min(768 / (32 * STEEL_ATTN_SIMDGROUPS),
                              steel_attn_bwd_residency(bk, de, dv, elem_bytes));
}
// a rows, or b where they let a core hold more dK/dV threadgroups.
constexpr int steel_attn_bwd_best_rows(int a, int b, int de, int dv, int elem_bytes) {
  return steel_attn_bwd_occupancy(b, de, dv, elem_bytes) >
                 steel_attn_bwd_occupancy(a, de, dv, elem_bytes)
             ? b
             : a;
}
constexpr int steel_attn_bwd_bk(int de, int dv, int elem_bytes) {
  return steel_attn_bwd_fits(8, de, dv, elem_bytes)
             ? steel_attn_bwd_best_rows(steel_attn_bwd_best_rows(32, 16, de, dv, elem_bytes), 8,
                                        de, dv, elem_bytes)
         : steel_attn_shared_bytes(8, de, dv, elem_bytes) + steel_attn_bwd_stats_bytes(8) <=
                 STEEL_ATTN_TG_BUDGET
             ? 8
             : 0;
}
// Bytes of the streamed tiles (without the row statistics) for (de, dv, elem_bytes).
constexpr int steel_attn_bwd_tile_bytes(int de, int dv, int elem_bytes) {
  return steel_attn_bwd_shared(de, dv, elem_bytes)
             ? steel_attn_shared_bytes(steel_attn_bwd_bk(de, dv, elem_bytes), de, dv, elem_bytes)
             : steel_attn_separate_bytes(steel_attn_bwd_bk(de, dv, elem_bytes), de, dv,
                                         elem_bytes);
}

// The dQ and dmask kernels' K/V buffer. As the prefill forward's (steel_attn_prefill_shared_kv),
// their two tiles take turns in one buffer (V, then K) whenever that lets more threadgroups
// reside on a core, by the residency rule above: at f16 and bf16 head dim 128, separate tiles
// (17408 bytes) allow 3 where the registers allow 4. The dK/dV kernel keeps the rule above:
// sharing would make it read Q twice. Registers a thread, a MODEL ASSUMPTION mirrored by
// timing.steel_kernel_info: Q and dO rows as MMA operands of the inputs' dtype (one 32-bit
// register a fragment for 16-bit types, two for float), the dQ row and two score tiles in fp32
// fragments (two each), and 24 scalars.
constexpr int steel_attn_bwd_dq_registers(int de, int dv, int elem_bytes) {
  return (elem_bytes == 4 ? 2 : 1) * (de / 8 + dv / 8) +
         2 * (de / 8 + 2 * (steel_attn_bwd_bk(de, dv, elem_bytes) / 8)) + 24;
}
constexpr bool steel_attn_bwd_dq_shared(int de, int dv, int elem_bytes) {
  return steel_attn_bwd_shared(de, dv, elem_bytes) ||
         (steel_attn_bwd_bk(de, dv, elem_bytes) > 0 &&
          steel_attn_prefill_residency(
              steel_attn_shared_bytes(steel_attn_bwd_bk(de, dv, elem_bytes), de, dv, elem_bytes),
              steel_attn_bwd_dq_registers(de, dv, elem_bytes)) >
              steel_attn_prefill_residency(steel_attn_separate_bytes(
                                               steel_attn_bwd_bk(de, dv, elem_bytes), de, dv,
                                               elem_bytes),
                                           steel_attn_bwd_dq_registers(de, dv, elem_bytes)));
}
constexpr int steel_attn_bwd_dq_tile_bytes(int de, int dv, int elem_bytes) {
  return steel_attn_bwd_dq_shared(de, dv, elem_bytes)
             ? steel_attn_shared_bytes(steel_attn_bwd_bk(de, dv, elem_bytes), de, dv, elem_bytes)
             : steel_attn_separate_bytes(steel_attn_bwd_bk(de, dv, elem_bytes), de, dv,
                                         elem_bytes);
}

// Everything an attention kernel needs at run time. Lengths and head counts fit in 32 bits;
// strides and offsets are 64-bit (see steel_i64). Strides are in elements.
//
// Varlen (STEEL_ATTN_FC_VARLEN): q, k, v are packed [tokens, heads, dim] (the row strides step
// over tokens), out is [total_q, Hq, Ev] and lse [Hq, total_q]. L and S hold the token counts
// total_q and total_k, which bound every sequence; each threadgroup reads its sequence's rows
// and keys from cu_seqlens and derives its own L, S and shift on the device.
struct AttnParams {
  int32_t L;           // query rows (varlen: total_q)
  int32_t S;           // keys (varlen: total_k)
  int32_t E;           // head dim of q and k
  int32_t Ev;          // head dim of v and out
  int32_t Hq;          // query heads
  int32_t group;       // query heads per key/value head (GQA; 1 without)
  int32_t shift;       // S - L for bottom-right causal alignment, else 0 (varlen: unused)
  int32_t hi_off;      // row i sees keys j <= i + shift + hi_off (STEEL_ATTN_FC_HAS_HI)
  int32_t lo_off;      // row i sees keys j >= i + shift - lo_off (STEEL_ATTN_FC_HAS_LO)
  float q_scale;       // multiplies q: scale times the score unit, or scale / softcap
  float softcap;       // softcap times the score unit (see forward.h); 0 when off
  int32_t batch_ndim;  // merged batch dims (0 when there is no batch)
  int32_t batch_shape[STEEL_ATTN_MAX_BATCH_DIMS];  // outermost first
  steel_i64 q_bs[STEEL_ATTN_MAX_BATCH_DIMS];  // batch strides, 0 where broadcast
  steel_i64 k_bs[STEEL_ATTN_MAX_BATCH_DIMS];
  steel_i64 v_bs[STEEL_ATTN_MAX_BATCH_DIMS];
  steel_i64 m_bs[STEEL_ATTN_MAX_BATCH_DIMS];
  steel_i64 q_hs;  // head and row strides
  steel_i64 q_rs;
  steel_i64 k_hs;
  steel_i64 k_rs;
  steel_i64 v_hs;
  steel_i64 v_rs;
  steel_i64 m_hs;  // mask: over query heads, rows, keys (0 where broadcast)
  steel_i64 m_rs;
  steel_i64 m_cs;
  steel_i64 o_bs;  // out: per flattened batch entry (varlen: 0), head, row (last dim contiguous)
  steel_i64 o_hs;
  steel_i64 o_rs;
  // Dropout (torch_steel/dropout.py's Philox keying): key words, counter word 3, and the
  // threshold floor(dropout_p * 2^32) at or above which a weight is kept, then scaled.
  uint32_t seed_lo;
  uint32_t seed_hi;
  uint32_t drop_offset;
  uint32_t drop_threshold;
  float drop_scale;  // 1 / (1 - dropout_p)
  int32_t pad_;      // keeps the struct a multiple of 8 bytes
};

static_assert(sizeof(AttnParams) == 312, "AttnParams layout changed: update both sides");
#ifndef __METAL_VERSION__
static_assert(offsetof(AttnParams, q_scale) == 36, "AttnParams.q_scale moved");
static_assert(offsetof(AttnParams, batch_shape) == 48, "AttnParams.batch_shape moved");
static_assert(offsetof(AttnParams, q_bs) == 64, "AttnParams.q_bs moved");
static_assert(offsetof(AttnParams, q_hs) == 192, "AttnParams.q_hs moved");
static_assert(offsetof(AttnParams, o_rs) == 280, "AttnParams.o_rs moved");
#endif

// ---- Attention backward ----------------------------------------------------------------------

// Function-constant indices of the backward kernels beyond the forward's (which they share:
// alignment, mask, diagonals, softcap, batch).
#define STEEL_ATTN_FC_GRAD_LSE 320  // bool: the lse output has a gradient (delta -= grad_lse)
#define STEEL_ATTN_FC_ALIGN_Q 321   // bool: L % the dK/dV kernel's query tile == 0
// The dmask kernel's sums: the float attn_mask broadcasts over query rows (its row dim is 1),
// or over keys, so that each of its elements gathers dS over that whole dim.
#define STEEL_ATTN_FC_DMASK_ROWS 324  // bool (322, 323: the decode kernels, below)
#define STEEL_ATTN_FC_DMASK_KEYS 325  // bool
// The dK/dV kernel's streamed q and grad_out rows: every row start is 16-byte aligned, so the
// tile loader moves whole chunks (as STEEL_ATTN_FC_VEC_K/V for the forward's K and V).
#define STEEL_ATTN_FC_VEC_Q 334  // bool
#define STEEL_ATTN_FC_VEC_G 335  // bool

// Buffer indices of the backward kernels (q, k, v, mask, sinks as in the forward).
#define STEEL_ATTN_BUF_GRAD_OUT 8
#define STEEL_ATTN_BUF_FWD_OUT 9   // the forward's out (delta pre-pass)
#define STEEL_ATTN_BUF_FWD_LSE 10  // the forward's lse
#define STEEL_ATTN_BUF_GRAD_LSE 11
#define STEEL_ATTN_BUF_DELTA 12    // fp32 scratch [2, batch * Hq * L]: delta, 1 / normaliser
#define STEEL_ATTN_BUF_DQ 13
#define STEEL_ATTN_BUF_DK 14
#define STEEL_ATTN_BUF_DV 15
#define STEEL_ATTN_BUF_DSINKS 16
#define STEEL_ATTN_BUF_BWD_PARAMS 17
#define STEEL_ATTN_BUF_DMASK 18    // the gradient of a float attn_mask, in the mask's shape
#define STEEL_ATTN_BUF_BWD_CU_Q 19  // varlen only: cu_seqlens_q, cu_seqlens_k (int32)
#define STEEL_ATTN_BUF_BWD_CU_K 20

// The delta pre-pass: simdgroups a threadgroup, rows a simdgroup (four lanes a row), and rows
// a threadgroup.
#define STEEL_ATTN_DELTA_SIMDGROUPS 4
#define STEEL_ATTN_DELTA_ROWS_PER_SIMDGROUP 8
#define STEEL_ATTN_DELTA_ROWS (STEEL_ATTN_DELTA_SIMDGROUPS * STEEL_ATTN_DELTA_ROWS_PER_SIMDGROUP)

// The backward's run-time values: the forward's, plus where grad_out and the forward's output
// lie. dq, dk, dv are contiguous in q's, k's and v's shapes; lse, grad_lse and delta are
// contiguous [batch, Hq, L]. Varlen (STEEL_ATTN_FC_VARLEN): as AttnParams says, with batch 1
// and lse, grad_lse, delta [Hq, total_q].
struct AttnBackwardParams {
  AttnParams fwd;
  float scale;        // the softmax scale, applied to dq and dk when they are stored
  int32_t batch;      // flattened batch entries
  steel_i64 g_bs[STEEL_ATTN_MAX_BATCH_DIMS];  // grad_out: batch, head, row strides
  steel_i64 g_hs;
  steel_i64 g_rs;
  steel_i64 y_bs[STEEL_ATTN_MAX_BATCH_DIMS];  // the forward's out: batch, head, row strides
  steel_i64 y_hs;
  steel_i64 y_rs;
  // dmask (contiguous in the mask's own shape): strides per merged batch dim, head, row, key,
  // 0 along every dim the mask broadcasts over. Its threadgroups own the mask's elements
  // (grid z: one per element of its kept batch and head dims) and sum dS over the broadcast
  // (batch, head) pairs in a fixed order: dm_combos of them.
  steel_i64 dm_bs[STEEL_ATTN_MAX_BATCH_DIMS];
  steel_i64 dm_hs;
  steel_i64 dm_rs;
  steel_i64 dm_cs;
  int32_t dm_combos;
  int32_t pad_;
};

static_assert(sizeof(AttnBackwardParams) == 480, "AttnBackwardParams layout changed");
#ifndef __METAL_VERSION__
static_assert(offsetof(AttnBackwardParams, scale) == 312, "AttnBackwardParams.scale moved");
static_assert(offsetof(AttnBackwardParams, g_bs) == 320, "AttnBackwardParams.g_bs moved");
static_assert(offsetof(AttnBackwardParams, y_bs) == 368, "AttnBackwardParams.y_bs moved");
static_assert(offsetof(AttnBackwardParams, dm_bs) == 416, "AttnBackwardParams.dm_bs moved");
static_assert(offsetof(AttnBackwardParams, dm_combos) == 472, "AttnBackwardParams.dm_combos");
#endif

// ---- Attention decode ------------------------------------------------------------------------

// Function-constant indices of the decode kernels beyond the forward's (shaders/steel/attn/
// decode.h; they share alignment, mask, diagonals, sinks, softcap, batch and varlen).
#define STEEL_ATTN_FC_SPLIT 322  // bool: the keys are split; partials go to the merge kernel
#define STEEL_ATTN_FC_PAGED 323  // bool: K and V are page pools read through a block table
#define STEEL_ATTN_FC_DECODE_ROWS 340  // int: the vector decode kernel's packed rows, heads x L
// int: the vector decode kernel's simdgroups a threadgroup, STEEL_ATTN_SIMDGROUPS (4) or a
// wider one-pass block of 8 or 16 (more key sets over the same tiles; attn::decode_simdgroups)
#define STEEL_ATTN_FC_DECODE_SIMDGROUPS 341
// bool: the vector decode kernel's key sets take whole key tiles, each reading its keys' rows
// straight from the device (no staging, loader or barrier a tile); dense and varlen K/V in the
// compute dtype only (attn::decode_direct)
#define STEEL_ATTN_FC_DECODE_DIRECT 342

// Buffer indices of the decode kernels beyond the forward's (q .. cu_seqlens_k as there; the
// decode kernels take AttnDecodeParams at STEEL_ATTN_BUF_PARAMS).
#define STEEL_ATTN_BUF_TABLE 10    // paged only: int32 block_table [sequences, max_pages]
#define STEEL_ATTN_BUF_SEQUSED 11  // paged only: int32 seqused_k [sequences], keys per sequence
#define STEEL_ATTN_BUF_PART_O 12   // split only: fp32 [rows, Ev] unnormalised partial outputs
#define STEEL_ATTN_BUF_PART_ML 13  // split only: fp32 [rows, 2] each partial's row max, sum

// Decode serves at most this many query rows per (batch entry, head), and packs the query
// heads of one KV head into a threadgroup of STEEL_ATTN_BQ rows (heads_per_tg * L <= BQ). A
// paged cache takes the decode kernels for any L, in blocks of BQ rows.
#define STEEL_ATTN_DECODE_MAX_L 8
// The merge reads one partition per lane: at most 32 partitions.
#define STEEL_ATTN_DECODE_MAX_SPLITS 32
// The vector decode kernel (attn/decode_vector.h): packed rows per threadgroup, over its row
// sets; the planner takes it where the GQA group's rows fit (attn::decode_vector).
#define STEEL_ATTN_DECODE_VECTOR_ROWS 8
// Its widest threadgroup (STEEL_ATTN_FC_DECODE_SIMDGROUPS): 16 simdgroups, 512 threads.
#define STEEL_ATTN_DECODE_VECTOR_MAX_SIMDGROUPS 16
// Its layout: the simdgroups form row sets (of the `rows` packed rows, STEEL_ATTN_FC_DECODE_ROWS,
// set s holds rows s, s + sets, ...) x key sets (a simdgroup takes its key set's share of the
// keys); each simdgroup converts a K or V element it reads once for all its rows, so fewer row
// sets convert less. Per lane a row keeps its q and o elements (steel_attn_decode_vector_elems:
// ceil(d / 32) in whole chunks of steel_attn_decode_vector_vec) and 3 scalars. The row sets are
// the fewest (1, 2, 4) whose rows' registers, with 24 scalars, still let a GPU core hold as many
// threadgroups of 128 threads as the K/V tiles do (a core's 3072 threads, 61440 bytes of
// threadgroup memory and 212992 bytes of registers: torch_steel/sim/chips.json, mirrored in
// timing.py): registers never cost residency. They depend on the packed rows (a pipeline
// constant): one packed row (MHA, one token) is one row set at every head dim, so no simdgroup
// idles for want of a row.
constexpr int steel_attn_decode_vector_vec(int d) { return d % 128 == 0 ? 4 : d % 64 == 0 ? 2 : 1; }
constexpr int steel_attn_decode_vector_elems(int d) {
  return (d + 32 * steel_attn_decode_vector_vec(d) - 1) / (32 * steel_attn_decode_vector_vec(d)) *
         steel_attn_decode_vector_vec(d);
}
constexpr int steel_attn_decode_vector_row_registers(int de, int dv) {
  return steel_attn_decode_vector_elems(de) + steel_attn_decode_vector_elems(dv) + 3;
}
constexpr int steel_attn_decode_vector_budget(int de, int dv, int elem_bytes) {
  return 212992 / 4 /
             ((61440 / steel_attn_threadgroup_bytes(de, dv, elem_bytes) < 24
                   ? 61440 / steel_attn_threadgroup_bytes(de, dv, elem_bytes)
                   : 24) *
              128) -
         24;
}
constexpr int steel_attn_decode_vector_row_sets(int de, int dv, int elem_bytes, int rows) {
  return rows * steel_attn_decode_vector_row_registers(de, dv) <=
                 steel_attn_decode_vector_budget(de, dv, elem_bytes)
             ? 1
         : (rows + 1) / 2 * steel_attn_decode_vector_row_registers(de, dv) <=
                 steel_attn_decode_vector_budget(de, dv, elem_bytes)
             ? 2
             : 4;
}

// The decode kernels' run-time values: the forward's, the split of the keys, and the paged
// cache. Partials of query row i of head h of batch entry (or sequence) zb, partition s, are
// row ((zb * Hq + h) * rows + i) * splits + s of the partial buffers.
struct AttnDecodeParams {
  AttnParams fwd;
  int32_t splits;        // partitions of the keys (1: one pass, no partials)
  int32_t split_keys;    // keys per partition, a multiple of the key tile
  int32_t heads_per_tg;  // query heads of one KV head served by one threadgroup
  int32_t rows;          // query rows per (batch entry, head) the partials hold: L or max_seqlen_q
  int32_t page_size;     // paged: keys per page
  int32_t pages;         // paged: pages in the pools
  int32_t max_pages;     // paged: block_table's columns
  int32_t table_stride;  // paged: block_table's row stride
  int32_t row_block;     // query rows per threadgroup block: min(rows, STEEL_ATTN_BQ)
  int32_t pad_;          // keeps the 64-bit fields aligned
  steel_i64 k_ps;        // paged: page strides of the key and value pools
  steel_i64 v_ps;
};

static_assert(sizeof(AttnDecodeParams) == 368, "AttnDecodeParams layout changed");
#ifndef __METAL_VERSION__
static_assert(offsetof(AttnDecodeParams, splits) == 312, "AttnDecodeParams.splits moved");
static_assert(offsetof(AttnDecodeParams, k_ps) == 352, "AttnDecodeParams.k_ps moved");
#endif

// ---- Quantized K/V (torch_steel.kv; the decode and prefill forward kernels) ------------------

// K and V may hold int8 codes (x = q * s) or two 4-bit codes per byte (x = q * s + m) with a
// scale (and a min) per group of values along the head dim, dequantized by the tile loader into
// threadgroup memory in the compute dtype (AttnQuantTileLoader, shaders/steel/attn/loader.h).
// Every forward and decode pipeline sets these (the plans' attn::dispatch: STEEL_ATTN_FC_QUANT
// off, the formats 0, unless the call is quantized); the backward kernels never read them.
#define STEEL_ATTN_FC_QUANT 327        // bool: K and V are quantized (buffers 14 .. 18 bound)
#define STEEL_ATTN_FC_K_BITS 328       // int: 8 (int8 codes) or 4 (two codes per byte); else 0
#define STEEL_ATTN_FC_K_GROUP 329      // int: values per scale, 32 / 64 / 128, or E (per row)
#define STEEL_ATTN_FC_K_SCALE_F32 330  // bool: K's scales and mins are float32, else float16
#define STEEL_ATTN_FC_V_BITS 331       // the same for V
#define STEEL_ATTN_FC_V_GROUP 332
#define STEEL_ATTN_FC_V_SCALE_F32 333

// Buffer indices of the quantized pipelines (beyond the decode kernels' 13): the scales and
// mins of K and V (mins only for 4-bit; an int8 operand binds its scales in their place, never
// read), and AttnQuantParams.
#define STEEL_ATTN_BUF_K_SCALES 14
#define STEEL_ATTN_BUF_K_MINS 15
#define STEEL_ATTN_BUF_V_SCALES 16
#define STEEL_ATTN_BUF_V_MINS 17
#define STEEL_ATTN_BUF_QUANT_PARAMS 18

// Where the scales (and mins, which share the scales' layout) of K and V lie, in scale
// elements: per merged batch dim (AttnParams.batch_shape), KV head, key (token; a varlen
// operand's token stride) and page of a paged pool. With STEEL_ATTN_FC_QUANT, AttnParams' k_*
// and v_* strides (and AttnDecodeParams' k_ps, v_ps) are those of the codes, in bytes.
// A struct of its own beside AttnParams (not fields in it): the fp16 path's params, the
// backward's and decode's, which embed AttnParams, keep their layout.
struct AttnQuantParams {
  steel_i64 k_bs[STEEL_ATTN_MAX_BATCH_DIMS];
  steel_i64 k_hs;
  steel_i64 k_rs;
  steel_i64 k_ps;
  steel_i64 v_bs[STEEL_ATTN_MAX_BATCH_DIMS];
  steel_i64 v_hs;
  steel_i64 v_rs;
  steel_i64 v_ps;
};

static_assert(sizeof(AttnQuantParams) == 112, "AttnQuantParams layout changed");
#ifndef __METAL_VERSION__
static_assert(offsetof(AttnQuantParams, v_bs) == 56, "AttnQuantParams.v_bs moved");
#endif
