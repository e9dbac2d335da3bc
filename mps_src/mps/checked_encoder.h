// The Metal host's reading of a plan, minus the Metal calls.
//
// CheckedEncoder implements the Encoder concept of plan/encode.h: it checks every call that
// steel::encode_plan makes against the plan and against Metal's limits, then forwards it to a
// Backend with the same member functions. The Objective-C++ host (module.mm) uses it with a
// backend that makes the Metal calls; tests/mps compiles it as plain C++ with a recording
// backend and compares the record with the plan the simulator executes. Keeping the checks here
// means they run on Linux, where nothing can run Metal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "plan/encode.h"
#include "plan/plan.h"
#include "plan/plan_cache.h"

namespace steel::mps {

// Limits from Apple's Metal feature set tables and the MTLComputeCommandEncoder documentation.
inline constexpr uint32_t kMaxBufferBindings = 31;      // buffer argument table entries
inline constexpr size_t kMaxInlineBytes = 4096;         // setBytes: "data smaller than 4 KB"
inline constexpr uint32_t kMaxThreadgroupBindings = 31;  // threadgroup memory argument table
inline constexpr uint32_t kThreadgroupMemoryAlign = 16;  // setThreadgroupMemoryLength
// Total threadgroup memory of a threadgroup on every Apple GPU family. The host also checks the
// device's own maxThreadgroupMemoryLength, static (in-kernel) memory included, and refuses.
inline constexpr uint64_t kMaxThreadgroupMemory = 32768;
inline constexpr uint64_t kMaxThreadsPerThreadgroup = 1024;

// A plan that Metal would reject or misread: a planner bug, never a refusal.
class InvalidPlan : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <class Backend>
class CheckedEncoder {
 public:
  // present[slot]: whether the slot holds a tensor (absent optionals and out-of-range slots
  // cannot be bound).
  CheckedEncoder(Backend& backend, std::vector<bool> present)
      : backend_(backend), present_(std::move(present)) {}

  void set_pipeline(const Dispatch& dispatch) {
    kernel_ = dispatch.kernel;
    bound_.assign(kMaxBufferBindings, false);
    threadgroup_bound_.assign(kMaxThreadgroupBindings, false);
    threadgroup_bytes_ = 0;
    for (const FunctionConstant& constant : dispatch.constants) check_constant(constant);
    backend_.set_pipeline(dispatch);
  }

  void set_tensor(uint32_t index, int32_t slot) {
    claim(index);
    if (slot < 0 || static_cast<size_t>(slot) >= present_.size() || !present_[slot]) {
      fail("buffer(" + std::to_string(index) + ") binds slot " + std::to_string(slot) +
           ", which holds no tensor");
    }
    backend_.set_tensor(index, slot);
  }

  void set_bytes(uint32_t index, const void* data, size_t size) {
    claim(index);
    if (size == 0 || size > kMaxInlineBytes) {
      fail("buffer(" + std::to_string(index) + ") has " + std::to_string(size) +
           " inline bytes; setBytes takes 1 to " + std::to_string(kMaxInlineBytes));
    }
    backend_.set_bytes(index, data, size);
  }

  void set_threadgroup_memory(uint32_t index, uint32_t bytes) {
    const std::string name = "threadgroup(" + std::to_string(index) + ")";
    if (index >= kMaxThreadgroupBindings) {
      fail(name + " is beyond Metal's " + std::to_string(kMaxThreadgroupBindings) +
           " threadgroup memory bindings");
    }
    if (threadgroup_bound_[index]) fail(name + " is set twice");
    threadgroup_bound_[index] = true;
    if (bytes == 0 || bytes % kThreadgroupMemoryAlign != 0) {
      fail(name + " length " + std::to_string(bytes) + " is not a positive multiple of " +
           std::to_string(kThreadgroupMemoryAlign));
    }
    threadgroup_bytes_ += bytes;
    if (threadgroup_bytes_ > kMaxThreadgroupMemory) {
      fail(std::to_string(threadgroup_bytes_) + " bytes of threadgroup memory, more than " +
           std::to_string(kMaxThreadgroupMemory));
    }
    backend_.set_threadgroup_memory(index, bytes);
  }

  void dispatch_threadgroups(const uint32_t grid[3], const uint32_t threads[3]) {
    uint64_t total = uint64_t{threads[0]} * threads[1] * threads[2];
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || total == 0) {
      fail("empty grid or threadgroup (a plan for empty tensors has no dispatches)");
    }
    if (total > kMaxThreadsPerThreadgroup) {
      fail(std::to_string(total) + " threads per threadgroup, more than " +
           std::to_string(kMaxThreadsPerThreadgroup));
    }
    backend_.dispatch_threadgroups(grid, threads);
  }

 private:
  void claim(uint32_t index) {
    if (index >= kMaxBufferBindings) {
      fail("buffer(" + std::to_string(index) + ") is beyond Metal's " +
           std::to_string(kMaxBufferBindings) + " buffer bindings");
    }
    if (bound_[index]) fail("buffer(" + std::to_string(index) + ") is bound twice");
    bound_[index] = true;
  }

  void check_constant(const FunctionConstant& constant) {
    int64_t low = 0;
    int64_t high = 0;
    switch (constant.type) {
      case FunctionConstant::Type::Bool:
        high = 1;
        break;
      case FunctionConstant::Type::Int:
        low = std::numeric_limits<int32_t>::min();
        high = std::numeric_limits<int32_t>::max();
        break;
      case FunctionConstant::Type::UInt:
        high = std::numeric_limits<uint32_t>::max();
        break;
      case FunctionConstant::Type::Float:
        return;
    }
    if (constant.int_value < low || constant.int_value > high) {
      fail("function constant " + std::to_string(constant.index) + " = " +
           std::to_string(constant.int_value) + " does not fit its type");
    }
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw InvalidPlan("kernel " + kernel_ + ": " + what);
  }

  Backend& backend_;
  std::vector<bool> present_;
  std::string kernel_;
  std::vector<bool> bound_;
  std::vector<bool> threadgroup_bound_;
  uint64_t threadgroup_bytes_ = 0;
};

// A backend that does nothing: running CheckedEncoder over it validates a whole plan before
// anything is encoded, so that the Metal encoding block meets no planner errors.
struct NullBackend {
  void set_pipeline(const Dispatch&) {}
  void set_tensor(uint32_t, int32_t) {}
  void set_bytes(uint32_t, const void*, size_t) {}
  void set_threadgroup_memory(uint32_t, uint32_t) {}
  void dispatch_threadgroups(const uint32_t[3], const uint32_t[3]) {}
};

// Throws InvalidPlan when the plan would not encode.
inline void validate_plan(const Plan& plan, const std::vector<bool>& present) {
  NullBackend backend;
  CheckedEncoder<NullBackend> encoder(backend, present);
  encode_plan(encoder, plan);
}

// Which plan slots hold a tensor: the op's arguments that are present, then every allocation.
inline std::vector<bool> slots_present(const TensorList& tensors, const Plan& plan) {
  std::vector<bool> present;
  for (const auto& tensor : tensors) present.push_back(tensor.has_value());
  present.resize(present.size() + plan.allocations.size(), true);
  return present;
}

// The pipeline cache's key of a dispatch: its kernel and every constant's index, type and value
// (floats by their bits).
inline std::string pipeline_key(const Dispatch& dispatch) {
  std::string key = dispatch.kernel;
  for (const FunctionConstant& constant : dispatch.constants) {
    int64_t value = constant.int_value;
    if (constant.type == FunctionConstant::Type::Float) {
      uint32_t bits = 0;
      std::memcpy(&bits, &constant.float_value, sizeof bits);
      value = bits;
    }
    key += "|" + std::to_string(constant.index) + ":" +
           std::to_string(static_cast<int32_t>(constant.type)) + "=" + std::to_string(value);
  }
  return key;
}

inline std::shared_ptr<const Plan> refused(std::string why) {
  return std::make_shared<const Plan>(Plan::refuse(std::move(why)));
}

// What Metal reports about a dispatch's compute pipeline.
struct PipelineLimits {
  uint64_t max_threads = kMaxThreadsPerThreadgroup;  // maxTotalThreadsPerThreadgroup
  uint64_t static_threadgroup_memory = 0;            // staticThreadgroupMemoryLength
};

// A pipeline whose compiler-chosen thread limit is below the plan's threadgroup size triggers a
// re-plan under "max_threads"; a planner that honours it converges on the second attempt.
inline constexpr int kPlanAttempts = 3;

// Plans `op` within the limits of the pipelines it gets. Metal may cap a pipeline below the
// plan's threadgroup size (the compiler lowers maxTotalThreadsPerThreadgroup when a kernel needs
// many registers): then the op is planned again with "max_threads" = that cap, which planners
// honour or refuse. Threadgroup memory, static and dynamic, beyond the device's is a refusal.
//
// `first`, when given, is the cached plan of the call's options (the first attempt's).
// limits_of(dispatch, i) builds (or finds) the pipeline of the i-th dispatch of a candidate plan
// and returns its limits; it is called for every dispatch of every attempt, in order, after the
// attempt passed validate_plan. Returns the plan, or a refused Plan whose reason names the limit;
// throws InvalidPlan for a plan that Metal would reject or misread (a planner bug), before any
// limits_of call for it. Plans come from the plan cache (plan/plan_cache.h): a repeated call
// plans nothing.
template <class LimitsOf>
std::shared_ptr<const Plan> plan_within_limits(const std::string& op, const TensorList& tensors,
                                               const Options& call_options,
                                               uint64_t device_threadgroup_memory,
                                               LimitsOf&& limits_of,
                                               std::shared_ptr<const Plan> first = nullptr) {
  const Options* options = &call_options;
  Options capped_options;  // a copy only when a pipeline's cap asks for another attempt
  for (int attempt = 1;; ++attempt) {
    std::shared_ptr<const Plan> candidate =
        attempt == 1 && first ? std::move(first) : cached_plan(op, tensors, *options);
    const Plan& plan = *candidate;
    if (!plan.ok) return candidate;
    validate_plan(plan, slots_present(tensors, plan));
    uint64_t cap = std::numeric_limits<uint64_t>::max();
    std::string capped;
    for (size_t i = 0; i < plan.dispatches.size(); ++i) {
      const Dispatch& dispatch = plan.dispatches[i];
      const PipelineLimits limits = limits_of(dispatch, i);
      const uint64_t threads =
          uint64_t{dispatch.threads[0]} * dispatch.threads[1] * dispatch.threads[2];
      if (threads > limits.max_threads && limits.max_threads < cap) {
        cap = limits.max_threads;
        capped = dispatch.kernel;
      }
      uint64_t memory = limits.static_threadgroup_memory;
      for (const ThreadgroupMemory& entry : dispatch.threadgroup_memory) memory += entry.bytes;
      if (memory > device_threadgroup_memory) {
        return refused("kernel " + dispatch.kernel + " needs " + std::to_string(memory) +
                            " bytes of threadgroup memory, the device has " +
                            std::to_string(device_threadgroup_memory));
      }
    }
    if (capped.empty()) return candidate;
    const double asked = options->number("max_threads", 1e9);
    if (attempt >= kPlanAttempts || asked <= static_cast<double>(cap)) {
      return refused("kernel " + capped + " runs at most " + std::to_string(cap) +
                          " threads per threadgroup on this device and the planner found no "
                          "smaller plan");
    }
    if (options != &capped_options) capped_options = call_options;
    capped_options.numbers["max_threads"] = static_cast<double>(cap);
    options = &capped_options;
  }
}

}  // namespace steel::mps
