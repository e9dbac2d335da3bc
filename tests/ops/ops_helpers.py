"""Shared helpers of the op tests: random inputs and the float64 oracle."""

import torch
import torch.nn.functional as F


def randn(*shape, dtype=torch.float64, requires_grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)


def torch_sdpa64(q, k, v, attn_mask=None, **kwargs):
    """PyTorch's own attention in float64: the independent oracle for steel::sdpa."""
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.double()
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask, **kwargs)


def naive_attention(q, k, v, keep=None, bias=None, scale=None, sinks=None, softcap=0.0):
    """Straightforward float64 attention written out row by row (for the extensions).

    keep: bool [..., L, S] which keys each row sees; bias: added to logits after the softcap;
    sinks: [H] extra logit per head without a value. Returns (out, lse).
    """
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(groups, -3)
    v = v.repeat_interleave(groups, -3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = q @ k.transpose(-1, -2) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    if bias is not None:
        logits = logits + bias.double()
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        sink = sinks.double().reshape(-1, 1, 1).expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, sink], -1)
    lse = torch.logsumexp(logits, -1)
    weights = torch.exp(logits - lse.unsqueeze(-1)).nan_to_num(0.0)
    if sinks is not None:
        weights = weights[..., :-1]
    return weights @ v, lse
