"""PyTorch's torch.nn.attention.varlen.varlen_attn served by steel (DESIGN.md section 9).

PyTorch defines varlen_attn (and varlen_attn_out) through the custom ops
torch_attn::_varlen_attn, _varlen_attn_out and _varlen_attn_backward, implemented with
FlashAttention only, so on MPS they have no kernel at all. Importing torch_steel registers, with
torch.library, a kernel for each of them:
  - MPS: steel::sdpa_varlen_forward / steel::sdpa_varlen_backward (the Metal kernels under the
    "auto" and "metal" backends, reference math under "reference");
  - CPU: the same while the steel backend is "sim" or "reference" (so the route is tested
    without a Mac), PyTorch's own implementation otherwise (which refuses CPU, as before);
  - every other device keeps PyTorch's kernels.

The semantics are those of PyTorch's FlashAttention 2 varlen path (aten/.../flash_api.cpp):
  - sequence b is rows cu_seq_q[b]:cu_seq_q[b+1] of query and cu_seq_k[b]:cu_seq_k[b+1] of
    key and value; query row i of a sequence of L queries and S keys sees keys
    i + S - L - left .. i + S - L + right for window_size (left, right), a negative side being
    unbounded, and is_causal sets right = 0 (alignment bottom-right, flash-attn's convention);
  - a window side of at least max_k is unbounded (flash_api drops it so);
  - scale defaults to 1 / sqrt(head dim); key and value may have fewer heads than query (GQA;
    enable_gqa only gates varlen_attn's own check of the head counts);
  - out is [total_q, Hq, D] in query's dtype, lse float32 [Hq, total_q], rng_state a zero uint64
    [2] (there is no dropout); a row that sees no key gives 0 and lse = +inf (FlashAttention's
    value where it does not split the keys);
  - num_splits is the number of partitions the decode kernels split a sequence's keys into
    (None: the plan's choice); num_splits=1 computes each sequence in one pass, so its result
    does not depend on the rest of the batch. The prefill kernel never splits.
  - seqused_k alone keeps the first seqused_k[b] keys of each sequence (gathered: a copy);
  - a paged KV cache: key and value are pools [pages, page_size, Hkv, D], block_table int32
    [B, max_pages], seqused_k int32 [B] and cu_seq_k None (steel::sdpa_paged_forward: the decode
    kernels, for any number of query rows). PyTorch's varlen backward takes no block table: the
    paged path is inference only.
"""

import math

import torch

from . import ops
from .backends import current_backend

_INF = float("inf")


def _attn(query, value, max_k, is_causal, scale, window_size, num_splits, op):
    """steel's attention options (ops.Attn) for the arguments of a torch_attn varlen op."""
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 0):
        raise ValueError(f"torch_steel: {op} needs num_splits >= 0 or None, got {num_splits!r}")
    if value.dim() == 3 and query.dim() == 3 and value.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"torch_steel: {op} needs value's head dim ({value.shape[-1]}) equal to query's "
            f"({query.shape[-1]}): PyTorch's op returns an output shaped like query"
        )
    window_size = (-1, -1) if window_size is None else tuple(window_size)
    if len(window_size) != 2:
        raise ValueError(f"window_size must have length 2, got {len(window_size)}")
    left, right = window_size
    # flash_api: a negative side is unbounded, and so is one of at least max_k keys.
    left = -1 if left < 0 or left >= max_k else int(left)
    right = -1 if right < 0 or right >= max_k else int(right)
    if is_causal:
        right = 0
    head_dim = query.shape[-1] if query.dim() else 0
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    return ops.Attn(0.0, False, float(scale), None, 0.0, left, right, True, 0, 0, num_splits or 0)


def _used_keys(op, key, value, cu_seq_k, seqused_k):
    """seqused_k without a block table: sequence b uses the first seqused_k[b] of its keys
    cu_seq_k[b]:cu_seq_k[b+1]; those are gathered (a copy) into packed key, value and offsets."""
    if not torch.is_tensor(seqused_k) or seqused_k.dtype != torch.int32 or seqused_k.dim() != 1:
        raise ValueError(f"torch_steel: {op} needs seqused_k as a 1-D int32 tensor")
    bounds = cu_seq_k.tolist()
    used = seqused_k.tolist()
    if len(used) != len(bounds) - 1:
        raise ValueError(
            f"torch_steel: {op}: seqused_k has {len(used)} entries for {len(bounds) - 1} sequences"
        )
    rows = []
    for b, n in enumerate(used):
        if not 0 <= n <= bounds[b + 1] - bounds[b]:
            raise ValueError(
                f"torch_steel: {op}: seqused_k[{b}] = {n} outside the sequence's "
                f"{bounds[b + 1] - bounds[b]} keys"
            )
        rows.append(torch.arange(bounds[b], bounds[b] + n, device=key.device))
    index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long, device=key.device)
    offsets = torch.tensor([0, *torch.tensor(used, dtype=torch.long).cumsum(0).tolist()])
    return key[index], value[index], offsets.to(torch.int32).to(cu_seq_k.device)


def _forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale, window_size,
             seqused_k, block_table, num_splits, op):  # fmt: skip
    attn = _attn(query, value, max_k, is_causal, scale, window_size, num_splits, op)
    if seqused_k is not None and block_table is None and cu_seq_k is not None:
        key, value, cu_seq_k = _used_keys(op, key, value, cu_seq_k, seqused_k)
        seqused_k = None
    if block_table is not None or seqused_k is not None:
        if block_table is None or seqused_k is None or cu_seq_k is not None:
            raise ValueError(
                f"torch_steel: {op} reads a paged KV cache with block_table and seqused_k "
                "together, and cu_seq_k=None"
            )
        out, lse = torch.ops.steel.sdpa_paged_forward(
            query, key, value, cu_seq_q, block_table, seqused_k, max_q, max_k, *attn
        )
    elif cu_seq_k is None:
        raise ValueError(f"torch_steel: {op} needs cu_seq_k (without a block_table)")
    else:
        out, lse = torch.ops.steel.sdpa_varlen_forward(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *attn
        )
    # FlashAttention's lse: float32, +inf where a row saw nothing (steel says -inf).
    return out, lse.float().masked_fill(lse == -_INF, _INF)


def varlen_attn_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                       scale=None, window_size=None, enable_gqa=False, seqused_k=None,
                       block_table=None, num_splits=None):  # fmt: skip
    """torch_attn::_varlen_attn on steel: (out, lse, rng_state)."""
    out, lse = _forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale,
                        window_size, seqused_k, block_table, num_splits,
                        "varlen_attn")  # fmt: skip
    return out, lse, torch.zeros(2, dtype=torch.uint64, device=query.device)


def varlen_attn_out_kernel(out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                           is_causal=False, scale=None, window_size=None, enable_gqa=False,
                           seqused_k=None, block_table=None, num_splits=None):  # fmt: skip
    """torch_attn::_varlen_attn_out on steel: writes out, returns lse."""
    result, lse = _forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale,
                           window_size, seqused_k, block_table, num_splits,
                           "varlen_attn_out")  # fmt: skip
    out.copy_(result)
    return lse


def varlen_attn_backward_kernel(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q,
                                max_k, is_causal, rng_state, scale=None,
                                window_size=None):  # fmt: skip
    """torch_attn::_varlen_attn_backward on steel::sdpa_varlen_backward: (dq, dk, dv).

    PyTorch's backward takes no gradient of lse (FlashAttention has none)."""
    attn = _attn(query, value, max_k, is_causal, scale, window_size, None,
                 "varlen_attn backward")  # fmt: skip
    lse = lse.masked_fill(lse == _INF, -_INF)  # back to steel's convention for empty rows
    dq, dk, dv, _ = torch.ops.steel.sdpa_varlen_backward(
        grad_out, None, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, *attn
    )
    return dq, dk, dv


def _cpu(kernel, op):
    """CPU: steel while the backend is "sim" or "reference", else PyTorch's implementation."""

    def cpu_kernel(*args, **kwargs):
        if current_backend() in ("sim", "reference"):
            return kernel(*args, **kwargs)
        return op._init_fn(*args, **kwargs)

    cpu_kernel.__name__ = f"{kernel.__name__}_cpu"
    return cpu_kernel


def register():
    """Registers the kernels (once; importing torch_steel calls it). False when this torch has no
    torch.nn.attention.varlen ops."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return False
    pairs = [
        ("_varlen_attn", varlen_attn_kernel),
        ("_varlen_attn_out", varlen_attn_out_kernel),
        ("_varlen_attn_backward", varlen_attn_backward_kernel),
    ]
    for name, kernel in pairs:
        op = getattr(varlen, name, None)
        if op is None or not hasattr(op, "register_kernel") or "mps" in op._backend_fns:
            continue
        op.register_kernel("mps")(kernel)
        op.register_kernel("cpu")(_cpu(kernel, op))
    return True


register()
