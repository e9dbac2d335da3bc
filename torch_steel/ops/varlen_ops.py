"""Variable-length attention over packed sequences, and over a paged KV cache:
torch.ops.steel.{sdpa_varlen, sdpa_varlen_forward, sdpa_varlen_backward, sdpa_paged_forward,
sdpa_varlen_quantized_forward} and torch_steel.sdpa_varlen (see torch_steel.ops for the ops'
contract). The attention options are attention_ops' (Attn).
"""

import torch

from .. import reference as ref
from .. import validation as check
from ..backends import backend, current_backend, run
from ..kv import QuantizedKV
from .attention_ops import (
    _EXTENSIONS,
    _OPTIONS,
    _QKV,
    _QKV_INFERENCE,
    Attn,
    _attn_and_sinks,
    _dequantized,
    _dsinks,
    _quantized,
    _quantized_pair,
    _refuse_gradient,
    _resolve,
    _sinks_fake,
)
from .registry import _FUNCTIONS, _LIB, _define, _undispatched

_VARLEN = "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k"


# ----------------------------------------------------------------------------- sdpa_varlen


def _sdpa_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         *options):  # fmt: skip
    check.check_varlen(q, k, v, Attn(*options).sinks, op="sdpa_varlen_forward")
    return _sdpa_varlen_forward_run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, *options)  # fmt: skip


def _sdpa_varlen_forward_run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             *options):  # fmt: skip
    """sdpa_varlen_forward once query, key and value are checked (by it, or by sdpa_varlen)."""
    attn = Attn(*options)
    check.check_cu_seqlens("sdpa_varlen", cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0],
                           max_seqlen_q, max_seqlen_k, q.device)  # fmt: skip
    out, lse = run(
        "sdpa_varlen",
        [q, k, v, cu_seqlens_q, cu_seqlens_k, attn.sinks],
        attn.run_options(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k),
        lambda: ref.sdpa_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *attn.math()),
    )
    return out, lse


def _varlen_outputs_fake(q, v):
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=ref.compute_dtype(q.dtype))
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1])), lse


def _sdpa_varlen_forward_fake(q, k, v, *rest):
    return _varlen_outputs_fake(q, v)


def _sdpa_varlen_backward(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k, *options):  # fmt: skip
    attn = Attn(*options)

    def reference():
        dq, dk, dv, dsinks = ref.sdpa_varlen_backward(
            grad_out, grad_lse, q, k, v, lse, cu_seqlens_q, cu_seqlens_k, *attn.math()
        )
        return [dq, dk, dv] + ([dsinks] if dsinks is not None else [])

    grads = run(
        "sdpa_varlen_backward",
        [grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, attn.sinks, grad_lse],
        attn.run_options(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k),
        reference,
    )
    return grads[0], grads[1], grads[2], _dsinks(grads, attn, q)


def _sdpa_varlen_backward_fake(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                               *options):  # fmt: skip
    sinks = Attn(*options).sinks
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _sinks_fake(sinks, q)


_define(
    "sdpa_varlen_backward",
    "(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    f"{_VARLEN}, {_OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor)",
    _sdpa_varlen_backward,
    _sdpa_varlen_backward_fake,
    (0, 1, 2, 3, 4, 5, 6, 14),  # the float tensors: a gradient of the gradients is not served
)


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, *options = inputs
    ctx.lengths = (max_q, max_k)
    ctx.attn, sinks = _attn_and_sinks(options)
    ctx.backend = current_backend()
    ctx.save_for_backward(q, k, v, cu_q, cu_k, sinks, *output)


def _varlen_backward_autograd(ctx, grad_out, grad_lse):
    q, k, v, cu_q, cu_k, sinks, out, lse = ctx.saved_tensors
    attn = ctx.attn._replace(sinks=sinks)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    with backend(ctx.backend):
        dq, dk, dv, dsinks = torch.ops.steel.sdpa_varlen_backward(
            grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, *ctx.lengths, *attn
        )
    grads = dict.fromkeys(Attn._fields)
    grads["sinks"] = dsinks if sinks is not None else None
    return dq, dk, dv, None, None, None, None, *grads.values()


_define(
    "sdpa_varlen_forward",
    f"(Tensor q, Tensor k, Tensor v, {_VARLEN}, {_OPTIONS}) -> (Tensor, Tensor)",
    _sdpa_varlen_forward,
    _sdpa_varlen_forward_fake,
    (0, 1, 2, 10),  # q, k, v, sinks
    _varlen_setup,
    _varlen_backward_autograd,  # sdpa_varlen_backward for the gradients
)


_SDPA_VARLEN_FORWARD = torch.ops.steel.sdpa_varlen_forward.default
# The implementation without the checks of query, key and value: sdpa_varlen made them.
_SDPA_VARLEN_FORWARD_CALLS = (
    _SDPA_VARLEN_FORWARD,
    _sdpa_varlen_forward_run,
    _FUNCTIONS["sdpa_varlen_forward"],
)


def _varlen_inputs(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p, is_causal, scale, sinks, softcap, window, causal_align, seed,
                   offset):  # fmt: skip
    check.check_varlen(query, key, value, sinks)
    attn = _resolve("sdpa_varlen", query.shape[-1], dropout_p, is_causal, scale, sinks, softcap,
                    window, causal_align, seed, offset)  # fmt: skip
    return (query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *attn)


_LIB.define(
    f"sdpa_varlen(Tensor query, Tensor key, Tensor value, {_VARLEN}, float dropout_p=0.0, "
    f"bool is_causal=False, float? scale=None, *, {_EXTENSIONS}) -> Tensor"
)


def _varlen_composite(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      dropout_p=0.0, is_causal=False, scale=None, *, sinks=None, softcap=0.0,
                      window=None, causal_align="top_left", seed=None, offset=0):  # fmt: skip
    inputs = _varlen_inputs(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, dropout_p, is_causal, scale, sinks, softcap, window,
                            causal_align, seed, offset)  # fmt: skip
    return torch.ops.steel.sdpa_varlen_forward(*inputs)[0]


_LIB.impl("sdpa_varlen", _varlen_composite, "CompositeImplicitAutograd")


def _sdpa_paged_forward(q, k, v, cu_seqlens_q, block_table, seqused_k, max_seqlen_q,
                        max_seqlen_k, *options):  # fmt: skip
    attn = Attn(*options)
    check.check_paged("sdpa_varlen", q, k, v, attn.sinks, cu_seqlens_q, block_table, seqused_k,
                      max_seqlen_q, max_seqlen_k)  # fmt: skip
    out, lse = run(
        "sdpa_varlen",
        [q, k, v, cu_seqlens_q, None, attn.sinks, block_table, seqused_k],
        attn.run_options(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k),
        lambda: ref.sdpa_paged_forward(q, k, v, cu_seqlens_q, block_table, seqused_k, *attn.math()),
    )
    return out, lse


def _sdpa_paged_forward_fake(q, k, v, *rest):
    return _varlen_outputs_fake(q, v)


_define(
    "sdpa_paged_forward",
    "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor block_table, Tensor seqused_k, "
    f"int max_seqlen_q, int max_seqlen_k, {_OPTIONS}) -> (Tensor, Tensor)",
    _sdpa_paged_forward,
    _sdpa_paged_forward_fake,
    (0, 1, 2, 11),  # q, k, v, sinks: inference only (a KV cache has no gradient)
)


def sdpa_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                dropout_p=0.0, is_causal=False, scale=None, *, sinks=None, softcap=None,
                window=None, causal_align="top_left", seed=None, offset=0, return_lse=False,
                block_table=None, seqused_k=None, num_splits=None):  # fmt: skip
    """Attention over packed variable-length sequences (flash-attn's varlen convention).

    query [total_q, heads, E], key [total_k, heads_kv, E], value [total_k, heads_kv, Ev];
    sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of query and
    cu_seqlens_k[b]:cu_seqlens_k[b+1] of key/value (int32 offsets starting at 0); max_seqlen_*
    bound the lengths. heads must be a multiple of heads_kv (grouped-query attention is implied).
    Options as in torch_steel.sdpa; is_causal and window align per sequence (causal_align
    defaults to "top_left" like sdpa; flash-attn's causal is "bottom_right"). Dropout treats the
    sequence index as the batch index. lse is [heads, total_q].

    A paged KV cache (PyTorch's varlen_attn convention): key and value are pools
    [pages, page_size, heads_kv, E|Ev], block_table int32 [batch, max_pages] lists each
    sequence's pages in order, seqused_k int32 [batch] its keys (the last page partly filled),
    and cu_seqlens_k is None. Key j of sequence b is slot j % page_size of page
    block_table[b, j // page_size]. Inference only (no autograd); served by the decode kernels
    (blocks of 32 query rows beyond 8 rows per sequence).
    num_splits: how many partitions the decode kernels split each sequence's keys into
    (None lets the plan choose from the shapes; 1 computes each sequence in one pass, so its
    result is bitwise the same whatever else is in the batch).
    """
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 0):
        check.fail("sdpa_varlen", f"num_splits must be an int >= 0 (0: the plan's choice), "
                   f"got {num_splits!r}")  # fmt: skip
    splits = 0 if num_splits is None else num_splits
    if type(key) is QuantizedKV or type(value) is QuantizedKV:
        return _varlen_quantized(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, dropout_p, is_causal, scale, sinks, softcap,
                                 window, causal_align, seed, offset, return_lse, block_table,
                                 seqused_k, splits)  # fmt: skip
    if block_table is not None or seqused_k is not None:
        if block_table is None or seqused_k is None or cu_seqlens_k is not None:
            check.fail("sdpa_varlen", "a paged KV cache takes block_table and seqused_k, and "
                       "cu_seqlens_k=None")  # fmt: skip
        check.check_paged("sdpa_varlen", query, key, value, sinks, cu_seqlens_q, block_table,
                          seqused_k, max_seqlen_q, max_seqlen_k)  # fmt: skip
        attn = _resolve("sdpa_varlen", query.shape[-1], dropout_p, is_causal, scale, sinks,
                        softcap, window, causal_align, seed, offset)  # fmt: skip
        attn = attn._replace(num_splits=splits)
        cache = (cu_seqlens_q, block_table, seqused_k, max_seqlen_q, max_seqlen_k)
        out, lse = torch.ops.steel.sdpa_paged_forward(query, key, value, *cache, *attn)
        return (out, lse) if return_lse else out
    inputs = _varlen_inputs(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, dropout_p, is_causal, scale, sinks, softcap, window,
                            causal_align, seed, offset)  # fmt: skip
    inputs = (*inputs[:-1], splits)  # num_splits is the last option
    # q, k, v, cu_seqlens, sinks: see gemm_ops.gemm
    how = 0 if torch.compiler.is_compiling() else _undispatched(*inputs[:5], inputs[10])
    out, lse = _SDPA_VARLEN_FORWARD_CALLS[how](*inputs)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- quantized KV
#
# sdpa_varlen with a QuantizedKV key and value (see attention_ops).


def _sdpa_varlen_quantized_forward(q, k, k_scales, k_mins, v, v_scales, v_mins, k_format,
                                   v_format, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                                   max_seqlen_q, max_seqlen_k, *options):  # fmt: skip
    attn = Attn(*options)
    op = "sdpa_varlen"
    pair, (ks, vs) = _quantized(op, q, k, k_scales, k_mins, v, v_scales, v_mins, k_format,
                                v_format)  # fmt: skip
    paged = block_table is not None
    if paged:
        check.check_paged(op, q, ks, vs, attn.sinks, cu_seqlens_q, block_table, seqused_k,
                          max_seqlen_q, max_seqlen_k)  # fmt: skip
        cache = (block_table, seqused_k)
    else:
        check.check_varlen(q, ks, vs, attn.sinks)
        check.check_cu_seqlens(op, cu_seqlens_q, cu_seqlens_k, q.shape[0], ks.shape[0],
                               max_seqlen_q, max_seqlen_k, q.device)  # fmt: skip
        cache = (cu_seqlens_k,)

    def reference():
        kd, vd = _dequantized(q, pair)
        if paged:
            return ref.sdpa_paged_forward(q, kd, vd, cu_seqlens_q, *cache, *attn.math())
        return ref.sdpa_varlen_forward(q, kd, vd, cu_seqlens_q, *cache, *attn.math())

    out, lse = run(
        "sdpa_varlen_quantized",
        [q, k, k_scales, k_mins, v, v_scales, v_mins, cu_seqlens_q, cu_seqlens_k, attn.sinks,
         block_table, seqused_k],
        attn.run_options(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         k_format=k_format, v_format=v_format),
        reference,
    )  # fmt: skip
    return out, lse


def _sdpa_varlen_quantized_forward_fake(q, k, k_scales, k_mins, v, v_scales, v_mins, k_format,
                                        v_format, *rest):  # fmt: skip
    _, (_, vs) = _quantized("sdpa_varlen", q, k, k_scales, k_mins, v, v_scales, v_mins, k_format,
                            v_format)  # fmt: skip
    return _varlen_outputs_fake(q, vs)


_define(
    "sdpa_varlen_quantized_forward",
    f"(Tensor q, {_QKV}, Tensor cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? block_table, "
    f"Tensor? seqused_k, int max_seqlen_q, int max_seqlen_k, {_OPTIONS}) -> (Tensor, Tensor)",
    _sdpa_varlen_quantized_forward,
    _sdpa_varlen_quantized_forward_fake,
    (0, 2, 3, 5, 6, 18),  # q, the scales and mins, sinks: inference only
    why=_QKV_INFERENCE,
)


def _varlen_quantized(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      dropout_p, is_causal, scale, sinks, softcap, window, causal_align, seed,
                      offset, return_lse, block_table, seqused_k, splits):  # fmt: skip
    """sdpa_varlen with QuantizedKV key and value: packed [total_k, H, E] or paged pools."""
    tensors = _quantized_pair("sdpa_varlen", key, value)
    _refuse_gradient("sdpa_varlen", query, sinks, *tensors[:6])
    if (block_table is None) != (seqused_k is None) or (
        block_table is not None and cu_seqlens_k is not None
    ):
        check.fail("sdpa_varlen", "a paged KV cache takes block_table and seqused_k, and "
                   "cu_seqlens_k=None")  # fmt: skip
    attn = _resolve("sdpa_varlen", query.shape[-1], dropout_p, is_causal, scale, sinks, softcap,
                    window, causal_align, seed, offset)._replace(num_splits=splits)  # fmt: skip
    out, lse = torch.ops.steel.sdpa_varlen_quantized_forward(
        query, *tensors, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, max_seqlen_q,
        max_seqlen_k, *attn
    )  # fmt: skip
    return (out, lse) if return_lse else out
