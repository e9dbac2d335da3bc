// Records what the Metal host would encode for a plan, without Metal.
//
// Reads one op call from stdin, plans it with steel::make_plan, walks the plan with
// steel::encode_plan through the host's CheckedEncoder (mps_src/mps/checked_encoder.h) over a
// backend that prints each call, and prints the plan's allocations. test_encoder_plan.py compares
// the record with the plan torch_steel.sim executes.
//
// Input, one item per line:
//   op <name>
//   tensor <dtype code> <ndim> <sizes...> <strides...> <offset>   (an op tensor argument)
//   none                                                          (an absent optional)
//   number <name> <value> | string <name> <value>
//   limit <kernel prefix> <max threads> <static threadgroup bytes>   (a made-up pipeline)
//   device_tgmem <bytes>                             (the device's threadgroup memory)
// Planning goes through plan_within_limits, the host's re-plan loop, with pipelines whose limits
// are the longest matching "limit" line (default: 1024 threads, no static memory); with any
// limit or device_tgmem line, "attempts <n>" (how many plans were made) follows "inputs".
// Output: "refused <reason>", or "invalid <what>" for a plan the host would reject, or the plan:
//   inputs <n> / contiguous <slots...> / allocation <dtype> <zero> <output> <ndim> <sizes...>
//   pipeline <kernel> <n> {<index> <type> <value>} / tensor <index> <slot> / bytes <index> <hex>
//   tgmem <index> <bytes> / dispatch <grid x y z> <threads x y z>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "mps/checked_encoder.h"
#include "plan/encode.h"
#include "plan/plan.h"

namespace {

struct PrintingBackend {
  std::ostream& out;

  void set_pipeline(const steel::Dispatch& d) {
    out << "pipeline " << d.kernel << " " << d.constants.size();
    for (const steel::FunctionConstant& c : d.constants) {
      out << " " << c.index << " " << static_cast<int>(c.type) << " ";
      if (c.type == steel::FunctionConstant::Type::Float) {
        char text[32];
        std::snprintf(text, sizeof text, "%.9g", c.float_value);  // round-trips a float
        out << text;
      } else {
        out << c.int_value;
      }
    }
    out << "\n";
  }
  void set_tensor(uint32_t index, int32_t slot) {
    out << "tensor " << index << " " << slot << "\n";
  }
  void set_bytes(uint32_t index, const void* data, size_t size) {
    out << "bytes " << index << " ";
    const auto* bytes = static_cast<const unsigned char*>(data);
    char hex[3];
    for (size_t i = 0; i < size; ++i) {
      std::snprintf(hex, sizeof hex, "%02x", bytes[i]);
      out << hex;
    }
    out << "\n";
  }
  void set_threadgroup_memory(uint32_t index, uint32_t bytes) {
    out << "tgmem " << index << " " << bytes << "\n";
  }
  void dispatch_threadgroups(const uint32_t grid[3], const uint32_t threads[3]) {
    out << "dispatch " << grid[0] << " " << grid[1] << " " << grid[2] << " " << threads[0] << " "
        << threads[1] << " " << threads[2] << "\n";
  }
};

// A planner for the host's checks themselves: a one-dispatch plan over tensors [x, y?] with the
// defect named by the string option "defect" (see test_encoder_plan.py).
steel::Plan plan_with_defect(const steel::TensorList& tensors, const steel::Options& options) {
  const std::string defect = options.string("defect", "none");
  steel::Plan plan;
  plan.ok = true;
  plan.allocations.push_back({"out", steel::DType::Float32, {4}, false, true});
  const int32_t out_slot = static_cast<int32_t>(tensors.size());
  steel::Dispatch d;
  d.kernel = "defect_" + defect;
  d.constants.push_back({0, steel::FunctionConstant::Type::Bool, defect == "constant" ? 2 : 1, 0});
  d.bindings.push_back({0, steel::Binding::Kind::Tensor, 0, {}});
  d.bindings.push_back({defect == "index" ? 31u : 1u, steel::Binding::Kind::Tensor, out_slot, {}});
  if (defect == "twice") d.bindings.push_back({0, steel::Binding::Kind::Tensor, out_slot, {}});
  if (defect == "absent") d.bindings.push_back({2, steel::Binding::Kind::Tensor, 1, {}});
  if (defect == "slot") d.bindings.push_back({2, steel::Binding::Kind::Tensor, out_slot + 1, {}});
  const size_t bytes = defect == "bytes" ? steel::mps::kMaxInlineBytes + 1 : 16;
  d.bindings.push_back({3, steel::Binding::Kind::Bytes, -1, std::vector<uint8_t>(bytes, 7)});
  d.threadgroup_memory.push_back({0, defect == "tgmem" ? 1000u : 1024u});
  if (defect == "tgindex") d.threadgroup_memory.push_back({31, 16});
  if (defect == "tgtwice") d.threadgroup_memory.push_back({0, 16});
  if (defect == "tgtotal") d.threadgroup_memory.push_back({1, 32768 - 1024 + 16});
  d.threads[0] = defect == "threads" ? 1025 : 1024;
  if (defect == "grid") d.grid[1] = 0;
  plan.dispatches.push_back(d);
  return plan;
}
STEEL_PLANNER("mps_test_defect", plan_with_defect);

}  // namespace

struct Limit {
  std::string prefix;
  steel::mps::PipelineLimits limits;
};

int main() {
  std::string op;
  steel::TensorList tensors;
  steel::Options options;
  std::vector<Limit> limits;
  uint64_t device_tgmem = steel::mps::kMaxThreadgroupMemory;
  bool report_attempts = false;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string kind;
    in >> kind;
    if (kind == "op") {
      in >> op;
    } else if (kind == "none") {
      tensors.emplace_back(std::nullopt);
    } else if (kind == "tensor") {
      int dtype = 0;
      size_t ndim = 0;
      steel::TensorDesc desc;
      in >> dtype >> ndim;
      desc.dtype = static_cast<steel::DType>(dtype);
      desc.sizes.resize(ndim);
      desc.strides.resize(ndim);
      for (int64_t& size : desc.sizes) in >> size;
      for (int64_t& stride : desc.strides) in >> stride;
      in >> desc.offset;
      tensors.emplace_back(desc);
    } else if (kind == "number") {
      std::string name;
      double value = 0;
      in >> name >> value;
      options.numbers[name] = value;
    } else if (kind == "string") {
      std::string name, value;
      in >> name >> value;
      options.strings[name] = value;
    } else if (kind == "limit") {
      Limit limit;
      in >> limit.prefix >> limit.limits.max_threads >> limit.limits.static_threadgroup_memory;
      limits.push_back(limit);
      report_attempts = true;
    } else if (kind == "device_tgmem") {
      in >> device_tgmem;
      report_attempts = true;
    } else if (!kind.empty()) {
      std::cerr << "plan_record: bad input line: " << line << "\n";
      return 2;
    }
  }

  int attempts = 0;
  steel::Plan plan;
  try {
    plan = *steel::mps::plan_within_limits(
        op, tensors, options, device_tgmem, [&](const steel::Dispatch& d, size_t index) {
          if (index == 0) ++attempts;
          const Limit* best = nullptr;
          for (const Limit& limit : limits) {
            if (d.kernel.rfind(limit.prefix, 0) == 0 &&
                (best == nullptr || limit.prefix.size() > best->prefix.size())) {
              best = &limit;
            }
          }
          return best != nullptr ? best->limits : steel::mps::PipelineLimits{};
        });
  } catch (const steel::mps::InvalidPlan& e) {
    std::cout << "invalid " << e.what() << "\n";
    return 0;
  }
  if (!plan.ok) {
    std::cout << "refused " << plan.reason << "\n";
    return 0;
  }
  std::ostringstream record;
  record << "inputs " << plan.inputs << "\n";
  if (report_attempts) record << "attempts " << attempts << "\n";
  record << "contiguous";
  for (int32_t slot : plan.contiguous_inputs) record << " " << slot;
  record << "\n";
  for (const steel::Allocation& a : plan.allocations) {
    record << "allocation " << steel::dtype_name(a.dtype) << " " << a.zero_init << " "
           << a.is_output << " " << a.sizes.size();
    for (int64_t size : a.sizes) record << " " << size;
    record << "\n";
  }
  PrintingBackend backend{record};
  steel::mps::CheckedEncoder<PrintingBackend> encoder(backend,
                                                      steel::mps::slots_present(tensors, plan));
  try {
    steel::encode_plan(encoder, plan);
  } catch (const steel::mps::InvalidPlan& e) {
    std::cout << "invalid " << e.what() << "\n";
    return 0;
  }
  std::cout << record.str();
  return 0;
}
