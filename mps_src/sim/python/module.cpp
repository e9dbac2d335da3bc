// The Python face of the simulator (torch_steel/sim/__init__.py and torch_steel/sim/build.py use it).
// Only pybind11: tensors cross as (data pointer, bound bytes), so this module does not depend
// on the torch C++ API and builds in seconds.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <tuple>

#include "plan/device.h"
#include "plan/plan.h"
#include "plan/plan_cache.h"
#include "sim/sim.h"

namespace py = pybind11;
using steel_sim::SimError;

namespace {

struct LibraryHandle {
  const steel_sim::Library* library;
};

struct PlanHandle {
  std::shared_ptr<const steel::Plan> plan;  // shared with the plan cache
};

// (dtype code, sizes, strides, storage offset) or None, as torch_steel/sim/__init__.py sends it.
using Desc = std::optional<std::tuple<int, std::vector<int64_t>, std::vector<int64_t>, int64_t>>;

// cached: through the process's plan cache (steel::cached_plan), as the Metal host plans; else
// planned afresh (tests compare the two). storages: TensorDesc::storage per desc (empty: none
// known to share storage).
PlanHandle make_plan(const std::string& op, const std::vector<Desc>& descs,
                     const std::map<std::string, double>& numbers,
                     const std::map<std::string, std::string>& strings, bool cached,
                     const std::vector<int64_t>& storages) {
  if (!storages.empty() && storages.size() != descs.size()) {
    throw py::value_error("make_plan: one storage id per desc");
  }
  steel::TensorList tensors;
  for (size_t i = 0; i < descs.size(); ++i) {
    const Desc& d = descs[i];
    if (!d) {
      tensors.emplace_back(std::nullopt);
      continue;
    }
    steel::TensorDesc t;
    t.dtype = static_cast<steel::DType>(std::get<0>(*d));
    t.sizes = std::get<1>(*d);
    t.strides = std::get<2>(*d);
    t.offset = std::get<3>(*d);
    t.storage = storages.empty() ? 0 : storages[i];
    tensors.emplace_back(std::move(t));
  }
  steel::Options options;
  options.numbers = numbers;
  options.strings = strings;
  if (cached) return PlanHandle{steel::cached_plan(op, tensors, options)};
  return PlanHandle{std::make_shared<const steel::Plan>(steel::make_plan(op, tensors, options))};
}

py::object constant_value(const steel::FunctionConstant& c) {
  switch (c.type) {
    case steel::FunctionConstant::Type::Bool:
      return py::bool_(c.int_value != 0);
    case steel::FunctionConstant::Type::Float:
      return py::float_(c.float_value);
    default:
      return py::int_(c.int_value);
  }
}

py::dict describe(const PlanHandle& h) {
  const steel::Plan& p = *h.plan;
  py::dict out;
  out["ok"] = p.ok;
  out["reason"] = p.reason;
  out["inputs"] = p.inputs;
  out["contiguous_inputs"] = p.contiguous_inputs;
  py::list allocations;
  for (const steel::Allocation& a : p.allocations) {
    py::dict d;
    d["name"] = a.name;
    d["dtype"] = steel::dtype_name(a.dtype);
    d["sizes"] = a.sizes;
    d["zero_init"] = a.zero_init;
    d["is_output"] = a.is_output;
    d["order"] = a.order;
    allocations.append(d);
  }
  out["allocations"] = allocations;
  py::list dispatches;
  for (const steel::Dispatch& x : p.dispatches) {
    py::dict d;
    d["kernel"] = x.kernel;
    py::dict constants;
    for (const steel::FunctionConstant& c : x.constants) {
      constants[py::int_(c.index)] = constant_value(c);
    }
    d["constants"] = constants;
    py::list bindings;
    for (const steel::Binding& b : x.bindings) {
      py::dict bd;
      bd["index"] = b.index;
      bd["kind"] = b.kind == steel::Binding::Kind::Tensor ? "tensor" : "bytes";
      bd["slot"] = b.slot;
      bd["bytes"] = py::bytes(reinterpret_cast<const char*>(b.bytes.data()), b.bytes.size());
      bindings.append(bd);
    }
    d["bindings"] = bindings;
    d["grid"] = py::make_tuple(x.grid[0], x.grid[1], x.grid[2]);
    d["threads"] = py::make_tuple(x.threads[0], x.threads[1], x.threads[2]);
    py::dict memory;
    for (const steel::ThreadgroupMemory& m : x.threadgroup_memory) {
      memory[py::int_(m.index)] = m.bytes;
    }
    d["threadgroup_memory"] = memory;
    dispatches.append(d);
  }
  out["dispatches"] = dispatches;
  return out;
}

py::dict counters_dict(const steel_sim::Counters& c) {
  py::dict d;
  d["kernel"] = c.kernel;
  d["threadgroups"] = c.threadgroups;
  d["lanes"] = c.lanes;
  d["mma"] = c.mma;
  d["simd_ops"] = c.simd_ops;
  d["shuffles"] = c.shuffles;
  d["reductions"] = c.reductions;
  d["ballots"] = c.ballots;
  d["threadgroup_read"] = c.threadgroup_read;
  d["threadgroup_written"] = c.threadgroup_written;
  d["threadgroup_memory_bytes"] = c.threadgroup_memory_bytes;
  d["barriers"] = c.barriers;
  d["lane_switches"] = c.lane_switches;
  d["tensor_ops"] = c.tensor_ops;
  d["tensor_multiply_adds"] = c.tensor_multiply_adds;
  py::dict buffers;
  for (const auto& kv : c.buffers) {
    py::dict b;
    b["read"] = kv.second.read;
    b["written"] = kv.second.written;
    buffers[py::int_(kv.first)] = b;
  }
  d["buffers"] = buffers;
  if (c.cache) {
    d["dram_read"] = c.dram_read;
    d["dram_written"] = c.dram_written;
    d["l2_hits"] = c.l2_hits;
    d["l2_misses"] = c.l2_misses;
    d["slc_hits"] = c.slc_hits;
    d["slc_misses"] = c.slc_misses;
  }
  if (c.instruction_counts) {
    // The order of torch_steel/sim/ir.py's FIELDS (Counters::issued).
    static const char* const kClasses[] = {"fp32", "half", "transcendental", "convert",
                                           "int", "compare_select", "branch", "other"};
    py::dict instructions;
    for (int k = 0; k < 8; ++k) instructions[kClasses[k]] = c.issued[k];
    d["instructions"] = instructions;
    py::dict mma;
    mma["half"] = c.issued[8];
    mma["bfloat"] = c.issued[9];
    mma["float"] = c.issued[10];
    d["mma_by_dtype"] = mma;
    d["threadgroup_loads"] = c.issued[11];
    d["threadgroup_stores"] = c.issued[12];
    d["device_loads"] = c.issued[13];
    d["device_stores"] = c.issued[14];
    d["constant_read"] = c.constant_read;
  }
  return d;
}

// (line_bytes, l2_bytes, slc_bytes, resident threadgroups) or None (no cache model).
using CacheArg = std::optional<std::tuple<uint32_t, uint64_t, uint64_t, uint32_t>>;
using Groups = std::vector<std::vector<uint32_t>>;

steel_sim::CacheSpec cache_spec(const CacheArg& a) {
  steel_sim::CacheSpec c;
  if (a) {
    c.enabled = true;
    std::tie(c.line_bytes, c.l2_bytes, c.slc_bytes, c.resident) = *a;
  }
  return c;
}

using Dim3 = std::tuple<uint32_t, uint32_t, uint32_t>;

// One dispatch; the counters of each group of `groups` (one entry when it is empty).
py::list launch(const LibraryHandle& lib, const std::string& kernel,
                const std::vector<std::tuple<uint32_t, int, int64_t, double>>& constants,
                const std::vector<std::tuple<uint32_t, uintptr_t, size_t, bool>>& buffers,
                const std::vector<std::tuple<uint32_t, uint32_t>>& threadgroup_memory,
                const Dim3& grid, const Dim3& threads, bool checkers, const CacheArg& cache,
                const Groups& groups, bool count_instructions, const Dim3& threads_grid) {
  steel_sim::LaunchSpec spec;
  spec.library = lib.library;
  spec.kernel = kernel;
  for (const auto& [index, type, int_value, float_value] : constants) {
    steel::FunctionConstant c;
    c.index = index;
    c.type = static_cast<steel::FunctionConstant::Type>(type);
    c.int_value = int_value;
    c.float_value = static_cast<float>(float_value);
    spec.constants.push_back(c);
  }
  for (const auto& [index, ptr, bytes, write_back] : buffers) {
    spec.buffers.push_back(
        steel_sim::BufferArg{index, reinterpret_cast<void*>(ptr), bytes, write_back});
  }
  for (const auto& [index, bytes] : threadgroup_memory) {
    spec.threadgroup_memory.push_back(steel::ThreadgroupMemory{index, bytes});
  }
  std::tie(spec.grid[0], spec.grid[1], spec.grid[2]) = grid;
  std::tie(spec.threads[0], spec.threads[1], spec.threads[2]) = threads;
  std::tie(spec.threads_grid[0], spec.threads_grid[1], spec.threads_grid[2]) = threads_grid;
  spec.checkers = checkers;
  spec.cache = cache_spec(cache);
  spec.groups = groups;
  spec.count_instructions = count_instructions;
  std::vector<steel_sim::Counters> counters;
  try {
    py::gil_scoped_release release;
    counters = steel_sim::launch_groups(spec);
  } catch (const steel_sim::Interrupted&) {
    PyErr_SetNone(PyExc_KeyboardInterrupt);
    throw py::error_already_set();
  }
  py::list out;
  for (const auto& c : counters) out.append(counters_dict(c));
  return out;
}

// Per dispatch of the plan, the counters of each group (caches and groups per dispatch, as
// steel_sim::run_plan_groups takes them).
py::list run_plan(const LibraryHandle& lib, const PlanHandle& plan,
                  const std::vector<std::optional<std::tuple<uintptr_t, size_t>>>& slots,
                  bool checkers, const std::vector<CacheArg>& caches,
                  const std::vector<Groups>& groups, bool count_instructions) {
  std::vector<steel_sim::SlotArg> args;
  for (const auto& s : slots) {
    steel_sim::SlotArg a;
    if (s) {
      a.present = true;
      a.host = reinterpret_cast<void*>(std::get<0>(*s));
      a.bytes = std::get<1>(*s);
    }
    args.push_back(a);
  }
  std::vector<steel_sim::CacheSpec> specs;
  for (const CacheArg& c : caches) specs.push_back(cache_spec(c));
  std::vector<std::vector<steel_sim::Counters>> counters;
  try {
    py::gil_scoped_release release;
    counters = steel_sim::run_plan_groups(lib.library, *plan.plan, args, checkers, specs, groups,
                                          count_instructions);
  } catch (const steel_sim::Interrupted&) {
    PyErr_SetNone(PyExc_KeyboardInterrupt);
    throw py::error_already_set();
  }
  py::list out;
  for (const auto& dispatch : counters) {
    py::list groups_out;
    for (const auto& c : dispatch) groups_out.append(counters_dict(c));
    out.append(groups_out);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch-steel CPU Metal simulator";
  py::register_exception<SimError>(m, "SimError");
  py::class_<LibraryHandle>(m, "Library")
      .def("kernels", [](const LibraryHandle& h) { return steel_sim::kernel_names(h.library); });
  py::class_<PlanHandle>(m, "Plan").def("describe", &describe);
  m.def("load_library", [](const std::vector<std::string>& paths) {
    return LibraryHandle{steel_sim::load_library(paths)};
  });
  m.def("make_plan", &make_plan, py::arg("op"), py::arg("descs"), py::arg("numbers"),
        py::arg("strings"), py::arg("cached") = true,
        py::arg("storages") = std::vector<int64_t>{});
  m.def("chip_dram_bytes_per_core_cycle", &steel::chip_dram_bytes_per_core_cycle,
        py::arg("name"), "The plans' DRAM rate of the GPU Metal names `name` (0: not known).");
  m.def("chip_dram_names", &steel::chip_dram_names, "The GPU names the plans' DRAM table holds.");
  m.def("plan_cache_stats", [] {
    const steel::PlanCache::Stats s = steel::plan_cache().stats();
    py::dict d;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["size"] = s.size;
    d["capacity"] = s.capacity;
    return d;
  });
  m.def("plan_cache_reset", [](size_t capacity) { steel::plan_cache().reset(capacity); },
        py::arg("capacity") = steel::kPlanCacheCapacity,
        "Empties the plan cache and sets its capacity (0: no caching).");
  m.def("launch", &launch);
  m.def("run_plan", &run_plan);
}
