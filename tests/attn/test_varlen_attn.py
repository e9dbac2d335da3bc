"""PyTorch's torch.nn.attention.varlen.varlen_attn on steel (torch_steel/varlen.py): CPU tensors
under the "sim" backend run the varlen kernel in the simulator, compared with PyTorch's own
definition of the op's semantics:
  - equal query and key lengths: the padded F.scaled_dot_product_attention of PyTorch's test
    (test/test_varlen_attention.py, AttentionBlock.forward_sdpa): a key-padding mask, tril for
    window (-1, 0), the band i - left .. i + right for a window;
  - other lengths: FlashAttention's rule that PyTorch's varlen op inherits, query i of a
    sequence of L queries and S keys sees keys i + S - L - left .. i + S - L + right (a side of
    at least max_k unbounded), rows that see nothing giving 0 and lse = +inf.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from attn_helpers import OUT_ROUNDING, rand, requires_simulator, strict
from torch.nn.attention.varlen import AuxRequest, varlen_attn, varlen_attn_out

import torch_steel

pytestmark = requires_simulator

LENGTHS = [1, 7, 100, 257, 0]


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed(lq, lk, Hq, Hkv, D, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (rand(sum(lq), Hq, D, dtype=dtype, gen=gen), rand(sum(lk), Hkv, D, dtype=dtype, gen=gen),
            rand(sum(lk), Hkv, D, dtype=dtype, gen=gen))  # fmt: skip


def sim_varlen_attn(q, k, v, lq, lk, **kwargs):
    with torch_steel.backend("sim"):
        return varlen_attn(q, k, v, cu(lq), cu(lk), max(lq), max(lk),
                           return_aux=AuxRequest(lse=True), **kwargs)  # fmt: skip


def padded_definition(q, k, v, lengths, window_size=(-1, -1), scale=None):
    """PyTorch's test of varlen_attn: the padded batch through F.sdpa with its masks (float64)."""
    B, T, Hq, Hkv = len(lengths), max(lengths), q.shape[1], k.shape[1]
    starts = cu(lengths).tolist()

    def pad(x):
        out = x.new_zeros(B, T, *x.shape[1:]).double()
        for b, n in enumerate(lengths):
            out[b, :n] = x[starts[b] : starts[b] + n]
        return out.transpose(1, 2)

    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    mask = mask.expand(B, Hq, T, T)
    if window_size == (-1, 0):
        mask = mask & torch.tril(torch.ones(T, T, dtype=torch.bool))
    if window_size[0] >= 0 or window_size[1] >= 0:
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        band = torch.ones(T, T, dtype=torch.bool)
        if window_size[0] >= 0:
            band &= j >= i - window_size[0]
        if window_size[1] >= 0:
            band &= j <= i + window_size[1]
        mask = mask & band
    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask, scale=scale,
                                         enable_gqa=Hq != Hkv).transpose(1, 2)  # fmt: skip
    return torch.cat([out[b, :n] for b, n in enumerate(lengths)])


def flash_definition(q, k, v, lq, lk, window_size=(-1, -1), scale=None):
    """(out, lse) by FlashAttention's varlen rule, per sequence in float64."""
    max_k = max(lk)
    left, right = (-1 if w < 0 or w >= max_k else w for w in window_size)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    groups = q.shape[1] // k.shape[1]
    outs, lses = [], []
    cq, ck = cu(lq).tolist(), cu(lk).tolist()
    for b, (L, S) in enumerate(zip(lq, lk, strict=True)):
        qs = q[cq[b] : cq[b + 1]].double().transpose(0, 1)
        ks = k[ck[b] : ck[b + 1]].double().transpose(0, 1).repeat_interleave(groups, 0)
        vs = v[ck[b] : ck[b + 1]].double().transpose(0, 1).repeat_interleave(groups, 0)
        i, j = torch.arange(L)[:, None] + S - L, torch.arange(S)[None, :]
        keep = torch.ones(L, S, dtype=torch.bool)
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
        s = (qs @ ks.mT * scale).masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(s, -1) if S else torch.full((q.shape[1], L), float("-inf"))
        p = torch.exp(s - lse.nan_to_num(0.0, 0.0, 0.0)[..., None])
        outs.append((p @ vs).transpose(0, 1) if S else qs.new_zeros(L, q.shape[1], v.shape[2]))
        lses.append(lse.masked_fill(lse.isneginf(), float("inf")))
    return torch.cat(outs), torch.cat(lses, 1)


def assert_close(out, ref, dtype):
    """Rounding of out's dtype plus a few fp32 ulps of the scores (|q|, |k|, |v| <= 4)."""
    err = (out.double() - ref).abs()
    bound = OUT_ROUNDING[dtype] * ref.abs() + 2e-4
    assert bool((err <= bound).all()), f"worst error {float(err.max()):.3g}"


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (16, 0), (3, 5)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_matches_pytorchs_padded_definition(window, dtype):
    q, k, v = packed(LENGTHS, LENGTHS, 4, 4, 64, dtype)
    out, lse = sim_varlen_attn(q, k, v, LENGTHS, LENGTHS, window_size=window)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    assert_close(out, padded_definition(q, k, v, LENGTHS, window), dtype)
    _, ref_lse = flash_definition(q, k, v, LENGTHS, LENGTHS, window)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


def test_gqa_and_scale():
    q, k, v = packed(LENGTHS, LENGTHS, 8, 2, 32, torch.float16)
    out, _ = sim_varlen_attn(q, k, v, LENGTHS, LENGTHS, enable_gqa=True, scale=0.3,
                             window_size=(-1, 0))  # fmt: skip
    assert_close(out, padded_definition(q, k, v, LENGTHS, (-1, 0), scale=0.3), torch.float16)


@pytest.mark.parametrize("window", [(-1, 0), (4, 2), (-1, -1), (1000, 0)])
def test_other_lengths_align_bottom_right(window):
    """Causal and windows align bottom-right per sequence; where a sequence has more queries
    than keys, its first rows see nothing: out 0, lse +inf, as FlashAttention returns them."""
    lq, lk = [1, 7, 100, 257, 0, 40], [100, 7, 33, 300, 5, 0]
    q, k, v = packed(lq, lk, 2, 1, 64, torch.float16)
    out, lse = sim_varlen_attn(q, k, v, lq, lk, window_size=window, enable_gqa=True)
    ref_out, ref_lse = flash_definition(q, k, v, lq, lk, window)
    assert_close(out, ref_out, torch.float16)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)
    if window == (-1, 0):
        for rows in (slice(8, 75), slice(365, 405)):  # 100 queries on 33 keys; no keys at all
            assert bool((out[rows] == 0).all()) and bool(lse[:, rows].isposinf().all())


def test_backward_goes_through_steels_varlen_backward():
    lq = [7, 0, 33, 20]
    q, k, v = (x.requires_grad_() for x in packed(lq, lq, 4, 2, 32, torch.float32))
    grad = rand(*q.shape, dtype=torch.float32, gen=torch.Generator().manual_seed(5))
    calls = []
    real = torch.ops.steel.sdpa_varlen_backward
    with strict(), torch_steel.backend("sim"):  # the varlen backward kernels, no fallback
        out = varlen_attn(q, k, v, cu(lq), cu(lq), 33, 33, window_size=(-1, 0), enable_gqa=True)
        torch.ops.steel.sdpa_varlen_backward = lambda *a: calls.append(1) or real(*a)
        try:
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        finally:
            torch.ops.steel.sdpa_varlen_backward = real
    assert calls == [1]
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = padded_definition(*leaves, lq, (-1, 0))
    expected = torch.autograd.grad(ref, leaves, grad.double())
    for got, want in zip((dq, dk, dv), expected, strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_varlen_attn_out_writes_into_out():
    q, k, v = packed(LENGTHS, LENGTHS, 2, 2, 32, torch.float16)
    buf = torch.empty_like(q)
    with torch_steel.backend("sim"):
        expected = varlen_attn(q, k, v, cu(LENGTHS), cu(LENGTHS), 257, 257)
        got = varlen_attn_out(buf, q, k, v, cu(LENGTHS), cu(LENGTHS), 257, 257)
    assert got.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf, expected, atol=0, rtol=0)


def test_other_backends_keep_pytorchs_behaviour_on_cpu():
    q, k, v = packed([3, 4], [3, 4], 2, 2, 32, torch.float16)
    with pytest.raises(NotImplementedError, match="_flash_attention_forward"):
        with torch_steel.backend("auto"):
            varlen_attn(q, k, v, cu([3, 4]), cu([3, 4]), 4, 4)


def test_paged_kv_cache_through_varlen_attn():
    """block_table / seqused_k with cu_seq_k None (the paged convention) run the decode kernel;
    the oracle gathers each sequence's pages by hand and runs the packed definition."""
    gen = torch.Generator().manual_seed(3)
    lq, used, page = [1, 2], [37, 5], 16
    q = rand(sum(lq), 4, 32, dtype=torch.float16, gen=gen)
    pool_k = rand(9, page, 2, 32, dtype=torch.float16, gen=gen)
    pool_v = rand(9, page, 2, 32, dtype=torch.float16, gen=gen)
    table = torch.tensor([[7, 2, 5], [0, 8, 8]], dtype=torch.int32)
    k = torch.cat([pool_k[table[b].long()].reshape(-1, 2, 32)[:n] for b, n in enumerate(used)])
    v = torch.cat([pool_v[table[b].long()].reshape(-1, 2, 32)[:n] for b, n in enumerate(used)])
    with torch_steel.backend("sim"):
        out, lse = varlen_attn(q, pool_k, pool_v, cu(lq), None, 2, 48, enable_gqa=True,
                               window_size=(-1, 0), return_aux=AuxRequest(lse=True),
                               seqused_k=torch.tensor(used, dtype=torch.int32),
                               block_table=table, num_splits=1)  # fmt: skip
        aux = AuxRequest(lse=True)
        ref_out, ref_lse = varlen_attn(q, k, v, cu(lq), cu(used), 2, 37, enable_gqa=True,
                                       window_size=(-1, 0), return_aux=aux)  # fmt: skip
    torch.testing.assert_close(out, ref_out, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=0)
    bad = torch.tensor([[7, 2, 9], [0, 8, 8]], dtype=torch.int32)  # page 9 of 9
    with torch_steel.backend("sim"), pytest.raises(ValueError, match="not a page of the pool"):
        varlen_attn(q, pool_k, pool_v, cu(lq), None, 2, 48, enable_gqa=True,
                    seqused_k=torch.tensor(used, dtype=torch.int32), block_table=bad)  # fmt: skip


def test_seqused_k_without_a_table_keeps_the_first_keys():
    q, k, v = packed([3, 4], [6, 9], 2, 2, 32, torch.float16)
    with torch_steel.backend("sim"):
        out = varlen_attn(q, k, v, cu([3, 4]), cu([6, 9]), 4, 9,
                          seqused_k=torch.tensor([2, 9], dtype=torch.int32))  # fmt: skip
        keep = torch.cat([torch.arange(0, 2), torch.arange(6, 15)])
        ref = varlen_attn(q, k[keep], v[keep], cu([3, 4]), cu([2, 9]), 4, 9)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_opcheck_on_the_reference_route():
    q, k, v = packed([3, 0, 5], [3, 0, 5], 2, 2, 16, torch.float32)
    c = cu([3, 0, 5])
    with torch_steel.backend("reference"):
        torch.library.opcheck(torch.ops.torch_attn._varlen_attn, (q, k, v, c, c, 5, 5, True))
        out, lse, rng = torch.ops.torch_attn._varlen_attn(q, k, v, c, c, 5, 5, True)
        torch.library.opcheck(
            torch.ops.torch_attn._varlen_attn_backward,
            (torch.ones_like(out), q, k, v, out, lse, c, c, 5, 5, True, rng),
            test_utils=["test_schema", "test_faketensor"],
        )


def test_compiles_fullgraph_with_pytorchs_fake():
    lq = [5, 0, 12]
    q, k, v = packed(lq, lq, 2, 1, 32, torch.float16)

    def f(q, k, v, c):
        return varlen_attn(q, k, v, c, c, 12, 12, window_size=(-1, 0), enable_gqa=True) * 2

    with torch_steel.backend("sim"):
        eager = f(q, k, v, cu(lq))
        compiled = torch.compile(f, backend="eager", fullgraph=True)(q, k, v, cu(lq))
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
