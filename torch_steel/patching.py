"""Route torch.nn.functional.scaled_dot_product_attention to steel::sdpa.

After patch(), F.scaled_dot_product_attention (and everything in torch that calls it, such as
nn.MultiheadAttention and nn.TransformerEncoderLayer) runs steel::sdpa for calls steel serves:
MPS tensors under the "auto" and "metal" backends, CPU tensors under "sim", any tensor under
"reference". Every other call, and any call steel cannot serve (invalid arguments), runs
PyTorch's original function unchanged.
"""

import threading

import torch
import torch.nn.functional as F

from . import ops, validation
from .backends import current_backend

_lock = threading.Lock()
_original = None


def _serves(query, key, value, attn_mask, is_causal, enable_gqa):
    if not all(torch.is_tensor(t) for t in (query, key, value)):
        return False
    name = current_backend()
    device = query.device.type
    if not (
        name == "reference"
        or (name == "sim" and device == "cpu")
        or (name in ("auto", "metal") and device == "mps")
    ):
        return False
    try:
        mask, _, _ = ops._causal_bias(attn_mask, is_causal, "top_left", query, key)
        if min(query.dim(), key.dim(), value.dim()) < 2:
            return False
        q, k, v = ops._broadcast_qkv(query, key, value, enable_gqa)
        validation.check_sdpa(q, k, v, mask, enable_gqa, None)
    except (ValueError, TypeError):
        return False  # PyTorch reports its own error for this call
    return True


def _steel_sdpa(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    **kwargs,
):
    if not kwargs and _serves(query, key, value, attn_mask, is_causal, enable_gqa):
        return ops.sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return _original(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        **kwargs,
    )


class _Patch:
    """Returned by patch(); as a context manager it restores the state from before patch()."""

    def __init__(self, was_patched):
        self._was_patched = was_patched

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self._was_patched:
            unpatch()
        return False


def is_patched() -> bool:
    return F.scaled_dot_product_attention is _steel_sdpa


def patch():
    """Make F.scaled_dot_product_attention use steel. Idempotent and thread-safe.

    Use as `torch_steel.patch()` (until unpatch()) or `with torch_steel.patch(): ...`.
    """
    global _original
    with _lock:
        was_patched = is_patched()
        if not was_patched:
            _original = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _steel_sdpa
    return _Patch(was_patched)


def unpatch():
    """Restore PyTorch's F.scaled_dot_product_attention (no-op if not patched)."""
    with _lock:
        if is_patched():
            F.scaled_dot_product_attention = _original
