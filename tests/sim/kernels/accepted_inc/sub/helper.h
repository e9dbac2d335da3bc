// Included as <sub/helper.h> by tests/sim/kernels/lang_accepted.metal (with include_dirs).
#pragma once
inline float accepted_helper(float x) { return x * 3.0f; }
