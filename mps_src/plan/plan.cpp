#include "plan.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <utility>

namespace steel {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::Float16:
    case DType::BFloat16:
      return 2;
    case DType::Float32:
    case DType::Int32:
      return 4;
    case DType::Int64:
      return 8;
    case DType::Bool:
    case DType::Int8:
    case DType::UInt8:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::Float16:
      return "float16";
    case DType::BFloat16:
      return "bfloat16";
    case DType::Float32:
      return "float32";
    case DType::Int32:
      return "int32";
    case DType::Int64:
      return "int64";
    case DType::Bool:
      return "bool";
    case DType::Int8:
      return "int8";
    case DType::UInt8:
      return "uint8";
  }
  return "unknown";
}

int64_t TensorDesc::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

bool TensorDesc::is_contiguous() const {
  int64_t expected = 1;
  for (int64_t d = dim() - 1; d >= 0; --d) {
    if (sizes[d] == 1) continue;  // the stride of a size-1 dim never matters
    if (strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

TensorDesc TensorDesc::contiguous() const {
  TensorDesc out;
  out.dtype = dtype;
  out.sizes = sizes;
  out.strides.assign(sizes.size(), 1);
  for (int64_t d = dim() - 2; d >= 0; --d) out.strides[d] = out.strides[d + 1] * std::max<int64_t>(sizes[d + 1], 1);
  out.offset = 0;
  return out;
}

double Options::number(const std::string& name, double fallback) const {
  auto it = numbers.find(name);
  return it == numbers.end() ? fallback : it->second;
}

std::string Options::string(const std::string& name, const std::string& fallback) const {
  auto it = strings.find(name);
  return it == strings.end() ? fallback : it->second;
}

Plan Plan::refuse(std::string why) {
  Plan plan;
  plan.ok = false;
  plan.reason = std::move(why);
  return plan;
}

namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, Planner> planners;
};

Registry& registry() {
  static Registry instance;  // constructed on first use, safe from static-init order
  return instance;
}

}  // namespace

void register_planner(const char* op, Planner planner) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.planners[op] = planner;
}

Plan make_plan(const std::string& op, const TensorList& tensors, const Options& options) {
  Planner planner = nullptr;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.planners.find(op);
    if (it != r.planners.end()) planner = it->second;
  }
  if (planner == nullptr) return Plan::refuse("no Metal kernel for op '" + op + "' yet");
  Plan plan = planner(tensors, options);
  plan.inputs = static_cast<int32_t>(tensors.size());
  return plan;
}

bool supported_dtype(DType d) {
  return d == DType::Float16 || d == DType::BFloat16 || d == DType::Float32;
}

const char* dtype_tag(DType d) {
  switch (d) {
    case DType::Float16:
      return "f16";
    case DType::BFloat16:
      return "bf16";
    default:
      return "f32";
  }
}

int64_t extent(const TensorDesc& t) {
  int64_t last = t.offset;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.sizes[d] == 0) return 0;
    last += (t.sizes[d] - 1) * t.strides[d];
  }
  return last + 1;
}

bool row_major(const TensorDesc& t) {
  return t.strides.size() == t.sizes.size() && t.strides == t.contiguous().strides;
}

std::string shape_str(const std::vector<int64_t>& sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

bool broadcast_strides(const TensorDesc& t, const std::vector<int64_t>& shape,
                       std::vector<int64_t>* strides) {
  const int64_t nd = static_cast<int64_t>(shape.size());
  if (t.dim() > nd) return false;
  strides->assign(nd, 0);
  for (int64_t i = 0; i < t.dim(); ++i) {
    const int64_t d = nd - t.dim() + i;
    if (t.sizes[i] == shape[d]) {
      (*strides)[d] = shape[d] == 1 ? 0 : t.strides[i];
    } else if (t.sizes[i] != 1) {
      return false;
    }
  }
  return true;
}

FunctionConstant fc_bool(uint32_t index, bool value) {
  FunctionConstant c;
  c.index = index;
  c.type = FunctionConstant::Type::Bool;
  c.int_value = value ? 1 : 0;
  return c;
}

FunctionConstant fc_int(uint32_t index, int64_t value) {
  FunctionConstant c;
  c.index = index;
  c.type = FunctionConstant::Type::Int;
  c.int_value = value;
  return c;
}

Binding tensor_binding(uint32_t index, int32_t slot) {
  Binding b;
  b.index = index;
  b.kind = Binding::Kind::Tensor;
  b.slot = slot;
  return b;
}

Binding bytes_binding(uint32_t index, const void* data, size_t size) {
  Binding b;
  b.index = index;
  b.kind = Binding::Kind::Bytes;
  b.bytes.resize(size);
  std::memcpy(b.bytes.data(), data, size);
  return b;
}

}  // namespace steel
