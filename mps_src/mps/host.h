// The Metal host's work for one op call, up to the Metal calls: plain C++ over ATen.
//
// run_plan_on describes the tensors, gets the plan (plan cache, re-planned within the limits of
// its pipelines), makes the plan's contiguous copies and allocations, and hands everything to
// the host's encode. module.mm runs it with the Metal pipelines and the MPS stream; the host
// recorder (tests/mps/host_record.cpp) runs it with a pipeline cache of its own and a recording
// encoder, so that the host time of a Mac call is measured (bench/bench_overhead.py) and tested
// where no Metal exists.
//
// A Host provides:
//   using Pipeline = ...;
//   Pipeline pipeline(const Dispatch& d);      // built or found (cached for the process)
//   PipelineLimits limits(const Pipeline& p);  // what the device reports about it
//   void check_tensor(const std::string& op, size_t position, const at::Tensor& tensor);
//   uint64_t max_threadgroup_memory();
//   void encode(const std::string& op, const Plan& plan, const std::vector<Pipeline>& pipelines,
//               const std::vector<at::Tensor>& slots, const std::vector<bool>& present);
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "mps/checked_encoder.h"
#include "plan/plan.h"
#include "plan/plan_cache.h"

namespace steel::mps {

// c10 errors starting with this are refusals (torch_steel.metal.REFUSED_PREFIX).
inline constexpr const char* kRefused = "steel plan refused: ";

inline std::optional<DType> to_dtype(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Half:
      return DType::Float16;
    case c10::ScalarType::BFloat16:
      return DType::BFloat16;
    case c10::ScalarType::Float:
      return DType::Float32;
    case c10::ScalarType::Int:
      return DType::Int32;
    case c10::ScalarType::Long:
      return DType::Int64;
    case c10::ScalarType::Bool:
      return DType::Bool;
    case c10::ScalarType::Char:  // quantized K/V codes (torch_steel.kv)
      return DType::Int8;
    case c10::ScalarType::Byte:
      return DType::UInt8;
    default:
      return std::nullopt;
  }
}

inline c10::ScalarType to_scalar_type(DType dtype) {
  switch (dtype) {
    case DType::Float16:
      return c10::ScalarType::Half;
    case DType::BFloat16:
      return c10::ScalarType::BFloat16;
    case DType::Float32:
      return c10::ScalarType::Float;
    case DType::Int32:
      return c10::ScalarType::Int;
    case DType::Int64:
      return c10::ScalarType::Long;
    case DType::Bool:
      return c10::ScalarType::Bool;
    case DType::Int8:
      return c10::ScalarType::Char;
    case DType::UInt8:
      return c10::ScalarType::Byte;
  }
  TORCH_CHECK(false, "torch-steel: unknown plan dtype ", static_cast<int>(dtype));
}

inline TensorDesc describe(const at::Tensor& tensor, size_t position, const std::string& op) {
  std::optional<DType> dtype = to_dtype(tensor.scalar_type());
  TORCH_CHECK(dtype.has_value(), kRefused, op, " tensor ", position, " has dtype ",
              tensor.scalar_type(), ", which no Metal kernel takes");
  TensorDesc desc;
  desc.dtype = *dtype;
  desc.sizes = tensor.sizes().vec();
  desc.strides = tensor.strides().vec();
  desc.offset = tensor.storage_offset();
  return desc;
}

// Options arrive as a dict name -> bool | int | float | str | None; bools become 0/1 numbers.
// Needs the GIL, as every pybind11 object does.
inline Options to_options(const pybind11::dict& options) {
  namespace py = pybind11;
  Options result;
  for (const auto& item : options) {
    const std::string name = py::cast<std::string>(item.first);
    const py::handle value = item.second;
    if (value.is_none()) continue;  // an unset option, as in torch_steel.sim
    if (py::isinstance<py::bool_>(value)) {
      result.numbers[name] = py::cast<bool>(value) ? 1.0 : 0.0;
    } else if (py::isinstance<py::int_>(value) || py::isinstance<py::float_>(value)) {
      result.numbers[name] = py::cast<double>(value);
    } else if (py::isinstance<py::str>(value)) {
      result.strings[name] = py::cast<std::string>(value);
    } else {
      TORCH_CHECK(false, "torch-steel: option '", name, "' must be a bool, number or string, not ",
                  std::string(py::str(py::type::handle_of(value))));
    }
  }
  return result;
}

// The converted options of recent calls. A decode stream passes the same options per token, in
// a dict that torch_steel.ops keeps (a GEMM, a new dict of the same objects), and converting it
// anew builds a dozen map nodes (issue 16). An entry is found by the identity of the dict's
// names and values, in order, and holds references to them, so that none of their addresses is
// reused while it lives (names and values are immutable: the same objects mean the same
// options). `finish` completes the options once per entry (the Metal host's device facts: it
// must not wait on anything that waits on the GIL). Needs the GIL, as to_options; its lock is
// never held while Python code may run (a conversion, an evicted entry's references
// released). Never destroyed: its references outlive the interpreter.
class OptionsMemo {
 public:
  template <class Finish>
  std::shared_ptr<const Options> get(const pybind11::dict& options, Finish finish) {
    const size_t size = 2 * options.size();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const Entry& entry : entries_) {
        if (entry.objects.size() == size && same(entry, options)) {
          ++hits_;
          return entry.parsed;
        }
      }
    }
    auto parsed = std::make_shared<Options>(to_options(options));
    finish(parsed.get());
    Entry entry;
    entry.objects.reserve(size);
    for (const auto& item : options) {
      entry.objects.push_back(pybind11::reinterpret_borrow<pybind11::object>(item.first));
      entry.objects.push_back(pybind11::reinterpret_borrow<pybind11::object>(item.second));
    }
    entry.parsed = std::move(parsed);
    const std::shared_ptr<const Options> result = entry.parsed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (entries_.size() < kEntries) {
        entries_.push_back(std::move(entry));
        return result;
      }
      next_ = (next_ + 1) % kEntries;  // round robin: a miss per call evicts each entry in turn
      std::swap(entries_[next_], entry);
    }
    return result;  // the evicted entry (now `entry`) releases its references unlocked
  }

  uint64_t hits() {
    std::lock_guard<std::mutex> lock(mutex_);
    return hits_;
  }

 private:
  static constexpr size_t kEntries = 16;

  struct Entry {
    std::vector<pybind11::object> objects;  // name, value, name, value, ... in the dict's order
    std::shared_ptr<const Options> parsed;
  };

  static bool same(const Entry& entry, const pybind11::dict& options) {
    PyObject* name = nullptr;
    PyObject* value = nullptr;
    Py_ssize_t position = 0;
    size_t i = 0;
    while (PyDict_Next(options.ptr(), &position, &name, &value)) {
      if (entry.objects[i].ptr() != name || entry.objects[i + 1].ptr() != value) return false;
      i += 2;
    }
    return true;
  }

  std::mutex mutex_;
  std::vector<Entry> entries_;
  size_t next_ = 0;
  uint64_t hits_ = 0;
};

// The process's options memo (per extension module).
inline OptionsMemo& options_memo() {
  static OptionsMemo* instance = new OptionsMemo();  // leaked on purpose: see OptionsMemo
  return *instance;
}

// The pipelines of each plan family (Plan::family) that planned within its pipelines' limits
// at the first try, found once: a repeated call, or a decode stream's next token, gets them here
// instead of validating the plan, building every pipeline's key and looking it up, and checking
// its limits again (all the same for every plan of a family). Bounded and thread-safe.
template <class Pipeline>
class PreparedPipelines {
 public:
  bool find(uint64_t family, std::vector<Pipeline>* pipelines) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = families_.find(family);
    if (found == families_.end()) return false;
    *pipelines = found->second;
    ++hits_;
    return true;
  }

  void add(uint64_t family, const std::vector<Pipeline>& pipelines) {
    std::lock_guard<std::mutex> lock(mutex_);
    // Families evicted from the plan cache are never asked for again: dropping them all now
    // and then keeps this within a few times the plan cache's size.
    if (families_.size() >= 2 * kPlanCacheCapacity) families_.clear();
    families_.emplace(family, pipelines);
  }

  uint64_t hits() {
    std::lock_guard<std::mutex> lock(mutex_);
    return hits_;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<uint64_t, std::vector<Pipeline>> families_;
  uint64_t hits_ = 0;
};

// The process's prepared pipelines of a host type.
template <class Host>
PreparedPipelines<typename Host::Pipeline>& prepared_pipelines() {
  static PreparedPipelines<typename Host::Pipeline> instance;
  return instance;
}

// Plans the op within the limits of its pipelines (plan_within_limits, which tests/mps runs with
// made-up limits) and leaves the final plan's pipelines in `pipelines`.
template <class Host>
std::shared_ptr<const Plan> plan_with_pipelines(Host& host, const std::string& op,
                                                const TensorList& descs, const Options& options,
                                                std::vector<typename Host::Pipeline>& pipelines) {
  std::shared_ptr<const Plan> plan = cached_plan(op, descs, options);
  PreparedPipelines<typename Host::Pipeline>& prepared = prepared_pipelines<Host>();
  if (plan->ok && plan->family != 0 && prepared.find(plan->family, &pipelines)) return plan;
  const uint64_t family = plan->family;
  pipelines.clear();
  try {
    plan = plan_within_limits(op, descs, options, host.max_threadgroup_memory(),
                              [&host, &pipelines](const Dispatch& dispatch, size_t index) {
                                if (index == 0) pipelines.clear();  // a new attempt
                                pipelines.push_back(host.pipeline(dispatch));
                                return host.limits(pipelines.back());
                              },
                              plan);
  } catch (const InvalidPlan& e) {
    // Metal would reject or misread the plan (a planner bug, not a refusal): stopped before any
    // pipeline is specialized with its constants or anything is encoded.
    TORCH_CHECK(false, "torch-steel: invalid launch plan for ", op, ": ", e.what());
  }
  TORCH_CHECK(plan->ok, kRefused, plan->reason);
  // A plan re-planned under a pipeline's thread cap is another family's: its first plan is
  // prepared only when it was the final one.
  if (family != 0 && plan->family == family) prepared.add(family, pipelines);
  return plan;
}

// One op call on `host`. Touches no Python object: module.mm runs it without the GIL.
template <class Host>
std::vector<at::Tensor> run_plan_on(Host& host, const std::string& op,
                                    const std::vector<std::optional<at::Tensor>>& tensors,
                                    const Options& options) {
  TensorList descs;
  descs.reserve(tensors.size());
  std::optional<at::Device> device;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].has_value() || !tensors[i]->defined()) {
      descs.emplace_back(std::nullopt);
      continue;
    }
    const at::Tensor& tensor = *tensors[i];
    host.check_tensor(op, i, tensor);
    TORCH_CHECK(!device.has_value() || *device == tensor.device(), "torch-steel: ", op,
                " tensors are on different devices (", *device, " and ", tensor.device(), ")");
    device = tensor.device();
    descs.emplace_back(describe(tensor, i, op));
    // TensorDesc::storage: 1 + the first tensor of the call on the same storage (one MTLBuffer).
    descs.back()->storage = static_cast<int64_t>(i) + 1;
    for (size_t j = 0; j < i; ++j) {
      if (tensors[j].has_value() && tensors[j]->defined() && tensor.storage().data() != nullptr &&
          tensors[j]->storage().unsafeGetStorageImpl() == tensor.storage().unsafeGetStorageImpl()) {
        descs.back()->storage = static_cast<int64_t>(j) + 1;
        break;
      }
    }
  }
  TORCH_CHECK(device.has_value(), "torch-steel: ", op, " got no tensor");

  std::vector<typename Host::Pipeline> pipelines;
  const std::shared_ptr<const Plan> planned =
      plan_with_pipelines(host, op, descs, options, pipelines);
  const Plan& plan = *planned;
  const std::vector<bool> present = slots_present(descs, plan);  // the plan was validated with it

  // Slots: the inputs (contiguous copies where the plan asks), then the plan's allocations.
  // Copies and scratch die when run_op returns, before the GPU has run: as for the temporaries
  // of PyTorch's own MPS ops, that is safe. The caching allocator hands a freed buffer only to
  // later work, which runs after ours on the same stream, and releases a buffer to Metal only
  // when no command buffer retains it (PyTorch's command buffers retain what they use).
  std::vector<at::Tensor> slots;
  slots.reserve(tensors.size() + plan.allocations.size());
  for (const std::optional<at::Tensor>& tensor : tensors) {
    slots.push_back(tensor.has_value() ? *tensor : at::Tensor());
  }
  for (int32_t input : plan.contiguous_inputs) {
    TORCH_CHECK(input >= 0 && static_cast<size_t>(input) < slots.size() && slots[input].defined(),
                "torch-steel: plan for ", op, " copies input ", input, ", which is absent");
    slots[input] = slots[input].contiguous();
  }
  std::vector<at::Tensor> outputs;
  for (const Allocation& allocation : plan.allocations) {
    const auto like = at::TensorOptions().dtype(to_scalar_type(allocation.dtype)).device(*device);
    // Allocated in the plan's memory order, handed out permuted back (see Allocation::order).
    std::vector<int64_t> stored = allocation.sizes;
    std::vector<int64_t> back(allocation.order.size());
    for (size_t i = 0; i < allocation.order.size(); ++i) {
      stored[i] = allocation.sizes[allocation.order[i]];
      back[allocation.order[i]] = static_cast<int64_t>(i);
    }
    at::Tensor buffer = allocation.zero_init ? at::zeros(stored, like) : at::empty(stored, like);
    if (!back.empty()) buffer = buffer.permute(back);
    slots.push_back(buffer);
    if (allocation.is_output) outputs.push_back(buffer);
  }

  if (!plan.dispatches.empty()) host.encode(op, plan, pipelines, slots, present);
  return outputs;
}

}  // namespace steel::mps
