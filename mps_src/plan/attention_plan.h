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

// The backward (shaders/steel/attn/attention_backward.metal), registered as "sdpa_backward":
// tensors [grad_out, q, k, v, out, lse, attn_mask, sinks, grad_lse] (mask, sinks, grad_lse
// optional), the forward's options. Outputs dq, dk, dv in q's, k's, v's shapes and dtype, and
// dsinks in the sinks' dtype when sinks are given; an fp32 delta scratch of O(L).
Plan plan_attention_backward(const TensorList& tensors, const Options& options);

}  // namespace steel
