// Launch planning for the attention forward (steel::sdpa_forward).
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
#include <string>
#include <vector>

#include "../../shaders/steel/params.h"

namespace steel {
namespace {

// The (DE, DV) pairs instantiated in attention.metal, in the order they are tried.
struct HeadDims {
  int de, dv;
};
constexpr HeadDims kHeadDims[] = {{32, 32},   {40, 40},   {64, 64},   {72, 72},
                                  {80, 80},   {96, 96},   {128, 128}, {160, 160},
                                  {192, 128}, {192, 192}, {256, 256}, {512, 512}};
constexpr int kMaxHeadDim = 512;
constexpr int64_t kThreads = 32 * STEEL_ATTN_SIMDGROUPS;

// The cheapest pair holding (E, Ev): fewest padded head-dim columns.
const HeadDims* pick_head_dims(int64_t E, int64_t Ev) {
  const HeadDims* best = nullptr;
  for (const HeadDims& h : kHeadDims) {
    if (h.de < E || h.dv < Ev) continue;
    if (best == nullptr || h.de + h.dv < best->de + best->dv) best = &h;
  }
  return best;
}

Binding params_binding(const AttnParams& params) {
  return bytes_binding(STEEL_ATTN_BUF_PARAMS, &params, sizeof(AttnParams));
}

// An extra tensor of the backward (grad_out, the forward's out): [*batch, Hq, L, Ev], read
// in place when its last stride is 1, batch dims merged together with q, k, v and the mask.
struct AttnExtra {
  int32_t slot;
  TensorDesc desc;
  steel_i64 bs[STEEL_ATTN_MAX_BATCH_DIMS] = {};
};

struct AttnSlots {
  int32_t q, k, v, mask, sinks;
};

// What both planners derive from q, k, v, mask, sinks and the options (the forward's plan
// rules, see the top of the file). `refusal` is set when the Metal path cannot serve the call.
struct AttnSetup {
  std::string refusal;
  DType dtype = DType::Float32;
  const HeadDims* hd = nullptr;
  std::vector<int64_t> batch;
  int64_t batch_count = 0, Hq = 0, Hkv = 0, L = 0, S = 0, E = 0, Ev = 0;
  bool blhd = false;
  bool empty = false;  // nothing to compute (no batch entry, head or query row)
  AttnParams params = {};
  std::vector<FunctionConstant> constants;
};

AttnSetup refused(std::string why) {
  AttnSetup s;
  s.refusal = std::move(why);
  return s;
}

AttnSetup setup_attention(const TensorList& tensors, const AttnSlots& slots,
                          std::vector<AttnExtra>* extras, const Options& options, Plan* plan) {
  TensorDesc q = *tensors[slots.q];
  TensorDesc k = *tensors[slots.k];
  TensorDesc v = *tensors[slots.v];
  std::optional<TensorDesc> mask = tensors[slots.mask];
  std::optional<TensorDesc> sinks = tensors[slots.sinks];

  // ---- dtypes, ranks, shapes ----
  const DType dtype = q.dtype;
  if (!supported_dtype(dtype)) {
    return refused(std::string("attention kernels support float16, bfloat16 and float32, not ") +
                        dtype_name(dtype));
  }
  if (k.dtype != dtype || v.dtype != dtype) {
    return refused(std::string("sdpa: key and value must share the query's dtype ") +
                        dtype_name(dtype));
  }
  const int64_t nd = q.dim();
  if (nd < 3 || k.dim() != nd || v.dim() != nd) {
    return refused("sdpa: q, k, v must be [*batch, heads, seq, dim] of one rank, got " +
                        shape_str(q.sizes) + ", " + shape_str(k.sizes) + ", " + shape_str(v.sizes));
  }
  const int64_t Hq = q.sizes[nd - 3], L = q.sizes[nd - 2], E = q.sizes[nd - 1];
  const int64_t Hkv = k.sizes[nd - 3], S = k.sizes[nd - 2], Ev = v.sizes[nd - 1];
  std::vector<int64_t> batch(q.sizes.begin(), q.sizes.end() - 3);
  for (int64_t d = 0; d < nd - 3; ++d) {
    if (k.sizes[d] != batch[d] || v.sizes[d] != batch[d]) {
      return refused("sdpa: batch dims of q " + shape_str(q.sizes) + ", k " +
                          shape_str(k.sizes) + ", v " + shape_str(v.sizes) + " differ");
    }
  }
  if (k.sizes[nd - 1] != E || v.sizes[nd - 3] != Hkv || v.sizes[nd - 2] != S || Hkv == 0 ||
      Hq % Hkv != 0) {
    return refused("sdpa: shapes q " + shape_str(q.sizes) + ", k " + shape_str(k.sizes) +
                        ", v " + shape_str(v.sizes) + " do not make an attention");
  }
  if (E == 0 || Ev == 0 || E > kMaxHeadDim || Ev > kMaxHeadDim) {
    return refused("sdpa: head dims E = " + std::to_string(E) + ", Ev = " +
                        std::to_string(Ev) + "; the kernels take 1 to " +
                        std::to_string(kMaxHeadDim));
  }
  const HeadDims* hd = pick_head_dims(E, Ev);
  if (hd == nullptr) {
    return refused("sdpa: no kernel instantiation holds head dims E = " + std::to_string(E) +
                        ", Ev = " + std::to_string(Ev));
  }

  // ---- options ----
  const bool is_causal = options.number("is_causal", 0.0) != 0.0;
  const bool bottom_right = options.number("bottom_right", 0.0) != 0.0;
  const double scale = options.number("scale", 1.0 / std::sqrt(static_cast<double>(E)));
  const double softcap = options.number("softcap", 0.0);
  const int64_t window_left = static_cast<int64_t>(options.number("window_left", -1));
  const int64_t window_right = static_cast<int64_t>(options.number("window_right", -1));
  const int64_t max_threads = static_cast<int64_t>(options.number("max_threads", 1024));
  if (max_threads < kThreads) {
    return refused("sdpa: the pipeline allows " + std::to_string(max_threads) +
                        " threads per threadgroup, the attention kernels need " +
                        std::to_string(kThreads));
  }
  if (L > kInt32Max / 2 || S > kInt32Max / 2) {
    return refused("sdpa: L = " + std::to_string(L) + ", S = " + std::to_string(S) +
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
      return refused(std::string("sdpa: an attn_mask of dtype ") + dtype_name(mask->dtype) +
                          " with " + dtype_name(dtype) + " inputs (bool, the query's dtype or " +
                          "float32 are served)");
    }
    if (!broadcast_strides(*mask, full, &mask_strides)) {
      return refused("sdpa: attn_mask " + shape_str(mask->sizes) + " does not broadcast to " +
                          shape_str(full));
    }
  }
  int sinks_kind = kSteelAttnOperandNone;
  if (sinks) {
    if (sinks->dim() != 1 || sinks->sizes[0] != Hq) {
      return refused("sdpa: sinks must be [" + std::to_string(Hq) + "], got " +
                          shape_str(sinks->sizes));
    }
    if (sinks->dtype == dtype) {
      sinks_kind = kSteelAttnOperandT;
    } else if (sinks->dtype == DType::Float32) {
      sinks_kind = kSteelAttnOperandF32;
    } else {
      return refused(std::string("sdpa: sinks of dtype ") + dtype_name(sinks->dtype) +
                          " (the query's dtype or float32 are served)");
    }
    if (Hq > 1 && sinks->strides[0] != 1) {
      plan->contiguous_inputs.push_back(slots.sinks);  // Hq elements: the kernel reads sinks[h]
    }
  }

  // ---- layouts: last dim contiguous, or a copy ----
  auto last_unit = [](const TensorDesc& t) {
    return t.sizes.back() == 1 || t.strides.back() == 1;
  };
  if (!last_unit(q)) {
    plan->contiguous_inputs.push_back(slots.q);
    q = q.contiguous();
  }
  if (!last_unit(k)) {
    plan->contiguous_inputs.push_back(slots.k);
    k = k.contiguous();
  }
  if (!last_unit(v)) {
    plan->contiguous_inputs.push_back(slots.v);
    v = v.contiguous();
  }
  for (AttnExtra& x : *extras) {
    if (!last_unit(x.desc)) {
      plan->contiguous_inputs.push_back(x.slot);
      x.desc = x.desc.contiguous();
    }
  }
  std::sort(plan->contiguous_inputs.begin(), plan->contiguous_inputs.end());

  AttnSetup st;
  st.dtype = dtype;
  st.hd = hd;
  st.batch = batch;
  st.Hq = Hq;
  st.Hkv = Hkv;
  st.L = L;
  st.S = S;
  st.E = E;
  st.Ev = Ev;
  // q is BLHD when its heads are closer in memory than its rows (a [B, L, H, E] tensor
  // transposed); out then has the same order, so out.transpose(1, 2) is a [B, L, H, Ev] view.
  st.blhd = Hq > 1 && L > 1 && q.strides[nd - 3] < q.strides[nd - 2];
  st.batch_count = 1;
  for (int64_t b : batch) st.batch_count *= b;
  st.empty = st.batch_count == 0 || Hq == 0 || L == 0;
  if (st.empty) return st;

  // ---- batch: drop size-1 dims, merge dims every tensor walks contiguously ----
  // Per batch dim: its size and each tensor's stride (q, k, v, mask, then the extras).
  struct BatchDim {
    int64_t size;
    std::vector<int64_t> strides;
  };
  std::vector<BatchDim> merged;
  for (int64_t d = 0; d < nd - 3; ++d) {
    if (batch[d] == 1) continue;
    BatchDim bd = {batch[d], {q.strides[d], k.strides[d], v.strides[d], mask ? mask_strides[d] : 0}};
    for (const AttnExtra& x : *extras) bd.strides.push_back(x.desc.strides[d]);
    if (!merged.empty()) {
      BatchDim& o = merged.back();
      bool joins = true;
      for (size_t i = 0; i < bd.strides.size(); ++i) {
        joins = joins && o.strides[i] == bd.strides[i] * bd.size;
      }
      if (joins) {
        o = {o.size * bd.size, bd.strides};
        continue;
      }
    }
    merged.push_back(bd);
  }
  if (merged.size() > STEEL_ATTN_MAX_BATCH_DIMS) {
    return refused("sdpa: " + std::to_string(merged.size()) +
                        " batch dims that cannot be merged; the kernels take at most " +
                        std::to_string(STEEL_ATTN_MAX_BATCH_DIMS));
  }

  // ---- score unit, causal and window diagonals (shaders/steel/attn/score.h) ----
  const bool additive = mask_kind == kSteelAttnMaskAdd || mask_kind == kSteelAttnMaskAddF32;
  const double unit = additive ? 1.0 : 1.4426950408889634;  // log2(e)
  // Row i sees keys [i + shift - lo_off, i + shift + hi_off]. A window side at least L + S wide
  // hides nothing and is dropped, which also keeps every bound within 32 bits.
  const int64_t shift = bottom_right ? S - L : 0;
  const int64_t reach = L + S;
  const bool right = window_right >= 0 && window_right < reach;
  const bool has_hi = is_causal || right;
  const int64_t hi_off = is_causal ? (right ? std::min<int64_t>(0, window_right) : 0)
                                   : (right ? window_right : 0);
  const bool has_lo = window_left >= 0 && window_left < reach;
  const int64_t lo_off = has_lo ? window_left : 0;

  AttnParams& p = st.params;
  std::memset(&p, 0, sizeof(p));
  p.L = static_cast<int32_t>(L);
  p.S = static_cast<int32_t>(S);
  p.E = static_cast<int32_t>(E);
  p.Ev = static_cast<int32_t>(Ev);
  p.Hq = static_cast<int32_t>(Hq);
  p.group = static_cast<int32_t>(Hq / Hkv);
  p.shift = static_cast<int32_t>(shift);
  p.hi_off = static_cast<int32_t>(hi_off);
  p.lo_off = static_cast<int32_t>(lo_off);
  p.q_scale = static_cast<float>(softcap > 0 ? scale / softcap : scale * unit);
  p.softcap = static_cast<float>(softcap > 0 ? softcap * unit : 0.0);
  p.batch_ndim = static_cast<int32_t>(merged.size());
  for (size_t d = 0; d < merged.size(); ++d) {
    p.batch_shape[d] = static_cast<int32_t>(merged[d].size);
    p.q_bs[d] = merged[d].strides[0];
    p.k_bs[d] = merged[d].strides[1];
    p.v_bs[d] = merged[d].strides[2];
    p.m_bs[d] = merged[d].strides[3];
    for (size_t i = 0; i < extras->size(); ++i) (*extras)[i].bs[d] = merged[d].strides[4 + i];
  }
  p.q_hs = q.strides[nd - 3];
  p.q_rs = q.strides[nd - 2];
  p.k_hs = k.strides[nd - 3];
  p.k_rs = k.strides[nd - 2];
  p.v_hs = v.strides[nd - 3];
  p.v_rs = v.strides[nd - 2];
  if (mask) {
    p.m_hs = mask_strides[nd - 3];
    p.m_rs = mask_strides[nd - 2];
    p.m_cs = mask_strides[nd - 1];
  }
  // out: the flattened batch entry, then heads and rows in q's order.
  p.o_bs = Hq * L * Ev;
  p.o_hs = st.blhd ? Ev : L * Ev;
  p.o_rs = st.blhd ? Hq * Ev : Ev;

  // ---- tiles, alignment ----
  const int es = static_cast<int>(dtype_size(dtype));
  const int64_t bk = steel_attn_bk(hd->de, hd->dv, es);
  if (steel_attn_threadgroup_bytes(hd->de, hd->dv, es) > 32 * 1024) {
    return refused("sdpa: the K/V tiles need more than 32 KiB of threadgroup memory");
  }
  // 16-byte chunk loads need every row start of K (V) aligned: offset, row, head and batch
  // strides all multiples of the chunk. MTLBuffers themselves are at least 16-byte aligned.
  const int64_t vec = 16 / es;
  auto vec_ok = [&](const TensorDesc& t, size_t which) {
    bool ok = t.offset % vec == 0 && t.strides[nd - 2] % vec == 0 && t.strides[nd - 3] % vec == 0;
    for (const BatchDim& bd : merged) ok = ok && bd.strides[which] % vec == 0;
    return ok;
  };

  st.constants = {
      fc_bool(STEEL_ATTN_FC_ALIGN_L, L % STEEL_ATTN_BQ == 0),
      fc_bool(STEEL_ATTN_FC_ALIGN_S, S % bk == 0),
      fc_bool(STEEL_ATTN_FC_ALIGN_E, E == hd->de),
      fc_bool(STEEL_ATTN_FC_ALIGN_EV, Ev == hd->dv),
      fc_bool(STEEL_ATTN_FC_VEC_K, vec_ok(k, 1)),
      fc_bool(STEEL_ATTN_FC_VEC_V, vec_ok(v, 2)),
      fc_int(STEEL_ATTN_FC_MASK, mask_kind),
      fc_bool(STEEL_ATTN_FC_HAS_HI, has_hi),
      fc_bool(STEEL_ATTN_FC_HAS_LO, has_lo),
      fc_int(STEEL_ATTN_FC_SINKS, sinks_kind),
      fc_bool(STEEL_ATTN_FC_SOFTCAP, softcap > 0),
      fc_bool(STEEL_ATTN_FC_HAS_BATCH, !merged.empty()),
  };
  return st;
}

std::string head_dims_tag(const AttnSetup& st) {
  return std::string(dtype_tag(st.dtype)) + "_e" + std::to_string(st.hd->de) + "_v" +
         std::to_string(st.hd->dv);
}

}  // namespace

Plan plan_attention(const TensorList& tensors, const Options& options) {
  if (tensors.size() != 5 || !tensors[0] || !tensors[1] || !tensors[2]) {
    return Plan::refuse("sdpa takes tensors [q, k, v, attn_mask, sinks] with q, k, v present");
  }
  Plan plan;
  std::vector<AttnExtra> extras;
  const AttnSlots slots = {0, 1, 2, 3, 4};
  const AttnSetup st = setup_attention(tensors, slots, &extras, options, &plan);
  if (!st.refusal.empty()) return Plan::refuse(st.refusal);
  if (options.number("dropout_p", 0.0) > 0.0) {
    return Plan::refuse("sdpa: dropout is not in the Metal forward kernel yet");
  }
  const int64_t nd = static_cast<int64_t>(st.batch.size()) + 3;

  // ---- outputs: out in q's memory layout, lse row-major ----
  std::vector<int64_t> out_sizes = st.batch;
  out_sizes.insert(out_sizes.end(), {st.Hq, st.L, st.Ev});
  Allocation out_alloc;
  out_alloc.name = "out";
  out_alloc.dtype = st.dtype;
  out_alloc.sizes = out_sizes;
  out_alloc.is_output = true;
  if (st.blhd) {
    for (int64_t d = 0; d < nd - 3; ++d) out_alloc.order.push_back(d);
    out_alloc.order.insert(out_alloc.order.end(), {nd - 2, nd - 3, nd - 1});
  }
  Allocation lse_alloc;
  lse_alloc.name = "lse";
  lse_alloc.dtype = DType::Float32;
  lse_alloc.sizes = std::vector<int64_t>(st.batch);
  lse_alloc.sizes.insert(lse_alloc.sizes.end(), {st.Hq, st.L});
  lse_alloc.is_output = true;
  plan.allocations = {out_alloc, lse_alloc};
  const int32_t kSlotOut = 5, kSlotLse = 6;
  plan.ok = true;
  if (st.empty) return plan;  // nothing to compute

  Dispatch d;
  d.kernel = "steel_attention_" + head_dims_tag(st);
  d.constants = st.constants;
  // Absent mask or sinks are never read (function constants), but every declared buffer is
  // bound, so q stands in.
  d.bindings = {tensor_binding(STEEL_ATTN_BUF_Q, slots.q),
                tensor_binding(STEEL_ATTN_BUF_K, slots.k),
                tensor_binding(STEEL_ATTN_BUF_V, slots.v),
                tensor_binding(STEEL_ATTN_BUF_MASK, tensors[3] ? slots.mask : slots.q),
                tensor_binding(STEEL_ATTN_BUF_SINKS, tensors[4] ? slots.sinks : slots.q),
                tensor_binding(STEEL_ATTN_BUF_OUT, kSlotOut),
                tensor_binding(STEEL_ATTN_BUF_LSE, kSlotLse),
                params_binding(st.params)};
  d.grid[0] = static_cast<uint32_t>(ceil_div(st.L, STEEL_ATTN_BQ));
  d.grid[1] = static_cast<uint32_t>(st.Hq);
  d.grid[2] = static_cast<uint32_t>(st.batch_count);
  d.threads[0] = static_cast<uint32_t>(kThreads);
  plan.dispatches.push_back(d);
  return plan;
}
Plan plan_attention_backward(const TensorList& tensors, const Options& options) {
  if (tensors.size() != 9 || !tensors[0] || !tensors[1] || !tensors[2] || !tensors[3] ||
      !tensors[4] || !tensors[5]) {
    return Plan::refuse(
        "sdpa_backward takes tensors [grad_out, q, k, v, out, lse, attn_mask, sinks, grad_lse]");
  }
  const int32_t kSlotGrad = 0, kSlotOut = 4, kSlotLse = 5, kSlotGradLse = 8;
  Plan plan;
  std::vector<AttnExtra> extras = {{kSlotGrad, *tensors[kSlotGrad]}, {kSlotOut, *tensors[kSlotOut]}};
  const AttnSlots slots = {1, 2, 3, 6, 7};
  for (const AttnExtra& x : extras) {
    if (x.desc.dtype != tensors[1]->dtype || x.desc.sizes.size() != tensors[1]->sizes.size()) {
      return Plan::refuse("sdpa_backward: grad_out and out must be [*batch, Hq, L, Ev] in q's dtype");
    }
  }
  const AttnSetup st = setup_attention(tensors, slots, &extras, options, &plan);
  if (!st.refusal.empty()) return Plan::refuse(st.refusal);
  if (options.number("dropout_p", 0.0) > 0.0) {
    return Plan::refuse("sdpa_backward: dropout is not in the Metal backward kernels yet");
  }
  if (options.number("mask_grad", 0.0) != 0.0) {
    return Plan::refuse("sdpa_backward: the gradient of attn_mask is not in the Metal kernels yet");
  }
  const int es = static_cast<int>(dtype_size(st.dtype));
  if (steel_attn_shared_kv(st.hd->de, st.hd->dv, es)) {
    return Plan::refuse(std::string("sdpa_backward: head dims ") + std::to_string(st.E) + "/" +
                        std::to_string(st.Ev) + " in " + dtype_name(st.dtype) +
                        " need more threadgroup memory than the backward tiles have");
  }
  std::vector<int64_t> rows = st.batch;
  rows.insert(rows.end(), {st.Hq, st.L});
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
  const int32_t kSlotDsinks = first + 3, kSlotDelta = first + (has_sinks ? 4 : 3);
  auto output = [&](const char* name, DType dtype, std::vector<int64_t> sizes) {
    Allocation a;
    a.name = name;
    a.dtype = dtype;
    a.sizes = std::move(sizes);
    a.is_output = true;
    a.zero_init = st.empty;  // no kernel writes them; their gradient is 0
    plan.allocations.push_back(a);
  };
  output("dq", st.dtype, tensors[1]->sizes);
  output("dk", st.dtype, tensors[2]->sizes);
  output("dv", st.dtype, tensors[3]->sizes);
  if (has_sinks) output("dsinks", tensors[7]->dtype, tensors[7]->sizes);
  Allocation delta;
  delta.name = "delta";
  delta.dtype = DType::Float32;
  delta.sizes = {2, st.batch_count * st.Hq * st.L};  // delta, then 1 / normaliser
  plan.allocations.push_back(delta);
  plan.ok = true;
  if (st.empty) return plan;

  AttnBackwardParams bp;
  std::memset(&bp, 0, sizeof(bp));
  bp.fwd = st.params;
  bp.scale = static_cast<float>(options.number("scale", 1.0 / std::sqrt(double(st.E))));
  bp.batch = static_cast<int32_t>(st.batch_count);
  const int64_t nd = static_cast<int64_t>(st.batch.size()) + 3;
  for (int i = 0; i < STEEL_ATTN_MAX_BATCH_DIMS; ++i) {
    bp.g_bs[i] = extras[0].bs[i];
    bp.y_bs[i] = extras[1].bs[i];
  }
  bp.g_hs = extras[0].desc.strides[nd - 3];
  bp.g_rs = extras[0].desc.strides[nd - 2];
  bp.y_hs = extras[1].desc.strides[nd - 3];
  bp.y_rs = extras[1].desc.strides[nd - 2];
  const Binding params = bytes_binding(STEEL_ATTN_BUF_BWD_PARAMS, &bp, sizeof(bp));
  const bool has_grad_lse = tensors[kSlotGradLse].has_value();
  std::vector<FunctionConstant> constants = st.constants;
  const int64_t bk = steel_attn_bk(st.hd->de, st.hd->dv, es);
  constants.push_back(fc_bool(STEEL_ATTN_FC_GRAD_LSE, has_grad_lse));
  constants.push_back(fc_bool(STEEL_ATTN_FC_ALIGN_Q, st.L % bk == 0));
  const std::string dtype = dtype_tag(st.dtype);
  const Binding mask = tensor_binding(STEEL_ATTN_BUF_MASK, tensors[6] ? slots.mask : slots.q);

  Dispatch pre;
  pre.kernel = "steel_attention_bwd_delta_" + dtype;
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
  pre.grid[0] = static_cast<uint32_t>(ceil_div(st.L, STEEL_ATTN_DELTA_ROWS));
  pre.grid[1] = static_cast<uint32_t>(st.Hq);
  pre.grid[2] = static_cast<uint32_t>(st.batch_count);
  pre.threads[0] = 32 * STEEL_ATTN_DELTA_ROWS;
  plan.dispatches.push_back(pre);

  const std::vector<Binding> inputs = {
      tensor_binding(STEEL_ATTN_BUF_Q, slots.q), tensor_binding(STEEL_ATTN_BUF_K, slots.k),
      tensor_binding(STEEL_ATTN_BUF_V, slots.v), mask,
      tensor_binding(STEEL_ATTN_BUF_GRAD_OUT, kSlotGrad),
      tensor_binding(STEEL_ATTN_BUF_FWD_LSE, kSlotLse),
      tensor_binding(STEEL_ATTN_BUF_DELTA, kSlotDelta)};
  if (st.S > 0) {
    Dispatch kv;
    kv.kernel = "steel_attention_bwd_dkdv_" + head_dims_tag(st);
    kv.constants = constants;
    kv.bindings = inputs;
    kv.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_DK, kSlotDk));
    kv.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_DV, kSlotDv));
    kv.bindings.push_back(params);
    kv.grid[0] = static_cast<uint32_t>(ceil_div(st.S, 8 * STEEL_ATTN_SIMDGROUPS));
    kv.grid[1] = static_cast<uint32_t>(st.Hkv);
    kv.grid[2] = static_cast<uint32_t>(st.batch_count);
    kv.threads[0] = static_cast<uint32_t>(kThreads);
    plan.dispatches.push_back(kv);
  }  // without keys dk and dv are empty, and the dQ kernel visits no tile: dq = 0

  Dispatch dq;
  dq.kernel = "steel_attention_bwd_dq_" + head_dims_tag(st);
  dq.constants = constants;
  dq.bindings = inputs;
  dq.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_DQ, kSlotDq));
  dq.bindings.push_back(params);
  dq.grid[0] = static_cast<uint32_t>(ceil_div(st.L, STEEL_ATTN_BQ));
  dq.grid[1] = static_cast<uint32_t>(st.Hq);
  dq.grid[2] = static_cast<uint32_t>(st.batch_count);
  dq.threads[0] = static_cast<uint32_t>(kThreads);
  plan.dispatches.push_back(dq);

  if (has_sinks) {
    Dispatch ds;
    ds.kernel = "steel_attention_bwd_dsinks_" + dtype;
    ds.constants = constants;
    ds.bindings = {tensor_binding(STEEL_ATTN_BUF_FWD_LSE, kSlotLse),
                   tensor_binding(STEEL_ATTN_BUF_DELTA, kSlotDelta),
                   tensor_binding(STEEL_ATTN_BUF_SINKS, slots.sinks),
                   tensor_binding(STEEL_ATTN_BUF_DSINKS, kSlotDsinks), params};
    ds.grid[0] = static_cast<uint32_t>(st.Hq);
    ds.threads[0] = 32;
    plan.dispatches.push_back(ds);
  }
  return plan;
}

STEEL_PLANNER("sdpa", plan_attention);
STEEL_PLANNER("sdpa_backward", plan_attention_backward);

}  // namespace steel
