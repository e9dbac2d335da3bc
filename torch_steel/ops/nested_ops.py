"""torch_steel.sdpa on PyTorch's jagged nested tensors (torch.nested, layout=torch.jagged),
served by steel's varlen attention (varlen_ops.sdpa_varlen).

A jagged query [B, H, j, E] (a [B, j, H, E] nested tensor transposed, the layout PyTorch's
nested F.scaled_dot_product_attention takes) is its values [total_q, H, E] and its offsets
[B + 1], sequence b being rows offsets[b]:offsets[b + 1] of the values: sdpa_varlen's packed
query and cu_seqlens_q. Key and value likewise give cu_seqlens_k. The result is wrapped back as
a jagged tensor on the query's offsets (so it has the query's ragged dim), and autograd runs
through values() and the wrapping to sdpa_varlen's backward.

Served as PyTorch's nested F.sdpa serves it (torch/nested/_internal/sdpa.py): key and value of
their own lengths, dropout, scale; not attn_mask, which PyTorch refuses on nested tensors too.
Beyond what PyTorch's math backend (its only one on CPU and MPS) takes: is_causal (which it
refuses there; its CUDA kernels take it), aligned per sequence by causal_align as in
sdpa_varlen, and enable_gqa (key and value with fewer heads), as well as steel's extensions.

Under torch_steel.patch(), F.scaled_dot_product_attention on nested tensors stays PyTorch's:
NestedTensor.__torch_function__ takes the call before the aten op that patch() serves, and the
one call of its path that an attention provider can register a kernel for,
aten._flash_attention_forward, is made only where torch.backends.cuda.can_use_flash_attention
holds, which is never on MPS or CPU.
"""

import torch
from torch import Tensor

from .. import validation as check

_LAYOUT = (
    "[batch, heads, ragged seq, dim] (a torch.nested jagged [B, j, H, E] tensor transposed "
    "with .transpose(1, 2), as F.scaled_dot_product_attention takes it)"
)


def is_nested(*tensors):
    """Whether any of the arguments is a nested tensor."""
    return any(isinstance(t, Tensor) and t.is_nested for t in tensors)


def check_layout(name, t):
    """That a nested query, key or value is one that sdpa serves: jagged [B, H, j, E]."""
    if t.layout != torch.jagged:
        check.fail("sdpa", f"{name} is a nested tensor of layout {t.layout}: only "
                   "torch.jagged nested tensors are served (torch.nested.nested_tensor(..., "
                   "layout=torch.jagged)), or use torch_steel.sdpa_varlen on packed "
                   "tensors")  # fmt: skip
    # _ragged_idx: which dim is ragged, as PyTorch's own nested sdpa reads it.
    if t.dim() != 4 or t._ragged_idx != 2:
        check.fail("sdpa", f"a nested {name} must be {_LAYOUT}, got a {t.dim()}-d nested tensor "
                   f"ragged in dim {t._ragged_idx}")  # fmt: skip
    if t.lengths() is not None:
        check.fail("sdpa", f"{name} is a nested tensor with holes (offsets and lengths, as "
                   "narrow() makes): call .contiguous() on it first")  # fmt: skip


def _packed(name, t):
    """A nested query, key or value as (values [total, H, E], int32 offsets, max length)."""
    if not (isinstance(t, Tensor) and t.is_nested):
        got = type(t).__name__ if not isinstance(t, Tensor) else "a dense tensor"
        check.fail("sdpa", f"query, key and value must all be nested tensors or none, but {name}"
                   f" is {got}")  # fmt: skip
    check_layout(name, t)
    offsets = t.offsets()
    longest = int(offsets.diff().max()) if offsets.numel() > 1 else 0
    return t.transpose(1, 2).values(), offsets.to(torch.int32), longest


def _jagged_like(query, values):
    """values [total_q, H, X] as a jagged [B, H, j, X] on the query's offsets (its ragged dim)."""
    return torch.nested.nested_tensor_from_jagged(values, query.offsets()).transpose(1, 2)


def sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks, softcap,
         window, causal_align, seed, offset, return_lse):  # fmt: skip
    """torch_steel.sdpa when query, key or value is a nested tensor (see the module)."""
    (q, cu_q, max_q), (k, cu_k, max_k), (v, cu_v, _) = (
        _packed(name, t) for name, t in (("query", query), ("key", key), ("value", value))
    )
    if attn_mask is not None:
        check.fail("sdpa", "attn_mask is not served on nested tensors (PyTorch's nested "
                   "F.scaled_dot_product_attention refuses it too): use is_causal or window, or "
                   "torch_steel.sdpa on padded dense tensors with a mask")  # fmt: skip
    batch = (query.shape[0], key.shape[0], value.shape[0])
    if len(set(batch)) != 1:
        check.fail("sdpa", f"nested query, key and value must have one batch size, got {batch}")
    if key.offsets() is not value.offsets() and not torch.equal(cu_k, cu_v):
        check.fail("sdpa", "nested key and value must have the same lengths (offsets)")
    hq, hk, hv = query.shape[1], key.shape[1], value.shape[1]
    if hk != hv:
        check.fail("sdpa", f"nested key and value must have one head count, got {hk} and {hv}")
    if hq != hk and not enable_gqa:
        check.fail("sdpa", f"query has {hq} heads and key {hk}: pass enable_gqa=True for "
                   "grouped-query attention, as F.scaled_dot_product_attention wants")  # fmt: skip
    # Here, not at the top: varlen_ops imports attention_ops, which imports this module.
    from .varlen_ops import sdpa_varlen

    result = sdpa_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale,
                         sinks=sinks, softcap=softcap, window=window, causal_align=causal_align,
                         seed=seed, offset=offset, return_lse=return_lse)  # fmt: skip
    if not return_lse:
        return _jagged_like(query, result)
    out, lse = result  # lse [H, total_q]: as [B, H, j], the dense sdpa's [B, H, L]
    return _jagged_like(query, out), _jagged_like(query, lse.transpose(0, 1).unsqueeze(-1))[..., 0]
