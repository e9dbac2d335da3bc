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

}  // namespace

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

  // ---- dtypes, ranks, shapes ----
  const DType dtype = q.dtype;
  if (!supported_dtype(dtype)) {
    return Plan::refuse(std::string("attention kernels support float16, bfloat16 and float32, not ") +
                        dtype_name(dtype));
  }
  if (k.dtype != dtype || v.dtype != dtype) {
    return Plan::refuse(std::string("sdpa: key and value must share the query's dtype ") +
                        dtype_name(dtype));
  }
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
  if (E == 0 || Ev == 0 || E > kMaxHeadDim || Ev > kMaxHeadDim) {
    return Plan::refuse("sdpa: head dims E = " + std::to_string(E) + ", Ev = " +
                        std::to_string(Ev) + "; the kernels take 1 to " +
                        std::to_string(kMaxHeadDim));
  }
  const HeadDims* hd = pick_head_dims(E, Ev);
  if (hd == nullptr) {
    return Plan::refuse("sdpa: no kernel instantiation holds head dims E = " + std::to_string(E) +
                        ", Ev = " + std::to_string(Ev));
  }

  // ---- options ----
  if (options.number("dropout_p", 0.0) > 0.0) {
    return Plan::refuse("sdpa: dropout is not in the Metal forward kernel yet");
  }
  const bool is_causal = options.number("is_causal", 0.0) != 0.0;
  const bool bottom_right = options.number("bottom_right", 0.0) != 0.0;
  const double scale = options.number("scale", 1.0 / std::sqrt(static_cast<double>(E)));
  const double softcap = options.number("softcap", 0.0);
  const int64_t window_left = static_cast<int64_t>(options.number("window_left", -1));
  const int64_t window_right = static_cast<int64_t>(options.number("window_right", -1));
  const int64_t max_threads = static_cast<int64_t>(options.number("max_threads", 1024));
  if (max_threads < kThreads) {
    return Plan::refuse("sdpa: the pipeline allows " + std::to_string(max_threads) +
                        " threads per threadgroup, the attention kernels need " +
                        std::to_string(kThreads));
  }
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
  Plan plan;
  int sinks_kind = kSteelAttnOperandNone;
  if (sinks) {
    if (sinks->dim() != 1 || sinks->sizes[0] != Hq) {
      return Plan::refuse("sdpa: sinks must be [" + std::to_string(Hq) + "], got " +
                          shape_str(sinks->sizes));
    }
    if (sinks->dtype == dtype) {
      sinks_kind = kSteelAttnOperandT;
    } else if (sinks->dtype == DType::Float32) {
      sinks_kind = kSteelAttnOperandF32;
    } else {
      return Plan::refuse(std::string("sdpa: sinks of dtype ") + dtype_name(sinks->dtype) +
                          " (the query's dtype or float32 are served)");
    }
    if (Hq > 1 && sinks->strides[0] != 1) {
      plan.contiguous_inputs.push_back(kSlotSinks);  // Hq elements: the kernel reads sinks[h]
    }
  }

  // ---- layouts: last dim contiguous, or a copy ----
  auto last_unit = [](const TensorDesc& t) {
    return t.sizes.back() == 1 || t.strides.back() == 1;
  };
  if (!last_unit(q)) {
    plan.contiguous_inputs.push_back(kSlotQ);
    q = q.contiguous();
  }
  if (!last_unit(k)) {
    plan.contiguous_inputs.push_back(kSlotK);
    k = k.contiguous();
  }
  if (!last_unit(v)) {
    plan.contiguous_inputs.push_back(kSlotV);
    v = v.contiguous();
  }
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

  AttnParams p;
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
    p.q_bs[d] = merged[d].q;
    p.k_bs[d] = merged[d].k;
    p.v_bs[d] = merged[d].v;
    p.m_bs[d] = merged[d].m;
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
  p.o_hs = blhd ? Ev : L * Ev;
  p.o_rs = blhd ? Hq * Ev : Ev;

  // ---- tiles, alignment ----
  const int es = static_cast<int>(dtype_size(dtype));
  const int64_t bk = steel_attn_bk(hd->de, hd->dv, es);
  if (steel_attn_threadgroup_bytes(hd->de, hd->dv, es) > 32 * 1024) {
    return Plan::refuse("sdpa: the K/V tiles need more than 32 KiB of threadgroup memory");
  }
  // 16-byte chunk loads need every row start of K (V) aligned: offset, row, head and batch
  // strides all multiples of the chunk. MTLBuffers themselves are at least 16-byte aligned.
  const int64_t vec = 16 / es;
  auto vec_ok = [&](const TensorDesc& t, int64_t BatchDim::*member) {
    bool ok = t.offset % vec == 0 && t.strides[nd - 2] % vec == 0 && t.strides[nd - 3] % vec == 0;
    for (const BatchDim& bd : merged) ok = ok && (bd.*member) % vec == 0;
    return ok;
  };

  Dispatch d;
  d.kernel = std::string("steel_attention_") + dtype_tag(dtype) + "_e" + std::to_string(hd->de) +
             "_v" + std::to_string(hd->dv);
  d.constants = {
      fc_bool(STEEL_ATTN_FC_ALIGN_L, L % STEEL_ATTN_BQ == 0),
      fc_bool(STEEL_ATTN_FC_ALIGN_S, S % bk == 0),
      fc_bool(STEEL_ATTN_FC_ALIGN_E, E == hd->de),
      fc_bool(STEEL_ATTN_FC_ALIGN_EV, Ev == hd->dv),
      fc_bool(STEEL_ATTN_FC_VEC_K, vec_ok(k, &BatchDim::k)),
      fc_bool(STEEL_ATTN_FC_VEC_V, vec_ok(v, &BatchDim::v)),
      fc_int(STEEL_ATTN_FC_MASK, mask_kind),
      fc_bool(STEEL_ATTN_FC_HAS_HI, has_hi),
      fc_bool(STEEL_ATTN_FC_HAS_LO, has_lo),
      fc_int(STEEL_ATTN_FC_SINKS, sinks_kind),
      fc_bool(STEEL_ATTN_FC_SOFTCAP, softcap > 0),
      fc_bool(STEEL_ATTN_FC_HAS_BATCH, !merged.empty()),
  };
  // Absent mask or sinks are never read (function constants), but every declared buffer is
  // bound, so q stands in.
  d.bindings = {tensor_binding(STEEL_ATTN_BUF_Q, kSlotQ),
                tensor_binding(STEEL_ATTN_BUF_K, kSlotK),
                tensor_binding(STEEL_ATTN_BUF_V, kSlotV),
                tensor_binding(STEEL_ATTN_BUF_MASK, mask ? kSlotMask : kSlotQ),
                tensor_binding(STEEL_ATTN_BUF_SINKS, sinks ? kSlotSinks : kSlotQ),
                tensor_binding(STEEL_ATTN_BUF_OUT, kSlotOut),
                tensor_binding(STEEL_ATTN_BUF_LSE, kSlotLse),
                params_binding(p)};
  d.grid[0] = static_cast<uint32_t>(ceil_div(L, STEEL_ATTN_BQ));
  d.grid[1] = static_cast<uint32_t>(Hq);
  d.grid[2] = static_cast<uint32_t>(batch_count);
  d.threads[0] = static_cast<uint32_t>(kThreads);
  plan.dispatches.push_back(d);
  return plan;
}

STEEL_PLANNER("sdpa", plan_attention);

}  // namespace steel
