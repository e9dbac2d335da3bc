// Launch planning for packed variable-length attention (steel::sdpa_varlen_forward): the prefill
// kernel of attention_plan.cpp with STEEL_ATTN_FC_VARLEN, one dispatch for the whole batch.
//
// The plan never sees the sequence lengths: cu_seqlens_q / cu_seqlens_k are device tensors that
// only the kernel reads (shaders/steel/attn/forward.h). So the grid covers the longest sequence,
// max_seqlen_q rows (bounded by total_q), for every head and sequence, and the threadgroups past
// the end of a shorter sequence leave at once; the alignment constants are off (no length is
// known to be a multiple of a tile); the causal and window diagonals keep their offsets, while
// their bottom-right shift S - L is taken per sequence on the device (STEEL_ATTN_FC_VARLEN_BR).
// q, k, v are read in place at any strides whose last one is 1 (the row stride steps over
// tokens); out is a fresh [total_q, Hq, Ev] tensor, lse [Hq, total_q] as flash-attn lays it out.
//
// With at most STEEL_ATTN_DECODE_MAX_L query rows per sequence (max_seqlen_q) the decode kernels
// serve the batch instead (attn::add_decode), split over max_seqlen_k keys. A paged KV cache
// (tensors 6 and 7: block_table int32 [sequences, max_pages], seqused_k int32 [sequences]; k and
// v are pools [pages, page_size, Hkv, D] and cu_seqlens_k is absent) is read by the decode
// kernels only, for any max_seqlen_q (blocks of 32 query rows; no dropout).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "attention_plan.h"

namespace steel {

using attn::Common;

Plan plan_attention_varlen(const TensorList& tensors, const Options& options) {
  const bool paged = tensors.size() == 8 && tensors[6].has_value();
  if ((tensors.size() != 6 && tensors.size() != 8) || !tensors[0] || !tensors[1] || !tensors[2] ||
      !tensors[3] || (!paged && !tensors[4]) ||
      (tensors.size() == 8 && paged != tensors[7].has_value())) {
    return Plan::refuse(
        "sdpa_varlen takes tensors [q, k, v, cu_seqlens_q, cu_seqlens_k, sinks] with all but "
        "sinks present, or [..., block_table, seqused_k] with cu_seqlens_k absent (a paged KV "
        "cache)");
  }
  if (paged && tensors[4]) {
    return Plan::refuse("sdpa_varlen: a paged KV cache (block_table) takes no cu_seqlens_k");
  }
  TensorDesc q = *tensors[0];
  TensorDesc k = *tensors[1];
  TensorDesc v = *tensors[2];
  const TensorDesc& cu_q = *tensors[3];
  const TensorDesc& cu_k = paged ? *tensors[3] : *tensors[4];
  std::optional<TensorDesc> sinks = tensors[5];
  const int32_t kSlotQ = 0, kSlotK = 1, kSlotV = 2, kSlotCuQ = 3, kSlotCuK = 4, kSlotSinks = 5;
  const int32_t kSlotTable = 6, kSlotSeqused = 7;
  const int32_t kSlotOut = static_cast<int32_t>(tensors.size()), kSlotLse = kSlotOut + 1;

  // ---- dtypes, shapes, offsets, options ----
  std::string why = attn::check_dtypes("sdpa_varlen", q, k, v);
  if (!why.empty()) return Plan::refuse(why);
  // A paged pool [pages, page_size, Hkv, D] is read as [pages * page_size, Hkv, D] rows below,
  // its page stride kept apart.
  int64_t page_size = 0, pages = 0, k_ps = 0, v_ps = 0;
  bool copy_pool[2] = {false, false};
  if (paged) {
    if (q.dim() != 3 || k.dim() != 4 || v.dim() != 4 || k.sizes[0] != v.sizes[0] ||
        k.sizes[1] != v.sizes[1] || k.sizes[2] != v.sizes[2] || k.sizes[3] != q.sizes[2]) {
      return Plan::refuse("sdpa_varlen: a paged KV cache takes q [tokens, heads, dim] and key and "
                          "value pools [pages, page_size, heads_kv, dim], got " +
                          shape_str(q.sizes) + ", " + shape_str(k.sizes) + ", " +
                          shape_str(v.sizes));
    }
    pages = k.sizes[0];
    page_size = k.sizes[1];
    // A pool whose rows are not contiguous is copied first (as read_in_place copies packed
    // k, v); its copy is dense, so the page and slot strides are the copy's.
    copy_pool[0] = k.strides[3] != 1 && k.sizes[3] != 1;
    copy_pool[1] = v.strides[3] != 1 && v.sizes[3] != 1;
    if (copy_pool[0]) k = k.contiguous();
    if (copy_pool[1]) v = v.contiguous();
    k_ps = k.strides[0];
    v_ps = v.strides[0];
    for (TensorDesc* t : {&k, &v}) {
      t->sizes.erase(t->sizes.begin());
      t->strides.erase(t->strides.begin());
      t->sizes[0] = pages * page_size;
    }
  }
  if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3) {
    return Plan::refuse("sdpa_varlen: q, k, v must be packed [tokens, heads, dim], got " +
                        shape_str(q.sizes) + ", " + shape_str(k.sizes) + ", " +
                        shape_str(v.sizes));
  }
  const int64_t Tq = q.sizes[0], Hq = q.sizes[1], E = q.sizes[2];
  const int64_t Tk = k.sizes[0], Hkv = k.sizes[1], Ev = v.sizes[2];
  if (k.sizes[2] != E || v.sizes[0] != Tk || v.sizes[1] != Hkv || Hkv == 0 || Hq % Hkv != 0) {
    return Plan::refuse("sdpa_varlen: shapes q " + shape_str(q.sizes) + ", k " +
                        shape_str(k.sizes) + ", v " + shape_str(v.sizes) +
                        " do not make an attention");
  }
  for (const TensorDesc* cu : {&cu_q, &cu_k}) {
    if (cu->dtype != DType::Int32 || cu->dim() != 1 || cu->sizes[0] < 1 ||
        cu->sizes[0] != cu_q.sizes[0]) {
      return Plan::refuse(std::string("sdpa_varlen: cu_seqlens_q and cu_seqlens_k must be ") +
                          "int32 [sequences + 1] of one length, got " +
                          dtype_name(cu_q.dtype) + " " + shape_str(cu_q.sizes) + " and " +
                          dtype_name(cu_k.dtype) + " " + shape_str(cu_k.sizes));
    }
  }
  const int64_t sequences = cu_q.sizes[0] - 1;
  int64_t max_pages = 0;
  if (paged) {
    const TensorDesc& table = *tensors[kSlotTable];
    const TensorDesc& used = *tensors[kSlotSeqused];
    if (table.dtype != DType::Int32 || table.dim() != 2 || table.sizes[0] != sequences ||
        used.dtype != DType::Int32 || used.dim() != 1 || used.sizes[0] != sequences) {
      return Plan::refuse("sdpa_varlen: block_table must be int32 [" + std::to_string(sequences) +
                          ", max_pages] and seqused_k int32 [" + std::to_string(sequences) +
                          "], got " + dtype_name(table.dtype) + " " + shape_str(table.sizes) +
                          " and " + dtype_name(used.dtype) + " " + shape_str(used.sizes));
    }
    max_pages = table.sizes[1];
    if (pages == 0 || page_size == 0 || max_pages == 0) {
      return Plan::refuse("sdpa_varlen: an empty paged KV cache (" + std::to_string(pages) +
                          " pages of " + std::to_string(page_size) + " keys, " +
                          std::to_string(max_pages) + " table columns)");
    }
    if (pages > kInt32Max || max_pages * page_size > kInt32Max / 2) {
      return Plan::refuse("sdpa_varlen: " + std::to_string(max_pages) + " pages of " +
                          std::to_string(page_size) +
                          " keys per sequence beyond the kernels' 32-bit key indexing");
    }
  }
  Plan plan;
  Common c;
  why = attn::common("sdpa_varlen", q.dtype, Hq, Hkv, E, Ev, sinks, kSlotSinks, options, &c,
                     &plan);
  if (!why.empty()) return Plan::refuse(why);
  const int64_t max_q = static_cast<int64_t>(options.number("max_seqlen_q", -1));
  const int64_t max_k = static_cast<int64_t>(options.number("max_seqlen_k", -1));
  if (max_q < 0 || max_k < 0) {
    return Plan::refuse("sdpa_varlen: the options max_seqlen_q and max_seqlen_k are required");
  }
  if (paged && c.dropout_p > 0.0) {
    return Plan::refuse("sdpa_varlen: a paged KV cache is read by the decode kernels, which have "
                        "no dropout");
  }
  // cu_seqlens are int32, so token offsets fit in 31 bits; the kernels' row and key indices
  // within a sequence (and the diagonals, up to max_seqlen_q + max_seqlen_k) must fit too.
  if (Tq > kInt32Max || Tk > kInt32Max) {
    return Plan::refuse("sdpa_varlen: " + std::to_string(Tq) + " query and " +
                        std::to_string(Tk) + " key tokens; cu_seqlens are int32 offsets");
  }
  if (max_q > kInt32Max / 2 || max_k > kInt32Max / 2) {
    return Plan::refuse("sdpa_varlen: max_seqlen_q = " + std::to_string(max_q) +
                        ", max_seqlen_k = " + std::to_string(max_k) +
                        " beyond the kernels' 32-bit row indexing (2^30)");
  }
  // The grid is planned from max_seqlen_q: tokens with no sequence to hold them, or no block
  // rows to reach them, would be left unwritten.
  if (Tq > 0 && (sequences == 0 || max_q == 0)) {
    return Plan::refuse("sdpa_varlen: " + std::to_string(Tq) + " query tokens, but " +
                        std::to_string(sequences) + " sequences and max_seqlen_q = " +
                        std::to_string(max_q));
  }

  // ---- layouts: last dim contiguous, or a copy; the offsets as one int32 vector each ----
  attn::read_in_place(&q, kSlotQ, &plan);
  if (copy_pool[0]) plan.contiguous_inputs.push_back(kSlotK);
  if (copy_pool[1]) plan.contiguous_inputs.push_back(kSlotV);
  attn::read_in_place(&k, kSlotK, &plan);
  attn::read_in_place(&v, kSlotV, &plan);
  if (sequences > 0 && cu_q.strides[0] != 1) plan.contiguous_inputs.push_back(kSlotCuQ);
  if (!paged && sequences > 0 && cu_k.strides[0] != 1) plan.contiguous_inputs.push_back(kSlotCuK);
  int64_t table_stride = 0;
  if (paged) {
    const TensorDesc& table = *tensors[kSlotTable];
    table_stride = table.strides[0];
    if (table.strides[1] != 1 || table_stride < 0) {
      plan.contiguous_inputs.push_back(kSlotTable);
      table_stride = max_pages;
    }
    if (tensors[kSlotSeqused]->strides[0] != 1) plan.contiguous_inputs.push_back(kSlotSeqused);
  }
  std::sort(plan.contiguous_inputs.begin(), plan.contiguous_inputs.end());

  // ---- outputs: out [total_q, Hq, Ev], lse [Hq, total_q] ----
  Allocation out_alloc;
  out_alloc.name = "out";
  out_alloc.dtype = c.dtype;
  out_alloc.sizes = {Tq, Hq, Ev};
  out_alloc.is_output = true;
  Allocation lse_alloc;
  lse_alloc.name = "lse";
  lse_alloc.dtype = DType::Float32;
  lse_alloc.sizes = {Hq, Tq};
  lse_alloc.is_output = true;
  plan.allocations = {out_alloc, lse_alloc};
  plan.ok = true;
  if (Tq == 0 || Hq == 0) return plan;  // nothing to compute

  // ---- params: the packed token counts bound every sequence ----
  // A sequence's L + S is at most max_seqlen_q + max_seqlen_k: wider window sides hide nothing.
  const attn::Diagonals diag = attn::diagonals(c, max_q + max_k);
  AttnParams p = attn::base_params(c, diag, false, q, k, v, 1, 0);
  p.L = static_cast<int32_t>(Tq);
  p.S = static_cast<int32_t>(Tk);
  p.o_hs = Ev;
  p.o_rs = Hq * Ev;

  // ---- the dispatch ----
  attn::Launch l;
  // Paged rows start at page strides too.
  l.vec_k = attn::vec_rows(c, k, 1, 0, &k_ps, paged ? 1 : 0);
  l.vec_v = attn::vec_rows(c, v, 1, 0, &v_ps, paged ? 1 : 0);
  l.kv_alias = attn::kv_alias(c, k, v) && k_ps == v_ps;  // pools: their pages too
  l.varlen = true;
  // Without a diagonal the alignment changes nothing: one pipeline serves both.
  l.varlen_br = c.bottom_right && (diag.has_hi || diag.has_lo);
  l.sinks_slot = sinks ? kSlotSinks : -1;
  l.out_slot = kSlotOut;
  l.lse_slot = kSlotLse;
  l.cu_q_slot = kSlotCuQ;
  l.cu_k_slot = kSlotCuK;
  const bool decode = paged || attn::decode_serves(c, max_q, options);
  c.tensor_ops = !decode && attn::tensor_serves(c, p, options);
  l.set_grid(c, std::min(max_q, Tq), Hq, sequences);  // no sequence is longer than total_q
  if (decode) {
    attn::Decode dec;
    dec.rows = std::min(max_q, Tq);
    dec.keys = paged ? std::min(max_k, max_pages * page_size) : std::min(max_k, Tk);
    dec.count = sequences;
    dec.paged = paged;
    dec.kv_alias = l.kv_alias;
    if (paged) {
      dec.table_slot = kSlotTable;
      dec.seqused_slot = kSlotSeqused;
      dec.page_size = page_size;
      dec.pages = pages;
      dec.max_pages = max_pages;
      dec.table_stride = table_stride;
      dec.k_ps = k_ps;
      dec.v_ps = v_ps;
    }
    plan.inputs = static_cast<int32_t>(tensors.size());  // the scratch slots follow out and lse
    attn::add_decode(c, diag, p, l, dec, options, &plan);
    return plan;
  }
  plan.dispatches.push_back(attn::dispatch(c, diag, p, l));
  return plan;
}

namespace attn {

bool paged_length_class(const TensorList& tensors, const Options& options, std::string* cls,
                        int64_t* max_keys) {
  if (tensors.size() != 8 || !tensors[0] || !tensors[1] || !tensors[2] || !tensors[3] ||
      tensors[4] || !tensors[6] || !tensors[7]) {
    return false;
  }
  const TensorDesc& q = *tensors[0];
  const TensorDesc& k = *tensors[1];
  const TensorDesc& v = *tensors[2];
  const TensorDesc& table = *tensors[6];
  if (q.dim() != 3 || k.dim() != 4 || v.dim() != 4 || table.dim() != 2 ||
      tensors[3]->dim() != 1 || k.sizes[2] == 0 || q.sizes[1] % k.sizes[2] != 0) {
    return false;
  }
  const int64_t max_q = static_cast<int64_t>(options.number("max_seqlen_q", -1));
  const int64_t max_k = static_cast<int64_t>(options.number("max_seqlen_k", -1));
  if (max_q < 0 || max_k < 0 || max_q > kInt32Max / 2 || max_k > kInt32Max / 2) return false;
  Common c;
  Plan scratch;
  if (!common("sdpa_varlen", q.dtype, q.sizes[1], k.sizes[2], q.sizes[2], v.sizes[3], tensors[5],
              5, options, &c, &scratch)
           .empty()) {
    return false;
  }
  // As plan_attention_varlen plans a paged call: the decode split over the keys a sequence can
  // hold, the diagonals over max_seqlen_q + max_seqlen_k.
  // Paged, as there: the split's costs depend on it (no direct reads, decode_plan.cpp).
  Decode dec;
  dec.rows = std::min(max_q, q.sizes[0]);
  dec.keys = std::min(max_k, table.sizes[1] * k.sizes[1]);
  dec.count = tensors[3]->sizes[0] - 1;
  dec.paged = true;
  const DecodeSplit split = decode_split(c, dec, options);
  const Diagonals diag = diagonals(c, max_q + max_k);
  const int64_t fields[] = {split.splits, split.split_keys, split.simdgroups, split.heads_per_tg,
                            diag.has_hi,  diag.has_lo,      diag.hi_off,      diag.lo_off};
  cls->append(reinterpret_cast<const char*>(fields), sizeof fields);
  *max_keys = max_k;
  return true;
}

}  // namespace attn

// The varlen backward builds on the varlen forward's plan for the same q, k, v, cu_seqlens and
// sinks (its refusals, kernel, constants and AttnParams), as the dense backward does on the
// dense forward's: the delta pre-pass, dK/dV, dQ (and dsinks) kernels of
// attention_backward.metal with STEEL_ATTN_FC_VARLEN, each over (blocks of the longest
// sequence, heads, sequences), cu_seqlens read on the device.
Plan plan_attention_varlen_backward(const TensorList& tensors, const Options& options) {
  if (tensors.size() != 10 || !tensors[0] || !tensors[1] || !tensors[2] || !tensors[3] ||
      !tensors[4] || !tensors[5] || !tensors[6] || !tensors[7]) {
    return Plan::refuse(
        "sdpa_varlen_backward takes tensors [grad_out, q, k, v, out, lse, cu_seqlens_q, "
        "cu_seqlens_k, sinks, grad_lse] with all but sinks and grad_lse present");
  }
  const int32_t kSlotGrad = 0, kSlotOut = 4, kSlotLse = 5, kSlotCuQ = 6, kSlotCuK = 7;
  const int32_t kSlotSinks = 8, kSlotGradLse = 9;
  const int32_t kForwardSlots[6] = {1, 2, 3, 6, 7, 8};  // q, k, v, cu_q, cu_k, sinks
  Options prefill = options;  // the backward reads the prefill kernel's params and tiles
  prefill.numbers["decode"] = 0.0;
  prefill.numbers["tensor_ops"] = 0.0;
  const Plan fwd = plan_attention_varlen(
      {tensors[1], tensors[2], tensors[3], tensors[6], tensors[7], tensors[8]}, prefill);
  if (!fwd.ok) return Plan::refuse(fwd.reason);
  Options on_tensor = options;  // the same call's forward as it runs (attn::tensor_backward)
  on_tensor.numbers["decode"] = 0.0;
  const Plan tensor_fwd = plan_attention_varlen(
      {tensors[1], tensors[2], tensors[3], tensors[6], tensors[7], tensors[8]}, on_tensor);
  const std::string why = attn::backward_head_dims(
      "sdpa_varlen_backward", tensors[1]->sizes.back(), tensors[3]->sizes.back());
  if (!why.empty()) return Plan::refuse(why);
  Plan plan;
  for (int32_t slot : fwd.contiguous_inputs) plan.contiguous_inputs.push_back(kForwardSlots[slot]);
  TensorDesc q = *tensors[1];
  const int64_t Tq = q.sizes[0], Hq = q.sizes[1], E = q.sizes[2];
  const int64_t Tk = tensors[2]->sizes[0], Hkv = tensors[2]->sizes[1];
  const int64_t sequences = tensors[6]->sizes[0] - 1;
  TensorDesc grad = *tensors[kSlotGrad], out = *tensors[kSlotOut];
  if (grad.dtype != q.dtype || grad.sizes != fwd.allocations[0].sizes || out.dtype != q.dtype ||
      out.sizes != grad.sizes) {
    return Plan::refuse("sdpa_varlen_backward: grad_out and out must be " +
                        shape_str(fwd.allocations[0].sizes) + " in q's dtype");
  }
  attn::read_in_place(&grad, kSlotGrad, &plan);
  attn::read_in_place(&out, kSlotOut, &plan);
  for (int32_t slot : {kSlotLse, kSlotGradLse}) {
    const std::optional<TensorDesc>& t = tensors[slot];
    if (!t) continue;
    if (t->dtype != DType::Float32 || t->sizes != fwd.allocations[1].sizes) {
      return Plan::refuse("sdpa_varlen_backward: lse and grad_lse must be float32 " +
                          shape_str(fwd.allocations[1].sizes));
    }
    if (!t->is_contiguous()) plan.contiguous_inputs.push_back(slot);
  }
  std::sort(plan.contiguous_inputs.begin(), plan.contiguous_inputs.end());
  const bool empty = fwd.dispatches.empty();
  const std::string tag =
      empty ? "" : fwd.dispatches[0].kernel.substr(std::string("steel_attention_").size());

  // ---- outputs: dq, dk, dv packed like q, k, v; dsinks; the delta scratch [2, Hq * Tq] ----
  const bool has_sinks = tensors[kSlotSinks].has_value();
  const int32_t first = static_cast<int32_t>(tensors.size());
  const int32_t kSlotDq = first, kSlotDk = first + 1, kSlotDv = first + 2;
  const int32_t kSlotDsinks = first + 3, kSlotDelta = first + (has_sinks ? 4 : 3);
  for (int32_t i = 1; i <= (has_sinks ? 4 : 3); ++i) {
    const TensorDesc& like = *tensors[i == 4 ? kSlotSinks : i];
    Allocation a;
    a.name = i == 1 ? "dq" : i == 2 ? "dk" : i == 3 ? "dv" : "dsinks";
    a.dtype = like.dtype;
    a.sizes = like.sizes;
    a.is_output = true;
    a.zero_init = empty;  // no kernel writes them; their gradient is 0
    plan.allocations.push_back(a);
  }
  Allocation delta;
  delta.name = "delta";
  delta.dtype = DType::Float32;
  delta.sizes = {2, Hq * Tq};  // delta, then 1 / normaliser, both [Hq, Tq]
  plan.allocations.push_back(delta);
  plan.ok = true;
  if (empty) return plan;

  const Dispatch& f = fwd.dispatches[0];
  AttnBackwardParams bp;
  std::memset(&bp, 0, sizeof(bp));
  const Binding& fp = *std::find_if(f.bindings.begin(), f.bindings.end(), [](const Binding& b) {
    return b.index == STEEL_ATTN_BUF_PARAMS;
  });
  std::memcpy(&bp.fwd, fp.bytes.data(), sizeof(AttnParams));
  bp.scale = static_cast<float>(options.number("scale", 1.0 / std::sqrt(double(E))));
  bp.batch = 1;  // the packed tokens are one [Hq, total_q] plane of rows
  bp.g_hs = grad.strides[1];
  bp.g_rs = grad.strides[0];
  bp.y_hs = out.strides[1];
  bp.y_rs = out.strides[0];
  const Binding params = bytes_binding(STEEL_ATTN_BUF_BWD_PARAMS, &bp, sizeof(bp));
  const bool has_grad_lse = tensors[kSlotGradLse].has_value();
  std::vector<FunctionConstant> constants = f.constants;
  constants.push_back(fc_bool(STEEL_ATTN_FC_GRAD_LSE, has_grad_lse));
  constants.push_back(fc_bool(STEEL_ATTN_FC_ALIGN_Q, false));  // no length is known
  // q (as the kernels read it: the forward's plan may copy it) and grad_out in whole chunks.
  TensorDesc q_read = q;
  for (int32_t slot : fwd.contiguous_inputs) {
    if (slot == 0) q_read = q_read.contiguous();
  }
  const int es = static_cast<int>(dtype_size(q.dtype));
  constants.push_back(fc_bool(STEEL_ATTN_FC_VEC_Q, attn::vec_rows(es, q_read, 1, 0)));
  constants.push_back(fc_bool(STEEL_ATTN_FC_VEC_G, attn::vec_rows(es, grad, 1, 0)));
  const Binding cu_q = tensor_binding(STEEL_ATTN_BUF_BWD_CU_Q, kSlotCuQ);
  const Binding cu_k = tensor_binding(STEEL_ATTN_BUF_BWD_CU_K, kSlotCuK);
  const Binding q_b = tensor_binding(STEEL_ATTN_BUF_Q, 1), k_b = tensor_binding(STEEL_ATTN_BUF_K, 2);
  const Binding no_mask = tensor_binding(STEEL_ATTN_BUF_MASK, 1);  // never read (varlen)
  // No sequence is longer than its packed total.
  const int64_t max_q = std::min<int64_t>(static_cast<int64_t>(options.number("max_seqlen_q", 0)), Tq);
  const int64_t max_k = std::min<int64_t>(static_cast<int64_t>(options.number("max_seqlen_k", 0)), Tk);
  auto add = [&](std::string kernel, std::vector<Binding> bindings, int64_t blocks,
                 int64_t heads, int64_t count, int64_t threads) {
    Dispatch d;
    d.kernel = std::move(kernel);
    d.constants = constants;
    d.bindings = std::move(bindings);
    d.grid[0] = static_cast<uint32_t>(blocks);
    d.grid[1] = static_cast<uint32_t>(heads);
    d.grid[2] = static_cast<uint32_t>(count);
    d.threads[0] = static_cast<uint32_t>(threads);
    plan.dispatches.push_back(d);
  };
  const std::string tname = dtype_tag(q.dtype);
  add("steel_attention_bwd_delta_" + tname,
      {q_b, k_b, no_mask,
       tensor_binding(STEEL_ATTN_BUF_SINKS, has_sinks ? kSlotSinks : 1),
       tensor_binding(STEEL_ATTN_BUF_GRAD_OUT, kSlotGrad),
       tensor_binding(STEEL_ATTN_BUF_FWD_OUT, kSlotOut),
       tensor_binding(STEEL_ATTN_BUF_FWD_LSE, kSlotLse),
       tensor_binding(STEEL_ATTN_BUF_GRAD_LSE, has_grad_lse ? kSlotGradLse : kSlotLse),
       tensor_binding(STEEL_ATTN_BUF_DELTA, kSlotDelta), cu_q, cu_k, params},
      ceil_div(max_q, STEEL_ATTN_DELTA_ROWS), Hq, sequences, 32 * STEEL_ATTN_DELTA_SIMDGROUPS);
  const std::vector<Binding> inputs = {
      q_b, k_b, tensor_binding(STEEL_ATTN_BUF_V, 3), no_mask,
      tensor_binding(STEEL_ATTN_BUF_GRAD_OUT, kSlotGrad),
      tensor_binding(STEEL_ATTN_BUF_FWD_LSE, kSlotLse),
      tensor_binding(STEEL_ATTN_BUF_DELTA, kSlotDelta)};
  // dK/dV and dQ on matmul2d where the forward runs there, as in the dense plan.
  const bool tensor = attn::tensor_backward(tensor_fwd, bp.g_rs, tensors[3]->sizes[2]);
  const std::string family = tensor ? "steel_attention_bwd_tensor_" : "steel_attention_bwd_";
  const int64_t threads = 32 * (tensor ? STEEL_ATTN_TENSOR_SIMDGROUPS : STEEL_ATTN_SIMDGROUPS);
  // The matmul2d dK/dV block's keys: params.h's steel_attn_tensor_bwd_keys (32 above head dim
  // 128, where 64 keys' cooperative tensors would not fit a core's register file).
  const int64_t kv_block =
      tensor ? steel_attn_tensor_bwd_keys(std::stoi(tag.substr(tag.find("_e") + 2)))
             : 8 * STEEL_ATTN_SIMDGROUPS;
  const int64_t q_block = tensor ? STEEL_ATTN_TENSOR_BQ : STEEL_ATTN_BQ;
  const size_t simdgroup_dispatches = plan.dispatches.size();
  if (max_k > 0) {
    std::vector<Binding> b = inputs;
    b.insert(b.end(), {tensor_binding(STEEL_ATTN_BUF_DK, kSlotDk),
                       tensor_binding(STEEL_ATTN_BUF_DV, kSlotDv), cu_q, cu_k, params});
    add(family + "dkdv_" + tag, b, ceil_div(max_k, kv_block), Hkv, sequences, threads);
  }  // without keys dk and dv are empty, and the dQ kernel visits no tile: dq = 0
  std::vector<Binding> b = inputs;
  b.insert(b.end(), {tensor_binding(STEEL_ATTN_BUF_DQ, kSlotDq), cu_q, cu_k, params});
  add(family + "dq_" + tag, b, ceil_div(max_q, q_block), Hq, sequences, threads);
  if (tensor) {
    for (size_t i = simdgroup_dispatches; i < plan.dispatches.size(); ++i) {
      plan.dispatches[i].constants =
          attn::tensor_backward_constants(tensor_fwd, plan.dispatches[i].constants);
    }
  }
  if (has_sinks) {
    add("steel_attention_bwd_dsinks_" + tname,
        {tensor_binding(STEEL_ATTN_BUF_FWD_LSE, kSlotLse),
         tensor_binding(STEEL_ATTN_BUF_DELTA, kSlotDelta),
         tensor_binding(STEEL_ATTN_BUF_SINKS, kSlotSinks),
         tensor_binding(STEEL_ATTN_BUF_DSINKS, kSlotDsinks), params},
        Hq, 1, 1, 32);
  }
  return plan;
}

STEEL_PLANNER("sdpa_varlen", plan_attention_varlen);
STEEL_PLANNER("sdpa_varlen_backward", plan_attention_varlen_backward);

}  // namespace steel
