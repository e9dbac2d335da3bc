// The simulator's Metal Performance Primitives (MSL 4, found by the include path Apple's
// compiler uses): mpp::tensor_ops, see steel_shim/tensor_ops.h.
#pragma once
#include <metal_tensor>
#include "../steel_shim/tensor_ops.h"
