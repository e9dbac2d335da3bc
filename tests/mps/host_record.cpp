// The Metal host's op call without Metal: mps/host.h's run_plan_on, the code module.mm runs,
// with a pipeline cache like library.mm's and a recording backend in place of the Metal calls.
//
// run_op(op, tensors, options) takes the tensors of any device (CPU here) and returns the plan's
// outputs, allocated as module.mm allocates them and left unwritten (no kernel runs). Each call
// replaces the record: last_record() is what the encoder was asked, one line per call
// ("pipeline <kernel>", "tensor <index> <slot> <byte offset>", "bytes <index> <size>",
// "tgmem <index> <bytes>", "dispatch <grid> <threads>"); pipelines_built() counts the pipelines
// made, each once per process as in library.mm; plan_cache_stats() is (hits, misses) of the
// plan cache, plan_cache_reset(capacity) empties it (capacity 0: plan every call). bench/bench_overhead.py times it behind the op
// layer; tests/mps/test_host_record.py checks it against the simulator's plans.
#include <torch/extension.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "mps/checked_encoder.h"
#include "mps/host.h"
#include "plan/encode.h"
#include "plan/plan_cache.h"

namespace py = pybind11;

namespace {

using steel::Dispatch;
using steel::Plan;
using steel::mps::PipelineLimits;

// The calls MetalBackend (module.mm) makes, as text.
class RecordingBackend {
 public:
  RecordingBackend(const std::vector<at::Tensor>& slots, std::vector<std::string>& record)
      : slots_(slots), record_(record) {}

  void set_pipeline(const Dispatch& dispatch) { record_.push_back("pipeline " + dispatch.kernel); }

  void set_tensor(uint32_t index, int32_t slot) {
    const at::Tensor& tensor = slots_.at(slot);
    const int64_t offset = tensor.storage_offset() * tensor.element_size();
    record_.push_back("tensor " + std::to_string(index) + " " + std::to_string(slot) + " " +
                      std::to_string(offset));
  }

  void set_bytes(uint32_t index, const void*, size_t size) {
    record_.push_back("bytes " + std::to_string(index) + " " + std::to_string(size));
  }

  void set_threadgroup_memory(uint32_t index, uint32_t bytes) {
    record_.push_back("tgmem " + std::to_string(index) + " " + std::to_string(bytes));
  }

  void dispatch_threadgroups(const uint32_t grid[3], const uint32_t threads[3]) {
    std::string line = "dispatch";
    for (int i = 0; i < 3; ++i) line += " " + std::to_string(grid[i]);
    for (int i = 0; i < 3; ++i) line += " " + std::to_string(threads[i]);
    record_.push_back(line);
  }

 private:
  const std::vector<at::Tensor>& slots_;
  std::vector<std::string>& record_;
};

struct State {
  std::mutex mutex;
  std::map<std::string, PipelineLimits> pipelines;  // library.mm's cache, by the same key
  std::vector<std::string> record;
};

State& state() {
  static State instance;
  return instance;
}

struct RecordingHost {
  using Pipeline = PipelineLimits;

  void check_tensor(const std::string&, size_t, const at::Tensor&) {}

  Pipeline pipeline(const Dispatch& dispatch) {
    State& s = state();
    const std::string key = steel::mps::pipeline_key(dispatch);
    std::lock_guard<std::mutex> lock(s.mutex);
    return s.pipelines.emplace(key, PipelineLimits{}).first->second;
  }

  PipelineLimits limits(const Pipeline& pipeline) { return pipeline; }

  uint64_t max_threadgroup_memory() { return steel::mps::kMaxThreadgroupMemory; }

  void encode(const std::string&, const Plan& plan, const std::vector<Pipeline>&,
              const std::vector<at::Tensor>& slots, const std::vector<bool>& present) {
    std::vector<std::string> record;
    RecordingBackend backend(slots, record);
    steel::mps::CheckedEncoder<RecordingBackend> encoder(backend, present);
    steel::encode_plan(encoder, plan);
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.record = std::move(record);
  }
};

// As module.mm's run_op: options read with the GIL, the rest without.
std::vector<at::Tensor> run_op(const std::string& op,
                               const std::vector<std::optional<at::Tensor>>& tensors,
                               const py::dict& options) {
  const steel::Options parsed = steel::mps::to_options(options);
  py::gil_scoped_release no_gil;
  RecordingHost host;
  return steel::mps::run_plan_on(host, op, tensors, parsed);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch-steel's Metal host path with a recording encoder (tests and benchmarks)";
  m.def("run_op", &run_op, py::arg("op"), py::arg("tensors"), py::arg("options"));
  m.def("last_record", [] {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    return s.record;
  });
  m.def("plan_cache_stats", [] {
    const steel::PlanCache::Stats stats = steel::plan_cache().stats();
    return std::make_pair(stats.hits, stats.misses);
  });
  m.def("plan_cache_reset", [](size_t capacity) { steel::plan_cache().reset(capacity); },
        py::arg("capacity") = steel::kPlanCacheCapacity);
  m.def("pipelines_built", [] {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    return s.pipelines.size();
  });
}
