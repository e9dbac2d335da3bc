// Test-only kernel for tests/sim/test_translate_kernels.py: struct assignment between device
// and threadgroup memory, which MSL allows and C++ expresses only from C++23 on (explicit object
// parameters; see STEEL_SIM_AS_COPY in mps_src/sim/shim/steel_shim/construct.h).
#include <metal_stdlib>

using namespace metal;

struct alignas(16) Chunk {
  half v[8];
};

kernel void lang_struct_copy(const device Chunk* in [[buffer(0)]], device Chunk* out [[buffer(1)]],
                             uint t [[thread_index_in_threadgroup]]) {
  threadgroup Chunk staged[32];
  staged[t] = in[t];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[t] = staged[31 - t];
}
