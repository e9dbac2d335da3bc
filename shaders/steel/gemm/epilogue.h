// The GEMM epilogue, applied to each fp32 accumulator in registers before the single store:
// out = act(alpha * acc + beta * c + bias). Which parts run is decided by function constants, so
// a plain matmul compiles to a multiply by alpha and a store.
#pragma once

#include <metal_stdlib>

#include "../params.h"

using namespace metal;

namespace steel {

// erf by Abramowitz & Stegun 7.1.26 (absolute error <= 1.5e-7, below fp32 GELU tolerances);
// MSL has no erf.
inline float erf_approx(float x) {
  const float t = 1.0f / (1.0f + 0.3275911f * fabs(x));
  const float poly =
      t * (0.254829592f +
           t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  const float y = 1.0f - poly * exp(-x * x);
  return x < 0.0f ? -y : y;
}

inline float activate(float v, int activation) {
  switch (activation) {
    case kSteelActRelu:
      return v < 0.0f ? 0.0f : v;  // NaN passes through, as in torch.relu (max() would drop it)
    case kSteelActGelu:
      return 0.5f * v * (1.0f + erf_approx(v * 0.70710678118654752f));
    case kSteelActGeluTanh: {
      // tanh saturates to +-1 in fp32 well before |u| = 10; clamping keeps fast tanh in range.
      const float u = clamp(0.7978845608028654f * (v + 0.044715f * v * v * v), -10.0f, 10.0f);
      return 0.5f * v * (1.0f + tanh(u));
    }
    case kSteelActSilu:
      return v / (1.0f + exp(-v));
    default:
      return v;
  }
}

// The epilogue of element (row, col) of one batch entry; c and bias point at that batch's data.
template <typename T>
inline float epilogue(float acc, int row, int col, const device T* c, const device T* bias,
                      constant GemmParams& p, bool use_c, bool has_bias, int activation) {
  float v = p.alpha * acc;
  if (use_c) v += p.beta * float(c[row * p.c_rs + col * p.c_cs]);
  if (has_bias) v += float(bias[col * p.bias_stride]);
  return activate(v, activation);
}

}  // namespace steel
