"""Reference math for every op, in plain torch ops.

These functions are what the ops run on devices without a Metal kernel, what a refused Metal
plan falls back to, and, run in float64, the oracle of the tests. They take already validated
arguments (see torch_steel.ops) and compute in float32 (float64 for float64 inputs).

Attention conventions shared with the kernels:
  - scores s = (q @ k^T) * scale, then softcap (s = cap * tanh(s / cap)) when cap > 0, then the
    additive float mask; bool masks, causal and window restrict which keys a row may see.
  - a query row i sees key j when (with shift = S - L for bottom_right alignment, else 0)
        j <= i + shift                       if is_causal
        i + shift - window_left <= j         if window_left >= 0
        j <= i + shift + window_right        if window_right >= 0
        attn_mask[..., i, j]                 if attn_mask is bool
  - sinks[h] is an extra logit in every row of head h that has no value vector.
  - lse = log(sum_j exp(s_j) + exp(sink)) over visible keys, -inf for a row with nothing at all;
    such a row outputs zeros (as F.scaled_dot_product_attention does).
  - dropout (torch_steel.dropout) drops attention weights after the softmax.
"""

import math

import torch

from . import dropout as _dropout


def compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def visible(L, S, is_causal, window_left, window_right, bottom_right, device):
    """[L, S] bool: which keys each query row may see from causal/window alone (None: all)."""
    if not is_causal and window_left < 0 and window_right < 0:
        return None
    i = torch.arange(L, device=device).unsqueeze(1) + ((S - L) if bottom_right else 0)
    j = torch.arange(S, device=device).unsqueeze(0)
    keep = torch.ones(L, S, dtype=torch.bool, device=device)
    if is_causal:
        keep &= j <= i
    if window_left >= 0:
        keep &= j >= i - window_left
    if window_right >= 0:
        keep &= j <= i + window_right
    return keep


def _expand_kv(x, groups):
    """GQA: query head h reads key/value head h // groups (torch's repeat_interleave rule)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


def _reduce_kv(dx, groups):
    if groups == 1:
        return dx
    shape = dx.shape
    return dx.reshape(*shape[:-3], shape[-3] // groups, groups, *shape[-2:]).sum(-3)


def dropout_scale(q_shape, S, dropout_p, seed, offset, batch_index, device, dtype):
    """Per-weight factor keep / (1 - p) of shape [*batch, H, L, S] (see torch_steel.dropout).

    batch_index is the dropout batch index of the first batch entry (a varlen sequence's index).
    """
    *batch, H, L, _ = q_shape
    if dropout_p >= 1.0:
        return torch.zeros(*batch, H, L, S, dtype=dtype, device=device)
    first = batch_index * H
    bh = torch.arange(first, first + math.prod(batch) * H)
    keep = _dropout.keep_mask(seed, offset, bh, L, S, dropout_p, device=device)
    return keep.reshape(*batch, H, L, S).to(dtype) / (1.0 - dropout_p)


class _Scores:
    """Scores, visibility and sink logits of one attention call, in the compute dtype."""

    def __init__(self, q, k, attn_mask, is_causal, scale, sinks, softcap, window_left,
                 window_right, bottom_right):  # fmt: skip
        ct = compute_dtype(q.dtype)
        L, S = q.shape[-2], k.shape[-2]
        self.groups = q.shape[-3] // k.shape[-3]
        self.qc = q.to(ct)
        self.kc = _expand_kv(k.to(ct), self.groups)
        raw = (self.qc @ self.kc.mT) * scale
        # tanh(raw / cap), kept for the backward: d(cap * tanh(x / cap)) / dx = 1 - tanh^2.
        self.tanh = torch.tanh(raw / softcap) if softcap > 0 else None
        self.s = softcap * self.tanh if softcap > 0 else raw
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            self.s = self.s + attn_mask.to(ct)
        allowed = visible(L, S, is_causal, window_left, window_right, bottom_right, q.device)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            allowed = attn_mask if allowed is None else attn_mask & allowed
        self.allowed = None if allowed is None else allowed.expand_as(self.s)
        if self.allowed is not None:
            self.s = self.s.masked_fill(~self.allowed, float("-inf"))
        # Sink logits as a [..., H, 1, 1] column that broadcasts against the rows.
        self.sink = None if sinks is None else sinks.to(ct).reshape(-1, 1, 1)

    def softmax(self):
        """(p, p_sink, lse): softmax probabilities of the visible keys and of the sink (None
        without sinks), normalised by the row max, and the log-sum-exp.

        Normalising exp(s - max) by its sum, instead of taking exp(s - lse), stays exact when
        every logit of a row is huge and negative (an additive mask of finfo(dtype).min, as
        Hugging Face pads): there lse ~ -3.4e38 has no bits left for log(S), and exp(s - lse)
        would give each key weight 1. A row that sees nothing (max -inf) is all zero, lse -inf.
        """
        s = self.s
        if s.shape[-1] > 0:
            row_max = s.amax(-1, keepdim=True)
        else:
            row_max = s.new_full((*s.shape[:-1], 1), float("-inf"))
        if self.sink is not None:
            row_max = torch.maximum(row_max, self.sink.expand_as(row_max))
        # A row that sees nothing has max -inf; any finite shift keeps exp() at 0 without NaN.
        row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
        e = torch.exp(s - row_max)
        total = e.sum(-1, keepdim=True)
        e_sink = None if self.sink is None else torch.exp(self.sink - row_max)
        if e_sink is not None:
            total = total + e_sink
        lse = (row_max + torch.log(total)).squeeze(-1)
        safe = torch.where(total == 0, torch.ones_like(total), total)
        p_sink = None if e_sink is None else e_sink / safe
        return e / safe, p_sink, lse


def _dense_non_overlapping(t):
    expected = 1
    for d in sorted(range(t.dim()), key=lambda d: t.stride(d)):
        if t.shape[d] == 1:
            continue
        if t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def layout_strides(q, shape):
    """The strides of a tensor of `shape` (q's shape but for the last dim) laid out like q.

    F.scaled_dot_product_attention's output follows the query's memory layout: a query that is
    a [B, L, H, E] tensor viewed as [B, H, L, E] gives an output whose strides are [B, L, H, Ev]
    ordered, so that out.transpose(1, 2).view(B, L, H * Ev) works. Dims of size > 1 are ordered
    by q's strides (outermost first; size-1 dims stay where they are); a query that is not dense
    and non-overlapping (an expanded view), or whose last dim is not innermost, gives contiguous
    strides.
    """
    n = len(shape)
    order = list(range(n))
    if _dense_non_overlapping(q):
        big = [d for d in range(n) if q.shape[d] > 1]
        ranked = iter(sorted(big, key=lambda d: (-q.stride(d), d)))
        order = [next(ranked) if q.shape[d] > 1 else d for d in range(n)]
        if order[-1] != n - 1:
            order = list(range(n))
    strides = [0] * n
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(int(shape[d]), 1)
    return strides


def like_layout(q, shape, dtype=None):
    """An empty tensor of `shape` laid out like q (see layout_strides)."""
    dtype = q.dtype if dtype is None else dtype
    return q.new_empty_strided(tuple(shape), layout_strides(q, shape), dtype=dtype)


def sdpa_forward(q, k, v, attn_mask, dropout_p, is_causal, scale, sinks, softcap, window_left,
                 window_right, bottom_right, seed, offset, batch_index=0):  # fmt: skip
    """Returns (out in q's dtype and memory layout (see like_layout), lse in float32 or float64
    of shape [*batch, H, L])."""
    sc = _Scores(
        q, k, attn_mask, is_causal, scale, sinks, softcap, window_left, window_right, bottom_right
    )
    vc = _expand_kv(v.to(sc.s.dtype), sc.groups)
    p, _, lse = sc.softmax()
    if dropout_p > 0:
        p = p * dropout_scale(
            q.shape, k.shape[-2], dropout_p, seed, offset, batch_index, q.device, p.dtype
        )
    result = p @ vc
    out = like_layout(q, result.shape)
    out.copy_(result)
    return out, lse


def sdpa_backward(grad_out, grad_lse, q, k, v, lse, attn_mask, dropout_p, is_causal, scale,
                  sinks, softcap, window_left, window_right, bottom_right, seed, offset,
                  batch_index=0, mask_grad=False):  # fmt: skip
    """Returns (dq, dk, dv, dsinks, dmask) in the dtypes of q, k, v, sinks, attn_mask (dsinks
    None without sinks, dmask None unless mask_grad: the gradient of a float attn_mask, summed
    over the dims it broadcasts along).

    The probabilities are recomputed and normalised by the row max (see _Scores.softmax), not
    rebuilt as exp(s - lse): the reference is the tests' oracle and must stay exact on rows of
    huge negative logits, where exp(s - lse) cancels catastrophically. lse is not read (it is
    an argument because the kernels, which rebuild from it, take the same arguments).
    """
    sc = _Scores(
        q, k, attn_mask, is_causal, scale, sinks, softcap, window_left, window_right, bottom_right
    )
    ct = sc.s.dtype
    vc = _expand_kv(v.to(ct), sc.groups)
    go = grad_out.to(ct)
    p, p_sink, _ = sc.softmax()
    dp = go @ vc.mT
    if dropout_p > 0:
        factor = dropout_scale(
            q.shape, k.shape[-2], dropout_p, seed, offset, batch_index, q.device, ct
        )
        pd = p * factor
        dp = dp * factor
    else:
        pd = p
    # delta = rowsum(dO * O) = rowsum(P * dP): the softmax Jacobian's correction term.
    delta = (p * dp).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    if grad_lse is not None:
        ds = ds + p * grad_lse.to(ct).unsqueeze(-1)
    # The float mask is added after the softcap: its gradient is ds itself.
    dmask = ds.sum_to_size(attn_mask.shape).to(attn_mask.dtype) if mask_grad else None
    if softcap > 0:
        ds = ds * (1 - sc.tanh**2)
    dq = (ds @ sc.kc) * scale
    dk = _reduce_kv((ds.mT @ sc.qc) * scale, sc.groups)
    dv = _reduce_kv(pd.mT @ go, sc.groups)
    dsinks = None
    if sinks is not None:
        d = -delta if grad_lse is None else grad_lse.to(ct).unsqueeze(-1) - delta
        per_head = (p_sink * d).sum((-1, -2))  # [*batch, H]; H >= 1, so -1 below is defined
        per_head = per_head.reshape(-1, per_head.shape[-1]).sum(0)  # (even with L or B = 0)
        dsinks = per_head.reshape(sinks.shape).to(sinks.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, dmask


def _segments(cu_seqlens_q, cu_seqlens_k):
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def _varlen_seq(x, start, end):
    """[tokens, H, D] slice -> [1, H, n, D] (batch 1: the sequence index goes in `offset`)."""
    return x[start:end].transpose(0, 1).unsqueeze(0)


def sdpa_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *options):
    """Packed [tokens, H, D] attention; returns (out [Tq, Hq, Ev], lse [Hq, Tq]).

    options: dropout_p ... offset as for sdpa_forward. Sequence b is a dense call whose dropout
    batch index is b.
    """
    Hq = q.shape[1]
    out = q.new_zeros(q.shape[0], Hq, v.shape[2])
    lse = torch.full((Hq, q.shape[0]), float("-inf"), dtype=compute_dtype(q.dtype), device=q.device)
    for b, (q0, q1, k0, k1) in enumerate(_segments(cu_seqlens_q, cu_seqlens_k)):
        if q1 == q0:
            continue
        qs, ks, vs = (_varlen_seq(q, q0, q1), _varlen_seq(k, k0, k1), _varlen_seq(v, k0, k1))
        o, l_ = sdpa_forward(qs, ks, vs, None, *options, batch_index=b)
        out[q0:q1] = o[0].transpose(0, 1)
        lse[:, q0:q1] = l_[0]
    return out, lse


def paged_keys(pool, block_table, seqused_k):
    """A paged pool [pages, page_size, H, D] gathered to packed [total_k, H, D] rows and their
    cu_seqlens_k: sequence b's keys are its first seqused_k[b] slots of the pages
    block_table[b, 0], block_table[b, 1], ... in that order."""
    page_size = pool.shape[1]
    parts, offsets = [], [0]
    for b, used in enumerate(seqused_k.tolist()):
        pages = block_table[b, : -(-used // page_size)].long()
        parts.append(pool[pages].reshape(-1, *pool.shape[2:])[:used])
        offsets.append(offsets[-1] + used)
    packed = torch.cat(parts) if parts else pool.new_empty(0, *pool.shape[2:])
    return packed, torch.tensor(offsets, dtype=torch.int32, device=pool.device)


def sdpa_paged_forward(q, k_pool, v_pool, cu_seqlens_q, block_table, seqused_k, *options):
    """Packed queries against a paged KV cache (see paged_keys); sdpa_varlen_forward's
    results."""
    k, cu_k = paged_keys(k_pool, block_table, seqused_k)
    v, _ = paged_keys(v_pool, block_table, seqused_k)
    return sdpa_varlen_forward(q, k, v, cu_seqlens_q, cu_k, *options)


def sdpa_varlen_backward(grad_out, grad_lse, q, k, v, lse, cu_seqlens_q, cu_seqlens_k, *options):
    """sdpa_backward per sequence, accumulated into packed gradients."""
    dq = q.new_zeros(q.shape)
    dk = k.new_zeros(k.shape)
    dv = v.new_zeros(v.shape)
    sinks = options[3]
    dsinks = None if sinks is None else sinks.new_zeros(sinks.shape)
    for b, (q0, q1, k0, k1) in enumerate(_segments(cu_seqlens_q, cu_seqlens_k)):
        if q1 == q0:
            continue
        go = _varlen_seq(grad_out, q0, q1)
        gl = None if grad_lse is None else grad_lse[:, q0:q1].unsqueeze(0)
        lb = lse[:, q0:q1].unsqueeze(0)
        qs, ks, vs = (_varlen_seq(q, q0, q1), _varlen_seq(k, k0, k1), _varlen_seq(v, k0, k1))
        gq, gk, gv, gs, _ = sdpa_backward(go, gl, qs, ks, vs, lb, None, *options, batch_index=b)
        dq[q0:q1] = gq[0].transpose(0, 1)
        dk[k0:k1] += gk[0].transpose(0, 1)
        dv[k0:k1] += gv[0].transpose(0, 1)
        if gs is not None:
            dsinks += gs
    return dq, dk, dv, dsinks


ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")
_GELU_TANH_K = math.sqrt(2.0 / math.pi)


def activation(z, name):
    if name == "relu":
        return torch.relu(z)
    if name == "gelu":
        return 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * z * (1.0 + torch.tanh(_GELU_TANH_K * (z + 0.044715 * z**3)))
    if name == "silu":
        return z * torch.sigmoid(z)
    return z


def activation_grad(z, name):
    """d act(z) / dz."""
    if name == "relu":
        return (z > 0).to(z.dtype)
    if name == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))
        return cdf + z * torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    if name == "gelu_tanh":
        t = torch.tanh(_GELU_TANH_K * (z + 0.044715 * z**3))
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _GELU_TANH_K * (
            1.0 + 3 * 0.044715 * z * z
        )
    if name == "silu":
        sig = torch.sigmoid(z)
        return sig * (1.0 + z * (1.0 - sig))
    return torch.ones_like(z)


def gemm_preactivation(a, b, bias, c, alpha, beta):
    """alpha * (a @ b) + beta * c + bias in the compute dtype (c ignored when beta == 0)."""
    ct = compute_dtype(a.dtype)
    z = (a.to(ct) @ b.to(ct)) * alpha
    if c is not None and beta != 0:
        z = z + beta * c.to(ct)
    if bias is not None:
        z = z + bias.to(ct)
    return z


def gemm(a, b, bias, c, alpha, beta, act):
    return activation(gemm_preactivation(a, b, bias, c, alpha, beta), act).to(a.dtype)
