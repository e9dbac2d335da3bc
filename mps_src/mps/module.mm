// torch_steel._C_metal: runs an op's launch plan on PyTorch's MPS stream.
//
// run_op(op, tensors, options) runs mps/host.h's run_plan_on: the op's plan from the plan cache
// (the planners the simulator also runs), its pipelines, the plan's contiguous copies and
// allocations as MPS tensors; then this file encodes it with steel::encode_plan on the current
// MPS stream's compute encoder. It makes no launch decision of its own. A refused plan is a c10::Error whose message starts with
// "steel plan refused: ", which torch_steel.metal turns into PlanRefused (and the op layer into
// reference math).
#include <torch/extension.h>

#include <ATen/mps/MPSStream.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "mps/checked_encoder.h"
#include "mps/host.h"
#include "mps/library.h"
#include "plan/encode.h"
#include "plan/plan.h"

namespace py = pybind11;

namespace steel::mps {
namespace {

// The Metal calls behind CheckedEncoder: one per call of steel::encode_plan, nothing else.
class MetalBackend {
 public:
  MetalBackend(id<MTLComputeCommandEncoder> encoder,
               const std::vector<id<MTLComputePipelineState>>& pipelines,
               const std::vector<at::Tensor>& slots)
      : encoder_(encoder), pipelines_(pipelines), slots_(slots) {}

  // Dispatches arrive in plan order, which is the order of `pipelines`.
  void set_pipeline(const Dispatch&) {
    [encoder_ setComputePipelineState:pipelines_.at(next_pipeline_++)];
  }

  // As PyTorch's own kernels bind tensors: the storage's MTLBuffer at the tensor's byte offset.
  void set_tensor(uint32_t index, int32_t slot) {
    const at::Tensor& tensor = slots_.at(slot);
    id<MTLBuffer> buffer = (__bridge id<MTLBuffer>)(tensor.storage().data());
    [encoder_ setBuffer:buffer
                 offset:tensor.storage_offset() * tensor.element_size()
                atIndex:index];
  }

  void set_bytes(uint32_t index, const void* data, size_t size) {
    [encoder_ setBytes:data length:size atIndex:index];
  }

  void set_threadgroup_memory(uint32_t index, uint32_t bytes) {
    [encoder_ setThreadgroupMemoryLength:bytes atIndex:index];
  }

  void dispatch_threadgroups(const uint32_t grid[3], const uint32_t threads[3]) {
    [encoder_ dispatchThreadgroups:MTLSizeMake(grid[0], grid[1], grid[2])
             threadsPerThreadgroup:MTLSizeMake(threads[0], threads[1], threads[2])];
  }

 private:
  id<MTLComputeCommandEncoder> encoder_;
  const std::vector<id<MTLComputePipelineState>>& pipelines_;
  const std::vector<at::Tensor>& slots_;
  size_t next_pipeline_ = 0;
};

// Encodes on the current MPS stream. Nothing may unwind out of a block running on the stream's
// dispatch queue, so errors are carried out as a string and raised on the caller's thread
// (PyTorch's dispatch_sync_with_rethrow does the same but is not exported to extensions;
// tests/mps/test_objc_check.py holds every dispatch block to this).
//
// No commit, as PyTorch's own Metal kernels: the dispatches join the stream's current command
// buffer and shared compute encoder, and the stream commits when something synchronizes (a copy
// to the CPU, torch.mps.synchronize) or adaptively. Encoders on one queue run in order and the
// compute encoder dispatches serially with hazard tracking, so a split-K reduction sees the
// partials of the dispatch before it and later work sees our outputs.
void encode_on_stream(const std::string& op, const Plan& plan,
                      const std::vector<id<MTLComputePipelineState>>& pipelines,
                      const std::vector<at::Tensor>& slots, const std::vector<bool>& present) {
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  TORCH_CHECK(stream != nullptr, "torch-steel: no current MPS stream");
  const Plan* plan_ptr = &plan;
  const std::vector<id<MTLComputePipelineState>>* pipelines_ptr = &pipelines;
  const std::vector<at::Tensor>* slots_ptr = &slots;
  const std::vector<bool>* present_ptr = &present;
  __block std::string error;
  dispatch_sync(stream->queue(), ^{
    @autoreleasepool {
      try {
        // nil (no command buffer, a device lost) would make every message below a no-op and
        // the op return uninitialised outputs: an error instead, as in PyTorch's own kernels.
        id<MTLComputeCommandEncoder> compute = stream->commandEncoder();
        if (compute == nil) {
          error = "the MPS stream gave no compute command encoder";
        } else {
          MetalBackend backend(compute, *pipelines_ptr, *slots_ptr);
          CheckedEncoder<MetalBackend> encoder(backend, *present_ptr);
          encode_plan(encoder, *plan_ptr);
        }
      } catch (const std::exception& e) {
        error = e.what();
      } catch (...) {
        error = "unknown C++ exception";
      }
    }
  });
  TORCH_CHECK(error.empty(), "torch-steel: encoding ", op, " on the MPS stream failed: ", error);
}

// The Metal side of run_plan_on (mps/host.h): pipelines from the library, encoding on the stream.
struct MetalHost {
  using Pipeline = id<MTLComputePipelineState>;

  void check_tensor(const std::string& op, size_t position, const at::Tensor& tensor) {
    TORCH_CHECK(tensor.device().is_mps(), "torch-steel: ", op, " tensor ", position, " is on ",
                tensor.device(), "; the Metal path takes MPS tensors");
  }

  Pipeline pipeline(const Dispatch& dispatch) { return steel::mps::pipeline(dispatch); }

  PipelineLimits limits(Pipeline state) {
    PipelineLimits limits;
    limits.max_threads = [state maxTotalThreadsPerThreadgroup];
    limits.static_threadgroup_memory = [state staticThreadgroupMemoryLength];
    return limits;
  }

  uint64_t max_threadgroup_memory() { return steel::mps::max_threadgroup_memory(); }

  void encode(const std::string& op, const Plan& plan, const std::vector<Pipeline>& pipelines,
              const std::vector<at::Tensor>& slots, const std::vector<bool>& present) {
    encode_on_stream(op, plan, pipelines, slots, present);
  }
};

// run_op's work once its Python arguments are C++ values. Runs without the GIL: nothing here or
// in what it calls may touch a Python object (tests/mps/test_objc_check.py holds it to that).
std::vector<at::Tensor> run_plan(const std::string& op,
                                 const std::vector<std::optional<at::Tensor>>& tensors,
                                 const Options& options) {
  MetalHost host;
  return run_plan_on(host, op, tensors, options);
}

// The extension's entry point. The options dict is read with the GIL held; then the GIL is
// released, as PyTorch's own bindings do around an op (pybind11::gil_scoped_release), for
// pipeline compilation (first use of a kernel: up to seconds) and dispatch_sync onto the MPS
// stream's queue, which another thread may be holding while it waits for the GIL. pybind11
// converted the tensors to at::Tensor before this runs and converts the outputs after the
// release ends (also when an error unwinds through it).
std::vector<at::Tensor> run_op(const std::string& op,
                               const std::vector<std::optional<at::Tensor>>& tensors,
                               const py::dict& options) {
  // With the device's facts: which kernel family the plan may choose (plan/device.h). They are
  // fixed once the library is loaded, which torch_steel.metal does before its first run_op, so
  // that a memoized entry keeps them.
  const std::shared_ptr<const Options> parsed = options_memo().get(options, describe_device);
  py::gil_scoped_release no_gil;
  return run_plan(op, tensors, *parsed);
}

}  // namespace
}  // namespace steel::mps

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch-steel's Metal host: launch plans encoded on PyTorch's MPS stream";
  m.def("run_op", &steel::mps::run_op, py::arg("op"), py::arg("tensors"), py::arg("options"),
        "Plans `op` and encodes it on the current MPS stream; returns the output tensors.");
  m.def("load_metallib", &steel::mps::load_metallib, py::arg("path"),
        py::call_guard<py::gil_scoped_release>(), "Loads the precompiled shader library.");
  m.def("compile_sources", &steel::mps::compile_sources, py::arg("sources"),
        py::call_guard<py::gil_scoped_release>(),
        "Compiles shader sources with the Metal runtime compiler (no metallib installed).");
  m.def("load_tensor_ops_metallib", &steel::mps::load_tensor_ops_metallib, py::arg("path"),
        py::call_guard<py::gil_scoped_release>(),
        "Loads the MSL 4 tensor-op library where the device has Metal 4; returns whether it did.");
  m.def("compile_tensor_ops_sources", &steel::mps::compile_tensor_ops_sources,
        py::arg("sources"), py::call_guard<py::gil_scoped_release>(),
        "Compiles the MSL 4 tensor-op sources where the device has Metal 4; returns whether it "
        "did.");
}
