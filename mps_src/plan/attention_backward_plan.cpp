// Launch planning for the attention backward (shaders/steel/attn/attention_backward.metal, and
// its dK/dV and dQ kernels on matmul2d, shaders/steel/attn_tensor/), registered as
// "sdpa_backward". It builds on the forward's plan (attention_plan.cpp) for the same call.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "attention_plan.h"

namespace steel {


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
  // Q's and grad_out's rows as the dK/dV kernel streams them: whole 16-byte chunks where every
  // row start is aligned (the merged batch strides included).
  std::vector<int64_t> q_batch, g_batch;
  for (const std::vector<int64_t>& dim : merged) {
    q_batch.push_back(dim[1]);
    g_batch.push_back(dim[5]);
  }
  constants.push_back(fc_bool(STEEL_ATTN_FC_VEC_Q, attn::vec_rows(es, q, nd - 3, nd - 2,
                                                                  q_batch.data(), q_batch.size())));
  constants.push_back(fc_bool(STEEL_ATTN_FC_VEC_G, attn::vec_rows(es, grad, nd - 3, nd - 2,
                                                                  g_batch.data(), g_batch.size())));
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
  pre.threads[0] = 32 * STEEL_ATTN_DELTA_SIMDGROUPS;
  plan.dispatches.push_back(pre);

  // dK/dV, dQ and dmask on matmul2d where the forward runs there (attn::tensor_backward), in
  // threadgroups of STEEL_ATTN_TENSOR_SIMDGROUPS: dQ and dmask blocks of 64 query rows, dK/dV
  // blocks of params.h's steel_attn_tensor_bwd_keys keys, 64 up to head dim 128 and 32 above:
  // by the timing model's register estimate (timing.steel_kernel_info) 64 keys' K, V, dK, dV
  // cooperative tensors at D = 256 take 440 registers a thread, more than a core's register
  // file holds for one threadgroup (tests/attn/test_attention_backward_tensor.py checks it).
  const bool tensor = attn::tensor_backward(tensor_fwd, bp.g_rs, Ev);
  const std::string family = tensor ? "steel_attention_bwd_tensor_" : "steel_attention_bwd_";
  const std::vector<FunctionConstant> kernel_constants =
      tensor ? attn::tensor_backward_constants(tensor_fwd, constants) : constants;
  const int64_t kv_block =
      tensor ? steel_attn_tensor_bwd_keys(std::stoi(tag.substr(tag.find("_e") + 2)))
             : 8 * STEEL_ATTN_SIMDGROUPS;
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
    // The matmul2d dmask's tiles are its dQ's: 64 rows by 32 keys.
    const int64_t dm_rows = tensor ? STEEL_ATTN_TENSOR_BQ : STEEL_ATTN_BQ;
    const int64_t dm_keys = tensor ? STEEL_ATTN_TENSOR_BK : bk;
    Dispatch dm;
    dm.kernel = family + "dmask_" + tag;
    dm.constants = kernel_constants;
    dm.constants.push_back(fc_bool(STEEL_ATTN_FC_DMASK_ROWS, rows));
    dm.constants.push_back(fc_bool(STEEL_ATTN_FC_DMASK_KEYS, keys));
    dm.bindings = inputs;
    dm.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_DMASK, kSlotDmask));
    dm.bindings.push_back(params);
    dm.grid[0] = static_cast<uint32_t>(rows ? 1 : ceil_div(L, dm_rows));
    dm.grid[1] = static_cast<uint32_t>(keys ? 1 : ceil_div(S, dm_keys));
    dm.grid[2] = static_cast<uint32_t>(dm_entries);
    dm.threads[0] = kernel_threads;
    plan.dispatches.push_back(dm);
  }  // without keys the mask has no elements, or broadcasts over S = 0 keys: dmask = 0
  return plan;
}

STEEL_PLANNER("sdpa_backward", plan_attention_backward);

}  // namespace steel
