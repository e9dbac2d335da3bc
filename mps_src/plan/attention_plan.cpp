// Launch planning for the attention forward (steel::sdpa_forward), and the pieces of it that the
// varlen planner (varlen_plan.cpp) shares.
//
// From shapes, strides, dtypes and options only, this decides:
//   - the kernel: the smallest instantiated (DE, DV) head-dim pair that holds (E, Ev), with
//     bounded head-dim loads when they differ (kHeadDims below mirrors attention.metal);
//   - how each tensor is read: any strides whose last one is 1 (BLHD views, KV-cache slices,
//     expanded batch or head dims) go to the kernel as they are; others are copied first;
//   - the batch: dims merged where every tensor walks them contiguously, a stride per merged dim
//     and tensor (0 where broadcast), the mask's broadcast over heads, rows and keys too;
//   - the score unit, scale and softcap factors (shaders/steel/attn/score.h), the causal and
//     window diagonals as offsets, the function constants and the AttnParams bytes;
//   - out in q's memory layout (BLHD in, BLHD out, as F.sdpa), lse [*batch, Hq, L];
//   - or a refusal that names the limit.
#include "attention_plan.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include "device.h"

namespace steel {
namespace attn {
namespace {

// The (DE, DV) pairs instantiated in attention.metal, in the order they are tried.
constexpr HeadDims kHeadDims[] = {{32, 32},   {40, 40},   {64, 64},   {72, 72},
                                  {80, 80},   {96, 96},   {128, 128}, {160, 160},
                                  {192, 128}, {192, 192}, {256, 256}, {512, 512},
                                  {576, 512}, {576, 576}};
constexpr int kMaxHeadDim = 576;
// The backward kernels (attention_backward.metal) are instantiated for the pairs up to 512:
// 576 / 512 is multi-head latent attention's absorbed form, an inference-time rewrite of a
// layer that trains in its own form (E = 192, Ev = 128, instantiated).
constexpr int kMaxBackwardHeadDim = 512;

// attention_backward.metal instantiates every pair up to kMaxBackwardHeadDim in every dtype:
// each has a backward tile.
constexpr bool every_pair_has_a_backward_tile() {
  for (const HeadDims& h : kHeadDims) {
    if (h.de > kMaxBackwardHeadDim || h.dv > kMaxBackwardHeadDim) continue;
    for (int es : {2, 4}) {
      if (steel_attn_bwd_bk(h.de, h.dv, es) == 0) return false;
    }
  }
  return true;
}
static_assert(every_pair_has_a_backward_tile(), "a head-dim pair without a backward tile");
constexpr int64_t kThreads = 32 * STEEL_ATTN_SIMDGROUPS;
// The (D, D) pairs of the matmul2d kernel (attention_tensor_msl4.metal): it serves a call when
// the simdgroup planner's pair is one of them, so both kernels pad the same head dims.
constexpr int kTensorHeadDims[] = {64, 96, 128, 256};

// The cheapest pair holding (E, Ev): fewest padded head-dim columns.
const HeadDims* pick_head_dims(int64_t E, int64_t Ev) {
  const HeadDims* best = nullptr;
  for (const HeadDims& h : kHeadDims) {
    if (h.de < E || h.dv < Ev) continue;
    if (best == nullptr || h.de + h.dv < best->de + best->dv) best = &h;
  }
  return best;
}

int elem_bytes(const Common& c) { return static_cast<int>(dtype_size(c.dtype)); }

}  // namespace

std::string check_dtypes(const char* op, const TensorDesc& q, const TensorDesc& k,
                         const TensorDesc& v) {
  if (!supported_dtype(q.dtype)) {
    return std::string("attention kernels support float16, bfloat16 and float32, not ") +
           dtype_name(q.dtype);
  }
  if (k.dtype != q.dtype || v.dtype != q.dtype) {
    return std::string(op) + ": key and value must share the query's dtype " +
           dtype_name(q.dtype);
  }
  return "";
}

std::string common(const char* op, DType dtype, int64_t Hq, int64_t Hkv, int64_t E, int64_t Ev,
                   const std::optional<TensorDesc>& sinks, int32_t sinks_slot,
                   const Options& options, Common* c, Plan* plan) {
  const std::string name(op);
  if (E == 0 || Ev == 0 || E > kMaxHeadDim || Ev > kMaxHeadDim) {
    return name + ": head dims E = " + std::to_string(E) + ", Ev = " + std::to_string(Ev) +
           "; the kernels take 1 to " + std::to_string(kMaxHeadDim);
  }
  const HeadDims* hd = pick_head_dims(E, Ev);
  if (hd == nullptr) {
    return name + ": no kernel instantiation holds head dims E = " + std::to_string(E) +
           ", Ev = " + std::to_string(Ev);
  }
  const double dropout_p = options.number("dropout_p", 0.0);
  // Dropout is refused only at p >= 1 (every weight dropped); any p below runs in the kernels.
  if (dropout_p >= 1.0) {
    return name + ": dropout_p = 1 drops every weight (reference math serves it)";
  }
  const int64_t max_threads = static_cast<int64_t>(options.number("max_threads", 1024));
  if (max_threads < kThreads) {
    return name + ": the pipeline allows " + std::to_string(max_threads) +
           " threads per threadgroup, the attention kernels need " + std::to_string(kThreads);
  }
  const int es = static_cast<int>(dtype_size(dtype));
  if (steel_attn_threadgroup_bytes(hd->de, hd->dv, es) > 32 * 1024) {
    return name + ": the K/V tiles need more than 32 KiB of threadgroup memory";
  }
  c->dtype = dtype;
  c->kernel = *hd;
  c->E = E;
  c->Ev = Ev;
  c->Hq = Hq;
  c->Hkv = Hkv;
  c->is_causal = options.number("is_causal", 0.0) != 0.0;
  c->bottom_right = options.number("bottom_right", 0.0) != 0.0;
  c->lse = options.number("lse", 1.0) != 0.0;
  c->scale = options.number("scale", 1.0 / std::sqrt(static_cast<double>(E)));
  c->softcap = options.number("softcap", 0.0);
  c->window_left = static_cast<int64_t>(options.number("window_left", -1));
  c->window_right = static_cast<int64_t>(options.number("window_right", -1));
  c->dropout_p = dropout_p > 0.0 ? dropout_p : 0.0;
  // The Philox key and counter word of torch_steel/dropout.py (seed in two 32-bit halves).
  c->seed_lo = static_cast<uint32_t>(options.number("seed_lo", 0));
  c->seed_hi = static_cast<uint32_t>(options.number("seed_hi", 0));
  c->drop_offset = static_cast<uint32_t>(options.number("offset", 0));
  c->sinks_kind = kSteelAttnOperandNone;
  if (sinks) {
    if (sinks->dim() != 1 || sinks->sizes[0] != Hq) {
      return name + ": sinks must be [" + std::to_string(Hq) + "], got " +
             shape_str(sinks->sizes);
    }
    if (sinks->dtype == dtype) {
      c->sinks_kind = kSteelAttnOperandT;
    } else if (sinks->dtype == DType::Float32) {
      c->sinks_kind = kSteelAttnOperandF32;
    } else {
      return name + ": sinks of dtype " + dtype_name(sinks->dtype) +
             " (the query's dtype or float32 are served)";
    }
    if (Hq > 1 && sinks->strides[0] != 1) {
      plan->contiguous_inputs.push_back(sinks_slot);  // Hq elements: the kernel reads sinks[h]
    }
  }
  return "";
}

void read_in_place(TensorDesc* t, int32_t slot, Plan* plan) {
  if (t->sizes.back() == 1 || t->strides.back() == 1) return;
  plan->contiguous_inputs.push_back(slot);
  *t = t->contiguous();
}

Diagonals diagonals(const Common& c, int64_t reach) {
  Diagonals d;
  const bool right = c.window_right >= 0 && c.window_right < reach;
  d.has_hi = c.is_causal || right;
  d.hi_off = c.is_causal ? (right ? std::min<int64_t>(0, c.window_right) : 0)
                         : (right ? c.window_right : 0);
  d.has_lo = c.window_left >= 0 && c.window_left < reach;
  d.lo_off = d.has_lo ? c.window_left : 0;
  return d;
}

AttnParams base_params(const Common& c, const Diagonals& d, bool additive, const TensorDesc& q,
                       const TensorDesc& k, const TensorDesc& v, int64_t head_dim,
                       int64_t row_dim) {
  // Scores are in nats with an additive mask, else in units of log2(e) nats (score.h): q is
  // prescaled by scale times the unit, or by 1 / softcap when softcap carries the unit.
  const double unit = additive ? 1.0 : 1.4426950408889634;  // log2(e)
  AttnParams p;
  std::memset(&p, 0, sizeof(p));
  p.E = static_cast<int32_t>(c.E);
  p.Ev = static_cast<int32_t>(c.Ev);
  p.Hq = static_cast<int32_t>(c.Hq);
  p.group = static_cast<int32_t>(c.Hq / c.Hkv);
  p.hi_off = static_cast<int32_t>(d.hi_off);
  p.lo_off = static_cast<int32_t>(d.lo_off);
  p.q_scale = static_cast<float>(c.softcap > 0 ? c.scale / c.softcap : c.scale * unit);
  p.softcap = static_cast<float>(c.softcap > 0 ? c.softcap * unit : 0.0);
  p.q_hs = q.strides[head_dim];
  p.q_rs = q.strides[row_dim];
  p.k_hs = k.strides[head_dim];
  p.k_rs = k.strides[row_dim];
  p.v_hs = v.strides[head_dim];
  p.v_rs = v.strides[row_dim];
  if (c.dropout_p > 0.0) {
    p.seed_lo = c.seed_lo;
    p.seed_hi = c.seed_hi;
    p.drop_offset = c.drop_offset;
    // keep_threshold of torch_steel/dropout.py: floor(p * 2^32), below 2^32 as p < 1.
    p.drop_threshold = static_cast<uint32_t>(std::floor(c.dropout_p * 4294967296.0));
    p.drop_scale = static_cast<float>(1.0 / (1.0 - c.dropout_p));
  }
  return p;
}

bool vec_rows(const Common& c, const TensorDesc& t, int64_t head_dim, int64_t row_dim,
              const int64_t* more, size_t count) {
  // 16-byte chunk loads need every row start aligned: offset, row, head and batch strides all
  // multiples of the chunk. MTLBuffers themselves are at least 16-byte aligned.
  const int64_t vec = 16 / elem_bytes(c);
  bool ok = t.offset % vec == 0 && t.strides[row_dim] % vec == 0 &&
            t.strides[head_dim] % vec == 0;
  for (size_t i = 0; i < count; ++i) ok = ok && more[i] % vec == 0;
  return ok;
}

std::string backward_head_dims(const char* op, int64_t E, int64_t Ev) {
  if (E <= kMaxBackwardHeadDim && Ev <= kMaxBackwardHeadDim) return "";
  return std::string(op) + ": head dims E = " + std::to_string(E) + ", Ev = " +
         std::to_string(Ev) + " have no backward kernel (it takes 1 to " +
         std::to_string(kMaxBackwardHeadDim) + "; above that, to 576, the forward is for " +
         "inference, as multi-head latent attention's absorbed 576 / 512)";
}

bool kv_alias(const Common& c, const TensorDesc& k, const TensorDesc& v) {
  const int64_t nd = k.dim();
  if (c.tensor_ops || c.kernel.dv > c.kernel.de || c.Ev > c.E || k.storage == 0 ||
      v.storage != k.storage || v.offset != k.offset || v.dim() != nd || nd == 0 ||
      k.strides.size() != k.sizes.size() || v.strides.size() != v.sizes.size() ||
      k.strides.back() != 1 || v.strides.back() != 1) {
    return false;
  }
  for (int64_t d = 0; d + 1 < nd; ++d) {
    if (k.sizes[d] != v.sizes[d] || k.strides[d] != v.strides[d]) return false;
  }
  return true;
}

int64_t key_tile(const Common& c) {
  if (c.tensor_ops) return STEEL_ATTN_TENSOR_BK;
  return steel_attn_bk(c.kernel.de, c.kernel.dv, elem_bytes(c));
}

int64_t row_block(const Common& c) {
  return c.tensor_ops ? STEEL_ATTN_TENSOR_BQ : STEEL_ATTN_BQ;
}

bool tensor_serves(const Common& c, const AttnParams& p, const Options& options) {
  if (!use_neural_accelerators(device_desc(options)) || options.number("tensor_ops", 1) == 0) {
    return false;
  }
  if (c.dtype != DType::Float16 && c.dtype != DType::BFloat16) return false;
  const int* const dims_end = kTensorHeadDims + std::size(kTensorHeadDims);
  if (c.kernel.de != c.kernel.dv || std::find(kTensorHeadDims, dims_end, c.kernel.de) == dims_end) {
    return false;
  }
  // The views start at the block's first row (the tile's first key) and span BQ (BK) rows.
  const int64_t rows = std::max<int64_t>(STEEL_ATTN_TENSOR_BQ, STEEL_ATTN_TENSOR_BK);
  for (int64_t stride : {p.q_rs, p.k_rs, p.v_rs, p.o_rs}) {
    if (stride < 0 || stride * rows + std::max(c.E, c.Ev) > kInt32Max) return false;
  }
  return true;
}

bool tensor_backward(const Plan& fwd, int64_t g_rs, int64_t Ev) {
  if (!fwd.ok || fwd.dispatches.empty() ||
      fwd.dispatches[0].kernel.rfind("steel_attention_tensor_", 0) != 0) {
    return false;
  }
  return g_rs >= 0 && g_rs * STEEL_ATTN_TENSOR_BQ + Ev <= kInt32Max;
}

std::vector<FunctionConstant> tensor_backward_constants(const Plan& fwd,
                                                        std::vector<FunctionConstant> constants) {
  for (FunctionConstant& c : constants) {
    if (c.index != STEEL_ATTN_FC_ALIGN_L && c.index != STEEL_ATTN_FC_ALIGN_S) continue;
    for (const FunctionConstant& f : fwd.dispatches[0].constants) {
      if (f.index == c.index) c = f;
    }
  }
  return constants;
}

Dispatch dispatch(const Common& c, const Diagonals& d, const AttnParams& p, const Launch& l) {
  Dispatch out;
  out.kernel = std::string(c.tensor_ops ? "steel_attention_tensor_" : "steel_attention_") +
               dtype_tag(c.dtype) + "_e" + std::to_string(c.kernel.de) + "_v" +
               std::to_string(c.kernel.dv);
  out.constants = {
      fc_bool(STEEL_ATTN_FC_ALIGN_L, l.align_l),
      fc_bool(STEEL_ATTN_FC_ALIGN_S, l.align_s),
      fc_bool(STEEL_ATTN_FC_ALIGN_E, c.E == c.kernel.de),
      fc_bool(STEEL_ATTN_FC_ALIGN_EV, c.Ev == c.kernel.dv),
      fc_bool(STEEL_ATTN_FC_VEC_K, l.vec_k),
      fc_bool(STEEL_ATTN_FC_VEC_V, l.vec_v),
      fc_int(STEEL_ATTN_FC_MASK, l.mask_kind),
      fc_bool(STEEL_ATTN_FC_HAS_HI, d.has_hi),
      fc_bool(STEEL_ATTN_FC_HAS_LO, d.has_lo),
      fc_int(STEEL_ATTN_FC_SINKS, c.sinks_kind),
      fc_bool(STEEL_ATTN_FC_SOFTCAP, c.softcap > 0),
      fc_bool(STEEL_ATTN_FC_HAS_BATCH, l.has_batch),
      fc_bool(STEEL_ATTN_FC_VARLEN, l.varlen),
      fc_bool(STEEL_ATTN_FC_VARLEN_BR, l.varlen_br),
      fc_bool(STEEL_ATTN_FC_DROPOUT, c.dropout_p > 0.0),
      fc_bool(STEEL_ATTN_FC_KV_ALIAS, l.kv_alias),
      fc_bool(STEEL_ATTN_FC_LSE, c.lse),
  };
  // Absent mask or sinks are never read (function constants), but every declared buffer is
  // bound, so q stands in. The cu_seqlens buffers exist only in varlen pipelines.
  const int32_t q_slot = 0, k_slot = 1, v_slot = 2;
  out.bindings = {tensor_binding(STEEL_ATTN_BUF_Q, q_slot),
                  tensor_binding(STEEL_ATTN_BUF_K, k_slot),
                  tensor_binding(STEEL_ATTN_BUF_V, v_slot),
                  tensor_binding(STEEL_ATTN_BUF_MASK, l.mask_slot >= 0 ? l.mask_slot : q_slot),
                  tensor_binding(STEEL_ATTN_BUF_SINKS, l.sinks_slot >= 0 ? l.sinks_slot : q_slot),
                  tensor_binding(STEEL_ATTN_BUF_OUT, l.out_slot),
                  tensor_binding(STEEL_ATTN_BUF_LSE, l.lse_slot),
                  bytes_binding(STEEL_ATTN_BUF_PARAMS, &p, sizeof(AttnParams))};
  if (l.varlen) {
    out.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_CU_Q, l.cu_q_slot));
    out.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_CU_K, l.cu_k_slot));
  }
  std::copy(l.grid, l.grid + 3, out.grid);
  out.threads[0] = static_cast<uint32_t>(c.tensor_ops ? 32 * STEEL_ATTN_TENSOR_SIMDGROUPS
                                                      : attn::kThreads);
  return out;
}

bool decode_serves(const Common& c, int64_t rows, const Options& options) {
  return rows <= STEEL_ATTN_DECODE_MAX_L && c.dropout_p == 0.0 &&
         options.number("decode", 1.0) != 0.0;
}

namespace {

// Query rows per threadgroup block: all of them up to STEEL_ATTN_BQ (decode), else BQ.
int64_t decode_row_block(int64_t rows) {
  return std::min<int64_t>(std::max<int64_t>(rows, 1), STEEL_ATTN_BQ);
}

// The largest divisor of the group whose heads' row blocks fit one threadgroup's BQ rows.
int64_t decode_heads_per_tg(int64_t group, int64_t rows) {
  int64_t best = 1;
  for (int64_t d = 1; d <= group; ++d) {
    if (group % d == 0 && d * decode_row_block(rows) <= STEEL_ATTN_BQ) best = d;
  }
  return best;
}

}  // namespace

void decode_split(const Common& c, const Decode& dec, const Options& options, int64_t* splits,
                  int64_t* split_keys) {
  const int64_t bk = key_tile(c);
  const int64_t keys = std::max<int64_t>(dec.keys, 1);
  const int64_t group = c.Hq / c.Hkv;
  const int64_t blocks = ceil_div(std::max<int64_t>(dec.rows, 1), decode_row_block(dec.rows));
  const int64_t threadgroups =
      dec.count * c.Hkv * (group / decode_heads_per_tg(group, dec.rows)) * blocks;
  int64_t n = static_cast<int64_t>(options.number("num_splits", 0));
  if (n <= 0) {
    const int64_t cores = std::max<int64_t>(
        1, static_cast<int64_t>(options.number("gpu_cores", kDecodeDefaultCores)));
    const int64_t target = cores * kDecodeTgPerCore;
    n = threadgroups >= target
            ? 1
            : std::min(ceil_div(target, std::max<int64_t>(threadgroups, 1)),
                       ceil_div(keys, kDecodeMinSplitKeys));
  }
  n = std::min<int64_t>({n, STEEL_ATTN_DECODE_MAX_SPLITS, ceil_div(keys, bk)});
  *split_keys = ceil_div(ceil_div(keys, n), bk) * bk;
  *splits = ceil_div(keys, *split_keys);  // rounding up the partitions may leave fewer
}

void add_decode(const Common& c, const Diagonals& d, const AttnParams& p, const Launch& l,
                const Decode& dec, const Options& options, Plan* plan) {
  int64_t splits = 1, split_keys = 0;
  decode_split(c, dec, options, &splits, &split_keys);
  const int64_t group = c.Hq / c.Hkv;
  const int64_t per_tg = decode_heads_per_tg(group, dec.rows);
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
  k.kernel = std::string("steel_attention_decode_") + dtype_tag(c.dtype) + "_e" +
             std::to_string(c.kernel.de) + "_v" + std::to_string(c.kernel.dv);
  k.constants = constants;
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
  k.threads[0] = static_cast<uint32_t>(kThreads);
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
  int64_t splits = 1, split_keys = 0;
  decode_split(c, dec, options, &splits, &split_keys);
  const Diagonals diag = diagonals(c, L + keys);
  const bool grown = row_major(k) && row_major(v);
  // A mask over the keys holds S in its last dim (and, row-major, in its strides above it); a
  // last dim of 1 (at S = 1 too) broadcasts, with a key stride of 0 at every S.
  const int64_t mask_class = !mask ? 0 : mask->sizes.back() == 1 ? 1 : row_major(*mask) ? 2 : 3;
  const int64_t fields[] = {
      splits, split_keys, keys % key_tile(c) == 0, diag.has_hi, diag.has_lo, grown, mask_class};
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
  const bool grown = row_major(k) && row_major(*tensors[2]);  // by torch.cat: see the header
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
      if (grown) {
        const int64_t from = dp.fwd.S;
        for (int32_t i = 0; i < dp.fwd.batch_ndim; ++i) {
          dp.fwd.k_bs[i] = rescaled(dp.fwd.k_bs[i], from, S);
          dp.fwd.v_bs[i] = rescaled(dp.fwd.v_bs[i], from, S);
        }
        dp.fwd.k_hs = rescaled(dp.fwd.k_hs, from, S);
        dp.fwd.v_hs = rescaled(dp.fwd.v_hs, from, S);
      }
      if (mask_grown) {  // its strides above the key dim are multiples of S, or 0
        const int64_t from = dp.fwd.S;
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

using attn::Common;

Plan plan_attention(const TensorList& tensors, const Options& options) {
  if (tensors.size() != 5 || !tensors[0] || !tensors[1] || !tensors[2]) {
    return Plan::refuse("sdpa takes tensors [q, k, v, attn_mask, sinks] with q, k, v present");
  }
  TensorDesc q = *tensors[0];
  TensorDesc k = *tensors[1];
  TensorDesc v = *tensors[2];
  std::optional<TensorDesc> mask = tensors[3];
  std::optional<TensorDesc> sinks = tensors[4];
  const int32_t kSlotQ = 0, kSlotK = 1, kSlotV = 2, kSlotMask = 3, kSlotSinks = 4;

  // ---- dtypes, ranks, shapes, options ----
  std::string why = attn::check_dtypes("sdpa", q, k, v);
  if (!why.empty()) return Plan::refuse(why);
  const DType dtype = q.dtype;
  const int64_t nd = q.dim();
  if (nd < 3 || k.dim() != nd || v.dim() != nd) {
    return Plan::refuse("sdpa: q, k, v must be [*batch, heads, seq, dim] of one rank, got " +
                        shape_str(q.sizes) + ", " + shape_str(k.sizes) + ", " + shape_str(v.sizes));
  }
  const int64_t Hq = q.sizes[nd - 3], L = q.sizes[nd - 2], E = q.sizes[nd - 1];
  const int64_t Hkv = k.sizes[nd - 3], S = k.sizes[nd - 2], Ev = v.sizes[nd - 1];
  std::vector<int64_t> batch(q.sizes.begin(), q.sizes.end() - 3);
  for (int64_t d = 0; d < nd - 3; ++d) {
    if (k.sizes[d] != batch[d] || v.sizes[d] != batch[d]) {
      return Plan::refuse("sdpa: batch dims of q " + shape_str(q.sizes) + ", k " +
                          shape_str(k.sizes) + ", v " + shape_str(v.sizes) + " differ");
    }
  }
  if (k.sizes[nd - 1] != E || v.sizes[nd - 3] != Hkv || v.sizes[nd - 2] != S || Hkv == 0 ||
      Hq % Hkv != 0) {
    return Plan::refuse("sdpa: shapes q " + shape_str(q.sizes) + ", k " + shape_str(k.sizes) +
                        ", v " + shape_str(v.sizes) + " do not make an attention");
  }
  Plan plan;
  Common c;
  why = attn::common("sdpa", dtype, Hq, Hkv, E, Ev, sinks, kSlotSinks, options, &c, &plan);
  if (!why.empty()) return Plan::refuse(why);
  if (L > kInt32Max / 2 || S > kInt32Max / 2) {
    return Plan::refuse("sdpa: L = " + std::to_string(L) + ", S = " + std::to_string(S) +
                        " beyond the kernels' 32-bit row indexing (2^30)");
  }

  int mask_kind = kSteelAttnMaskNone;
  std::vector<int64_t> full = batch;  // [*batch, Hq, L, S], what the mask broadcasts to
  full.insert(full.end(), {Hq, L, S});
  std::vector<int64_t> mask_strides;
  if (mask) {
    if (mask->dtype == DType::Bool) {
      mask_kind = kSteelAttnMaskBool;
    } else if (mask->dtype == dtype) {
      mask_kind = kSteelAttnMaskAdd;
    } else if (mask->dtype == DType::Float32) {
      mask_kind = kSteelAttnMaskAddF32;
    } else {
      return Plan::refuse(std::string("sdpa: an attn_mask of dtype ") + dtype_name(mask->dtype) +
                          " with " + dtype_name(dtype) + " inputs (bool, the query's dtype or " +
                          "float32 are served)");
    }
    if (!broadcast_strides(*mask, full, &mask_strides)) {
      return Plan::refuse("sdpa: attn_mask " + shape_str(mask->sizes) + " does not broadcast to " +
                          shape_str(full));
    }
  }

  // ---- layouts: last dim contiguous, or a copy ----
  attn::read_in_place(&q, kSlotQ, &plan);
  attn::read_in_place(&k, kSlotK, &plan);
  attn::read_in_place(&v, kSlotV, &plan);
  std::sort(plan.contiguous_inputs.begin(), plan.contiguous_inputs.end());

  // ---- outputs: out in q's memory layout, lse row-major ----
  // q is BLHD when its heads are closer in memory than its rows (a [B, L, H, E] tensor
  // transposed); out then has the same order, so out.transpose(1, 2) is a [B, L, H, Ev] view.
  const bool blhd = Hq > 1 && L > 1 && q.strides[nd - 3] < q.strides[nd - 2];
  std::vector<int64_t> out_sizes = batch;
  out_sizes.insert(out_sizes.end(), {Hq, L, Ev});
  Allocation out_alloc;
  out_alloc.name = "out";
  out_alloc.dtype = dtype;
  out_alloc.sizes = out_sizes;
  out_alloc.is_output = true;
  if (blhd) {
    for (int64_t d = 0; d < nd - 3; ++d) out_alloc.order.push_back(d);
    out_alloc.order.insert(out_alloc.order.end(), {nd - 2, nd - 3, nd - 1});
  }
  Allocation lse_alloc;
  lse_alloc.name = "lse";
  lse_alloc.dtype = DType::Float32;
  lse_alloc.sizes = std::vector<int64_t>(batch);
  lse_alloc.sizes.insert(lse_alloc.sizes.end(), {Hq, L});
  lse_alloc.is_output = true;
  plan.allocations = {out_alloc, lse_alloc};
  const int32_t kSlotOut = 5, kSlotLse = 6;
  int64_t batch_count = 1;
  for (int64_t b : batch) batch_count *= b;
  plan.ok = true;
  if (batch_count == 0 || Hq == 0 || L == 0) return plan;  // nothing to compute

  // ---- batch: drop size-1 dims, merge dims every tensor walks contiguously ----
  struct BatchDim {
    int64_t size, q, k, v, m;
  };
  std::vector<BatchDim> merged;
  for (int64_t d = 0; d < nd - 3; ++d) {
    if (batch[d] == 1) continue;
    BatchDim bd = {batch[d], q.strides[d], k.strides[d], v.strides[d],
                   mask ? mask_strides[d] : 0};
    if (!merged.empty()) {
      BatchDim& o = merged.back();
      if (o.q == bd.q * bd.size && o.k == bd.k * bd.size && o.v == bd.v * bd.size &&
          o.m == bd.m * bd.size) {
        o = {o.size * bd.size, bd.q, bd.k, bd.v, bd.m};
        continue;
      }
    }
    merged.push_back(bd);
  }
  if (merged.size() > STEEL_ATTN_MAX_BATCH_DIMS) {
    return Plan::refuse("sdpa: " + std::to_string(merged.size()) +
                        " batch dims that cannot be merged; the kernels take at most " +
                        std::to_string(STEEL_ATTN_MAX_BATCH_DIMS));
  }

  // ---- params: diagonals aligned once for the whole launch, batch and mask strides ----
  const bool additive = mask_kind == kSteelAttnMaskAdd || mask_kind == kSteelAttnMaskAddF32;
  const attn::Diagonals diag = attn::diagonals(c, L + S);
  AttnParams p = attn::base_params(c, diag, additive, q, k, v, nd - 3, nd - 2);
  p.L = static_cast<int32_t>(L);
  p.S = static_cast<int32_t>(S);
  p.shift = static_cast<int32_t>(c.bottom_right ? S - L : 0);
  p.batch_ndim = static_cast<int32_t>(merged.size());
  std::vector<int64_t> k_batch, v_batch;
  for (size_t d = 0; d < merged.size(); ++d) {
    p.batch_shape[d] = static_cast<int32_t>(merged[d].size);
    p.q_bs[d] = merged[d].q;
    p.k_bs[d] = merged[d].k;
    p.v_bs[d] = merged[d].v;
    p.m_bs[d] = merged[d].m;
    k_batch.push_back(merged[d].k);
    v_batch.push_back(merged[d].v);
  }
  if (mask) {
    p.m_hs = mask_strides[nd - 3];
    p.m_rs = mask_strides[nd - 2];
    p.m_cs = mask_strides[nd - 1];
  }
  // out: the flattened batch entry, then heads and rows in q's order.
  p.o_bs = Hq * L * Ev;
  p.o_hs = blhd ? Ev : L * Ev;
  p.o_rs = blhd ? Hq * Ev : Ev;

  // ---- the dispatch ----
  const bool decode = attn::decode_serves(c, L, options);
  c.tensor_ops = !decode && attn::tensor_serves(c, p, options);
  attn::Launch l;
  l.align_l = L % attn::row_block(c) == 0;
  l.align_s = S % attn::key_tile(c) == 0;
  l.vec_k = attn::vec_rows(c, k, nd - 3, nd - 2, k_batch.data(), k_batch.size());
  l.vec_v = attn::vec_rows(c, v, nd - 3, nd - 2, v_batch.data(), v_batch.size());
  l.kv_alias = attn::kv_alias(c, k, v);
  l.mask_kind = mask_kind;
  l.has_batch = !merged.empty();
  l.mask_slot = mask ? kSlotMask : -1;
  l.sinks_slot = sinks ? kSlotSinks : -1;
  l.out_slot = kSlotOut;
  l.lse_slot = kSlotLse;
  l.set_grid(c, L, Hq, batch_count);
  if (decode) {
    attn::Decode dec;
    dec.rows = L;
    dec.keys = S;
    dec.count = batch_count;
    plan.inputs = static_cast<int32_t>(tensors.size());  // the scratch slots follow out and lse
    attn::add_decode(c, diag, p, l, dec, options, &plan);
    return plan;
  }
  plan.dispatches.push_back(attn::dispatch(c, diag, p, l));
  return plan;
}

// The backward's plan builds on the forward's for the same q, k, v, mask and sinks: its
// refusals, head-dim pair, function constants and AttnParams are exactly the ones the forward
// ran with. The batch dims are merged again with grad_out and out in the set, and each gets its
// strides per merged dim.
Plan plan_attention_backward(const TensorList& tensors, const Options& options) {
  if (tensors.size() != 9 || !tensors[0] || !tensors[1] || !tensors[2] || !tensors[3] ||
      !tensors[4] || !tensors[5]) {
    return Plan::refuse(
        "sdpa_backward takes tensors [grad_out, q, k, v, out, lse, attn_mask, sinks, grad_lse]");
  }
  const int32_t kSlotGrad = 0, kSlotOut = 4, kSlotLse = 5, kSlotGradLse = 8;
  const int32_t kForwardSlots[5] = {1, 2, 3, 6, 7};  // q, k, v, mask, sinks
  const TensorList forward_tensors = {tensors[1], tensors[2], tensors[3], tensors[6], tensors[7]};
  Options prefill = options;  // the backward reads the prefill kernel's params and tiles
  prefill.numbers["decode"] = 0.0;
  prefill.numbers["tensor_ops"] = 0.0;
  const Plan fwd = plan_attention(forward_tensors, prefill);
  if (!fwd.ok) return Plan::refuse(fwd.reason);
  Options on_tensor = options;  // the same call's forward as it runs (attn::tensor_backward)
  on_tensor.numbers["decode"] = 0.0;
  const Plan tensor_fwd = plan_attention(forward_tensors, on_tensor);
  const std::string why = attn::backward_head_dims(
      "sdpa_backward", tensors[1]->sizes.back(), tensors[3]->sizes.back());
  if (!why.empty()) return Plan::refuse(why);
  const bool mask_grad = options.number("mask_grad", 0.0) != 0.0;
  if (mask_grad && (!tensors[6] || tensors[6]->dtype == DType::Bool)) {
    return Plan::refuse("sdpa_backward: mask_grad needs a float attn_mask");
  }
  Plan plan;
  for (int32_t slot : fwd.contiguous_inputs) plan.contiguous_inputs.push_back(kForwardSlots[slot]);
  TensorDesc q = *tensors[1], k = *tensors[2], v = *tensors[3];
  for (int32_t slot : fwd.contiguous_inputs) {
    if (slot == 0) q = q.contiguous();
    if (slot == 1) k = k.contiguous();
    if (slot == 2) v = v.contiguous();
  }
  TensorDesc grad = *tensors[kSlotGrad], out = *tensors[kSlotOut];
  if (grad.dtype != q.dtype || grad.sizes != fwd.allocations[0].sizes || out.dtype != q.dtype ||
      out.sizes != grad.sizes) {
    return Plan::refuse("sdpa_backward: grad_out and out must be " +
                        shape_str(fwd.allocations[0].sizes) + " in q's dtype");
  }
  for (auto [slot, t] : {std::pair<int32_t, TensorDesc*>{kSlotGrad, &grad}, {kSlotOut, &out}}) {
    attn::read_in_place(t, slot, &plan);
  }
  const DType dtype = q.dtype;
  const int64_t nd = q.dim();
  const int64_t Hq = q.sizes[nd - 3], L = q.sizes[nd - 2], E = q.sizes[nd - 1];
  const int64_t Hkv = k.sizes[nd - 3], S = k.sizes[nd - 2], Ev = v.sizes[nd - 1];
  const std::vector<int64_t> batch(q.sizes.begin(), q.sizes.end() - 3);
  int64_t batch_count = 1;
  for (int64_t b : batch) batch_count *= b;
  const bool empty = fwd.dispatches.empty();
  const std::string tag = empty ? "" : fwd.dispatches[0].kernel.substr(strlen("steel_attention_"));
  const int es = static_cast<int>(dtype_size(dtype));
  std::vector<int64_t> rows = batch;
  rows.insert(rows.end(), {Hq, L});
  for (int32_t slot : {kSlotLse, kSlotGradLse}) {
    const std::optional<TensorDesc>& t = tensors[slot];
    if (!t) continue;
    if (t->dtype != DType::Float32 || t->sizes != rows) {
      return Plan::refuse("sdpa_backward: lse and grad_lse must be float32 " + shape_str(rows));
    }
    if (!t->is_contiguous()) plan.contiguous_inputs.push_back(slot);
  }
  std::sort(plan.contiguous_inputs.begin(), plan.contiguous_inputs.end());

  // ---- outputs: dq, dk, dv contiguous in q's, k's, v's shapes; dsinks; the delta scratch ----
  const bool has_sinks = tensors[7].has_value();
  const int32_t first = static_cast<int32_t>(tensors.size());
  const int32_t kSlotDq = first, kSlotDk = first + 1, kSlotDv = first + 2;
  const int32_t kSlotDsinks = first + 3, kSlotDmask = first + (has_sinks ? 4 : 3);
  const int32_t kSlotDelta = kSlotDmask + (mask_grad ? 1 : 0);
  auto output = [&](const char* name, DType dtype, std::vector<int64_t> sizes) {
    Allocation a;
    a.name = name;
    a.dtype = dtype;
    a.sizes = std::move(sizes);
    a.is_output = true;
    a.zero_init = empty;  // no kernel writes them; their gradient is 0
    plan.allocations.push_back(a);
  };
  output("dq", dtype, tensors[1]->sizes);
  output("dk", dtype, tensors[2]->sizes);
  output("dv", dtype, tensors[3]->sizes);
  if (has_sinks) output("dsinks", tensors[7]->dtype, tensors[7]->sizes);
  if (mask_grad) {
    output("dmask", tensors[6]->dtype, tensors[6]->sizes);
    plan.allocations.back().zero_init = empty || S == 0;  // no key: no dS to sum
  }
  Allocation delta;
  delta.name = "delta";
  delta.dtype = DType::Float32;
  delta.sizes = {2, batch_count * Hq * L};  // delta, then 1 / normaliser
  plan.allocations.push_back(delta);
  plan.ok = true;
  if (empty) return plan;

  // The forward's params and constants, the batch merged again with grad_out and out.
  const Dispatch& f = fwd.dispatches[0];
  AttnBackwardParams bp;
  std::memset(&bp, 0, sizeof(bp));
  const Binding& fp = *std::find_if(f.bindings.begin(), f.bindings.end(), [](const Binding& b) {
    return b.index == STEEL_ATTN_BUF_PARAMS;
  });
  std::memcpy(&bp.fwd, fp.bytes.data(), sizeof(AttnParams));
  AttnParams& p = bp.fwd;
  bp.scale = static_cast<float>(options.number("scale", 1.0 / std::sqrt(double(E))));
  bp.batch = static_cast<int32_t>(batch_count);
  // The mask as read, and dmask: contiguous in the mask's shape, 0 where the mask broadcasts.
  std::vector<int64_t> mask_strides(nd, 0), dm_strides(nd, 0);
  if (tensors[6]) {
    std::vector<int64_t> full = batch;
    full.insert(full.end(), {Hq, L, S});
    broadcast_strides(*tensors[6], full, &mask_strides);
    broadcast_strides(tensors[6]->contiguous(), full, &dm_strides);
  }
  // per merged dim: size, q, k, v, mask, grad, out, dmask
  std::vector<std::vector<int64_t>> merged;
  for (int64_t d = 0; d < nd - 3; ++d) {
    if (batch[d] == 1) continue;
    std::vector<int64_t> dim = {batch[d],        q.strides[d],    k.strides[d],
                                v.strides[d],    mask_strides[d], grad.strides[d],
                                out.strides[d],  dm_strides[d]};
    if (!merged.empty()) {
      std::vector<int64_t>& o = merged.back();
      bool joins = true;
      for (size_t i = 1; i < dim.size(); ++i) joins = joins && o[i] == dim[i] * dim[0];
      if (joins) {
        dim[0] *= o[0];
        o = dim;
        continue;
      }
    }
    merged.push_back(dim);
  }
  if (merged.size() > STEEL_ATTN_MAX_BATCH_DIMS) {
    return Plan::refuse("sdpa_backward: " + std::to_string(merged.size()) +
                        " batch dims that cannot be merged with grad_out's and out's");
  }
  p.batch_ndim = static_cast<int32_t>(merged.size());
  for (size_t d = 0; d < merged.size(); ++d) {
    p.batch_shape[d] = static_cast<int32_t>(merged[d][0]);
    p.q_bs[d] = merged[d][1];
    p.k_bs[d] = merged[d][2];
    p.v_bs[d] = merged[d][3];
    p.m_bs[d] = merged[d][4];
    bp.g_bs[d] = merged[d][5];
    bp.y_bs[d] = merged[d][6];
    bp.dm_bs[d] = merged[d][7];
  }
  // dmask's threadgroups: one per element of the batch and head dims it keeps; each sums the
  // (batch, head) pairs it broadcasts over.
  bp.dm_hs = dm_strides[nd - 3];
  int64_t dm_entries = bp.dm_hs != 0 ? Hq : 1;
  for (size_t d = 0; d < merged.size(); ++d) dm_entries *= merged[d][7] != 0 ? merged[d][0] : 1;
  bp.dm_rs = dm_strides[nd - 2];
  bp.dm_cs = dm_strides[nd - 1];
  bp.dm_combos = static_cast<int32_t>(batch_count * Hq / dm_entries);
  bp.g_hs = grad.strides[nd - 3];
  bp.g_rs = grad.strides[nd - 2];
  bp.y_hs = out.strides[nd - 3];
  bp.y_rs = out.strides[nd - 2];
  const Binding params = bytes_binding(STEEL_ATTN_BUF_BWD_PARAMS, &bp, sizeof(bp));
  const bool has_grad_lse = tensors[kSlotGradLse].has_value();
  std::vector<FunctionConstant> constants;
  for (const FunctionConstant& c : f.constants) {
    if (c.index != STEEL_ATTN_FC_HAS_BATCH) constants.push_back(c);
  }
  constants.push_back(fc_bool(STEEL_ATTN_FC_HAS_BATCH, !merged.empty()));
  const int64_t bk = steel_attn_bwd_bk(std::stoi(tag.substr(tag.find("_e") + 2)),
                                   std::stoi(tag.substr(tag.find("_v") + 2)), es);
  constants.push_back(fc_bool(STEEL_ATTN_FC_GRAD_LSE, has_grad_lse));
  constants.push_back(fc_bool(STEEL_ATTN_FC_ALIGN_Q, L % bk == 0));
  const std::string tname = dtype_tag(dtype);
  const struct {
    int32_t q, k, v, mask, sinks;
  } slots = {1, 2, 3, 6, 7};
  const Binding mask = tensor_binding(STEEL_ATTN_BUF_MASK, tensors[6] ? slots.mask : slots.q);

  Dispatch pre;
  pre.kernel = "steel_attention_bwd_delta_" + tname;
  pre.constants = constants;
  pre.bindings = {tensor_binding(STEEL_ATTN_BUF_Q, slots.q),
                  tensor_binding(STEEL_ATTN_BUF_K, slots.k),
                  mask,
                  tensor_binding(STEEL_ATTN_BUF_SINKS, has_sinks ? slots.sinks : slots.q),
                  tensor_binding(STEEL_ATTN_BUF_GRAD_OUT, kSlotGrad),
                  tensor_binding(STEEL_ATTN_BUF_FWD_OUT, kSlotOut),
                  tensor_binding(STEEL_ATTN_BUF_FWD_LSE, kSlotLse),
                  tensor_binding(STEEL_ATTN_BUF_GRAD_LSE, has_grad_lse ? kSlotGradLse : kSlotLse),
                  tensor_binding(STEEL_ATTN_BUF_DELTA, kSlotDelta), params};
  pre.grid[0] = static_cast<uint32_t>(ceil_div(L, STEEL_ATTN_DELTA_ROWS));
  pre.grid[1] = static_cast<uint32_t>(Hq);
  pre.grid[2] = static_cast<uint32_t>(batch_count);
  pre.threads[0] = 32 * STEEL_ATTN_DELTA_ROWS;
  plan.dispatches.push_back(pre);

  // dK/dV and dQ on matmul2d where the forward runs there (attn::tensor_backward): BQ = 64
  // keys (dK/dV) or query rows (dQ) per threadgroup of STEEL_ATTN_TENSOR_SIMDGROUPS.
  const bool tensor = attn::tensor_backward(tensor_fwd, bp.g_rs, Ev);
  const std::string family = tensor ? "steel_attention_bwd_tensor_" : "steel_attention_bwd_";
  const std::vector<FunctionConstant> kernel_constants =
      tensor ? attn::tensor_backward_constants(tensor_fwd, constants) : constants;
  const int64_t kv_block = tensor ? STEEL_ATTN_TENSOR_BQ : 8 * STEEL_ATTN_SIMDGROUPS;
  const int64_t q_block = tensor ? STEEL_ATTN_TENSOR_BQ : STEEL_ATTN_BQ;
  const uint32_t kernel_threads = static_cast<uint32_t>(
      tensor ? 32 * STEEL_ATTN_TENSOR_SIMDGROUPS : attn::kThreads);
  const std::vector<Binding> inputs = {
      tensor_binding(STEEL_ATTN_BUF_Q, slots.q), tensor_binding(STEEL_ATTN_BUF_K, slots.k),
      tensor_binding(STEEL_ATTN_BUF_V, slots.v), mask,
      tensor_binding(STEEL_ATTN_BUF_GRAD_OUT, kSlotGrad),
      tensor_binding(STEEL_ATTN_BUF_FWD_LSE, kSlotLse),
      tensor_binding(STEEL_ATTN_BUF_DELTA, kSlotDelta)};
  if (S > 0) {
    Dispatch kv;
    kv.kernel = family + "dkdv_" + tag;
    kv.constants = kernel_constants;
    kv.bindings = inputs;
    kv.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_DK, kSlotDk));
    kv.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_DV, kSlotDv));
    kv.bindings.push_back(params);
    kv.grid[0] = static_cast<uint32_t>(ceil_div(S, kv_block));
    kv.grid[1] = static_cast<uint32_t>(Hkv);
    kv.grid[2] = static_cast<uint32_t>(batch_count);
    kv.threads[0] = kernel_threads;
    plan.dispatches.push_back(kv);
  }  // without keys dk and dv are empty, and the dQ kernel visits no tile: dq = 0

  Dispatch dq;
  dq.kernel = family + "dq_" + tag;
  dq.constants = kernel_constants;
  dq.bindings = inputs;
  dq.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_DQ, kSlotDq));
  dq.bindings.push_back(params);
  dq.grid[0] = static_cast<uint32_t>(ceil_div(L, q_block));
  dq.grid[1] = static_cast<uint32_t>(Hq);
  dq.grid[2] = static_cast<uint32_t>(batch_count);
  dq.threads[0] = kernel_threads;
  plan.dispatches.push_back(dq);

  if (has_sinks) {
    Dispatch ds;
    ds.kernel = "steel_attention_bwd_dsinks_" + tname;
    ds.constants = constants;
    ds.bindings = {tensor_binding(STEEL_ATTN_BUF_FWD_LSE, kSlotLse),
                   tensor_binding(STEEL_ATTN_BUF_DELTA, kSlotDelta),
                   tensor_binding(STEEL_ATTN_BUF_SINKS, slots.sinks),
                   tensor_binding(STEEL_ATTN_BUF_DSINKS, kSlotDsinks), params};
    ds.grid[0] = static_cast<uint32_t>(Hq);
    ds.threads[0] = 32;
    plan.dispatches.push_back(ds);
  }

  if (mask_grad && S > 0) {
    const bool rows = bp.dm_rs == 0, keys = bp.dm_cs == 0;
    Dispatch dm;
    dm.kernel = "steel_attention_bwd_dmask_" + tag;
    dm.constants = constants;
    dm.constants.push_back(fc_bool(STEEL_ATTN_FC_DMASK_ROWS, rows));
    dm.constants.push_back(fc_bool(STEEL_ATTN_FC_DMASK_KEYS, keys));
    dm.bindings = inputs;
    dm.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_DMASK, kSlotDmask));
    dm.bindings.push_back(params);
    dm.grid[0] = static_cast<uint32_t>(rows ? 1 : ceil_div(L, STEEL_ATTN_BQ));
    dm.grid[1] = static_cast<uint32_t>(keys ? 1 : ceil_div(S, bk));
    dm.grid[2] = static_cast<uint32_t>(dm_entries);
    dm.threads[0] = static_cast<uint32_t>(attn::kThreads);
    plan.dispatches.push_back(dm);
  }  // without keys the mask has no elements, or broadcasts over S = 0 keys: dmask = 0
  return plan;
}


STEEL_PLANNER("sdpa", plan_attention);
STEEL_PLANNER("sdpa_backward", plan_attention_backward);

}  // namespace steel
