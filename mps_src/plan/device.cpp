#include "device.h"

namespace steel {

DeviceDesc device_desc(const Options& options) {
  DeviceDesc d;
  d.apple_family = static_cast<int>(options.number(kDeviceAppleFamily, 0));
  d.metal4 = options.number(kDeviceMetal4, 0) != 0;
  d.tensor_ops_library = options.number(kDeviceTensorOps, 0) != 0;
  return d;
}

bool use_neural_accelerators(const DeviceDesc& device) {
  return device.metal4 && device.tensor_ops_library &&
         device.apple_family >= kFirstNeuralAcceleratorFamily;
}

}  // namespace steel
