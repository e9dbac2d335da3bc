"""The varlen backward (plan "sdpa_varlen_backward": the delta, dK/dV, dQ and dsinks kernels of
shaders/steel/attn/backward.h with STEEL_ATTN_FC_VARLEN) in the simulator, checkers on, strict:
gradients of q, k, v (and sinks) through torch_steel.sdpa_varlen against float64 autograd
through a loop of dense reference calls, one per sequence.

One launch per kernel for the whole packed batch. Lengths straddle the tiles (32 query rows or
keys per threadgroup, 8 to 32 streamed) and include an empty sequence; the checkers report any
access outside the packed tensors or the offsets, so a block that strays past its sequence
fails even where the numbers would not show it.
"""

from __future__ import annotations

import pytest
import torch
from attn_helpers import DTYPES, OUT_ROUNDING, requires_simulator, strict
from test_attention_backward import SLACK
from test_varlen import RAGGED, cu, packed

import torch_steel

pytestmark = requires_simulator


def varlen_grads(q, k, v, lq, lk, grad_out, **kwargs):
    """Gradients of <out, grad_out> + <lse, ramp> through the kernels (sim, strict)."""
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    sinks = kwargs.pop("sinks", None)
    if sinks is not None:
        inputs.append(sinks.detach().clone().requires_grad_())
    with strict(), torch_steel.backend("sim"):
        out, lse = torch_steel.sdpa_varlen(*inputs[:3], cu(lq), cu(lk), max(lq), max(lk),
                                           sinks=sinks if sinks is None else inputs[3],
                                           return_lse=True, **kwargs)  # fmt: skip
        ramp = torch.linspace(-1, 1, lse.shape[-1], dtype=lse.dtype)
        loss = (out * grad_out.to(out.dtype)).sum() + (lse * ramp).sum()
        return torch.autograd.grad(loss, inputs)


def dense_grads(q, k, v, lq, lk, grad_out, **kwargs):
    """The oracle: float64 autograd through one dense reference call per sequence, with
    dropout's batch index the sequence's index as in the kernels (offset + b would not do: the
    dense call of sequence b is batch entry 0, so its weights are regenerated here directly)."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    sinks = kwargs.pop("sinks", None)
    if sinks is not None:
        leaves.append(sinks.detach().double().requires_grad_())
    cq, ck = cu(lq).tolist(), cu(lk).tolist()
    ramp = torch.linspace(-1, 1, q.shape[0], dtype=torch.float64)
    loss = 0.0
    for b in range(len(lq)):
        if lq[b] == 0:
            continue
        qs = leaves[0][cq[b] : cq[b + 1]].transpose(0, 1).unsqueeze(0)
        ks = leaves[1][ck[b] : ck[b + 1]].transpose(0, 1).unsqueeze(0)
        vs = leaves[2][ck[b] : ck[b + 1]].transpose(0, 1).unsqueeze(0)
        out, lse = sequence(qs, ks, vs, leaves[3] if sinks is not None else None, b, kwargs)
        go = grad_out[cq[b] : cq[b + 1]].double().transpose(0, 1).unsqueeze(0)
        loss = loss + (out * go).sum() + (lse[0] * ramp[cq[b] : cq[b + 1]]).sum()
    return torch.autograd.grad(loss, leaves)


def sequence(qs, ks, vs, sinks, b, kwargs):
    """Sequence b through the reference's dense forward (torch_steel.reference.sdpa_forward is
    differentiable in float64 torch ops) with batch_index b."""
    from torch_steel import ops
    from torch_steel import reference as ref

    attn = ops.attention_ops._resolve("sdpa", qs.shape[-1], kwargs.get("dropout_p", 0.0),
                        kwargs.get("is_causal", False), kwargs.get("scale"), sinks,
                        kwargs.get("softcap"), kwargs.get("window"),
                        kwargs.get("causal_align", "top_left"), kwargs.get("seed"),
                        kwargs.get("offset", 0))  # fmt: skip
    ks = ks.repeat_interleave(qs.shape[1] // ks.shape[1], 1)
    vs = vs.repeat_interleave(qs.shape[1] // vs.shape[1], 1)
    return ref.sdpa_forward(qs, ks, vs, None, *attn.math(), batch_index=b)


def check(lq, lk, Hq=4, Hkv=2, E=64, dtype=torch.float32, **kwargs):
    q, k, v = packed(lq, lk, Hq, Hkv, E, dtype=dtype)
    grad_out = torch.randn(sum(lq), Hq, E, generator=torch.Generator().manual_seed(9))
    got = varlen_grads(q, k, v, lq, lk, grad_out.to(dtype), **dict(kwargs))
    want = dense_grads(q, k, v, lq, lk, grad_out.to(dtype), **dict(kwargs))
    assert len(got) == len(want)
    for name, g, r in zip(["dq", "dk", "dv", "dsinks"], got, want):
        assert g.shape == r.shape, name
        assert not bool(g.isnan().any()), f"{name}: NaN"
        mag = float(r.abs().max()) if r.numel() else 0.0
        bound = OUT_ROUNDING[g.dtype] * r.abs() + SLACK[dtype] * mag + 1e-6
        err = (g.double() - r).abs()
        assert bool((err <= bound).all()), f"{name}: worst error {float(err.max()):.3g} ({mag:.3g})"
    return got


@pytest.mark.parametrize(
    "dtype",
    [torch.float16, *(pytest.param(d, marks=pytest.mark.slow) for d in DTYPES[1:])],
    ids=str,
)
def test_ragged_lengths(dtype):
    check(RAGGED, RAGGED, dtype=dtype)


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("lq,lk", [(RAGGED, [3, 7, 50, 300, 9]), ([40, 1, 0, 70], [9, 33, 5, 0])])
def test_causal_both_alignments_l_not_s(lq, lk, align):
    check(lq, lk, is_causal=True, causal_align=align)


def test_gqa_window_sinks_softcap_scale():
    check([33, 0, 90, 5], [40, 8, 70, 1], Hq=6, Hkv=1, E=32, window=(12, 3), softcap=6.0,
          sinks=torch.randn(6), scale=0.2, causal_align="bottom_right")  # fmt: skip


def test_dropout():
    check([33, 0, 57], [20, 5, 64], dropout_p=0.3, seed=7, offset=3, is_causal=True)


@pytest.mark.slow
def test_wide_head_dims():
    check([9, 40], [33, 17], Hq=2, Hkv=2, E=256, dtype=torch.float32)
    check([9, 40], [33, 17], Hq=2, Hkv=1, E=512, dtype=torch.float16)
    check([9, 40, 0, 3], [33, 17, 4, 0], Hq=4, Hkv=2, E=512, dtype=torch.float32,
          window=(6, 2), sinks=torch.randn(4))  # fmt: skip


def test_float32_head_dim_512():
    """float32 at 512 (Q and dO, K and V sharing one tile buffer), short: GQA, causal, ragged."""
    check([13, 0, 5], [4, 9, 21], Hq=2, Hkv=1, E=512, is_causal=True, causal_align="bottom_right")


def test_deterministic():
    lengths = [1, 7, 100, 0, 40]
    q, k, v = packed(lengths, lengths, 4, 2, 32, dtype=torch.float32)
    grad_out = torch.randn(q.shape[0], 4, 32)
    first = varlen_grads(q, k, v, lengths, lengths, grad_out, is_causal=True)
    second = varlen_grads(q, k, v, lengths, lengths, grad_out, is_causal=True)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
