// Launch plans: everything that decides how a Metal kernel is launched.
//
// A plan is computed from shapes, strides, dtypes and flags only (never from data), by portable
// C++17 with no Metal and no torch dependency. The Metal host (mps_src/mps) and the CPU simulator
// (mps_src/sim) both execute exactly this structure, so what the simulator verifies is what the
// Mac encodes. See DESIGN.md section 5.
//
// Slots. A plan names buffers by slot: slots [0, inputs) are the op's tensor arguments in the
// order the planner received them (after the copies listed in `contiguous_inputs`), slots
// [inputs, inputs + allocations.size()) are the buffers the plan asks the host to allocate
// (outputs and scratch). A tensor binding is bound at the tensor's own storage offset.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace steel {

// Int8 and UInt8: the codes of quantized K/V (torch_steel.kv), read as bytes.
enum class DType : int32_t { Float16 = 0, BFloat16 = 1, Float32 = 2, Int32 = 3, Int64 = 4, Bool = 5,
                             Int8 = 6, UInt8 = 7 };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

// A tensor as the planner sees it: no data, only its layout. Strides and offset are in elements.
struct TensorDesc {
  DType dtype = DType::Float32;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t offset = 0;
  // Which storage the view reads: tensors of one call with the same nonzero value view one
  // storage (the host sets it from the tensors; 0: not known to share one with any other).
  // What the attention planner's K/V alias (attention_plan.h, kv_alias) is decided from.
  int64_t storage = 0;

  int64_t dim() const { return static_cast<int64_t>(sizes.size()); }
  int64_t numel() const;
  bool is_contiguous() const;
  // The same shape with row-major contiguous strides and offset 0 in a storage of its own (what
  // a copy produces).
  TensorDesc contiguous() const;
};

// Scalar and string options of an op, by name (e.g. "alpha", "activation").
struct Options {
  std::map<std::string, double> numbers;
  std::map<std::string, std::string> strings;

  double number(const std::string& name, double fallback) const;
  std::string string(const std::string& name, const std::string& fallback) const;
};

struct FunctionConstant {
  enum class Type : int32_t { Bool = 0, Int = 1, UInt = 2, Float = 3 };
  uint32_t index = 0;
  Type type = Type::Bool;
  int64_t int_value = 0;  // Bool, Int, UInt
  float float_value = 0;  // Float
};

// One [[buffer(index)]] argument of a dispatch: a slot's tensor or inline bytes (setBytes).
struct Binding {
  enum class Kind : int32_t { Tensor = 0, Bytes = 1 };
  uint32_t index = 0;
  Kind kind = Kind::Tensor;
  int32_t slot = -1;           // Kind::Tensor
  std::vector<uint8_t> bytes;  // Kind::Bytes, e.g. a params struct from shaders/steel/params.h
};

// One [[threadgroup(index)]] argument: setThreadgroupMemoryLength(bytes, index).
struct ThreadgroupMemory {
  uint32_t index = 0;
  uint32_t bytes = 0;
};

struct Dispatch {
  std::string kernel;  // host name in the metallib
  std::vector<FunctionConstant> constants;
  std::vector<Binding> bindings;  // in binding order; the encoder and the simulator walk this list
  std::vector<ThreadgroupMemory> threadgroup_memory;
  uint32_t grid[3] = {1, 1, 1};     // threadgroups per grid (dispatchThreadgroups)
  uint32_t threads[3] = {1, 1, 1};  // threads per threadgroup
};

// A buffer the host allocates for the plan. Outputs are returned to the caller in order.
struct Allocation {
  std::string name;
  DType dtype = DType::Float32;
  std::vector<int64_t> sizes;
  bool zero_init = false;
  bool is_output = false;
  // The dims in memory order, outermost first; empty for row-major. The host allocates the
  // sizes in this order contiguously and hands out the view permuted back to `sizes`, so that an
  // output can follow an input's memory layout (attention's output follows the query's).
  std::vector<int64_t> order;
};

struct Plan {
  bool ok = false;
  std::string reason;  // why the Metal path refuses, when !ok; names the limit
  int32_t inputs = 0;  // number of input slots
  std::vector<int32_t> contiguous_inputs;  // inputs the host copies to contiguous first
  std::vector<Allocation> allocations;
  std::vector<Dispatch> dispatches;  // encoded in order on one stream
  // The plan cache's number for the key this plan was made for (0: not from the cache). A plan
  // rewritten for another decode length keeps it: the plans of one family differ in their
  // params bytes only, so that the Metal host prepares them once (mps/host.h).
  uint64_t family = 0;

  static Plan refuse(std::string why);
};

// Inputs of a planner: the op's tensor arguments (absent optionals are nullopt) and its options.
using TensorList = std::vector<std::optional<TensorDesc>>;
using Planner = Plan (*)(const TensorList& tensors, const Options& options);

// Planners register themselves by op name at static-initialization time (see STEEL_PLANNER), so
// the Metal host and the simulator reach every planner through make_plan without per-op glue.
void register_planner(const char* op, Planner planner);
// Plans `op`; an unknown op is refused with a reason, never an exception.
Plan make_plan(const std::string& op, const TensorList& tensors, const Options& options);

// ---- Helpers shared by the planners ----

constexpr int64_t kInt32Max = 2147483647;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The floating dtypes the kernels take (float16, bfloat16, float32).
bool supported_dtype(DType d);
// The dtype's tag in kernel host names: f16, bf16, f32.
const char* dtype_tag(DType d);
// One past the largest element offset a tensor can touch (0 when empty).
int64_t extent(const TensorDesc& t);
// Whether the strides are exactly contiguous()'s (as torch.cat and torch.empty make them),
// every dim's included.
bool row_major(const TensorDesc& t);
// "[2, 3, 4]".
std::string shape_str(const std::vector<int64_t>& sizes);
// Strides of `t` aligned to the trailing dims of a `shape`-shaped broadcast, 0 where broadcast;
// false when `t` does not broadcast to `shape`.
bool broadcast_strides(const TensorDesc& t, const std::vector<int64_t>& shape,
                       std::vector<int64_t>* strides);
FunctionConstant fc_bool(uint32_t index, bool value);
FunctionConstant fc_int(uint32_t index, int64_t value);
Binding tensor_binding(uint32_t index, int32_t slot);
// [[buffer(index)]] = a copy of `size` bytes at `data` (a params struct).
Binding bytes_binding(uint32_t index, const void* data, size_t size);

}  // namespace steel

#define STEEL_PLANNER_CONCAT2(a, b) a##b
#define STEEL_PLANNER_CONCAT(a, b) STEEL_PLANNER_CONCAT2(a, b)
// STEEL_PLANNER("gemm", plan_gemm); at namespace scope in the planner's .cpp file.
#define STEEL_PLANNER(op, fn)                                                        \
  static const bool STEEL_PLANNER_CONCAT(steel_planner_registered_, __LINE__) = [] { \
    ::steel::register_planner(op, fn);                                               \
    return true;                                                                     \
  }()
