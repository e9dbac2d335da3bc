// The id of a threadgroup array (construct.h, tg_array): its declaration's id mixed with a hash
// of the enclosing function's name, which tells two template instantiations apart. It lives
// outside construct.h and types.h: ir.py counts the code of those two headers as the shader's
// own (they carry the shader's rewritten expressions), and this id is the simulator's
// bookkeeping, not work a GPU does (Metal lays threadgroup arrays out when it compiles the
// kernel). Counted, it cost each simdgroup 3 integer operations, a compare and a branch per
// character of the function's __PRETTY_FUNCTION__, per array.
#pragma once

#include <cstdint>

namespace steel_shim {

inline uint32_t threadgroup_array_id(uint32_t decl_id, const char* function) {
  uint32_t h = 2166136261u;
  for (const char* s = function; *s; ++s) h = (h ^ uint32_t(uint8_t(*s))) * 16777619u;
  return decl_id ^ h;
}

}  // namespace steel_shim
