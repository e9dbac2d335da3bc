// Executing a launch plan: the simulator's implementation of the Encoder concept of
// plan/encode.h, driven by steel::encode_plan exactly as the Metal host drives its encoder.
#include "plan/encode.h"
#include "sim.h"

namespace steel_sim {

namespace {

constexpr size_t kMaxInlineBytes = 4096;  // setBytes:length:atIndex: limit

class SimEncoder {
 public:
  SimEncoder(const Library* library, const std::vector<SlotArg>& slots, bool checkers,
             const std::vector<CacheSpec>& caches,
             const std::vector<std::vector<std::vector<uint32_t>>>& groups,
             bool count_instructions)
      : library_(library),
        slots_(slots),
        checkers_(checkers),
        caches_(caches),
        groups_(groups),
        count_instructions_(count_instructions) {}

  void set_pipeline(const steel::Dispatch& d) {
    spec_ = LaunchSpec();
    spec_.library = library_;
    spec_.kernel = d.kernel;
    spec_.constants = d.constants;
    spec_.checkers = checkers_;
    spec_.count_instructions = count_instructions_;
  }

  void set_tensor(uint32_t index, int32_t slot) {
    if (slot < 0 || static_cast<size_t>(slot) >= slots_.size() || !slots_[slot].present) {
      throw SimError("kernel '" + spec_.kernel + "': the plan binds [[buffer(" +
                     std::to_string(index) + ")]] to slot " + std::to_string(slot) +
                     ", which holds no tensor");
    }
    spec_.buffers.push_back(BufferArg{index, slots_[slot].host, slots_[slot].bytes, true});
  }

  void set_bytes(uint32_t index, const void* data, size_t size) {
    if (size > kMaxInlineBytes) {
      throw SimError("kernel '" + spec_.kernel + "': the plan sets " + std::to_string(size) +
                     " inline bytes for [[buffer(" + std::to_string(index) +
                     ")]]; Metal's setBytes takes at most 4 KB, bind a buffer instead");
    }
    // The plan outlives the launch, so its bytes can be bound in place (they are copied into the
    // device arena like any buffer and never written back).
    spec_.buffers.push_back(BufferArg{index, const_cast<void*>(data), size, false});
  }

  void set_threadgroup_memory(uint32_t index, uint32_t bytes) {
    spec_.threadgroup_memory.push_back(steel::ThreadgroupMemory{index, bytes});
  }

  void dispatch_threadgroups(const uint32_t grid[3], const uint32_t threads[3]) {
    for (int d = 0; d < 3; ++d) {
      spec_.grid[d] = grid[d];
      spec_.threads[d] = threads[d];
    }
    const size_t i = counters_.size();
    if (i < caches_.size()) spec_.cache = caches_[i];
    if (i < groups_.size()) spec_.groups = groups_[i];
    counters_.push_back(launch_groups(spec_));
  }

  std::vector<std::vector<Counters>> take_counters() { return std::move(counters_); }

 private:
  const Library* library_;
  const std::vector<SlotArg>& slots_;
  bool checkers_;
  const std::vector<CacheSpec>& caches_;
  const std::vector<std::vector<std::vector<uint32_t>>>& groups_;
  bool count_instructions_;
  LaunchSpec spec_;
  std::vector<std::vector<Counters>> counters_;
};

}  // namespace

std::vector<std::vector<Counters>> run_plan_groups(
    const Library* library, const steel::Plan& plan, const std::vector<SlotArg>& slots,
    bool checkers, const std::vector<CacheSpec>& caches,
    const std::vector<std::vector<std::vector<uint32_t>>>& groups, bool count_instructions) {
  if (!plan.ok) throw SimError("cannot run a refused plan: " + plan.reason);
  size_t expected = static_cast<size_t>(plan.inputs) + plan.allocations.size();
  if (slots.size() != expected) {
    throw SimError("the plan has " + std::to_string(expected) + " slots, got " +
                   std::to_string(slots.size()) + " tensors");
  }
  SimEncoder encoder(library, slots, checkers, caches, groups, count_instructions);
  steel::encode_plan(encoder, plan);
  return encoder.take_counters();
}

std::vector<Counters> run_plan(const Library* library, const steel::Plan& plan,
                               const std::vector<SlotArg>& slots, bool checkers) {
  std::vector<Counters> out;
  for (std::vector<Counters>& c : run_plan_groups(library, plan, slots, checkers, {}, {})) {
    out.push_back(std::move(c[0]));
  }
  return out;
}

}  // namespace steel_sim
