#include "device.h"

#include <algorithm>

namespace steel {

DeviceDesc device_desc(const Options& options) {
  DeviceDesc d;
  d.apple_family = static_cast<int>(options.number(kDeviceAppleFamily, 0));
  d.metal4 = options.number(kDeviceMetal4, 0) != 0;
  d.tensor_ops_library = options.number(kDeviceTensorOps, 0) != 0;
  d.gpu_cores = std::max<int64_t>(0, static_cast<int64_t>(options.number(kDeviceGpuCores, 0)));
  d.dram_bytes_per_core_cycle = std::max(0.0, options.number(kDeviceDramBytes, 0));
  return d;
}

bool use_neural_accelerators(const DeviceDesc& device) {
  return device.metal4 && device.tensor_ops_library &&
         device.apple_family >= kFirstNeuralAcceleratorFamily;
}

}  // namespace steel
