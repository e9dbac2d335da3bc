// -*- C++ -*-
// <simd/simd.h> in Metal: the simd:: vector and matrix types that Metal code shares with host
// code. The simulator's vector types are the shim's (steel_shim/types.h); simd_floatN and the
// other C names are aliases of them.
#pragma once

#include <metal_stdlib>

#define STEEL_SIMD_ALIASES(T)             \
  typedef metal::T##2 simd_##T##2;        \
  typedef metal::T##3 simd_##T##3;        \
  typedef metal::T##4 simd_##T##4;        \
  namespace simd {                        \
  typedef metal::T##2 T##2;               \
  typedef metal::T##3 T##3;               \
  typedef metal::T##4 T##4;               \
  }
STEEL_SIMD_ALIASES(float)
STEEL_SIMD_ALIASES(half)
STEEL_SIMD_ALIASES(int)
STEEL_SIMD_ALIASES(uint)
STEEL_SIMD_ALIASES(short)
STEEL_SIMD_ALIASES(ushort)
STEEL_SIMD_ALIASES(char)
STEEL_SIMD_ALIASES(uchar)
#undef STEEL_SIMD_ALIASES
