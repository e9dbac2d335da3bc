// The address ranges the load/store callbacks watch, shared by the runtime (which sets them for
// each launch) and the callbacks linked into every shader library (shader/callbacks.cpp), which
// test them inline so that the common case, an access to the lane's own variables, costs two
// compares and no call into the runtime.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

struct SteelSimArenas {
  uintptr_t dev_lo;
  uintptr_t dev_size;  // 0 outside a launch: then no address is watched
  uintptr_t tg_lo;
  uintptr_t tg_size;
};

extern SteelSimArenas steel_sim_arenas;

// The slow path: an access inside one of the arenas (counted, checked); pc is the shader code
// making it, for messages.
void steel_sim_access(const void* p, size_t n, bool write, const void* pc);
// The same for an access declared `align` bytes aligned, less than its size n.
void steel_sim_access_aligned(const void* p, size_t n, size_t align, bool write, const void* pc);
// The same for the bytes of a memcpy/memset (no alignment rule: it moves bytes).
void steel_sim_access_range(const void* p, size_t n, bool write, const void* pc);

// Instruction counters (torch_steel/sim/ir.py, count_blocks): nonzero while a launch counts;
// then every basic block of shader code with a histogram reports it when it runs.
extern uint32_t steel_sim_counting;
void steel_sim_count_block(const uint32_t* histogram);
}
