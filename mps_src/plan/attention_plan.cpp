// Launch planning for the attention forward (steel::sdpa_forward), and the pieces of it that the
// decode (decode_plan.cpp), varlen (varlen_plan.cpp) and backward (attention_backward_plan.cpp)
// planners share.
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
#include "quantized_plan.h"

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
  return vec_rows(elem_bytes(c), t, head_dim, row_dim, more, count);
}

bool vec_rows(int elem_bytes, const TensorDesc& t, int64_t head_dim, int64_t row_dim,
              const int64_t* more, size_t count) {
  // 16-byte chunk loads need every row start aligned: offset, row, head and batch strides all
  // multiples of the chunk. MTLBuffers themselves are at least 16-byte aligned.
  const int64_t vec = 16 / elem_bytes;
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
  // Unquantized K and V (the quantized planners, quantized_plan.cpp, rewrite these).
  for (const FunctionConstant& q : quant_constants(nullptr, nullptr, c.E, c.Ev)) {
    out.constants.push_back(q);
  }
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
    dec.kv_alias = l.kv_alias;
    plan.inputs = static_cast<int32_t>(tensors.size());  // the scratch slots follow out and lse
    attn::add_decode(c, diag, p, l, dec, options, &plan);
    return plan;
  }
  plan.dispatches.push_back(attn::dispatch(c, diag, p, l));
  return plan;
}

STEEL_PLANNER("sdpa", plan_attention);

}  // namespace steel
