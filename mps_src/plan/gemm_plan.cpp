// Launch planning for steel::gemm: out = act(alpha * (a @ b) + beta * c + bias).
//
// From shapes, strides and dtypes only, this decides:
//   - how each operand is read: a matrix whose last stride is 1 is read row by row ("n"), one
//     whose second-to-last stride is 1 column by column ("t", a transpose: only the kernel's
//     template constants change); one with neither is copied to contiguous first;
//   - how batch dims broadcast: out's batch dims are merged where every operand allows it, and
//     each operand gets a stride per merged dim (0 where it is broadcast);
//   - the kernel family: matmul2d (Metal 4 tensor ops) on devices whose description (device.h)
//     says M5-generation matrix units, simdgroup matrices everywhere else;
//   - the tile (the table below), the function constants, the GemmParams bytes, the grid with its
//     swizzle, and split-K (two dispatches and an fp32 scratch buffer) for small M*N with long K;
//   - or a refusal naming the limit.
#include "gemm_plan.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "../../shaders/steel/params.h"
#include "device.h"

namespace steel {
namespace {

// One kernel configuration of gemm.metal: BM x BN block, BK step, WM x WN simdgroups.
struct Tile {
  int bm, bn, bk, wm, wn;
};

// The tile table.
//
// Device traffic of a tiled GEMM is about M*N*K*(1/BM + 1/BN) element reads, so larger blocks
// move fewer bytes per FLOP; the limits are registers (each lane holds TM*TN*2 fp32
// accumulators, TM = BM/(8*WM), TN = BN/(8*WN)), threadgroup memory (the A and B tiles, rows
// padded by 16 bytes) and occupancy (a problem with few blocks leaves GPU cores idle).
//   - kLarge 64x64x32 with 2x4 simdgroups (256 threads, 4x2 fragments = 16 accumulators a
//     lane): each element brought into threadgroup memory is used 64 times; the tiles take
//     8.75 KiB (f16/bf16) or 17.5 KiB (f32). Eight simdgroups of 4x2 fragments rather than four
//     of 4x4: half the accumulators a lane, so more simdgroups fit a core. The timing model
//     (its register estimate, timing.steel_kernel_info: 52 registers against 72) keeps 4 such
//     threadgroups = 32 simdgroups a core (f32: 3 by threadgroup memory, 24), where the ALU
//     runs at full efficiency, against 5 x 4 = 20 simdgroups (90.6%) for 64x64 on 2x2. The
//     price is 6 fragment loads per 8 MMAs instead of 8 per 16. BK = 32 gives each thread one
//     16-byte load per operand and K step (f32: two), and halves the barriers and loop
//     overhead per MMA against BK = 16. 2x4 rather than 4x2: with b stored column by column
//     (x @ W^T, torch_steel.linear's layout) B's fragment elements are not adjacent and take
//     two loads each, so fewer B fragments a simdgroup (2) is the cheaper way round. Predicted
//     (f16, 1024^3, M4 Pro, sim.predict): docs/gemm.md.
//   - kLarge32 64x64x16 with 2x4 simdgroups: kLarge for float32. At BK = 32 its f32 tiles
//     (17.5 KiB) let 3 threadgroups share a core's 60 KiB; at BK = 16 (9.25 KiB) 4 fit, as
//     many as the register estimate allows, so the waves hold a third more blocks (one 16-byte
//     load per thread and operand a step either way). The model (f32 1024^3, 256 blocks):
//     M4 Pro 13.6 threadgroup-times a core either way, 40 cores 7.0 against 7.6, 80 cores 4.0
//     against 4.6, for 2% more loop and loader work per MMA.
//   - kLarge4 64x64x16 with 2x2 simdgroups (128 threads, 4x4 fragments): the same block for a
//     pipeline that allows fewer than 256 threads (the Metal host re-plans with its
//     maxTotalThreadsPerThreadgroup, option max_threads).
//   - kSmall 32x32x16 with 2x2 simdgroups (2x2 fragments a lane): four times the threadgroups of
//     kLarge for the same output, for problems that would otherwise not fill the GPU, and for
//     thin outputs (decode: M = 1) where most of a 64-row block would be zero fill.
//   - kThin 32x128x16 with 1x4 simdgroups (4x4 fragments a lane, like kLarge4) for a few rows
//     against many columns (M <= 32, e.g. 32x11008x4096 in an LLM MLP): every column block
//     re-reads all of A, so wide blocks cut A's traffic by 4 against kSmall, while B, the big
//     operand, is read once whatever the tile. Needs enough column blocks to fill the GPU;
//     otherwise (decode, M = 1, N = 4096) kSmall keeps more threadgroups streaming B.
//   - kTall 128x32x16 with 4x1 simdgroups: the same for many rows against few columns
//     (N <= 32), where every row block re-reads all of B.
//   - the split-K first pass uses kSmall: split-K is only chosen when M*N is small.
// Transposes do not change the tile: tiles are stored in threadgroup memory as they lie in
// device memory, so every combination loads whole vectors along its contiguous dim.
// The same sizes serve all three dtypes: f32 doubles the threadgroup memory but stays below the
// 32 KiB limit.
constexpr Tile kLarge = {64, 64, 32, 2, 4};
constexpr Tile kLarge32 = {64, 64, 16, 2, 4};
constexpr Tile kLarge4 = {64, 64, 16, 2, 2};
constexpr Tile kSmall = {32, 32, 16, 2, 2};
constexpr Tile kThin = {32, 128, 16, 1, 4};
constexpr Tile kTall = {128, 32, 16, 4, 1};
constexpr int64_t kMinLargeBlocks = 128;
// ... unless the device describes its core count (device.h) and kLarge's blocks fill at least
// kLargeWaveFill of the core slots of their waves, blocks / (ceil(blocks / cores) * cores): a
// 64x64 block does 4x a 32x32 block's work for 2x its operand bytes and half its fragment loads
// per MMA, so when it leaves no core idle in its last wave it is the faster tile. The timing
// model (f16, sim.predict with gpu_cores pinned, 32x32 then kLarge's 8-simdgroup 64x64; at
// 9bb6f72): 512^3 on M1 (8 cores, 64 blocks fill 100%) 170.4 and 151.8 us, M4 (10 cores, 91%)
// 119.2 and 117.8; 256x1024x1024 M1 323.3 and 287.5, M4 223.3 and 221.1; at 80% kSmall wins:
// M4 Pro (20 cores) 69.5 and 71.6, 126.3 and 130.6; M3 Max (40) 37.0 and 44.8, 62.8 and 78.2.
constexpr double kLargeWaveFill = 0.9;
constexpr int64_t kMinThinBlocks = 64;  // for kThin and kTall

// Split-K: when even kSmall gives at most kSplitMaxBlocks blocks (every batch entry's counted)
// and K is long (at least kSplitKRatio * max(M, N) and kSplitMinK), K is cut into partitions of
// at least kSplitMinSlice so that about kSplitTargetBlocks threadgroups run, or
// kSplitBlocksPerCore a core on a GPU with more cores. Each partition writes batch * M * N fp32
// partials, so the extra traffic (2 * 4 * batch * M * N * partitions bytes) stays small next to
// reading A and B. A batch splits like one matrix: bmm 4 x 32 x 32 x 8192 (f16) unsplit runs 4
// threadgroups that each walk all of K, at 0.14 of the roofline on M4 Pro by the timing model
// (bench_gemm.py --predict; 186.5 us), split 64 threadgroups (41.4 us), and at 4 a core 80
// (37.8 us; M3 Ultra, 80 cores: 31.0 us at 64, 27.2 at 128).
constexpr int64_t kSplitMaxBlocks = 16;
constexpr int64_t kSplitKRatio = 8;
constexpr int64_t kSplitMinK = 512;
constexpr int64_t kSplitMinSlice = 128;
constexpr int64_t kSplitTargetBlocks = 64;
constexpr int64_t kSplitBlocksPerCore = 4;
constexpr int64_t kSplitMaxPartitions = 32;

// The matmul2d kernels (shaders/steel/gemm_tensor/gemm_tensor_msl4.metal), for devices with
// Metal 4 matrix units (device.h), f16 and bf16: 64x64 blocks of 4 simdgroups, K in steps of
// 32. The operation reads its operands from device memory itself, so no threadgroup tiles and
// no vector-load constraints; one size serves every shape (small problems, like kSmall above,
// and split-K's first pass) because the units' cost is per operation, not per fragment.
// wm x wn only counts the simdgroups here (the operation splits the block among them).
constexpr Tile kTensorTile = {64, 64, 32, 2, 2};

// Every tile but kLarge has 4 simdgroups; kLarge has 8 and gives way to kLarge4 (the same
// block) when the pipeline allows fewer threads.
constexpr int64_t kTileThreads = 128;
constexpr int64_t kLargeThreads = 256;
constexpr int64_t kReduceThreads = 256;
static_assert(32 * kLarge4.wm * kLarge4.wn == kTileThreads && 32 * kSmall.wm * kSmall.wn == kTileThreads &&
                  32 * kThin.wm * kThin.wn == kTileThreads && 32 * kTall.wm * kTall.wn == kTileThreads &&
                  32 * kTensorTile.wm * kTensorTile.wn == kTileThreads &&
                  32 * kLarge.wm * kLarge.wn == kLargeThreads &&
                  32 * kLarge32.wm * kLarge32.wn == kLargeThreads,
              "max_threads handling assumes these thread counts");
static_assert(kLarge.bm == kLarge4.bm && kLarge.bn == kLarge4.bn && kLarge.bm == kLarge32.bm &&
                  kLarge.bn == kLarge32.bn,
              "kLarge32 and kLarge4 replace kLarge block for block (the tile rules count kLarge's "
              "blocks)");

// kLarge's blocks fill at least kLargeWaveFill of the core slots of their waves (cores 0:
// unknown, never).
bool large_fills_waves(int64_t blocks, int64_t cores) {
  if (cores <= 0 || blocks <= 0) return false;
  const int64_t slots = ceil_div(blocks, cores) * cores;
  return static_cast<double>(blocks) >= kLargeWaveFill * static_cast<double>(slots);
}

// How the kernel reads a 2-D operand (the last two dims of `t`).
struct MatrixLayout {
  bool ok = false;
  bool transposed = false;  // columns contiguous
  int64_t ld = 0;           // stride between rows (n) or columns (t)
};

MatrixLayout matrix_layout(const TensorDesc& t) {
  const int64_t rows = t.sizes[t.dim() - 2], cols = t.sizes[t.dim() - 1];
  const int64_t rs = t.strides[t.dim() - 2], cs = t.strides[t.dim() - 1];
  MatrixLayout l;
  if (cs == 1 || cols == 1) {
    // A single row is never stepped over, so its row stride does not matter.
    l = {true, false, rows == 1 ? 0 : rs};
  } else if (rs == 1 || rows == 1) {
    l = {true, true, cols == 1 ? 0 : cs};
  }
  return l;
}

struct Activation {
  const char* name;
  int value;
};
constexpr Activation kActivations[] = {{"none", kSteelActNone},
                                       {"relu", kSteelActRelu},
                                       {"gelu", kSteelActGelu},
                                       {"gelu_tanh", kSteelActGeluTanh},
                                       {"silu", kSteelActSilu}};

Binding params_binding(const GemmParams& params) {
  return bytes_binding(STEEL_GEMM_BUF_PARAMS, &params, sizeof(GemmParams));
}

std::string tile_suffix(const char* trans, DType dtype, const Tile& t) {
  return std::string(trans) + "_" + dtype_tag(dtype) + "_bm" + std::to_string(t.bm) + "_bn" +
         std::to_string(t.bn) + "_bk" + std::to_string(t.bk) + "_wm" + std::to_string(t.wm) +
         "_wn" + std::to_string(t.wn);
}

std::string tensor_tile_suffix(const char* trans, DType dtype, const Tile& t) {
  return std::string(trans) + "_" + dtype_tag(dtype) + "_bm" + std::to_string(t.bm) + "_bn" +
         std::to_string(t.bn) + "_bk" + std::to_string(t.bk) + "_sg" +
         std::to_string(t.wm * t.wn);
}

// Threadgroup memory of a tile's A and B blocks, as the kernel declares them.
int64_t tile_threadgroup_bytes(const Tile& t, DType dtype, bool ta, bool tb) {
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  const int64_t pad = 16 / es;
  const int64_t a = ta ? t.bk * (t.bm + pad) : t.bm * (t.bk + pad);
  const int64_t b = tb ? t.bn * (t.bk + pad) : t.bk * (t.bn + pad);
  return (a + b) * es;
}

// A batch dim after merging: its size and each operand's stride (0 where broadcast).
struct BatchDim {
  int64_t size, a, b, c;
};

// Threadgroups of the GEMV kernels: STEEL_GEMV_SIMDGROUPS simdgroups, of STEEL_GEMV_LINES
// weight lines each (rows, cols), or together a strip of STEEL_GEMV_NN_COLS columns (nn; gemv.h).
constexpr int64_t kGemvSimdgroups = STEEL_GEMV_SIMDGROUPS;
constexpr int64_t kGemvCols = STEEL_GEMV_LINES;
constexpr int64_t kGemvVec = STEEL_GEMV_VEC;  // elements per vector access (gemv_load4)

// The GEMV kernels: rows (M <= 8, b column by column), cols (N <= 8 by transposition: a's rows
// are the weight lines), nn (M <= 8, b row-major: lanes along N).
enum class Gemv { Rows, Cols, Nn };

// The GEMV dispatch (see plan_gemm's rule).
Plan plan_gemv(Plan plan, const TensorDesc& a, const TensorDesc& b, const MatrixLayout& la,
               const MatrixLayout& lb, const std::vector<BatchDim>& merged, int64_t M, int64_t N,
               int64_t K, int64_t batches, DType dtype, Gemv kind, bool use_c, int64_t c_rs,
               int64_t c_cs, const std::optional<TensorDesc>& bias, double alpha, double beta,
               int activation, int32_t slot_c, int32_t slot_bias, int32_t slot_out) {
  GemmParams p;
  std::memset(&p, 0, sizeof(p));
  p.M = static_cast<int32_t>(M);
  p.N = static_cast<int32_t>(N);
  p.K = static_cast<int32_t>(K);
  p.lda = static_cast<int32_t>(la.ld);
  p.ldb = static_cast<int32_t>(lb.ld);
  p.ldd = static_cast<int32_t>(N);
  p.c_rs = static_cast<int32_t>(c_rs);
  p.c_cs = static_cast<int32_t>(c_cs);
  p.bias_stride = bias ? static_cast<int32_t>(bias->strides[0]) : 0;
  p.alpha = static_cast<float>(alpha);
  p.beta = static_cast<float>(beta);
  p.batch_ndim = static_cast<int32_t>(merged.size());
  for (size_t d = 0; d < merged.size(); ++d) {
    p.batch_shape[d] = static_cast<int32_t>(merged[d].size);
    p.a_batch_strides[d] = static_cast<int32_t>(merged[d].a);
    p.b_batch_strides[d] = static_cast<int32_t>(merged[d].b);
    p.c_batch_strides[d] = static_cast<int32_t>(merged[d].c);
  }
  p.out_batch_stride = static_cast<int32_t>(M * N);
  // Vector loads of 4 elements need every line start (offset, leading dim, batch strides) a
  // multiple of 4 elements; storage itself is 16-byte aligned.
  auto vec_ok = [&](const TensorDesc& x, const MatrixLayout& l, bool is_a) {
    bool ok = x.offset % kGemvVec == 0 && l.ld % kGemvVec == 0;
    for (const BatchDim& bd : merged) ok = ok && (is_a ? bd.a : bd.b) % kGemvVec == 0;
    return ok;
  };
  Dispatch d;
  d.kernel = std::string(kind == Gemv::Rows   ? "steel_gemv_rows_"
                         : kind == Gemv::Cols ? "steel_gemv_cols_"
                                              : "steel_gemv_nn_") +
             dtype_tag(dtype);
  d.constants = {fc_bool(STEEL_GEMM_FC_HAS_BATCH, batches > 1),
                 fc_bool(STEEL_GEMM_FC_USE_C, use_c),
                 fc_bool(STEEL_GEMM_FC_HAS_BIAS, bias.has_value()),
                 fc_int(STEEL_GEMM_FC_ACTIVATION, activation),
                 fc_bool(STEEL_GEMM_FC_VEC_A, vec_ok(a, la, true)),
                 fc_bool(STEEL_GEMM_FC_VEC_B, vec_ok(b, lb, false))};
  d.grid[0] = static_cast<uint32_t>(kind == Gemv::Nn
                                        ? ceil_div(N, STEEL_GEMV_NN_COLS)
                                        : ceil_div(kind == Gemv::Cols ? M : N,
                                                   kGemvSimdgroups * kGemvCols));
  d.grid[1] = 1;
  d.grid[2] = static_cast<uint32_t>(batches);
  d.threads[0] = static_cast<uint32_t>(32 * kGemvSimdgroups);
  d.bindings = {tensor_binding(STEEL_GEMM_BUF_A, 0), tensor_binding(STEEL_GEMM_BUF_B, 1),
                tensor_binding(STEEL_GEMM_BUF_C, use_c ? slot_c : 0),
                tensor_binding(STEEL_GEMM_BUF_BIAS, bias ? slot_bias : 0),
                tensor_binding(STEEL_GEMM_BUF_OUT, slot_out), params_binding(p)};
  plan.dispatches.push_back(d);
  return plan;
}

}  // namespace

Plan plan_gemm(const TensorList& tensors, const Options& options) {
  if (tensors.size() < 2 || tensors.size() > 4 || !tensors[0] || !tensors[1]) {
    return Plan::refuse("gemm takes tensors [a, b, bias, c] with a and b present");
  }
  TensorDesc a = *tensors[0];
  TensorDesc b = *tensors[1];
  const std::optional<TensorDesc> bias = tensors.size() > 2 ? tensors[2] : std::nullopt;
  const std::optional<TensorDesc> c = tensors.size() > 3 ? tensors[3] : std::nullopt;
  const int32_t n_inputs = static_cast<int32_t>(tensors.size());
  const int32_t kSlotA = 0, kSlotB = 1, kSlotBias = 2, kSlotC = 3;

  // ---- dtypes and shapes ----
  const DType dtype = a.dtype;
  if (!supported_dtype(dtype)) {
    return Plan::refuse(std::string("gemm kernels support float16, bfloat16 and float32, not ") +
                        dtype_name(dtype));
  }
  for (const std::optional<TensorDesc>* t : {&tensors[1], &bias, &c}) {
    if (*t && (*t)->dtype != dtype) {
      return Plan::refuse(std::string("gemm operands must share a's dtype ") + dtype_name(dtype) +
                          ", got " + dtype_name((*t)->dtype));
    }
  }
  if (a.dim() < 2 || b.dim() < 2) {
    return Plan::refuse("gemm needs a and b with at least 2 dims, got " + shape_str(a.sizes) +
                        " and " + shape_str(b.sizes));
  }
  const int64_t M = a.sizes[a.dim() - 2], K = a.sizes[a.dim() - 1];
  const int64_t N = b.sizes[b.dim() - 1];
  if (b.sizes[b.dim() - 2] != K) {
    return Plan::refuse("gemm: a " + shape_str(a.sizes) + " and b " + shape_str(b.sizes) +
                        " do not agree on K");
  }

  // Batch dims broadcast like torch.matmul.
  const int64_t nb = std::max(a.dim(), b.dim()) - 2;
  std::vector<int64_t> batch(nb, 1);
  for (int64_t d = 0; d < nb; ++d) {
    const int64_t da = d - (nb - (a.dim() - 2)), db = d - (nb - (b.dim() - 2));
    const int64_t sa = da >= 0 ? a.sizes[da] : 1, sb = db >= 0 ? b.sizes[db] : 1;
    if (sa != sb && sa != 1 && sb != 1) {
      return Plan::refuse("gemm: batch dims of a " + shape_str(a.sizes) + " and b " +
                          shape_str(b.sizes) + " do not broadcast");
    }
    batch[d] = std::max(sa, sb);
    if (sa == 0 || sb == 0) batch[d] = 0;
  }
  std::vector<int64_t> out_sizes = batch;
  out_sizes.push_back(M);
  out_sizes.push_back(N);

  if (bias && (bias->dim() != 1 || bias->sizes[0] != N)) {
    return Plan::refuse("gemm: bias must have shape [" + std::to_string(N) + "], got " +
                        shape_str(bias->sizes));
  }

  // ---- options ----
  const double alpha = options.number("alpha", 1.0);
  const double beta = options.number("beta", 1.0);
  const std::string act_name = options.string("activation", "none");
  int activation = -1;
  for (const Activation& act : kActivations) {
    if (act_name == act.name) activation = act.value;
  }
  if (activation < 0) {
    return Plan::refuse("gemm: unknown activation '" + act_name +
                        "' (none, relu, gelu, gelu_tanh, silu)");
  }
  // The Metal host re-plans with the pipeline's maxTotalThreadsPerThreadgroup when it is below
  // what a plan asked for; every tile needs 128 threads (4 simdgroups), the reduction fewer.
  const int64_t max_threads = static_cast<int64_t>(options.number("max_threads", 1024));
  if (max_threads < kTileThreads) {
    return Plan::refuse("gemm: the pipeline allows " + std::to_string(max_threads) +
                        " threads per threadgroup, the GEMM tiles need " +
                        std::to_string(kTileThreads));
  }
  const bool use_c = c.has_value() && beta != 0.0;
  std::vector<int64_t> c_strides;
  if (use_c && !broadcast_strides(*c, out_sizes, &c_strides)) {
    return Plan::refuse("gemm: c " + shape_str(c->sizes) + " does not broadcast to out " +
                        shape_str(out_sizes));
  }

  // ---- operand layouts; copies for operands with no unit stride ----
  Plan plan;
  MatrixLayout la = matrix_layout(a);
  if (!la.ok) {
    plan.contiguous_inputs.push_back(kSlotA);
    a = a.contiguous();
    la = matrix_layout(a);
  }
  MatrixLayout lb = matrix_layout(b);
  if (!lb.ok) {
    plan.contiguous_inputs.push_back(kSlotB);
    b = b.contiguous();
    lb = matrix_layout(b);
  }

  // ---- 32-bit indexing ----
  int64_t out_numel = M * N;
  for (int64_t s : batch) out_numel *= s;
  const struct {
    const char* name;
    int64_t value;
  } extents[] = {{"a", extent(a)},
                 {"b", extent(b)},
                 {"bias", bias ? extent(*bias) : 0},
                 {"c", use_c ? extent(*c) : 0},
                 {"out", out_numel}};
  for (const auto& e : extents) {
    if (e.value > kInt32Max) {
      return Plan::refuse(std::string("gemm: ") + e.name + " spans " + std::to_string(e.value) +
                          " elements, beyond the kernels' 32-bit indexing (2^31 - 1)");
    }
  }

  // ---- batch: drop size-1 dims, merge dims every operand walks contiguously ----
  std::vector<BatchDim> dims;
  for (int64_t d = 0; d < nb; ++d) {
    if (batch[d] == 1) continue;
    const int64_t da = d - (nb - (a.dim() - 2)), db = d - (nb - (b.dim() - 2));
    BatchDim bd;
    bd.size = batch[d];
    bd.a = (da >= 0 && a.sizes[da] != 1) ? a.strides[da] : 0;
    bd.b = (db >= 0 && b.sizes[db] != 1) ? b.strides[db] : 0;
    bd.c = use_c ? c_strides[d] : 0;
    dims.push_back(bd);
  }
  std::vector<BatchDim> merged;
  for (const BatchDim& bd : dims) {
    if (!merged.empty()) {
      BatchDim& o = merged.back();
      if (o.a == bd.a * bd.size && o.b == bd.b * bd.size && o.c == bd.c * bd.size) {
        o = {o.size * bd.size, bd.a, bd.b, bd.c};
        continue;
      }
    }
    merged.push_back(bd);
  }
  if (merged.size() > STEEL_GEMM_MAX_BATCH_DIMS) {
    return Plan::refuse("gemm: " + std::to_string(merged.size()) +
                        " batch dims that cannot be merged; the kernels take at most " +
                        std::to_string(STEEL_GEMM_MAX_BATCH_DIMS));
  }
  const int64_t batch_count = out_numel == 0 ? 0 : out_numel / (M * N);

  Allocation out_alloc;
  out_alloc.name = "out";
  out_alloc.dtype = dtype;
  out_alloc.sizes = out_sizes;
  out_alloc.is_output = true;
  plan.allocations.push_back(out_alloc);
  const int32_t kSlotOut = n_inputs;
  plan.ok = true;
  if (out_numel == 0) return plan;  // nothing to compute

  // ---- batch folded into M ----
  // When b is the same matrix for every batch entry and a's batch entries follow each other
  // row after row (x @ W with x [B, T, K], as torch_steel.linear calls it), the batch is one
  // [B * T, K] @ [K, N] GEMM: W is then read once per BM rows of all entries instead of once per
  // entry and row block (8 decode rows, T = 1: once instead of 8 times, and in one 32-row tile
  // instead of 8 mostly empty ones), and split-K becomes possible. Needs a read row by row
  // (n layout), one merged batch dim with a's stride M * lda (any stride when M = 1, which then
  // becomes the row stride), and c, when added, laid out the same way. out is contiguous, so its
  // rows follow each other anyway.
  int64_t Mk = M;
  int64_t batches = batch_count;
  const int64_t cd = static_cast<int64_t>(out_sizes.size());
  int64_t c_rs = use_c ? c_strides[cd - 2] : 0;
  if (merged.size() == 1 && merged[0].b == 0 && !la.transposed) {
    const BatchDim& bd = merged[0];
    const bool a_rows = M == 1 || bd.a == M * la.ld;
    const bool c_rows = !use_c || M == 1 || bd.c == M * c_rs;
    if (a_rows && c_rows) {
      if (M == 1) {
        la.ld = bd.a;
        c_rs = bd.c;
      }
      Mk = bd.size * M;
      batches = 1;
      merged.clear();
    }
  }

  // ---- kernel family, tile and split-K ----
  // matmul2d kernels where the device has Metal 4 matrix units (M5) and they take the dtype.
  const bool tensor_ops = use_neural_accelerators(device_desc(options)) &&
                          (dtype == DType::Float16 || dtype == DType::BFloat16);
  const Tile small = tensor_ops ? kTensorTile : kSmall;
  const int64_t blocks_large = ceil_div(Mk, kLarge.bm) * ceil_div(N, kLarge.bn) * batches;
  const int64_t blocks_small = ceil_div(Mk, small.bm) * ceil_div(N, small.bn) * batches;
  const int64_t blocks_thin = ceil_div(N, kThin.bn) * batches;
  const int64_t blocks_tall = ceil_div(Mk, kTall.bm) * batches;
  const int64_t cores = device_desc(options).gpu_cores;
  // The large block on 8 simdgroups where the pipeline allows them, else on 4.
  const Tile large = max_threads < kLargeThreads          ? kLarge4
                     : dtype == DType::Float32 ? kLarge32
                                               : kLarge;
  Tile tile = large;
  if (Mk <= kThin.bm && blocks_thin >= kMinThinBlocks) {
    tile = kThin;
  } else if (N <= kTall.bn && blocks_tall >= kMinThinBlocks) {
    tile = kTall;
  } else if ((blocks_large < kMinLargeBlocks && !large_fills_waves(blocks_large, cores)) ||
             Mk <= kSmall.bm || N <= kSmall.bn) {
    tile = kSmall;
  }
  if (tensor_ops) tile = kTensorTile;

  int64_t partitions = 1;
  int64_t k_split = K;
  if (blocks_small <= kSplitMaxBlocks && K >= kSplitMinK &&
      K >= kSplitKRatio * std::max(Mk, N)) {
    const int64_t target = std::max(kSplitTargetBlocks, kSplitBlocksPerCore * cores);
    partitions = std::min({ceil_div(target, blocks_small), K / kSplitMinSlice,
                           kSplitMaxPartitions});
    if (partitions >= 2) {
      k_split = ceil_div(ceil_div(K, partitions), small.bk) * small.bk;
      partitions = ceil_div(K, k_split);
    }
  }
  const bool split = partitions >= 2;

  // ---- GEMV: at most 8 output rows (or columns) ----
  // The tiled kernels spend an 8x8 MMA on every 8 rows, real or not: at M = 1 a 32x32 tile does
  // 32x the multiply-adds it needs and its fragments' ALU work, and the timing model puts the
  // 1 x 4096 x 4096 decode GEMM compute-bound at 2.3x the DRAM bound on M4 Pro. The GEMV kernels
  // (gemm/gemv.h) do R dot products per weight line instead, with lanes along K, and read the
  // weight once. They need both operands contiguous along K: a row-major and b column by column
  // ("nt", how torch_steel.linear passes x @ W^T). With M <= 8 the lines are b's columns; with
  // N <= 8 (M > 8), by transposition, a's rows. Split-K, when the plan chose it (few output
  // blocks, long K), keeps more threadgroups busy than a GEMV over a few lines, so it wins.
  // A single column of b ([K, 1]) with unit K stride is such a line too (its ld is never used).
  MatrixLayout lb_gemv = lb;
  if (N == 1 && b.strides[b.dim() - 2] == 1) lb_gemv = {true, true, 0};
  const bool gemv_layout = !la.transposed && lb_gemv.transposed;
  const bool gemv_rows = !split && gemv_layout && Mk <= STEEL_GEMV_MAX_ROWS;
  const bool gemv_cols = !split && !gemv_rows && gemv_layout && N <= STEEL_GEMV_MAX_ROWS;
  // x @ W with W stored [K, N] (a and b row-major, torch.matmul(x, W)): the same waste, and b's
  // columns are not contiguous along K, so steel_gemv_nn_'s lanes go along N instead: each
  // threadgroup reads a strip of 32 columns of W once. The model (bench_gemm.py --predict M4 Pro)
  // put 1 x 4096 x 4096 f16 on the tiled kernel at 253 us, compute-bound, against 133 us for
  // reading W once.
  const bool gemv_nn = !split && !gemv_rows && !gemv_cols && !la.transposed && !lb.transposed &&
                       Mk <= STEEL_GEMV_MAX_ROWS;
  if (gemv_rows || gemv_cols || gemv_nn) {
    const Gemv kind = gemv_rows ? Gemv::Rows : gemv_cols ? Gemv::Cols : Gemv::Nn;
    return plan_gemv(plan, a, b, la, gemv_nn ? lb : lb_gemv, merged, Mk, N, K, batches, dtype,
                     kind, use_c, c_rs, use_c ? c_strides[cd - 1] : 0, bias, alpha, beta,
                     activation, kSlotC, kSlotBias, kSlotOut);
  }

  const Tile t = split ? small : tile;
  if (split && partitions * batches * Mk * N > kInt32Max) {
    return Plan::refuse("gemm: split-K partials beyond 32-bit indexing");
  }
  if (!tensor_ops && tile_threadgroup_bytes(t, dtype, la.transposed, lb.transposed) > 32 * 1024) {
    return Plan::refuse("gemm: tile needs more than 32 KiB of threadgroup memory");
  }

  // ---- params ----
  GemmParams p;
  std::memset(&p, 0, sizeof(p));
  p.M = static_cast<int32_t>(Mk);
  p.N = static_cast<int32_t>(N);
  p.K = static_cast<int32_t>(K);
  p.lda = static_cast<int32_t>(la.ld);
  p.ldb = static_cast<int32_t>(lb.ld);
  p.ldd = static_cast<int32_t>(N);
  p.tiles_m = static_cast<int32_t>(ceil_div(Mk, t.bm));
  p.tiles_n = static_cast<int32_t>(ceil_div(N, t.bn));
  // Bands of 2 or 4 tile rows once the grid is big enough that neighbours would otherwise have
  // left L2 (a band costs at most 2^swizzle_log - 1 idle rows of threadgroups).
  p.swizzle_log = (p.tiles_m >= 16 && p.tiles_n >= 16) ? 2 : (p.tiles_m >= 4 && p.tiles_n >= 4);
  p.k_split = static_cast<int32_t>(k_split);
  p.partial_stride = static_cast<int32_t>(batches * Mk * N);
  p.partitions = static_cast<int32_t>(partitions);
  p.c_rs = static_cast<int32_t>(c_rs);
  p.c_cs = use_c ? static_cast<int32_t>(c_strides[cd - 1]) : 0;
  p.bias_stride = bias ? static_cast<int32_t>(bias->strides[0]) : 0;
  p.alpha = static_cast<float>(alpha);
  p.beta = static_cast<float>(beta);
  p.batch_ndim = static_cast<int32_t>(merged.size());
  for (size_t d = 0; d < merged.size(); ++d) {
    p.batch_shape[d] = static_cast<int32_t>(merged[d].size);
    p.a_batch_strides[d] = static_cast<int32_t>(merged[d].a);
    p.b_batch_strides[d] = static_cast<int32_t>(merged[d].b);
    p.c_batch_strides[d] = static_cast<int32_t>(merged[d].c);
  }
  p.out_batch_stride = static_cast<int32_t>(Mk * N);

  // Vector loads need every row start of the operand aligned to the loader's access size
  // (steel_gemm_loader_vec: 16 bytes for most tiles, 8 for the f16/bf16 32-wide ones): storage
  // offset, leading dim and batch strides all multiples of it. Storage itself (an MTLBuffer, at
  // a byte offset of storage_offset * element size) is at least 16-byte aligned. The K slices of
  // split-K (multiples of BK) and the tile origins (multiples of BM, BN) keep that alignment.
  const int es = static_cast<int>(dtype_size(dtype));
  const int threads_per_tile = 32 * t.wm * t.wn;
  const int64_t vec_a = steel_gemm_loader_vec(t.bm * t.bk, threads_per_tile, es);
  const int64_t vec_b = steel_gemm_loader_vec(t.bk * t.bn, threads_per_tile, es);
  auto vec_ok = [&](const TensorDesc& x, const MatrixLayout& l, bool is_a) {
    const int64_t vec = is_a ? vec_a : vec_b;
    bool ok = x.offset % vec == 0 && l.ld % vec == 0;
    for (const BatchDim& bd : merged) ok = ok && (is_a ? bd.a : bd.b) % vec == 0;
    return ok;
  };

  const bool align_m = Mk % t.bm == 0, align_n = N % t.bn == 0, align_k = K % t.bk == 0;
  std::vector<FunctionConstant> tile_constants = {
      fc_bool(STEEL_GEMM_FC_HAS_BATCH, batches > 1),
      fc_bool(STEEL_GEMM_FC_USE_C, use_c && !split),
      fc_bool(STEEL_GEMM_FC_HAS_BIAS, bias.has_value() && !split),
      fc_int(STEEL_GEMM_FC_ACTIVATION, split ? kSteelActNone : activation),
      fc_bool(STEEL_GEMM_FC_ALIGN_M, align_m),
      fc_bool(STEEL_GEMM_FC_ALIGN_N, align_n),
      fc_bool(STEEL_GEMM_FC_ALIGN_K, align_k),
  };
  if (!tensor_ops) {  // the matmul2d kernels read no vectors of their own
    tile_constants.push_back(fc_bool(STEEL_GEMM_FC_VEC_A, vec_ok(a, la, true)));
    tile_constants.push_back(fc_bool(STEEL_GEMM_FC_VEC_B, vec_ok(b, lb, false)));
  }
  const char* trans = la.transposed ? (lb.transposed ? "tt" : "tn") : (lb.transposed ? "nt" : "nn");
  // Absent c or bias: the kernel never reads them (function constants), but every declared
  // buffer is bound, so a stands in.
  const int32_t c_slot = use_c ? kSlotC : kSlotA;
  const int32_t bias_slot = bias ? kSlotBias : kSlotA;
  const uint32_t threads = static_cast<uint32_t>(32 * t.wm * t.wn);
  const uint32_t grid_x = static_cast<uint32_t>(p.tiles_n) << p.swizzle_log;
  const uint32_t grid_y =
      static_cast<uint32_t>(ceil_div(p.tiles_m, int64_t{1} << p.swizzle_log));

  Dispatch d;
  d.constants = tile_constants;
  d.grid[0] = grid_x;
  d.grid[1] = grid_y;
  d.threads[0] = threads;
  if (!split) {
    d.kernel = tensor_ops ? "steel_gemm_tensor_" + tensor_tile_suffix(trans, dtype, t)
                          : "steel_gemm_" + tile_suffix(trans, dtype, t);
    d.grid[2] = static_cast<uint32_t>(batches);
    d.bindings = {tensor_binding(STEEL_GEMM_BUF_A, kSlotA),
                  tensor_binding(STEEL_GEMM_BUF_B, kSlotB),
                  tensor_binding(STEEL_GEMM_BUF_C, c_slot),
                  tensor_binding(STEEL_GEMM_BUF_BIAS, bias_slot),
                  tensor_binding(STEEL_GEMM_BUF_OUT, kSlotOut), params_binding(p)};
    plan.dispatches.push_back(d);
    return plan;
  }

  Allocation scratch;
  scratch.name = "splitk_partials";
  scratch.dtype = DType::Float32;
  scratch.sizes = {partitions, batches, Mk, N};
  plan.allocations.push_back(scratch);
  const int32_t kSlotScratch = n_inputs + 1;

  d.kernel = tensor_ops ? "steel_gemm_tensor_splitk_" + tensor_tile_suffix(trans, dtype, t)
                        : "steel_gemm_splitk_" + tile_suffix(trans, dtype, t);
  d.grid[2] = static_cast<uint32_t>(batches * partitions);
  d.bindings = {tensor_binding(STEEL_GEMM_BUF_A, kSlotA), tensor_binding(STEEL_GEMM_BUF_B, kSlotB),
                tensor_binding(STEEL_GEMM_BUF_OUT, kSlotScratch), params_binding(p)};
  plan.dispatches.push_back(d);

  Dispatch r;
  r.kernel = std::string("steel_gemm_splitk_reduce_") + dtype_tag(dtype);
  r.constants = {fc_bool(STEEL_GEMM_FC_HAS_BATCH, batches > 1),
                 fc_bool(STEEL_GEMM_FC_USE_C, use_c),
                 fc_bool(STEEL_GEMM_FC_HAS_BIAS, bias.has_value()),
                 fc_int(STEEL_GEMM_FC_ACTIVATION, activation)};
  r.bindings = {tensor_binding(STEEL_GEMM_BUF_A, kSlotScratch),
                tensor_binding(STEEL_GEMM_BUF_C, c_slot),
                tensor_binding(STEEL_GEMM_BUF_BIAS, bias_slot),
                tensor_binding(STEEL_GEMM_BUF_OUT, kSlotOut), params_binding(p)};
  const int64_t reduce_threads = std::min(kReduceThreads, max_threads / 32 * 32);
  r.grid[0] = static_cast<uint32_t>(ceil_div(batches * Mk * N, reduce_threads));
  r.threads[0] = static_cast<uint32_t>(reduce_threads);
  plan.dispatches.push_back(r);
  return plan;
}

STEEL_PLANNER("gemm", plan_gemm);

}  // namespace steel
