"""The steel ops: torch.ops.steel.{sdpa, sdpa_varlen, gemm} and their internal pieces.

Public ops (wrapped, with a friendlier signature, as torch_steel.sdpa / sdpa_varlen / gemm):
  steel::sdpa         F.scaled_dot_product_attention plus keyword-only extensions. Composite:
                      validates, resolves scale and the dropout seed, calls sdpa_forward.
  steel::sdpa_varlen  packed variable-length attention, composite over sdpa_varlen_forward.
  steel::gemm         gemm(a, b, bias=None, c=None, alpha=1.0, beta=0.0, activation="none") =
                      act(alpha * (a @ b) + beta * c + bias). (The op's tensors are positional;
                      torch_steel.gemm takes them keyword-only.)
Internal ops, what the Metal kernels implement; autograd connects forward to backward:
  steel::sdpa_forward(q, k, v, attn_mask, <attention options>) -> (out, lse)
  steel::sdpa_backward(grad_out, grad_lse, q, k, v, out, lse, attn_mask, mask_grad, <options>)
      -> (dq, dk, dv, dsinks, dmask)   (dsinks is empty when there are no sinks, dmask unless
      mask_grad asks for the gradient of a float attn_mask, in the mask's shape)
  steel::sdpa_varlen_forward / steel::sdpa_varlen_backward: the same over packed tensors, with
      cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k in place of attn_mask.
  steel::sdpa_paged_forward(q, k_pool, v_pool, cu_seqlens_q, block_table, seqused_k,
      max_seqlen_q, max_seqlen_k, <attention options>) -> (out, lse): varlen against a paged KV
      cache (inference: no autograd).
  steel::sdpa_quantized_forward(q, k, k_scales, k_mins, v, v_scales, v_mins, k_format,
      v_format, attn_mask, <attention options>), steel::sdpa_varlen_quantized_forward(q, <the
      same six tensors and two formats>, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
      max_seqlen_q, max_seqlen_k, <options>): quantized K/V (torch_steel.kv), inference only.
  <attention options> = dropout_p, is_causal, scale, sinks, softcap, window_left, window_right,
      bottom_right, seed, offset, num_splits (all resolved: see Attn and torch_steel.reference).
  steel::sdpa_forward_prechecked, steel::gemm_prechecked: sdpa_forward and gemm without the
      input checks and without defaults, which the public functions call while torch.compile
      traces them: the checks run in the fake implementations when the graph is traced.

Every op goes through torch_steel.backends.run with these run_op names and arguments. Absent
tensors are None. Outputs are contiguous, except sdpa's `out`, which has the query's memory
layout as in F.scaled_dot_product_attention (torch_steel.reference.layout_strides: a
[B, L, H, E] query viewed as [B, H, L, E] gives an out with [B, L, H, Ev]-ordered strides).
The fake implementations say so and the kernels must write that layout (sdpa_forward copies an
out of any other layout into it):
  "sdpa"                  [q, k, v, attn_mask, sinks] -> [out, lse]
  "sdpa_backward"         [grad_out, q, k, v, out, lse, attn_mask, sinks, grad_lse]
                          -> [dq, dk, dv] + [dsinks] when sinks is given + [dmask] when the
                          option mask_grad is true
  "sdpa_varlen"           [q, k, v, cu_seqlens_q, cu_seqlens_k, sinks] -> [out, lse], or
                          [q, k_pool, v_pool, cu_seqlens_q, None, sinks, block_table, seqused_k]
                          over a paged KV cache (steel::sdpa_paged_forward)
  "sdpa_varlen_backward"  [grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks,
                          grad_lse] -> [dq, dk, dv] + [dsinks]
      options: dropout_p, is_causal, scale, softcap (0 = off), window_left, window_right
      (-1 = unbounded), bottom_right, offset, seed_lo, seed_hi (the 64-bit seed in 32-bit halves:
      option numbers are doubles), num_splits (decode key partitions, 0 = the plan's choice);
      varlen adds max_seqlen_q, max_seqlen_k.
      lse is float32 [*batch, Hq, L] ([Hq, total_q] for varlen; float64 for float64 inputs).
  "sdpa_quantized"        [q, k, k_scales, k_mins, v, v_scales, v_mins, attn_mask, sinks]
                          -> [out, lse]; options of "sdpa" plus k_format, v_format
  "sdpa_varlen_quantized" [q, k, k_scales, k_mins, v, v_scales, v_mins, cu_seqlens_q,
                          cu_seqlens_k, sinks, block_table, seqused_k] -> [out, lse]
  "gemm"                  [a, b, bias, c] -> [out]; options alpha, beta, activation.

The ops are defined, by concern, in:
  registry       the machinery: _define (op, fake, Autograd kernel, torch.compile twin), the
                 dispatcher gate _undispatched, the graph call of torch_steel.inductor, autocast;
  attention_ops  dense attention (sdpa, sdpa_forward, sdpa_backward, sdpa_quantized_forward),
                 the attention options Attn;
  varlen_ops     packed variable-length and paged attention (sdpa_varlen*, sdpa_paged_forward,
                 sdpa_varlen_quantized_forward);
  nested_ops     torch_steel.sdpa on jagged nested tensors, through varlen_ops;
  gemm_ops       gemm, linear.
"""

from . import attention_ops, gemm_ops, nested_ops, registry, varlen_ops
from .attention_ops import Attn, sdpa
from .gemm_ops import gemm, linear
from .varlen_ops import sdpa_varlen

registry._register_autocast()  # once every op it casts for is defined

__all__ = [
    "Attn",
    "attention_ops",
    "gemm",
    "gemm_ops",
    "linear",
    "nested_ops",
    "registry",
    "sdpa",
    "sdpa_varlen",
    "varlen_ops",
]
