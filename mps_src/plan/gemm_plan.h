// Launch planning for steel::gemm (shaders/steel/gemm/gemm.metal). Registered as "gemm".
#pragma once

#include "plan.h"

namespace steel {

// tensors: [a, b, bias, c] (bias and c optional); options: numbers alpha (1), beta (1),
// strings activation (none|relu|gelu|gelu_tanh|silu). One output: out, a's dtype.
// The device description (device.h) chooses the matmul2d kernels on M5-generation GPUs.
Plan plan_gemm(const TensorList& tensors, const Options& options);

}  // namespace steel
