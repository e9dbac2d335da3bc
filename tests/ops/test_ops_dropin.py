"""F.scaled_dot_product_attention's behaviours that steel must reproduce (issue 12): bias
objects, finfo.min padding rows, nested tensors, dropout_p errors, autocast, grouped-query
attention with different key and value head counts, and the output's memory layout."""

import pytest
import torch
import torch.nn.functional as F
from ops_helpers import randn, torch_sdpa64
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import torch_steel
from torch_steel import patching
from torch_steel import reference as ref

CPU = ("mps", "cpu")


def pytorch_sdpa(*args, **kwargs):
    return patching._pytorch_sdpa(*args, **kwargs)


# ----------------------------------------------------------------------------- CausalBias


@pytest.mark.parametrize("bias", [causal_lower_right, causal_upper_left])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_causal_bias_objects_are_kept(bias, backend):
    """Before: patch() replaced the Python function, PyTorch's bias object no longer recognised
    the call, and a fallback ran unmasked attention."""
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    mask = bias(3, 5)
    expected = F.scaled_dot_product_attention(q, k, k, mask)
    with torch_steel.backend(backend), torch_steel.patch(devices=CPU):
        got = F.scaled_dot_product_attention(q, k, k, mask)
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    keep = mask._materialize()
    torch.testing.assert_close(got, torch_sdpa64(q, k, k, keep).float(), atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- finfo.min rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_masked_with_finfo_min_are_exact(dtype):
    """Hugging Face pads with finfo(dtype).min: a fully padded row attends uniformly (PyTorch's
    softmax). Before: exp(s - lse) with lse ~ -3.4e38 gave every key weight 1 (5x too large)."""
    L, S = 4, 5
    q, k, v = (randn(2, 3, n, 8, dtype=dtype, requires_grad=True) for n in (L, S, S))
    mask = torch.zeros(2, 1, L, S, dtype=dtype)
    mask[0, :, 1] = torch.finfo(dtype).min  # a fully padded query row
    mask[1, :, :, 3:] = torch.finfo(dtype).min  # padded keys
    mask.requires_grad_()
    grad = torch.randn(2, 3, L, 8, dtype=dtype)
    with torch_steel.backend("reference"):
        out = torch_steel.sdpa(q, k, v, mask)
    grads = torch.autograd.grad(out, (q, k, v, mask), grad)
    expected = torch_sdpa64(q, k, v, mask)
    expected_grads = torch.autograd.grad(expected, (q, k, v, mask), grad.double())
    torch.testing.assert_close(out[0, :, 1], v[0].mean(-2).expand(3, 8), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out, expected.to(dtype), atol=1e-6, rtol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want.to(dtype), atol=1e-6, rtol=1e-5)


def test_finfo_min_row_with_sinks_is_exact():
    q, k, v = randn(1, 2, 3, 4), randn(1, 2, 5, 4), randn(1, 2, 5, 4)
    mask = torch.zeros(3, 5, dtype=torch.float64)
    mask[0] = torch.finfo(torch.float64).min
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    out, lse = torch_steel.sdpa(q, k, v, mask, sinks=sinks, return_lse=True)
    # The sink's logit (~1) dwarfs the row's (~-1.8e308): all of the row's weight is the sink's.
    torch.testing.assert_close(out[0, :, 0], torch.zeros(2, 4, dtype=torch.float64))
    torch.testing.assert_close(lse[0, :, 0], sinks)


# ----------------------------------------------------------------------------- nested tensors


def test_nested_jagged_tensors_run_pytorchs_path(steel_calls):
    """Before: NotImplementedError: aten.alias.default from the patched Python function."""
    seqs = [torch.randn(3, 2, 8), torch.randn(5, 2, 8)]
    nt = torch.nested.nested_tensor(seqs, layout=torch.jagged).transpose(1, 2)
    with torch_steel.backend("reference"), torch_steel.patch(devices=CPU):
        got = F.scaled_dot_product_attention(nt, nt, nt)
    assert steel_calls == [] and got.is_nested
    for g, s in zip(got.unbind(), seqs):
        s = s.transpose(0, 1)
        torch.testing.assert_close(g, pytorch_sdpa(s, s, s), atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- dropout_p


@pytest.mark.parametrize("dropout_p", [1.5, -0.1])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_out_of_range_dropout_raises_pytorchs_error(dropout_p, backend):
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(RuntimeError) as theirs:
        F.scaled_dot_product_attention(q, q, q, dropout_p=dropout_p)
    with torch_steel.backend(backend), torch_steel.patch(devices=CPU):
        with pytest.raises(RuntimeError) as ours:
            F.scaled_dot_product_attention(q, q, q, dropout_p=dropout_p)
    assert str(ours.value) == str(theirs.value)


# ----------------------------------------------------------------------------- autocast


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_gives_the_autocast_dtype(dtype, steel_calls):
    q, k = torch.randn(1, 2, 4, 8, requires_grad=True), torch.randn(1, 2, 6, 8)
    mask = torch.randn(4, 6)
    with torch.autocast("cpu", dtype=dtype):
        expected = F.scaled_dot_product_attention(q, k, k, mask)
        direct = torch_steel.sdpa(q, k, k, mask)
        gemm = torch_steel.gemm(q, k.mT)
        with torch_steel.backend("reference"), torch_steel.patch(devices=CPU):
            patched = F.scaled_dot_product_attention(q, k, k, mask)
    assert expected.dtype == dtype
    assert direct.dtype == patched.dtype == gemm.dtype == dtype
    assert steel_calls == ["forward", "forward"]
    torch.testing.assert_close(patched, expected, atol=2e-2, rtol=2e-2)
    patched.float().sum().backward()
    assert q.grad.dtype == torch.float32


def test_autocast_kernels_registered_for_cpu_and_mps():
    for op in ("steel::sdpa_forward", "steel::sdpa_varlen_forward", "steel::gemm"):
        for key in ("AutocastCPU", "AutocastMPS"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op, key), (op, key)


def test_autocast_varlen():
    q = torch.randn(7, 2, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch_steel.sdpa_varlen(q, q, q, cu, cu, 4, 4)
    assert out.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- GQA


@pytest.mark.parametrize("heads", [(8, 2, 4), (8, 4, 2), (6, 2, 3), (8, 1, 4)])
def test_gqa_with_different_key_and_value_heads(heads, steel_calls):
    """Before: refused (key and value must agree in all but the last dim)."""
    hq, hk, hv = heads
    q = randn(2, hq, 5, 8, requires_grad=True)
    k = randn(2, hk, 7, 8, requires_grad=True)
    v = randn(2, hv, 7, 6, requires_grad=True)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    out = torch_steel.sdpa(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, expected)
    for got, want in zip(torch.autograd.grad(out.sum(), (q, k, v)), expected_grads):
        torch.testing.assert_close(got, want)
    with torch_steel.backend("reference"), torch_steel.patch(devices=CPU):
        patched = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert steel_calls == ["forward", "backward", "forward"]
    torch.testing.assert_close(patched, expected)


def test_gqa_head_counts_that_do_not_divide_are_refused():
    q, k, v = randn(1, 8, 3, 4), randn(1, 3, 3, 4), randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="heads"):
        torch_steel.sdpa(q, k, v, enable_gqa=True)


# ----------------------------------------------------------------------------- layout


def _blhd(B, L, H, E, **kwargs):
    return torch.randn(B, L, H, E, **kwargs).transpose(1, 2)  # [B, H, L, E] view of BLHD


def _order(t):
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


@pytest.mark.parametrize("ev", [8, 6])
def test_output_follows_the_querys_layout(ev):
    """Before: always contiguous. A BLHD query gives a BLHD output, as F.sdpa does (which lets
    an attention layer merge heads with a view)."""
    B, L, H, S = 2, 5, 3, 7
    q = _blhd(B, L, H, 8)
    k, v = _blhd(B, S, H, 8), _blhd(B, S, H, ev)
    out = torch_steel.sdpa(q, k, v, is_causal=True)
    assert _order(out) == [0, 2, 1, 3]
    merged = out.transpose(1, 2).view(B, L, H * ev)  # a view: raises if the layout were BHLD
    torch.testing.assert_close(merged, pytorch_sdpa(q, k, v, is_causal=True).transpose(1, 2)
                               .reshape(B, L, H * ev), atol=1e-6, rtol=1e-5)  # fmt: skip
    contiguous = torch_steel.sdpa(q.contiguous(), k, v)
    assert contiguous.is_contiguous()


def test_fake_output_has_the_querys_layout():
    with FakeTensorMode():
        q, k = _blhd(2, 5, 3, 8), _blhd(2, 7, 3, 8)
        out, lse = torch.ops.steel.sdpa_forward(q, k, k, None, *_attn_options(8))
        assert out.stride() == tuple(ref.layout_strides(q, out.shape))
        assert _order(out) == [0, 2, 1, 3] and lse.is_contiguous()


def _attn_options(head_dim):
    from torch_steel.ops.attention_ops import _resolve

    return _resolve("sdpa", head_dim, 0.0, False, None, None, 0.0, None, "top_left", None, 0)


def test_compiled_output_has_the_querys_layout():
    torch._dynamo.reset()
    q = _blhd(2, 5, 3, 8)

    def f(q):
        return torch_steel.sdpa(q, q, q).transpose(1, 2).view(2, 5, 24)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q), f(q))
    torch._dynamo.reset()


def test_layout_strides():
    q = _blhd(2, 5, 1, 8)  # a single head: its stride says nothing
    assert ref.layout_strides(q, (2, 1, 5, 4)) == [20, 20, 4, 1]
    assert ref.layout_strides(_blhd(2, 5, 3, 8), (2, 3, 5, 4)) == [60, 4, 12, 1]
    expanded = torch.randn(1, 3, 5, 8).expand(2, 3, 5, 8)
    assert ref.layout_strides(expanded, (2, 3, 5, 4)) == [60, 20, 4, 1]
    assert ref.layout_strides(torch.randn(2, 3, 8, 5).mT, (2, 3, 5, 4)) == [60, 20, 4, 1]


def test_layout_of_a_backend_output_is_enforced(monkeypatch):
    """sdpa_forward keeps the layout contract whatever a backend returns (a contiguous out is
    copied into the query's layout)."""
    from torch_steel.ops import attention_ops

    def contiguous_run(op, tensors, options, reference):
        out, lse = reference()
        return [out.contiguous(), lse]

    monkeypatch.setattr(attention_ops, "run", contiguous_run)
    q = _blhd(2, 5, 3, 8)
    out = torch_steel.sdpa(q, q, q)
    assert _order(out) == [0, 2, 1, 3]
