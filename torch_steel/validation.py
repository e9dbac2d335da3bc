"""Input checks of the steel ops: bad input is a ValueError (TypeError for non-tensors) that
names the op and the problem, raised before any backend sees the call."""

import math

import torch

from .reference import ACTIVATIONS

ALIGNS = ("top_left", "bottom_right")


def fail(op, message):
    raise ValueError(f"steel.{op}: {message}")


def _dtypes(*tensors):
    return ", ".join(str(t.dtype).replace("torch.", "") for t in tensors)


def _broadcasts_to(shape, target):
    """Whether `shape` broadcasts to `target` (compared in Python: torch.broadcast_shapes costs
    microseconds per call)."""
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target)))


def _check_float_same(op, names, tensors):
    first = tensors[0]
    if (
        all(
            isinstance(t, torch.Tensor) and t.dtype == first.dtype and t.device == first.device
            for t in tensors
        )
        and first.is_floating_point()
    ):
        return  # the common case, in one pass
    for name, t in zip(names, tensors):
        if not torch.is_tensor(t):
            raise TypeError(f"steel.{op}: {name} must be a Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            fail(op, f"{name} must be a floating-point tensor, got {_dtypes(t)}")
    if len({t.dtype for t in tensors}) != 1:
        fail(op, f"{', '.join(names)} must share one dtype, got {_dtypes(*tensors)}")
    if len({t.device for t in tensors}) != 1:
        devices = ", ".join(str(t.device) for t in tensors)
        fail(op, f"{', '.join(names)} must be on one device, got {devices}")


def _check_same_device(op, name, t, query):
    if t.device != query.device:
        fail(op, f"{name} is on {t.device} but query is on {query.device}")


def attention_options(op, dropout_p, softcap, window, causal_align, seed, offset):
    """Checks the scalar attention options; returns (softcap, left, right, bottom_right)."""
    if not 0.0 <= dropout_p <= 1.0:
        fail(op, f"dropout_p must be in [0, 1], got {dropout_p}")
    softcap = 0.0 if softcap is None else softcap
    if not (softcap >= 0.0 and math.isfinite(softcap)):
        fail(op, f"softcap must be a finite number >= 0 (0 disables it), got {softcap}")
    window = (-1, -1) if window is None else tuple(window)
    if len(window) != 2 or any(not isinstance(w, int) or w < -1 for w in window):
        fail(op, f"window must be (left, right) with ints >= 0, or -1 for unbounded, got {window}")
    if causal_align not in ALIGNS:
        fail(op, f"causal_align must be one of {ALIGNS}, got {causal_align!r}")
    if seed is not None and not 0 <= seed < 2**63:
        fail(op, f"seed must be in [0, 2**63) (an int64), got {seed}")
    if not 0 <= offset < 2**32:
        fail(op, f"offset must be in [0, 2**32), got {offset}")
    return float(softcap), window[0], window[1], causal_align == "bottom_right"


def _check_sinks(op, sinks, heads, query):
    if sinks is None:
        return
    if not torch.is_tensor(sinks) or not sinks.is_floating_point():
        fail(op, "sinks must be a floating-point tensor of shape [query heads]")
    _check_same_device(op, "sinks", sinks, query)
    if tuple(sinks.shape) != (heads,):
        shape = list(sinks.shape)
        fail(op, f"sinks must have shape [{heads}] (one logit per query head), got {shape}")


def _check_qkv_dims(op, q, k, v):
    if q.shape[-1] != k.shape[-1]:
        fail(op, f"query and key head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    if k.shape[:-1] != v.shape[:-1]:
        kv = f"key {list(k.shape)} and value {list(v.shape)}"
        fail(op, f"{kv} must agree in all but the last dim")


def _plain_sdpa(q, k, v, attn_mask, sinks):
    """The common attention, accepted in a few checks: query, key and value floating tensors of
    one dtype, device and rank >= 3, one batch shape, key and value of one shape but for the
    last dim, the query's heads a multiple of theirs, the key's head dim the query's; no sinks,
    no mask or a bool or float one on their device that broadcasts (check_sdpa's full checks
    name the problem of anything else)."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return False
    if sinks is not None or not q.is_floating_point():
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    n = len(qs)
    if n < 3 or len(ks) != n or len(vs) != n or qs[:-3] != ks[:-3] or ks[:-1] != vs[:-1]:
        return False
    hk = ks[-3]
    if not (
        q.dtype == k.dtype == v.dtype
        and q.device == k.device == v.device
        and qs[-1] == ks[-1]
        and hk > 0
        and qs[-3] % hk == 0
    ):
        return False
    return attn_mask is None or (
        type(attn_mask) is torch.Tensor
        and (attn_mask.dtype == torch.bool or attn_mask.is_floating_point())
        and attn_mask.device == q.device
        and _broadcasts_to(attn_mask.shape, (*qs[:-1], ks[-2]))
    )


def check_sdpa(q, k, v, attn_mask, enable_gqa, sinks, op="sdpa"):
    """Dense attention: [*batch, heads, L, E] query, [*batch, heads_kv, S, E|Ev] key|value."""
    if enable_gqa and _plain_sdpa(q, k, v, attn_mask, sinks):
        return
    _check_float_same(op, ("query", "key", "value"), (q, k, v))
    qs, ks, vs = q.shape, k.shape, v.shape
    if not len(qs) == len(ks) == len(vs):
        ranks = f"{len(qs)}, {len(ks)}, {len(vs)}"
        fail(op, f"query, key and value must have the same rank, got {ranks}")
    if len(qs) < 3:
        fail(op, f"expected [*batch, heads, seq, dim] tensors, got rank {len(qs)}")
    hq, hk, hv = qs[-3], ks[-3], vs[-3]
    if enable_gqa and hk != hv and (hk == 0 or hv == 0 or hq % hk or hq % hv):
        heads = f"query heads ({hq}) divisible by key heads ({hk}) and value heads ({hv})"
        fail(op, f"grouped-query attention needs {heads}")
    _check_qkv_dims(op, q, k, v)
    if qs[:-3] != ks[:-3]:
        fail(op, f"batch dims of query {list(qs[:-3])} and key {list(ks[:-3])} differ")
    if hq != hk and not enable_gqa:
        fail(
            op,
            f"query has {hq} heads but key/value have {hk}; pass enable_gqa=True for "
            "grouped-query attention",
        )
    if hk == 0 or hq % hk != 0:
        fail(
            op,
            f"grouped-query attention needs query heads ({hq}) divisible by key/value heads ({hk})",
        )
    if attn_mask is not None:
        if not torch.is_tensor(attn_mask):
            raise TypeError(
                f"steel.{op}: attn_mask must be a Tensor (or a torch.nn.attention.bias "
                f"CausalBias via torch_steel.sdpa), got {type(attn_mask).__name__}"
            )
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            kind = _dtypes(attn_mask)
            fail(op, f"attn_mask must be bool (True = attend) or floating (added), got {kind}")
        _check_same_device(op, "attn_mask", attn_mask, q)
        target = (*qs[:-1], ks[-2])
        if not _broadcasts_to(attn_mask.shape, target):
            fail(
                op,
                f"attn_mask of shape {list(attn_mask.shape)} does not broadcast to the attention "
                f"shape {list(target)}",
            )
    _check_sinks(op, sinks, hq, q)


def _plain_varlen(q, k, v, sinks):
    """The common packed attention, accepted in a few checks: query, key and value floating
    tensors of one dtype and device, each of rank 3, key and value of one shape but for the
    last dim, the query's heads a multiple of theirs, the key's head dim the query's; no sinks
    (check_varlen's full checks name the problem of anything else)."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    return (
        sinks is None
        and len(qs) == 3
        and len(ks) == 3
        and len(vs) == 3
        and q.is_floating_point()
        and q.dtype == k.dtype == v.dtype
        and q.device == k.device == v.device
        and qs[2] == ks[2]
        and ks[0] == vs[0]
        and ks[1] == vs[1]
        and ks[1] > 0
        and qs[1] % ks[1] == 0
    )


def check_varlen(q, k, v, sinks, op="sdpa_varlen"):
    """Packed attention: [total_q, heads, E] query, [total_k, heads_kv, E|Ev] key|value."""
    if _plain_varlen(q, k, v, sinks):
        return
    _check_float_same(op, ("query", "key", "value"), (q, k, v))
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() != 3:
            fail(op, f"{name} must be packed [total_tokens, heads, dim], got rank {t.dim()}")
    _check_qkv_dims(op, q, k, v)
    hq, hk = q.shape[1], k.shape[1]
    if hk == 0 or hq % hk != 0:
        fail(op, f"query heads ({hq}) must be a multiple of key/value heads ({hk})")
    _check_sinks(op, sinks, hq, q)


def check_cu_seqlens(op, cu_q, cu_k, total_q, total_k, max_q, max_k, device):
    """The offsets: dtype, rank, device and length always; their values only when they are in
    host memory. Reading a device tensor would synchronize the device on every call, and the
    kernels need no such check: they clamp every offset to the packed tensors on the device."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not torch.is_tensor(cu) or cu.dtype != torch.int32 or cu.dim() != 1:
            got = f"{_dtypes(cu)} of rank {cu.dim()}" if torch.is_tensor(cu) else type(cu).__name__
            fail(op, f"{name} must be a 1-D int32 tensor of batch + 1 offsets, got {got}")
        if cu.device != device:
            fail(op, f"{name} is on {cu.device} but query is on {device}")
        if cu.numel() < 1:
            fail(op, f"{name} must hold at least one offset")
    if cu_q.numel() != cu_k.numel():
        counts = f"{cu_q.numel()} and {cu_k.numel()}"
        fail(
            op, f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got {counts}"
        )
    if not cu_q.is_cpu:
        return
    for name, cu, total, longest in (
        ("cu_seqlens_q", cu_q, total_q, max_q),
        ("cu_seqlens_k", cu_k, total_k, max_k),
    ):
        values = cu.tolist()
        if values[0] != 0 or values[-1] != total:
            span = f"{values[0]}..{values[-1]}"
            fail(op, f"{name} must start at 0 and end at the token count {total}, got {span}")
        start, most = 0, 0
        for end in values:
            if end < start:
                fail(op, f"{name} must be non-decreasing, got {values}")
            if end - start > most:
                most = end - start
            start = end
        if len(values) > 1 and most > longest:
            fail(op, f"{name} has a sequence of length {most} > max_seqlen {longest}")


def check_paged(op, q, k, v, sinks, cu_q, block_table, seqused_k, max_q, max_k):
    """Packed queries against a paged KV cache: q [total_q, heads, E], key and value pools
    [pages, page_size, heads_kv, E|Ev], block_table int32 [batch, max_pages], seqused_k int32
    [batch]. In host memory, the offsets, the lengths and the pages they use are read: a page
    out of the pool or a length beyond the table is an error. On a device they are not (that
    would synchronize it on every decode step, see check_cu_seqlens): the decode kernels clamp
    every page index and length, so a bad table gives wrong rows, never a read outside."""
    _check_float_same(op, ("query", "key", "value"), (q, k, v))
    if q.dim() != 3:
        fail(op, f"query must be packed [total_tokens, heads, dim], got rank {q.dim()}")
    for name, t in (("key", k), ("value", v)):
        if t.dim() != 4:
            fail(op, f"a paged {name} must be a pool [pages, page_size, heads_kv, dim], got "
                 f"rank {t.dim()}")  # fmt: skip
    if k.shape[:3] != v.shape[:3]:
        fail(op, f"key pool {list(k.shape)} and value pool {list(v.shape)} must agree in all but "
             "the last dim")  # fmt: skip
    if q.shape[-1] != k.shape[-1]:
        fail(op, f"query and key head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    pages, page_size, hk = k.shape[0], k.shape[1], k.shape[2]
    if hk == 0 or q.shape[1] % hk != 0:
        fail(op, f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({hk})")
    if pages == 0 or page_size == 0:
        fail(op, f"the key/value pools hold no keys ({pages} pages of {page_size})")
    _check_sinks(op, sinks, q.shape[1], q)
    for name, t, rank in (("block_table", block_table, 2), ("seqused_k", seqused_k, 1),
                          ("cu_seqlens_q", cu_q, 1)):  # fmt: skip
        if not torch.is_tensor(t) or t.dtype != torch.int32 or t.dim() != rank:
            got = f"{_dtypes(t)} of rank {t.dim()}" if torch.is_tensor(t) else type(t).__name__
            fail(op, f"{name} must be an int32 tensor of rank {rank}, got {got}")
        _check_same_device(op, name, t, q)
    batch = block_table.shape[0]
    if seqused_k.shape[0] != batch or cu_q.shape[0] != batch + 1:
        counts = f"{batch} rows, seqused_k {seqused_k.shape[0]}, cu_seqlens_q {cu_q.shape[0]}"
        fail(op, f"block_table has {counts}: expected batch, batch and batch + 1 entries")
    check_cu_seqlens(op, cu_q, cu_q, q.shape[0], q.shape[0], max_q, max_q, q.device)
    if block_table.device.type != "cpu":
        return
    used = seqused_k.tolist()
    covered = block_table.shape[1] * page_size
    for b, n in enumerate(used):
        if not 0 <= n <= covered:
            fail(op, f"seqused_k[{b}] = {n} keys, but the block table covers {covered} "
                 f"({block_table.shape[1]} pages of {page_size})")  # fmt: skip
        if n > max_k:
            fail(op, f"seqused_k[{b}] = {n} > max_seqlen_k {max_k}")
    table = block_table.tolist()
    for b, n in enumerate(used):
        for j, page in enumerate(table[b][: -(-n // page_size)]):
            if not 0 <= page < pages:
                fail(op, f"block_table[{b}, {j}] = {page} is not a page of the pool "
                     f"(0 .. {pages - 1})")  # fmt: skip


def _broadcast(x, y):
    """The broadcast of shapes x and y, or None when they do not broadcast."""
    if len(x) < len(y):
        x, y = y, x
    out = list(x)
    shift = len(x) - len(y)
    for i, t in enumerate(y):
        s = out[shift + i]
        if s == 1:
            out[shift + i] = t
        elif t != 1 and t != s:
            return None
    return out


def gemm_out_shape(a, b):
    a_batch, b_batch = a.shape[:-2], b.shape[:-2]
    batch = a_batch if a_batch == b_batch else _broadcast(a_batch, b_batch)
    return (*batch, a.shape[-2], b.shape[-1])


def check_gemm(a, b, bias, c, activation):
    if (
        bias is None
        and c is None
        and type(a) is torch.Tensor
        and type(b) is torch.Tensor
        and a.dtype == b.dtype
        and a.device == b.device
        and a.is_floating_point()
        and activation in ACTIVATIONS
    ):
        sa, sb = a.shape, b.shape
        if len(sa) >= 2 and len(sb) >= 2 and sa[-1] == sb[-2] and sa[:-2] == sb[:-2]:
            return  # the common case in one pass; the checks below name any problem
    op = "gemm"
    if bias is None and c is None:
        _check_float_same(op, ("a", "b"), (a, b))
    else:
        named = [(n, t) for n, t in (("a", a), ("b", b), ("bias", bias), ("c", c)) if t is not None]
        _check_float_same(op, [n for n, _ in named], [t for _, t in named])
    if a.dim() < 2 or b.dim() < 2:
        ranks = f"{a.dim()} and {b.dim()}"
        fail(op, f"a and b must be at least 2-D ([..., M, K] and [..., K, N]), got ranks {ranks}")
    if a.shape[-1] != b.shape[-2]:
        shapes = f"a is {list(a.shape)}, b is {list(b.shape)}"
        fail(op, f"inner dims differ: {shapes} (K = {a.shape[-1]} vs {b.shape[-2]})")
    if a.shape[:-2] != b.shape[:-2] and _broadcast(a.shape[:-2], b.shape[:-2]) is None:
        batches = f"a {list(a.shape[:-2])} and b {list(b.shape[:-2])}"
        fail(op, f"batch dims of {batches} do not broadcast")
    shape = gemm_out_shape(a, b)
    if bias is not None and tuple(bias.shape) != (b.shape[-1],):
        fail(op, f"bias must have shape [N] = [{b.shape[-1]}], got {list(bias.shape)}")
    if c is not None and not _broadcasts_to(c.shape, shape):
        fail(op, f"c of shape {list(c.shape)} does not broadcast to the output shape {list(shape)}")
    if activation not in ACTIVATIONS:
        fail(op, f"activation must be one of {ACTIVATIONS}, got {activation!r}")
