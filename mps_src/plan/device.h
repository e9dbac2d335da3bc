// What a plan may know about the GPU: a device description passed in the op's options by the
// Metal host (mps_src/mps/module.mm fills it from the MTLDevice), or by tests and the
// simulator, which describe made-up devices. Absent options describe a device without Metal 4
// matrix units, so every plan made without a description (the simulator's default) keeps the
// simdgroup-matrix kernels.
#pragma once

#include <string>
#include <vector>

#include "plan.h"

namespace steel {

// Option names of the description.
constexpr const char* kDeviceAppleFamily = "device_apple_family";  // N of MTLGPUFamilyAppleN
constexpr const char* kDeviceMetal4 = "device_metal4";  // supportsFamily(MTLGPUFamilyMetal4)
// The MSL 4 tensor-op library (steel_tensor_ops.metallib, or its source compiled at run time)
// is loaded: built with a macOS 26.2+ SDK and loadable by this OS.
constexpr const char* kDeviceTensorOps = "device_tensor_ops";
// The GPU's core count (the IORegistry's gpu-core-count on the Mac; a chip's gpu_cores in
// torch_steel/sim/chips.json for sim.predict). Absent or 0: unknown, and the planners that size
// a grid by it assume their default (attention_plan.h, kDecodeDefaultCores).
constexpr const char* kDeviceGpuCores = "gpu_cores";
// The GPU's name as Metal reports it (MTLDevice.name, "Apple M1 Max"; sim.predict gives
// "Apple " and the chip's name in torch_steel/sim/chips.json). Metal reports no bandwidth: the
// plans take the DRAM rate of the chips the timing model describes by this name
// (chip_dram_bytes_per_core_cycle), and assume their default for others (attention_plan.h,
// kDecodeDramBytes).
constexpr const char* kDeviceName = "device_name";

// M5-generation GPUs are the Apple10 family: their per-core matrix units ("neural
// accelerators") are what mpp::tensor_ops::matmul2d reaches. Earlier GPUs run matmul2d too,
// but through the same simdgroup hardware the steel kernels already use.
constexpr int kFirstNeuralAcceleratorFamily = 10;

struct DeviceDesc {
  int apple_family = 0;  // 0: unknown
  bool metal4 = false;
  bool tensor_ops_library = false;
  int64_t gpu_cores = 0;  // 0: unknown
  std::string name;
  double dram_bytes_per_core_cycle = 0.0;  // of the named chip (chip_dram_bytes_per_core_cycle)
};

DeviceDesc device_desc(const Options& options);

// The DRAM bandwidth in bytes a core-cycle (bytes a second over cores and clock) of the GPU that
// Metal names `name`, for the chips of the timing model's table (torch_steel/sim/chips.json:
// 6.25 on M3 Max to 9.7 on M5), else 0. A binned variant is taken at its full chip's rate:
// right where its bandwidth falls with its cores (M3 Max with 30 cores, 300 GB/s), nearly so on
// M4 Max (32 cores, 410 GB/s: 8.7 against 9.3), and an understatement where the bandwidth stays
// (M1 Max with 24 cores keeps 400 GB/s: 12.9 against 9.6), which makes a split's merge look
// cheaper against the DRAM floor than it is.
double chip_dram_bytes_per_core_cycle(const std::string& name);
// The names that table knows, in its order (for its test against chips.json).
std::vector<std::string> chip_dram_names();

// Whether matmul2d kernels should replace the simdgroup ones: Metal 4, an Apple10 (M5) GPU,
// and the tensor-op library present.
bool use_neural_accelerators(const DeviceDesc& device);

}  // namespace steel
