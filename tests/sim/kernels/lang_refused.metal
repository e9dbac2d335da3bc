// Constructs that Metal's compiler refuses and clang would accept (tests/sim/test_refusals.py):
// each kernel must fail to build here, with the message the test names. Never built as part of
// any library that must work: the file as a whole does not compile.
#include <metal_stdlib>
using namespace metal;

kernel void refused_as_cast(device float* out [[buffer(0)]], uint t [[thread_index_in_threadgroup]]) {
  threadgroup float scratch[32];
  device float* wrong = (device float*)scratch;  // threadgroup -> device
  wrong[t] = 1.0f;
  out[t] = scratch[t];
}

// reinterpret_cast cannot change an address space either (clang refuses it as Metal does).
kernel void refused_as_reinterpret(device float* out [[buffer(0)]],
                                   uint t [[thread_index_in_threadgroup]]) {
  threadgroup float scratch[32];
  device float* wrong = reinterpret_cast<device float*>(scratch);  // threadgroup -> device
  thread float* local = reinterpret_cast<thread float*>(out);       // device -> thread
  wrong[t] = local[t];
}

kernel void refused_vla(device float* out [[buffer(0)]], constant uint& n [[buffer(1)]]) {
  float values[n];
  values[0] = 1.0f;
  out[0] = values[0];
}

kernel void refused_atomic_orders(device atomic_int* a [[buffer(0)]]) {
  atomic_fetch_add_explicit(a, 1, memory_order_seq_cst);
}

kernel void refused_atomic_64(device atomic_ulong* a [[buffer(0)]]) {
  atomic_fetch_add_explicit(a, 1ul, memory_order_relaxed);
}

kernel void refused_atomic_bool(device atomic_bool* a [[buffer(0)]]) {
  atomic_fetch_or_explicit(a, true, memory_order_relaxed);
}

kernel void refused_tg_atomic_float(device float* out [[buffer(0)]]) {
  threadgroup atomic_float total;
  atomic_fetch_add_explicit(&total, 1.0f, memory_order_relaxed);
}
