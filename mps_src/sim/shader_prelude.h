// Force-included (clang -include) at the top of every translated shader TU.
//
// Marks the rendezvous of runtime.h `convergent`, as GPU compilers treat barriers and simd
// operations: the optimizer must not duplicate a call into several paths (tail duplication, jump
// threading) or make it depend on more conditions. The runtime identifies a barrier or simd
// operation by its call site to report lanes that meet at different ones (divergent control
// flow), so one source-level call must stay one call site.
#pragma once

// Predefined by Metal's compiler for every shader (so are __METAL_VERSION__ and friends, which
// the shim's <metal_stdlib> defines).
#define __METAL__ 1

#include "sim/runtime.h"

namespace steel_sim {

__attribute__((convergent)) void threadgroup_barrier();
__attribute__((convergent)) void simdgroup_barrier();
__attribute__((convergent)) void threadgroup_barrier_flags(uint32_t mem_flags);
__attribute__((convergent)) void simdgroup_barrier_flags(uint32_t mem_flags);
__attribute__((convergent)) const void* simd_exchange(const void* mine, size_t bytes,
                                                      SimdKind kind, uint32_t* active_mask);

}  // namespace steel_sim
