// The shaders' Metal library (loaded once per process) and the compute pipelines built from it.
//
// Objective-C++ only (compiled with -fobjc-arc: the ids below are strong references).
#pragma once

#include <Metal/Metal.h>

#include <string>
#include <vector>

#include "plan/plan.h"

namespace steel::mps {

// Loads the metallib that setup.py compiled with Xcode's Metal toolchain. The first successful
// load (of either kind) wins; later calls do nothing.
void load_metallib(const std::string& path);

// Compiles shader sources with the Metal runtime compiler instead, one library per source (each
// shader is its own translation unit, as in the metallib). For installs without Xcode; slow.
void compile_sources(const std::vector<std::string>& sources);

// The MSL 4 tensor-op kernels (shaders/**/*_msl4.metal, mpp::tensor_ops::matmul2d): a library
// of their own, built with -std=metal4.0 against a macOS 26.2+ SDK, loaded next to the main one
// only where the device reports Metal 4 (supportsFamily, which an older OS answers NO for).
// Both return whether the kernels are now available and never throw: without them the plans
// keep to the simdgroup kernels (device_description says so).
bool load_tensor_ops_metallib(const std::string& path);
bool compile_tensor_ops_sources(const std::vector<std::string>& sources);

// The device description of mps_src/plan/device.h, added to `options` (where the caller did
// not set it): the GPU's Apple family, Metal 4 support, whether the tensor-op kernels are
// loaded, its core count where the IORegistry gives one, and its name (MTLDevice.name).
void describe_device(Options* options);

// The pipeline of dispatch.kernel specialized with dispatch.constants, built on first use and
// cached for the process. Throws c10::Error when the kernel is missing or does not compile.
id<MTLComputePipelineState> pipeline(const Dispatch& dispatch);

// The device's threadgroup memory limit, for checking plans against a pipeline's static use.
uint64_t max_threadgroup_memory();

}  // namespace steel::mps
