#include "device.h"

#include <algorithm>

namespace steel {

namespace {

// The DRAM figures of the timing model's chips: the values (not the sources) of
// torch_steel/sim/chips.json, where each figure's source is recorded;
// tests/plan/test_device.py holds the two equal.
struct ChipDram {
  const char* name;  // MTLDevice.name
  double bytes_per_s;
  int64_t cores;
  double clock_ghz;
};

constexpr ChipDram kChipDram[] = {
    {"Apple M1", 68.25e9, 8, 1.278},      {"Apple M1 Max", 400e9, 32, 1.296},
    {"Apple M2", 100e9, 10, 1.398},       {"Apple M3 Max", 400e9, 40, 1.6},
    {"Apple M3 Ultra", 819e9, 80, 1.6},   {"Apple M4", 120e9, 10, 1.47},
    {"Apple M4 Pro", 273e9, 20, 1.47},    {"Apple M4 Max", 546e9, 40, 1.47},
    {"Apple M5", 153e9, 10, 1.578},       {"Apple M5 Pro", 307e9, 20, 1.578},
    {"Apple M5 Max", 614e9, 40, 1.578},
};

}  // namespace

std::vector<std::string> chip_dram_names() {
  std::vector<std::string> names;
  for (const ChipDram& chip : kChipDram) names.emplace_back(chip.name);
  return names;
}

double chip_dram_bytes_per_core_cycle(const std::string& name) {
  for (const ChipDram& chip : kChipDram) {
    if (name == chip.name) return chip.bytes_per_s / (chip.cores * chip.clock_ghz * 1e9);
  }
  return 0.0;
}

DeviceDesc device_desc(const Options& options) {
  DeviceDesc d;
  d.apple_family = static_cast<int>(options.number(kDeviceAppleFamily, 0));
  d.metal4 = options.number(kDeviceMetal4, 0) != 0;
  d.tensor_ops_library = options.number(kDeviceTensorOps, 0) != 0;
  d.gpu_cores = std::max<int64_t>(0, static_cast<int64_t>(options.number(kDeviceGpuCores, 0)));
  d.name = options.string(kDeviceName, "");
  d.dram_bytes_per_core_cycle = chip_dram_bytes_per_core_cycle(d.name);
  return d;
}

bool use_neural_accelerators(const DeviceDesc& device) {
  return device.metal4 && device.tensor_ops_library &&
         device.apple_family >= kFirstNeuralAcceleratorFamily;
}

}  // namespace steel
