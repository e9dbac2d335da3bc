// torch_steel._C_metal: runs an op's launch plan on PyTorch's MPS stream.
//
// run_op(op, tensors, options) plans the op with steel::make_plan (the planner the simulator also
// runs), builds its pipelines, makes the plan's contiguous copies and allocations as MPS tensors,
// and encodes it with steel::encode_plan on the current MPS stream's compute encoder. It makes no
// launch decision of its own. A refused plan is a c10::Error whose message starts with
// "steel plan refused: ", which torch_steel.metal turns into PlanRefused (and the op layer into
// reference math).
#include <torch/extension.h>

#include <ATen/mps/MPSStream.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "mps/checked_encoder.h"
#include "mps/library.h"
#include "plan/encode.h"
#include "plan/plan.h"

namespace py = pybind11;

namespace steel::mps {
namespace {

constexpr const char* kRefused = "steel plan refused: ";

std::optional<DType> to_dtype(c10::ScalarType type) {
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
    default:
      return std::nullopt;
  }
}

c10::ScalarType to_scalar_type(DType dtype) {
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
  }
  TORCH_CHECK(false, "torch-steel: unknown plan dtype ", static_cast<int>(dtype));
}

TensorDesc describe(const at::Tensor& tensor, size_t position, const std::string& op) {
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
Options to_options(const py::dict& options) {
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

// Plans the op within the limits of its pipelines (steel::mps::plan_within_limits, which
// tests/mps runs with made-up limits) and leaves the final plan's pipelines in `pipelines`.
Plan plan_with_pipelines(const std::string& op, const TensorList& descs, const Options& options,
                         std::vector<id<MTLComputePipelineState>>& pipelines) {
  Plan plan;
  pipelines.clear();
  try {
    plan = plan_within_limits(op, descs, options, max_threadgroup_memory(),
                              [&pipelines](const Dispatch& dispatch, size_t index) {
                                if (index == 0) pipelines.clear();  // a new attempt
                                id<MTLComputePipelineState> state = pipeline(dispatch);
                                pipelines.push_back(state);
                                PipelineLimits limits;
                                limits.max_threads = [state maxTotalThreadsPerThreadgroup];
                                limits.static_threadgroup_memory =
                                    [state staticThreadgroupMemoryLength];
                                return limits;
                              });
  } catch (const InvalidPlan& e) {
    // Metal would reject or misread the plan (a planner bug, not a refusal): stopped before any
    // pipeline is specialized with its constants or anything is encoded.
    TORCH_CHECK(false, "torch-steel: invalid launch plan for ", op, ": ", e.what());
  }
  TORCH_CHECK(plan.ok, kRefused, plan.reason);
  return plan;
}

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

// run_op's work once its Python arguments are C++ values. Runs without the GIL: nothing here or
// in what it calls may touch a Python object (tests/mps/test_objc_check.py holds it to that).
std::vector<at::Tensor> run_plan(const std::string& op,
                                 const std::vector<std::optional<at::Tensor>>& tensors,
                                 const Options& options) {
  TensorList descs;
  std::optional<at::Device> device;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].has_value() || !tensors[i]->defined()) {
      descs.emplace_back(std::nullopt);
      continue;
    }
    const at::Tensor& tensor = *tensors[i];
    TORCH_CHECK(tensor.device().is_mps(), "torch-steel: ", op, " tensor ", i, " is on ",
                tensor.device(), "; the Metal path takes MPS tensors");
    TORCH_CHECK(!device.has_value() || *device == tensor.device(), "torch-steel: ", op,
                " tensors are on different devices (", *device, " and ", tensor.device(), ")");
    device = tensor.device();
    descs.emplace_back(describe(tensor, i, op));
  }
  TORCH_CHECK(device.has_value(), "torch-steel: ", op, " got no tensor");

  std::vector<id<MTLComputePipelineState>> pipelines;
  const Plan plan = plan_with_pipelines(op, descs, options, pipelines);
  const std::vector<bool> present = slots_present(descs, plan);  // the plan was validated with it

  // Slots: the inputs (contiguous copies where the plan asks), then the plan's allocations.
  // Copies and scratch die when run_op returns, before the GPU has run: as for the temporaries
  // of PyTorch's own MPS ops, that is safe. The caching allocator hands a freed buffer only to
  // later work, which runs after ours on the same stream, and releases a buffer to Metal only
  // when no command buffer retains it (PyTorch's command buffers retain what they use).
  std::vector<at::Tensor> slots;
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

  if (!plan.dispatches.empty()) encode_on_stream(op, plan, pipelines, slots, present);
  return outputs;
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
  Options parsed = to_options(options);
  py::gil_scoped_release no_gil;
  describe_device(&parsed);  // which kernel family the plan may choose (plan/device.h)
  return run_plan(op, tensors, parsed);
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
