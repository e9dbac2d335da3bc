// The GEMM epilogue, applied to each fp32 accumulator in registers before the single store:
// out = act(alpha * acc + beta * c + bias). Which parts run is decided by function constants, so
// a plain matmul compiles to a multiply by alpha and a store.
#pragma once

#include <metal_stdlib>

#include "../params.h"

using namespace metal;

namespace steel {

// erfc(x) for x >= 0 by Abramowitz & Stegun 7.1.26, poly(t) * exp(-x^2) with t = 1 / (1 + p x)
// (MSL has no erf): absolute error <= 1.5e-7, and since the exp factor carries the decay, the
// relative error stays below 0.2% for x <= 3.6 and 4% out to fp32's smallest normals.
inline float erfc_nonneg(float x) {
  const float t = 1.0f / (1.0f + 0.3275911f * x);
  const float poly =
      t * (0.254829592f +
           t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  return poly * exp(-x * x);
}

// gelu(v) = v * Phi(v) = 0.5 v erfc(-v / sqrt(2)). For v < 0 the tail erfc(|v| / sqrt(2)) is
// used as it is: computing 1 + erf(v / sqrt(2)) instead cancels to a few ulps of 1 (4% error at
// v = -5, exactly 0 below v = -5.5, where gelu is still -1e-8). For v >= 0, 2 - tail.
// +inf gives inf, -inf NaN (-inf * 0, as in torch), NaN stays NaN.
inline float gelu_erf(float v) {
  const float tail = erfc_nonneg(fabs(v) * 0.70710678118654752f);
  return 0.5f * v * (v < 0.0f ? tail : 2.0f - tail);
}

inline float activate(float v, int activation) {
  switch (activation) {
    case kSteelActRelu:
      return v < 0.0f ? 0.0f : v;  // NaN passes through, as in torch.relu (max() would drop it)
    case kSteelActGelu:
      return gelu_erf(v);
    case kSteelActGeluTanh: {
      // 0.5 v (1 + tanh(u)) = v / (1 + exp(-2u)). The first form cancels for u < 0 (1 + tanh
      // is a few ulps of 1 near u = -8: 30% off at v = -5, 0 below v = -5.3); the second keeps
      // exp's relative accuracy. u = +-inf (v^3 overflows) gives v or a signed zero, v = -inf
      // NaN (-inf / inf, as torch's 0.5 * -inf * 0).
      const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
      return v / (1.0f + exp(-2.0f * u));
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
