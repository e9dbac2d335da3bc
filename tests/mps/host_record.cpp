// The Metal host's op call without Metal: mps/host.h's run_plan_on, the code module.mm runs,
// with a pipeline cache like library.mm's and a recording backend in place of the Metal calls.
//
// run_op(op, tensors, options) takes the tensors of any device (CPU here) and returns the plan's
// outputs, allocated as module.mm allocates them and left unwritten (no kernel runs). Each call
// replaces the record: last_record() is what the encoder was asked, one line per call
// ("pipeline <kernel>", "tensor <index> <slot> <byte offset>", "bytes <index> <size>",
// "tgmem <index> <bytes>", "dispatch <grid> <threads>"); pipelines_built() counts the pipelines
// made, each once per process as in library.mm; plan_cache_stats() is (hits, misses) of the
// plan cache, plan_cache_reset(capacity) empties it (capacity 0: plan every call);
// last_pipelines() the keys of the pipelines the last call was encoded with (in plan order: the
// record's pipeline lines are theirs, as MetalBackend sets them); prepared_hits() counts the
// calls that found their plan's pipelines prepared (mps/host.h).
// bench/bench_overhead.py times it behind the op layer; tests/mps/test_host_record.py checks it
// against the simulator's plans.
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

// One call MetalBackend (module.mm) makes, kept as numbers: formatted as text only when the
// record is read, so that the host time measured around it (bench/bench_overhead.py) is the
// host's, not the formatting's.
struct Call {
  enum class Kind { Pipeline, Tensor, Bytes, Tgmem, Dispatch } kind;
  uint64_t values[6] = {};
  std::string kernel;  // Pipeline
};

std::string format(const Call& call) {
  const uint64_t* v = call.values;
  switch (call.kind) {
    case Call::Kind::Pipeline:
      return "pipeline " + call.kernel;
    case Call::Kind::Tensor:
      return "tensor " + std::to_string(v[0]) + " " + std::to_string(v[1]) + " " +
             std::to_string(v[2]);
    case Call::Kind::Bytes:
      return "bytes " + std::to_string(v[0]) + " " + std::to_string(v[1]);
    case Call::Kind::Tgmem:
      return "tgmem " + std::to_string(v[0]) + " " + std::to_string(v[1]);
    case Call::Kind::Dispatch: {
      std::string line = "dispatch";
      for (int i = 0; i < 6; ++i) line += " " + std::to_string(v[i]);
      return line;
    }
  }
  return "";
}

// A pipeline of the recorder's cache: its key (steel::mps::pipeline_key: the kernel, then its
// constants) in the cache, and what "Metal" reports about it.
struct RecordedPipeline {
  const std::string* key = nullptr;
  PipelineLimits limits;
};

class RecordingBackend {
 public:
  RecordingBackend(const std::vector<RecordedPipeline>& pipelines,
                   const std::vector<at::Tensor>& slots, std::vector<Call>& record)
      : pipelines_(pipelines), slots_(slots), record_(record) {}

  // As MetalBackend: the host's pipelines in plan order, whatever the dispatch says.
  void set_pipeline(const Dispatch&) {
    const std::string& key = *pipelines_.at(next_pipeline_++).key;
    record_.push_back(Call{Call::Kind::Pipeline, {}, key.substr(0, key.find('|'))});
  }

  void set_tensor(uint32_t index, int32_t slot) {
    const at::Tensor& tensor = slots_.at(slot);
    const int64_t offset = tensor.storage_offset() * tensor.element_size();
    record_.push_back(Call{Call::Kind::Tensor,
                           {index, static_cast<uint64_t>(slot), static_cast<uint64_t>(offset)}});
  }

  void set_bytes(uint32_t index, const void*, size_t size) {
    record_.push_back(Call{Call::Kind::Bytes, {index, size}});
  }

  void set_threadgroup_memory(uint32_t index, uint32_t bytes) {
    record_.push_back(Call{Call::Kind::Tgmem, {index, bytes}});
  }

  void dispatch_threadgroups(const uint32_t grid[3], const uint32_t threads[3]) {
    record_.push_back(Call{Call::Kind::Dispatch,
                           {grid[0], grid[1], grid[2], threads[0], threads[1], threads[2]}});
  }

 private:
  const std::vector<RecordedPipeline>& pipelines_;
  const std::vector<at::Tensor>& slots_;
  std::vector<Call>& record_;
  size_t next_pipeline_ = 0;
};

struct State {
  std::mutex mutex;
  std::map<std::string, PipelineLimits> pipelines;  // library.mm's cache, by the same key
  std::vector<Call> record;
  std::vector<const std::string*> used;  // the keys of the last call's pipelines
};

State& state() {
  static State instance;
  return instance;
}

struct RecordingHost {
  using Pipeline = RecordedPipeline;

  void check_tensor(const std::string&, size_t, const at::Tensor&) {}

  Pipeline pipeline(const Dispatch& dispatch) {
    State& s = state();
    const std::string key = steel::mps::pipeline_key(dispatch);
    std::lock_guard<std::mutex> lock(s.mutex);
    auto entry = s.pipelines.emplace(key, PipelineLimits{}).first;  // std::map: stays put
    return RecordedPipeline{&entry->first, entry->second};
  }

  PipelineLimits limits(const Pipeline& pipeline) { return pipeline.limits; }

  uint64_t max_threadgroup_memory() { return steel::mps::kMaxThreadgroupMemory; }

  void encode(const std::string&, const Plan& plan, const std::vector<Pipeline>& pipelines,
              const std::vector<at::Tensor>& slots, const std::vector<bool>& present) {
    std::vector<Call> record;
    RecordingBackend backend(pipelines, slots, record);
    steel::mps::CheckedEncoder<RecordingBackend> encoder(backend, present);
    steel::encode_plan(encoder, plan);
    std::vector<const std::string*> used;
    for (const Pipeline& pipeline : pipelines) used.push_back(pipeline.key);
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.record = std::move(record);
    s.used = std::move(used);
  }
};

// As module.mm's run_op: options read with the GIL, the rest without.
std::vector<at::Tensor> run_op(const std::string& op,
                               const std::vector<std::optional<at::Tensor>>& tensors,
                               const py::dict& options) {
  const std::shared_ptr<const steel::Options> parsed =
      steel::mps::options_memo().get(options, [](steel::Options*) {});
  py::gil_scoped_release no_gil;
  RecordingHost host;
  return steel::mps::run_plan_on(host, op, tensors, *parsed);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch-steel's Metal host path with a recording encoder (tests and benchmarks)";
  m.def("run_op", &run_op, py::arg("op"), py::arg("tensors"), py::arg("options"));
  m.def("last_record", [] {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    std::vector<std::string> lines;
    for (const Call& call : s.record) lines.push_back(format(call));
    return lines;
  });
  m.def("last_pipelines", [] {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    std::vector<std::string> keys;
    for (const std::string* key : s.used) keys.push_back(*key);
    return keys;
  });
  m.def("options_hits", [] { return steel::mps::options_memo().hits(); });
  m.def("parsed_options", [](const py::dict& options) {
    const std::shared_ptr<const steel::Options> parsed =
        steel::mps::options_memo().get(options, [](steel::Options*) {});
    return std::make_pair(parsed->numbers, parsed->strings);
  });
  m.def("prepared_hits", [] {
    return steel::mps::prepared_pipelines<RecordingHost>().hits();
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
