"""torch_steel.sdpa on jagged nested tensors (torch_steel.ops.nested_ops), reference backend in
float64, against PyTorch's own nested F.scaled_dot_product_attention (its math backend on CPU)
where PyTorch serves the call, and against one dense F.sdpa call per sequence where it refuses
it (is_causal, grouped-query heads); the bad inputs. (F.sdpa on nested tensors under patch()
stays PyTorch's: the served-table row of test_ops_served_table.)

Tolerance: both sides compute in float64, in different orders; 1e-10 is some 10^5 ulps of the
values (|out| < 4) and 10^6 times below the smallest effect of a wrong offset (a row attending
one key more or less moves the result by O(0.1) on random data).
"""

import pytest
import torch
import torch.nn.functional as F

import torch_steel

TOL64 = {"atol": 1e-10, "rtol": 1e-10}


def jagged(lengths, heads, dim, requires_grad=True, seed=0):
    """A [B, heads, j, dim] jagged float64 tensor (built [B, j, heads, dim], transposed, the
    layout nested F.sdpa takes)."""
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, heads, dim, dtype=torch.float64, generator=gen) for n in lengths]
    nt = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=requires_grad)
    return nt.transpose(1, 2)


def on_offsets(like, heads, dim, seed):
    """A jagged tensor on `like`'s offsets (the same ragged dim: self-attention's q, k, v)."""
    gen = torch.Generator().manual_seed(seed)
    total = like.transpose(1, 2).values().shape[0]
    values = torch.randn(total, heads, dim, dtype=torch.float64, generator=gen)
    nt = torch.nested.nested_tensor_from_jagged(values, like.offsets()).requires_grad_()
    return nt.transpose(1, 2)


def sequences(t):
    """A [B, H, j, E] jagged tensor's sequences, each a dense [1, H, n, E] view."""
    return [x.unsqueeze(0) for x in t.unbind()]


def grads(out, inputs, seed=5):
    """Gradients of <out, g> for a fixed random jagged g on out's offsets, as dense values."""
    g = on_offsets(out.detach(), out.shape[1], out.shape[-1], seed).detach()
    return [x.transpose(1, 2).values() for x in torch.autograd.grad(out, inputs, g)]


LENGTHS = [
    ([3, 5, 2, 1], None),  # self-attention: key and value on the query's offsets
    ([31, 1, 33], [4, 1, 65]),  # cross-attention: the key's own lengths, off the 32-row tiles
]


@pytest.mark.parametrize("lq,lk", LENGTHS)
@pytest.mark.parametrize("kwargs", [{}, {"scale": 0.3}])
def test_matches_pytorch_nested_sdpa(lq, lk, kwargs):
    q = jagged(lq, 2, 8)
    if lk is None:
        k, v = on_offsets(q, 2, 8, 1), on_offsets(q, 2, 6, 2)
    else:
        k, v = jagged(lk, 2, 8, seed=1), jagged(lk, 2, 6, seed=2)
    out = torch_steel.sdpa(q, k, v, **kwargs)
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert out.is_nested and out.layout == torch.jagged and out.shape[-1] == 6
    assert out.transpose(1, 2).offsets() is q.offsets()  # the query's ragged dim
    torch.testing.assert_close(out.transpose(1, 2).values(), expected.transpose(1, 2).values(),
                               **TOL64)  # fmt: skip
    for ours, theirs in zip(grads(out, (q, k, v)), grads(expected, (q, k, v))):
        torch.testing.assert_close(ours, theirs, **TOL64)


def test_result_adds_to_the_query():
    """The result is on the query's offsets: jagged arithmetic with the query works."""
    q = jagged([4, 2, 7], 2, 8)
    k, v = jagged([1, 5, 3], 2, 8, seed=1), jagged([1, 5, 3], 2, 8, seed=2)
    residual = q + torch_steel.sdpa(q, k, v)
    assert residual.shape == q.shape


def dense_loop(q, k, v, **kwargs):
    """The oracle where PyTorch's nested F.sdpa refuses: one dense F.sdpa call per sequence."""
    return [F.scaled_dot_product_attention(*x, **kwargs) for x in zip(*map(sequences, (q, k, v)))]


def causal_bottom_right(qs, ks):
    L, S = qs.shape[-2], ks.shape[-2]
    return torch.ones(L, S, dtype=torch.bool).tril(S - L)


def test_pytorch_nested_sdpa_refuses_causal_and_gqa():
    """Why the dense loop is the oracle of the next test: PyTorch's nested F.sdpa on CPU (its
    math backend) refuses both. A torch that serves them should become that test's oracle."""
    q = jagged([3, 4], 4, 8, requires_grad=False)
    k = jagged([3, 4], 2, 8, requires_grad=False)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, k, enable_gqa=True)


@pytest.mark.parametrize(
    "lq,lk,align",
    [([5, 1, 33], None, "top_left"), ([5, 1, 33], [9, 4, 31], "top_left"),
     ([5, 1, 33], [9, 4, 40], "bottom_right")],  # S >= L: no row without keys (F.sdpa: NaN)
)  # fmt: skip
def test_causal_and_gqa_match_a_dense_loop(lq, lk, align):
    """is_causal (which PyTorch's nested math backend refuses), aligned per sequence as
    causal_align says, with grouped-query heads (4 query heads on 2 key heads)."""
    q = jagged(lq, 4, 8)
    if lk is None:
        k, v = on_offsets(q, 2, 8, 1), on_offsets(q, 2, 8, 2)
    else:
        k, v = jagged(lk, 2, 8, seed=1), jagged(lk, 2, 8, seed=2)
    out = torch_steel.sdpa(q, k, v, is_causal=True, enable_gqa=True, causal_align=align)
    if align == "top_left":
        expected = dense_loop(q, k, v, is_causal=True, enable_gqa=True)
    else:
        expected = [
            F.scaled_dot_product_attention(qs, ks, vs, causal_bottom_right(qs, ks), enable_gqa=True)
            for qs, ks, vs in zip(*map(sequences, (q, k, v)))
        ]
    for got, want in zip(sequences(out), expected):
        torch.testing.assert_close(got, want, **TOL64)
    g = [torch.randn_like(x) for x in expected]
    theirs = torch.autograd.grad(expected, (q, k, v), g)
    g_nested = torch.nested.nested_tensor_from_jagged(
        torch.cat([x[0].transpose(0, 1) for x in g]), q.offsets()
    ).transpose(1, 2)
    ours = torch.autograd.grad(out, (q, k, v), g_nested)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.transpose(1, 2).values(), b.transpose(1, 2).values(),
                                   **TOL64)  # fmt: skip


def test_lse_is_jagged_and_is_the_rows_logsumexp():
    q = jagged([3, 6], 2, 8)
    k, v = jagged([2, 5], 2, 8, seed=1), jagged([2, 5], 2, 8, seed=2)
    out, lse = torch_steel.sdpa(q, k, v, return_lse=True)
    assert lse.is_nested and lse.dim() == 3
    for got, qs, ks in zip(sequences(lse), sequences(q), sequences(k)):
        want = torch.logsumexp(qs @ ks.transpose(-1, -2) / 8**0.5, -1)
        torch.testing.assert_close(got, want, **TOL64)


def test_dropout_is_sdpa_varlen_on_the_packed_sequences():
    """The conversion, dropout included: the same as sdpa_varlen on the packed values with
    cu_seqlens written out from the lengths (dropout draws from the seed, per sequence)."""
    lq, lk = [3, 7, 1], [5, 2, 8]
    q, k, v = jagged(lq, 2, 8), jagged(lk, 2, 8, seed=1), jagged(lk, 2, 8, seed=2)
    out = torch_steel.sdpa(q, k, v, dropout_p=0.4, seed=3)
    packed = [x.transpose(1, 2).values() for x in (q, k, v)]
    cu_q = torch.tensor([0, 3, 10, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 15], dtype=torch.int32)
    expected = torch_steel.sdpa_varlen(*packed, cu_q, cu_k, 7, 8, dropout_p=0.4, seed=3)
    assert torch.equal(out.transpose(1, 2).values(), expected)


def _narrowed():
    padded = torch.randn(3, 6, 2, 8, dtype=torch.float64)  # [B, longest, H, E]
    starts, lengths = torch.tensor([0, 1, 2]), torch.tensor([3, 2, 4])
    nt = torch.nested.narrow(padded, 1, starts, lengths, layout=torch.jagged)
    return nt.transpose(1, 2)


def _strided():
    parts = [torch.randn(2, n, 8, dtype=torch.float64) for n in (3, 4)]
    return torch.nested.nested_tensor(parts)  # layout=torch.strided


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda q: (q, q, q, {"attn_mask": torch.ones(1, dtype=torch.bool)}),
         "attn_mask is not served on nested tensors"),
        (lambda q: (q, torch.randn(2, 2, 4, 8), q, {}), "key is a dense tensor"),
        (lambda q: (q.values(), q, q, {}), "query, key and value must all be nested"),
        (lambda q: (q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), {}),
         r"must be \[batch, heads, ragged seq, dim\]"),
        (lambda q: (_strided(), _strided(), _strided(), {}), "layout torch.strided"),
        (lambda q: (_narrowed(), _narrowed(), _narrowed(), {}), "nested tensor with holes"),
        (lambda q: (q, jagged([2, 2, 2], 2, 8), jagged([2, 2, 2], 2, 8), {}),
         "one batch size"),
        (lambda q: (q, q, jagged([3, 1], 2, 8), {}), "same lengths"),
        (lambda q: (q, jagged([3, 1], 1, 8), jagged([3, 1], 1, 8), {}), "pass enable_gqa=True"),
    ],
)  # fmt: skip
def test_bad_nested_inputs_are_named(make, message):
    q = jagged([2, 5], 2, 8, requires_grad=False)
    query, key, value, kwargs = make(q)
    with pytest.raises(ValueError, match=message):
        torch_steel.sdpa(query, key, value, **kwargs)
