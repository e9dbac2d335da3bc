// Launch planning for the attention forward (shaders/steel/attn/attention.metal). Registered as
// "sdpa".
#pragma once

#include "plan.h"

namespace steel {

// tensors: [q, k, v, attn_mask, sinks] (mask and sinks optional), q [*batch, Hq, L, E],
// k [*batch, Hkv, S, E], v [*batch, Hkv, S, Ev], attn_mask broadcasting to [*batch, Hq, L, S],
// sinks [Hq]; options as torch_steel.ops passes them (dropout_p, is_causal, scale, softcap,
// window_left, window_right, bottom_right, ...). Outputs: out [*batch, Hq, L, Ev] in q's dtype
// and memory layout, lse float32 [*batch, Hq, L].
Plan plan_attention(const TensorList& tensors, const Options& options);

}  // namespace steel
