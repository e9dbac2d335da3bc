// The shaders' Metal library and the pipeline cache (see library.h).
#include "mps/library.h"

#include <ATen/mps/MPSDevice.h>
#include <CoreFoundation/CoreFoundation.h>
#include <IOKit/IOKitLib.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <map>
#include <mutex>

#include "mps/checked_encoder.h"
#include "plan/device.h"

namespace steel::mps {
namespace {

struct State {
  std::mutex mutex;
  std::vector<id<MTLLibrary>> libraries;
  std::vector<id<MTLLibrary>> tensor_libraries;  // the MSL 4 tensor-op kernels, when loaded
  std::atomic<bool> tensor_ops_loaded{false};     // !tensor_libraries.empty(), read unlocked
  bool tensor_ops_tried = false;
  std::map<std::string, id<MTLComputePipelineState>> pipelines;
};

// Never destroyed: pipelines may still be in use by command buffers at interpreter exit.
State& state() {
  static State* instance = new State();
  return *instance;
}

id<MTLDevice> device() { return at::mps::MPSDevice::getInstance()->device(); }

// MTLGPUFamilyMetal4 and MTLGPUFamilyApple7..10 by value: the Metal 4 and Apple10 enumerators
// exist only in macOS 26 SDKs, and the host builds with older ones too. An OS that does not
// know a family answers NO for it.
constexpr NSInteger kGPUFamilyMetal4 = 5002;
constexpr NSInteger kGPUFamilyApple1 = 1000;  // MTLGPUFamilyAppleN = 1000 + N
constexpr int kNewestAppleFamily = 10;

bool supports_metal4() { return [device() supportsFamily:(MTLGPUFamily)kGPUFamilyMetal4]; }

int apple_family() {
  for (int n = kNewestAppleFamily; n >= 1; --n) {
    if ([device() supportsFamily:(MTLGPUFamily)(kGPUFamilyApple1 + n)]) return n;
  }
  return 0;
}

// The GPU's core count, or 0 where the IORegistry does not say. Metal has no API for it; Apple's
// GPU driver service, AGXAccelerator, publishes it as the property "gpu-core-count" (what
// PyTorch's MPSDevice::getCoreCount reads too, asserting where the service is missing: here a
// missing service or property is no error, and the plans assume their default, device.h). Read
// once: the process keeps its GPU.
int64_t gpu_core_count() {
  static const int64_t count = [] {
    int64_t found = 0;
    CFMutableDictionaryRef matching = IOServiceMatching("AGXAccelerator");
    io_iterator_t iterator = IO_OBJECT_NULL;
    // The look-up consumes `matching`, whatever it returns.
    if (matching == nullptr ||
        IOServiceGetMatchingServices(kIOMainPortDefault, matching, &iterator) != KERN_SUCCESS) {
      return found;
    }
    io_registry_entry_t entry = IO_OBJECT_NULL;
    while (found == 0 && (entry = IOIteratorNext(iterator)) != IO_OBJECT_NULL) {
      CFTypeRef property = IORegistryEntryCreateCFProperty(entry, CFSTR("gpu-core-count"),
                                                           kCFAllocatorDefault, 0);
      if (property != nullptr) {
        int64_t value = 0;
        if (CFGetTypeID(property) == CFNumberGetTypeID() &&
            CFNumberGetValue(static_cast<CFNumberRef>(property), kCFNumberSInt64Type, &value) &&
            value > 0) {
          found = value;
        }
        CFRelease(property);
      }
      IOObjectRelease(entry);
    }
    IOObjectRelease(iterator);
    return found;
  }();
  return count;
}

NSString* to_ns(const std::string& text) { return [NSString stringWithUTF8String:text.c_str()]; }

std::string describe(NSError* error) {
  if (error == nil) return "no error description";
  const char* text = [[error localizedDescription] UTF8String];
  return text != nullptr ? text : "no error description";
}

// Metal reads each constant as its shader type: bool is one byte, int/uint/float four.
MTLFunctionConstantValues* constant_values(const Dispatch& dispatch) {
  MTLFunctionConstantValues* values = [[MTLFunctionConstantValues alloc] init];
  for (const FunctionConstant& constant : dispatch.constants) {
    switch (constant.type) {
      case FunctionConstant::Type::Bool: {
        bool value = constant.int_value != 0;
        [values setConstantValue:&value type:MTLDataTypeBool atIndex:constant.index];
        break;
      }
      case FunctionConstant::Type::Int: {
        int32_t value = static_cast<int32_t>(constant.int_value);
        [values setConstantValue:&value type:MTLDataTypeInt atIndex:constant.index];
        break;
      }
      case FunctionConstant::Type::UInt: {
        uint32_t value = static_cast<uint32_t>(constant.int_value);
        [values setConstantValue:&value type:MTLDataTypeUInt atIndex:constant.index];
        break;
      }
      case FunctionConstant::Type::Float: {
        float value = constant.float_value;
        [values setConstantValue:&value type:MTLDataTypeFloat atIndex:constant.index];
        break;
      }
    }
  }
  return values;
}

id<MTLLibrary> library_at(const std::string& path, NSError** error) {
  return [device() newLibraryWithURL:[NSURL fileURLWithPath:to_ns(path)] error:error];
}

// The flags setup.py passes to `xcrun metal`: no fast math, so that the GPU computes what the
// simulator verified (build_macos.py says why). fastMathEnabled is deprecated from macOS 15 for
// mathMode, which macOS 14 lacks.
MTLCompileOptions* compile_options(MTLLanguageVersion version) {
  MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
  options.languageVersion = version;
  options.fastMathEnabled = NO;
  return options;
}

}  // namespace

void load_metallib(const std::string& path) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.libraries.empty()) return;
  std::string error;
  @autoreleasepool {
    NSError* ns_error = nil;
    id<MTLLibrary> library = library_at(path, &ns_error);
    if (library != nil) {
      s.libraries.push_back(library);
    } else {
      error = describe(ns_error);
    }
  }
  TORCH_CHECK(error.empty(), "torch-steel: cannot load the Metal library ", path, ": ", error);
}

void compile_sources(const std::vector<std::string>& sources) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.libraries.empty()) return;
  std::vector<id<MTLLibrary>> libraries;
  std::string error;
  @autoreleasepool {
    // bfloat needs Metal 3.1 (macOS 14).
    MTLCompileOptions* options = compile_options(MTLLanguageVersion3_1);
    for (size_t i = 0; i < sources.size() && error.empty(); ++i) {
      NSError* ns_error = nil;
      id<MTLLibrary> library = [device() newLibraryWithSource:to_ns(sources[i])
                                                      options:options
                                                        error:&ns_error];
      if (library != nil) {
        libraries.push_back(library);
      } else {
        error = "shader source " + std::to_string(i) + ": " + describe(ns_error);
      }
    }
  }
  TORCH_CHECK(error.empty(), "torch-steel: the Metal runtime compiler rejected ", error);
  s.libraries = std::move(libraries);
}

bool load_tensor_ops_metallib(const std::string& path) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.tensor_ops_tried) return !s.tensor_libraries.empty();
  s.tensor_ops_tried = true;
  if (!supports_metal4()) return false;
  @autoreleasepool {
    NSError* ns_error = nil;
    id<MTLLibrary> library = library_at(path, &ns_error);
    if (library != nil) s.tensor_libraries.push_back(library);
  }
  s.tensor_ops_loaded = !s.tensor_libraries.empty();
  return !s.tensor_libraries.empty();
}

bool compile_tensor_ops_sources(const std::vector<std::string>& sources) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.tensor_ops_tried) return !s.tensor_libraries.empty();
  s.tensor_ops_tried = true;
  if (!supports_metal4() || sources.empty()) return false;
  std::vector<id<MTLLibrary>> libraries;
  @autoreleasepool {
    // MTLLanguageVersion4_0 by value ((4 << 16) + 0), an enumerator of macOS 26 SDKs only; the
    // OS compiler refuses it where it has no MSL 4, and then the kernels are simply absent.
    MTLCompileOptions* options = compile_options((MTLLanguageVersion)(4 << 16));
    for (const std::string& source : sources) {
      NSError* ns_error = nil;
      id<MTLLibrary> library = [device() newLibraryWithSource:to_ns(source)
                                                      options:options
                                                        error:&ns_error];
      if (library == nil) return false;  // all or nothing: a plan may name any of them
      libraries.push_back(library);
    }
  }
  s.tensor_libraries = std::move(libraries);
  s.tensor_ops_loaded = true;
  return true;
}

// Without the state's lock: run_op calls it with the GIL held (OptionsMemo), and pipeline()
// holds the lock while it compiles.
void describe_device(Options* options) {
  const bool loaded = state().tensor_ops_loaded;
  options->numbers.emplace(kDeviceAppleFamily, apple_family());
  options->numbers.emplace(kDeviceMetal4, supports_metal4() ? 1.0 : 0.0);
  options->numbers.emplace(kDeviceTensorOps, loaded ? 1.0 : 0.0);
  const int64_t cores = gpu_core_count();
  if (cores > 0) options->numbers.emplace(kDeviceGpuCores, static_cast<double>(cores));
  // The plans know the DRAM rate of the timing model's chips by this name ("Apple M1 Max"),
  // copied into the options inside the pool that releases the string (run_op's thread has no
  // pool of its own that drains).
  @autoreleasepool {
    const char* name = [[device() name] UTF8String];
    if (name != nullptr) options->strings.emplace(kDeviceName, std::string(name));
  }
}

id<MTLComputePipelineState> pipeline(const Dispatch& dispatch) {
  State& s = state();
  const std::string key = pipeline_key(dispatch);
  std::lock_guard<std::mutex> lock(s.mutex);
  auto found = s.pipelines.find(key);
  if (found != s.pipelines.end()) return found->second;
  TORCH_CHECK(!s.libraries.empty(), "torch-steel: the Metal library is not loaded");

  id<MTLComputePipelineState> result = nil;
  std::string error;
  @autoreleasepool {
    NSString* name = to_ns(dispatch.kernel);
    MTLFunctionConstantValues* values = constant_values(dispatch);
    id<MTLFunction> function = nil;
    NSError* ns_error = nil;
    std::vector<id<MTLLibrary>> all = s.libraries;
    all.insert(all.end(), s.tensor_libraries.begin(), s.tensor_libraries.end());
    for (id<MTLLibrary> library : all) {
      if (![[library functionNames] containsObject:name]) continue;
      function = [library newFunctionWithName:name constantValues:values error:&ns_error];
      if (function == nil) error = "specializing it failed: " + describe(ns_error);
      break;
    }
    if (function != nil) {
      result = [device() newComputePipelineStateWithFunction:function error:&ns_error];
      if (result == nil) error = "building its pipeline failed: " + describe(ns_error);
    } else if (error.empty()) {
      error = "no such kernel in the library (the metallib is older than the plans?)";
    }
  }
  TORCH_CHECK(result != nil, "torch-steel: Metal kernel ", dispatch.kernel, ": ", error);
  s.pipelines.emplace(key, result);
  return result;
}

uint64_t max_threadgroup_memory() { return [device() maxThreadgroupMemoryLength]; }

}  // namespace steel::mps
