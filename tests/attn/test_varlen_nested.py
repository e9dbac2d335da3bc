"""torch_steel.sdpa on jagged nested tensors (torch_steel.ops.nested_ops) served by the varlen
kernels in the Metal simulator, checkers on, strict (a refused plan fails the test): forward
and gradients against PyTorch's own nested F.scaled_dot_product_attention in float64, and,
where PyTorch's nested sdpa refuses the call (is_causal, grouped-query heads), against one
float64 dense reference call per sequence (test_varlen.dense_loop).

The kernels' own sweeps are test_varlen and test_varlen_backward; here the lengths straddle
the 32-row tiles (S % 32 in {1, 31}) so that a conversion that moved a sequence by one row, or
wrapped the result on other offsets, reads or writes the wrong rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attn_helpers import (
    DTYPES,
    OUT_ROUNDING,
    assert_attention_close,
    requires_simulator,
    score_error,
    strict,
)
from test_attention_backward import SLACK
from test_varlen import cu, dense_loop, packed

import torch_steel

pytestmark = requires_simulator

LQ, LK = [33, 1, 31, 65], [31, 64, 1, 33]


def jagged(values, lengths):
    """Packed [total, H, E] values as a jagged [B, H, j, E] (the layout nested F.sdpa takes)."""
    offsets = cu(lengths).long()
    return torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2)


def unpacked(t):
    """A [B, H, j, E] jagged tensor's values, [total, H, E]."""
    return t.transpose(1, 2).values()


def steel_nested(q, k, v, lq, lk, **kwargs):
    """(out, lse) of torch_steel.sdpa on jagged q, k, v in the simulator, as packed tensors
    (out [total_q, H, Ev], lse [H, total_q])."""
    with strict(), torch_steel.backend("sim"):
        out, lse = torch_steel.sdpa(jagged(q, lq), jagged(k, lk), jagged(v, lk), return_lse=True,
                                    **kwargs)  # fmt: skip
    assert out.is_nested and lse.is_nested
    return unpacked(out), unpacked(lse.unsqueeze(-1))[..., 0].transpose(0, 1)


def pytorch_nested(q, k, v, lq, lk):
    """PyTorch's nested F.sdpa in float64 (its math backend), as packed out [total_q, H, Ev]."""
    qn, kn, vn = jagged(q.double(), lq), jagged(k.double(), lk), jagged(v.double(), lk)
    return unpacked(F.scaled_dot_product_attention(qn, kn, vn))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_matches_pytorch_nested_sdpa(dtype):
    q, k, v = packed(LQ, LK, 2, 2, 64, dtype=dtype)
    out, lse = steel_nested(q, k, v, LQ, LK)
    _, ref_lse = dense_loop(q, k, v, LQ, LK)  # PyTorch's nested sdpa returns no lse
    err = score_error(q.transpose(0, 1), k.transpose(0, 1))
    v_max = float(v.double().abs().max())
    assert_attention_close(out, lse, pytorch_nested(q, k, v, LQ, LK), ref_lse, dtype, v_max, err)


@pytest.mark.parametrize(
    "dtype",
    [torch.float16, *(pytest.param(d, marks=pytest.mark.slow) for d in DTYPES[1:])],
    ids=str,
)
def test_gradients_match_pytorch_nested_sdpa(dtype):
    """dq, dk, dv through the varlen backward kernels against float64 autograd through
    PyTorch's nested sdpa (tolerance as test_varlen_backward: the dtype's rounding of each
    gradient plus SLACK of the largest)."""
    q, k, v = packed(LQ, LK, 2, 2, 64, dtype=dtype)
    grad_out = torch.randn(sum(LQ), 2, 64, generator=torch.Generator().manual_seed(9))
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    with strict(), torch_steel.backend("sim"):
        out = torch_steel.sdpa(jagged(leaves[0], LQ), jagged(leaves[1], LK), jagged(leaves[2], LK))
        got = torch.autograd.grad(unpacked(out), leaves, grad_out.to(dtype))
    refs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out = pytorch_nested(*refs, LQ, LK)
    want = torch.autograd.grad(ref_out, refs, grad_out.double())
    for name, g, r in zip(["dq", "dk", "dv"], got, want):
        mag = float(r.abs().max())
        bound = OUT_ROUNDING[dtype] * r.abs() + SLACK[dtype] * mag + 1e-6
        err = (g.double() - r).abs()
        assert bool((err <= bound).all()), f"{name}: worst error {float(err.max()):.3g} ({mag:.3g})"


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_causal_gqa_matches_a_dense_loop(align):
    """is_causal and grouped-query heads, which PyTorch's nested sdpa refuses on CPU: against
    the dense float64 reference per sequence (both causal alignments, L != S)."""
    q, k, v = packed(LQ, LK, 4, 2, 64, dtype=torch.float16)
    kwargs = {"is_causal": True, "causal_align": align}
    out, lse = steel_nested(q, k, v, LQ, LK, enable_gqa=True, **kwargs)
    ref_out, ref_lse = dense_loop(q, k, v, LQ, LK, **kwargs)
    err = score_error(q.transpose(0, 1), k.transpose(0, 1))
    v_max = float(v.double().abs().max())
    assert_attention_close(out, lse, ref_out, ref_lse, torch.float16, v_max, err)
