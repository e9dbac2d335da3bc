// Instruction-mix markers for the simulator's counters (torch_steel/sim/ir.py, count_blocks).
//
// The shim computes Metal's operations with whatever C++ it takes (exp2 through a libm call, a
// simd_sum through a loop over the lanes, half math in binary32): that code is not what a GPU
// issues, so the counters' pass does not count it. Instead a shim function that stands for a
// Metal operation says which with STEEL_SHIM_OP("name", T) in its body: an llvm.annotation that
// the pass counts as operation `name` (ir.py: _OPS gives its class) once per element of T, each
// time its basic block runs, and then removes. Markers of shim functions that a marked one calls
// do not count (fast::exp10 is one operation, not also the exp2 it is computed with).
#pragma once

#include "types.h"

#define STEEL_SHIM_OP_MARK(name, T, elem)                                                   \
  (void)__builtin_annotation(                                                               \
      int(::metal::steel_traits::vector_info<::metal::remove_cv_t<T>>::size), "steel_op:" name \
      ":" elem)
#define STEEL_SHIM_OP(name, T)                                                           \
  do {                                                                                   \
    using steel_op_elem =                                                                \
        typename ::metal::steel_traits::vector_info<::metal::remove_cv_t<T>>::element;   \
    if constexpr (__is_same(steel_op_elem, float)) {                                     \
      STEEL_SHIM_OP_MARK(name, T, "float");                                              \
    } else if constexpr (__is_same(steel_op_elem, half)) {                               \
      STEEL_SHIM_OP_MARK(name, T, "half");                                               \
    } else if constexpr (__is_same(steel_op_elem, bfloat)) {                             \
      STEEL_SHIM_OP_MARK(name, T, "bfloat");                                             \
    } else {                                                                             \
      STEEL_SHIM_OP_MARK(name, T, "int");                                                \
    }                                                                                    \
  } while (0)
