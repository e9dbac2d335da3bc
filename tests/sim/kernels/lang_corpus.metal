// Constructs of other projects' production Metal (MLX, llama.cpp) that Apple's compiler accepts
// (issue 26, deliverable 3; tests/sim/test_accepted.py). Each kernel is the smallest use of one.
#include <metal_stdlib>
using namespace metal;

// A function no kernel calls may pass a float to a bitwise simd builtin (MLX's bfloat16
// simd_and/or/xor overloads do): it compiles; running such a call is an error.
inline float float_xor(float x) { return __metal_simd_xor(x); }

kernel void simd_xor_builtin(device uint* out [[buffer(0)]], device float* f [[buffer(1)]],
                             constant uint& run_float [[buffer(2)]],
                             uint i [[thread_position_in_grid]]) {
  out[i] = __metal_simd_xor(uint(1) << i);
  if (run_float) f[i] = float_xor(f[i]);
}

// A vector element passed by value to a function (MLX's `epilogue_op.apply(accum[k], ...)`).
inline float twice(float x) { return 2 * x; }

kernel void vector_element_argument(device float* out [[buffer(0)]],
                                    uint i [[thread_position_in_grid]]) {
  float2 acc = float2(i, i + 0.5);
  for (int k = 0; k < 2; ++k) acc[k] = twice(acc[k]);
  out[2 * i] = acc[0];
  out[2 * i + 1] = acc[1];
}

// `return f(...);` of a void function, in a kernel whose attribute has arguments (MLX's
// `[[kernel, max_total_threads_per_threadgroup(...)]]` GEMM returns mma_op.store_result()).
inline void store_thrice(device float* out, uint i) { out[i] = 3 * i; }

[[kernel, max_total_threads_per_threadgroup(64)]] void void_return(
    device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  if (i % 2 == 0) return store_thrice(out, i);
  out[i] = -1;
}

// A function pointer as a template parameter, a constant of each instance (llama.cpp's
// dequantizers `void (*deq_k)(device const T*, short, thread U&)`).
inline void doubled(device const float* x, short j, thread float& y) { y = 2 * x[j]; }
inline void negated(device const float* x, short j, thread float& y) { y = -x[j]; }

template <void (*load)(device const float*, short, thread float&)>
inline float load_with(device const float* x, short j) {
  float y;
  load(x, j, y);
  return y;
}

kernel void template_function_pointer(device const float* x [[buffer(0)]],
                                      device float* out [[buffer(1)]],
                                      uint i [[thread_position_in_grid]]) {
  out[i] = i % 2 ? load_with<negated>(x, i) : load_with<doubled>(x, i);
}

// Buffer parameters without [[buffer(n)]]: Metal assigns each the first free index (llama.cpp
// binds all of its kernels' buffers so): scale 0, x 1, y 3 (named), z 2.
kernel void implicit_buffer_indices(constant float& scale, device const float* x,
                                    device float* y [[buffer(3)]], device float* z,
                                    uint i [[thread_position_in_grid]]) {
  y[i] = scale * x[i];
  z[i] = x[i] + 1;
}

// An instantiation naming the kernel's type through a typedef (llama.cpp's form).
template <typename T>
kernel void typed_instance(device T* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = T(i) + T(0.5);
}
typedef decltype(typed_instance<float>) typed_instance_t;
template [[host_name("typed_instance_float")]] kernel typed_instance_t typed_instance<float>;

// Matrix types: a half4x4 from device memory converted to float4x4, staged through threadgroup
// memory, indexed by column and row, and multiplied by a vector and by a scalar.
kernel void matrix_types(device const half4x4* src [[buffer(0)]],
                         device float4x4* dst [[buffer(1)]], device float4* prod [[buffer(2)]],
                         uint i [[thread_index_in_threadgroup]]) {
  threadgroup half4x4 staged[2];
  if (i < 2) staged[i] = src[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (i < 2) {
    float4x4 m = (float4x4)(staged[i]);
    m[1][2] += 1;
    dst[i] = m * 2.0f;
    prod[i] = m * float4(1, 2, 3, 4);
  }
}

// An 8-byte struct declared 2-byte aligned, copied from a 2-byte-aligned device address (MLX's
// BlockLoader ReadVector, `struct alignas(alignment * sizeof(T))`): legal, the type's alignment
// is 2; reading a half4 (8-byte aligned) from the same address is not.
struct alignas(2) four_halves {
  uchar bytes[8];
};

kernel void underaligned_struct_copy(device const half* src [[buffer(0)]],
                                     device half4* out [[buffer(1)]],
                                     constant uint& as_vector [[buffer(2)]],
                                     uint i [[thread_index_in_threadgroup]]) {
  threadgroup half staged[32];
  device const half* p = src + 1 + 4 * i;  // 2 bytes past an 8-byte boundary
  if (as_vector) {
    out[i] = *(device const half4*)p;
    return;
  }
  *((threadgroup four_halves*)(&staged[4 * i])) = *((device const four_halves*)p);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = half4(staged[4 * i], staged[4 * i + 1], staged[4 * i + 2], staged[4 * i + 3]);
}
