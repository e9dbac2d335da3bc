// Launch planning for attention over quantized K/V (torch_steel.kv formats): "sdpa_quantized"
// and "sdpa_varlen_quantized" (packed or paged). The kernels are the fp16 path's decode and
// prefill kernels with STEEL_ATTN_FC_QUANT: their tile loaders dequantize the codes into
// threadgroup memory in the query's dtype (AttnQuantTileLoader), so everything else about the
// launch is the unquantized call's. This planner therefore plans that call, with k and v
// replaced by stand-ins in the query's dtype that have the logical shapes [..., E] and the
// codes' strides (in bytes: the codes are one byte each), and then
//   - rewrites the function constants: the formats, and VEC_K / VEC_V from the codes' byte
//     alignment (16-byte chunks);
//   - binds the scales and mins and AttnQuantParams (their strides, in scale elements) to the
//     decode or prefill kernel;
//   - renumbers the slots from the unquantized op's tensor list to the quantized one's.
// The matmul2d prefill (M5-generation GPUs, attention_tensor_msl4.metal) is kept off
// (option tensor_ops = 0): its tensor operations read K and V from device memory themselves,
// so there is no threadgroup tile to dequantize into; quantized calls stay on the simdgroup
// kernels, which take the same options. Both decode kernels (decode.h, decode_vector.h) stage
// their tiles through AttnDecodeBlock, which dequantizes. Copies: codes or scales whose last
// stride is not 1, and mins laid out unlike their scales, are copied first (contiguous_inputs).
#include "quantized_plan.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "../../shaders/steel/params.h"
#include "attention_plan.h"

namespace steel {
namespace attn {

std::vector<FunctionConstant> quant_constants(const QuantFormat* k, const QuantFormat* v,
                                              int64_t E, int64_t Ev) {
  const QuantFormat none;
  const QuantFormat& kf = k != nullptr ? *k : none;
  const QuantFormat& vf = v != nullptr ? *v : none;
  return {fc_bool(STEEL_ATTN_FC_QUANT, k != nullptr && v != nullptr),
          fc_int(STEEL_ATTN_FC_K_BITS, kf.bits),
          fc_int(STEEL_ATTN_FC_K_GROUP, kf.bits == 0 ? 0 : kf.group != 0 ? kf.group : E),
          fc_bool(STEEL_ATTN_FC_K_SCALE_F32, kf.scale_f32),
          fc_int(STEEL_ATTN_FC_V_BITS, vf.bits),
          fc_int(STEEL_ATTN_FC_V_GROUP, vf.bits == 0 ? 0 : vf.group != 0 ? vf.group : Ev),
          fc_bool(STEEL_ATTN_FC_V_SCALE_F32, vf.scale_f32)};
}

}  // namespace attn

namespace {

using attn::QuantFormat;

// torch_steel.kv.FORMATS: name, bits, values per scale (0: the whole row).
struct FormatName {
  const char* name;
  int bits, group;
};
constexpr FormatName kFormats[] = {{"int8", 8, 0},      {"int8_g32", 8, 32}, {"int8_g64", 8, 64},
                                   {"int8_g128", 8, 128}, {"q4_g32", 4, 32},  {"q4_g64", 4, 64}};

// One quantized operand as the op passes it, after its copies.
struct Operand {
  QuantFormat f;
  TensorDesc data, scales;
  bool has_mins = false;
  int32_t data_slot = -1, scales_slot = -1, mins_slot = -1;
  int64_t E = 0;
};

// Checks the operand at slots data_slot .. data_slot + 2 in the format of option `fmt_option`
// and lists its copies; returns the refusal ("" when the kernels take it).
std::string check_operand(const std::string& op, const TensorList& tensors,
                          const Options& options, const std::string& name,
                          const char* fmt_option, int32_t data_slot, Operand* x, Plan* plan) {
  const std::string fmt = options.string(fmt_option, "");
  const FormatName* known = nullptr;
  for (const FormatName& f : kFormats) {
    if (fmt == f.name) known = &f;
  }
  if (known == nullptr) {
    return op + ": unknown " + name + " format '" + fmt +
           "' (int8, int8_g32, int8_g64, int8_g128, q4_g32, q4_g64 are served)";
  }
  x->f.bits = known->bits;
  x->f.group = known->group;
  x->data_slot = data_slot;
  x->scales_slot = data_slot + 1;
  x->mins_slot = data_slot + 2;
  if (!tensors[data_slot] || !tensors[data_slot + 1]) {
    return op + ": the " + name + "'s codes and scales are required";
  }
  x->data = *tensors[data_slot];
  x->scales = *tensors[data_slot + 1];
  const std::optional<TensorDesc>& mins = tensors[data_slot + 2];
  const DType want = x->f.bits == 8 ? DType::Int8 : DType::UInt8;
  if (x->data.dtype != want) {
    return op + ": " + fmt + " " + name + " codes must be " + dtype_name(want) + ", got " +
           dtype_name(x->data.dtype);
  }
  if (x->data.dim() < 1) return op + ": the " + name + "'s codes have no head dim";
  x->E = x->data.sizes.back() * (x->f.bits == 4 ? 2 : 1);
  const int64_t group = x->f.group != 0 ? x->f.group : x->E;
  if (x->E == 0 || x->E % group != 0) {
    return op + ": " + fmt + " " + name + " head dim " + std::to_string(x->E) +
           " is not a positive multiple of its group of " + std::to_string(group);
  }
  if (x->scales.dtype != DType::Float16 && x->scales.dtype != DType::Float32) {
    return op + ": the " + name + "'s scales must be float16 or float32, got " +
           dtype_name(x->scales.dtype);
  }
  x->f.scale_f32 = x->scales.dtype == DType::Float32;
  std::vector<int64_t> scale_sizes(x->data.sizes.begin(), x->data.sizes.end() - 1);
  scale_sizes.push_back(x->E / group);
  if (x->scales.sizes != scale_sizes) {
    return op + ": " + fmt + " " + name + " scales must be " + shape_str(scale_sizes) +
           " for codes " + shape_str(x->data.sizes) + ", got " + shape_str(x->scales.sizes);
  }
  if (x->f.bits == 4) {
    if (!mins || mins->sizes != x->scales.sizes || mins->dtype != x->scales.dtype) {
      return op + ": " + fmt + " " + name + " mins must have the scales' shape " +
             shape_str(scale_sizes) + " and dtype " + dtype_name(x->scales.dtype);
    }
    x->has_mins = true;
  } else if (mins) {
    return op + ": " + fmt + " " + name + " takes no mins (int8 is symmetric)";
  }
  // The loader reads a row's codes and its scales along the last dim, element after element.
  if (x->data.sizes.back() != 1 && x->data.strides.back() != 1) {
    plan->contiguous_inputs.push_back(x->data_slot);
    x->data = x->data.contiguous();
  }
  // Mins are found at the scales' offsets: a different layout is copied, with the scales.
  const bool copy = (x->scales.sizes.back() != 1 && x->scales.strides.back() != 1) ||
                    (mins && mins->strides != x->scales.strides);
  if (copy) {
    plan->contiguous_inputs.push_back(x->scales_slot);
    x->scales = x->scales.contiguous();
    if (mins) plan->contiguous_inputs.push_back(x->mins_slot);
  }
  return "";
}

// The unquantized planner's view of an operand: the logical shape [..., E] in `dtype`, the
// codes' strides (bytes), no storage shared with anything (no K/V alias).
TensorDesc stand_in(const Operand& x, DType dtype) {
  TensorDesc t = x.data;
  t.dtype = dtype;
  t.sizes.back() = x.E;
  t.strides.back() = 1;
  t.offset = 0;
  t.storage = 0;
  return t;
}

// Every code row starts on a 16-byte boundary (the loader's whole-chunk reads): the offset and
// every stride above the last dim, in bytes.
bool vec_codes(const TensorDesc& data) {
  bool ok = data.offset % 16 == 0;
  for (int64_t d = 0; d + 1 < data.dim(); ++d) {
    if (data.sizes[d] > 1) ok = ok && data.strides[d] % 16 == 0;
  }
  return ok;
}

void set_constant(std::vector<FunctionConstant>* constants, const FunctionConstant& c) {
  for (FunctionConstant& x : *constants) {
    if (x.index == c.index) {
      x = c;
      return;
    }
  }
  constants->push_back(c);
}

// Rewrites the unquantized plan `plan` (input slots `inner` mapped to `slot_of`, allocations
// after them) into the quantized op's: constants, the scale bindings of the attention kernel
// (the first dispatch), slots.
void quantize_plan(Plan* plan, const std::vector<int32_t>& slot_of, const Operand& k,
                   const Operand& v, const AttnQuantParams& qp, int32_t outer_inputs,
                   const std::vector<int32_t>& own_copies) {
  const int32_t inner = static_cast<int32_t>(slot_of.size());
  auto renumber = [&](int32_t s) { return s < inner ? slot_of[s] : s - inner + outer_inputs; };
  std::vector<FunctionConstant> constants = attn::quant_constants(&k.f, &v.f, k.E, v.E);
  constants.push_back(fc_bool(STEEL_ATTN_FC_VEC_K, vec_codes(k.data)));
  constants.push_back(fc_bool(STEEL_ATTN_FC_VEC_V, vec_codes(v.data)));
  for (size_t i = 0; i < plan->dispatches.size(); ++i) {
    Dispatch& d = plan->dispatches[i];
    for (const FunctionConstant& c : constants) set_constant(&d.constants, c);
    for (Binding& b : d.bindings) {
      if (b.kind == Binding::Kind::Tensor) b.slot = renumber(b.slot);
    }
    if (i != 0) continue;  // the decode merge reads partials only
    d.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_K_SCALES, k.scales_slot));
    d.bindings.push_back(
        tensor_binding(STEEL_ATTN_BUF_K_MINS, k.has_mins ? k.mins_slot : k.scales_slot));
    d.bindings.push_back(tensor_binding(STEEL_ATTN_BUF_V_SCALES, v.scales_slot));
    d.bindings.push_back(
        tensor_binding(STEEL_ATTN_BUF_V_MINS, v.has_mins ? v.mins_slot : v.scales_slot));
    d.bindings.push_back(bytes_binding(STEEL_ATTN_BUF_QUANT_PARAMS, &qp, sizeof(qp)));
  }
  for (int32_t& s : plan->contiguous_inputs) s = renumber(s);
  plan->contiguous_inputs.insert(plan->contiguous_inputs.end(), own_copies.begin(),
                                 own_copies.end());
  std::sort(plan->contiguous_inputs.begin(), plan->contiguous_inputs.end());
}

// The AttnParams the unquantized planner wrote into its attention kernel's params (AttnParams,
// or AttnDecodeParams, which begins with them).
AttnParams planned_params(const Plan& plan) {
  AttnParams p;
  std::memset(&p, 0, sizeof(p));
  for (const Binding& b : plan.dispatches[0].bindings) {
    if (b.index == STEEL_ATTN_BUF_PARAMS && b.bytes.size() >= sizeof(p)) {
      std::memcpy(&p, b.bytes.data(), sizeof(p));
    }
  }
  return p;
}

// The options of the unquantized call, with the kernel that cannot dequantize kept off, and
// the vector decode's direct reads too (the dequantizing tile loaders stage its tiles).
Options tile_loader_kernels(const Options& options) {
  Options o = options;
  o.numbers["tensor_ops"] = 0.0;  // see the top of this file
  o.numbers["decode_direct"] = 0.0;
  return o;
}

}  // namespace

Plan plan_attention_quantized(const TensorList& tensors, const Options& options) {
  const std::string op = "sdpa_quantized";
  if (tensors.size() != 9 || !tensors[0]) {
    return Plan::refuse(op + " takes tensors [q, k, k_scales, k_mins, v, v_scales, v_mins, "
                             "attn_mask, sinks] with q present");
  }
  Plan copies;  // the operands' own copies, in the quantized op's slots
  Operand k, v;
  std::string why = check_operand(op, tensors, options, "key", "k_format", 1, &k, &copies);
  if (why.empty()) why = check_operand(op, tensors, options, "value", "v_format", 4, &v, &copies);
  if (!why.empty()) return Plan::refuse(why);
  const TensorDesc& q = *tensors[0];
  const int64_t nd = q.dim();
  if (k.data.dim() != nd || v.data.dim() != nd || nd < 3) {
    return Plan::refuse(op + ": q, k, v must be [*batch, heads, seq, dim] of one rank, got " +
                        shape_str(q.sizes) + ", " + shape_str(k.data.sizes) + ", " +
                        shape_str(v.data.sizes) + " (codes)");
  }
  const TensorList inner = {q, stand_in(k, q.dtype), stand_in(v, q.dtype), tensors[7],
                            tensors[8]};
  Plan plan = plan_attention(inner, tile_loader_kernels(options));
  if (!plan.ok) return Plan::refuse("sdpa_quantized: " + plan.reason);
  if (plan.dispatches.empty()) {  // nothing to compute
    quantize_plan(&plan, {0, 1, 4, 7, 8}, k, v, AttnQuantParams{}, 9, copies.contiguous_inputs);
    return plan;
  }

  // The scales' strides per batch dim, merged as plan_attention merges q, k, v and the mask's
  // (which must merge the same way with the scales in the set).
  AttnQuantParams qp;
  std::memset(&qp, 0, sizeof(qp));
  qp.k_hs = k.scales.strides[nd - 3];
  qp.k_rs = k.scales.strides[nd - 2];
  qp.v_hs = v.scales.strides[nd - 3];
  qp.v_rs = v.scales.strides[nd - 2];
  TensorDesc qr = q;
  if (qr.sizes.back() != 1 && qr.strides.back() != 1) qr = qr.contiguous();  // read_in_place
  std::vector<int64_t> full(q.sizes.begin(), q.sizes.end() - 3);
  full.insert(full.end(), {q.sizes[nd - 3], q.sizes[nd - 2], k.data.sizes[nd - 2]});
  std::vector<int64_t> mask_strides(nd, 0);
  if (tensors[7]) broadcast_strides(*tensors[7], full, &mask_strides);
  struct Dim {
    int64_t size;
    int64_t s[6];  // q, k codes, v codes, mask, k scales, v scales
  };
  std::vector<Dim> merged;
  for (int64_t d = 0; d < nd - 3; ++d) {
    if (q.sizes[d] == 1) continue;
    const Dim bd = {q.sizes[d],
                    {qr.strides[d], k.data.strides[d], v.data.strides[d], mask_strides[d],
                     k.scales.strides[d], v.scales.strides[d]}};
    if (!merged.empty()) {
      Dim& o = merged.back();
      bool merge = true;
      for (int i = 0; i < 6; ++i) merge = merge && o.s[i] == bd.s[i] * bd.size;
      if (merge) {
        o.size *= bd.size;
        std::copy(bd.s, bd.s + 6, o.s);
        continue;
      }
    }
    merged.push_back(bd);
  }
  const AttnParams p = planned_params(plan);
  bool same = static_cast<int64_t>(merged.size()) == p.batch_ndim;
  for (size_t d = 0; same && d < merged.size(); ++d) {
    same = merged[d].size == p.batch_shape[d];
    qp.k_bs[d] = merged[d].s[4];
    qp.v_bs[d] = merged[d].s[5];
  }
  if (!same) {
    return Plan::refuse(op + ": the scales' batch strides do not merge as the codes' do "
                             "(scales laid out unlike their codes; make them contiguous)");
  }
  quantize_plan(&plan, {0, 1, 4, 7, 8}, k, v, qp, 9, copies.contiguous_inputs);
  return plan;
}

Plan plan_attention_varlen_quantized(const TensorList& tensors, const Options& options) {
  const std::string op = "sdpa_varlen_quantized";
  if (tensors.size() != 12 || !tensors[0]) {
    return Plan::refuse(op + " takes tensors [q, k, k_scales, k_mins, v, v_scales, v_mins, "
                             "cu_seqlens_q, cu_seqlens_k, sinks, block_table, seqused_k]");
  }
  Plan copies;
  Operand k, v;
  std::string why = check_operand(op, tensors, options, "key", "k_format", 1, &k, &copies);
  if (why.empty()) why = check_operand(op, tensors, options, "value", "v_format", 4, &v, &copies);
  if (!why.empty()) return Plan::refuse(why);
  const bool paged = tensors[10].has_value();
  const int64_t nd = paged ? 4 : 3;  // pools [pages, page_size, Hkv, .], packed [tokens, Hkv, .]
  if (k.data.dim() != nd || v.data.dim() != nd) {
    return Plan::refuse(op + ": codes must be " +
                        (paged ? "pools [pages, page_size, heads_kv, dim]"
                               : "packed [tokens, heads_kv, dim]") +
                        ", got " + shape_str(k.data.sizes) + ", " + shape_str(v.data.sizes));
  }
  const TensorList inner = {tensors[0], stand_in(k, tensors[0]->dtype),
                            stand_in(v, tensors[0]->dtype), tensors[7], tensors[8], tensors[9],
                            tensors[10], tensors[11]};
  Plan plan = plan_attention_varlen(inner, tile_loader_kernels(options));
  if (!plan.ok) return Plan::refuse("sdpa_varlen_quantized: " + plan.reason);
  AttnQuantParams qp;
  std::memset(&qp, 0, sizeof(qp));
  const TensorDesc& ks = k.scales;
  const TensorDesc& vs = v.scales;
  qp.k_ps = paged ? ks.strides[0] : 0;
  qp.v_ps = paged ? vs.strides[0] : 0;
  qp.k_rs = ks.strides[nd - 3];
  qp.v_rs = vs.strides[nd - 3];
  qp.k_hs = ks.strides[nd - 2];
  qp.v_hs = vs.strides[nd - 2];
  quantize_plan(&plan, {0, 1, 4, 7, 8, 9, 10, 11}, k, v, qp, 12, copies.contiguous_inputs);
  return plan;
}

STEEL_PLANNER("sdpa_quantized", plan_attention_quantized);
STEEL_PLANNER("sdpa_varlen_quantized", plan_attention_varlen_quantized);

}  // namespace steel
