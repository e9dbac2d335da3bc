// One of two files defining a helper of the same name (tests/sim/test_runtime_build.py): Metal
// compiles each file on its own, so each kernel calls its own file's helper.
#include <metal_stdlib>
using namespace metal;

inline __attribute__((noinline)) float lang_file_helper(float x) { return x + 1.0f; }

template <typename T>
__attribute__((noinline)) T lang_file_template(T x) {
  return x + 1.0f;
}

kernel void lang_file_a(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = lang_file_helper(float(i)) + 100.0f * lang_file_template(1.0f);
}
