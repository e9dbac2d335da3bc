"""The gradient of a float attn_mask that requires grad, written by the dmask kernel
(shaders/steel/attn/backward.h, plan "sdpa_backward" with mask_grad), in the simulator with
checkers on, strict: against float64 autograd through the reference and through F.sdpa, for
every broadcast of the mask (batch, heads, rows, keys), both mask dtypes, GQA, causal with a
mask, ragged lengths, and the other options the kernel composes with.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from attn_helpers import OUT_ROUNDING, qkv, requires_simulator, strict
from test_attention_backward import SLACK

import torch_steel
from torch_steel import sim

pytestmark = requires_simulator


def grads(backend, q, k, v, mask, grad_out, **kwargs):
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v, mask)]
    with strict(backend == "sim"), torch_steel.backend(backend):
        out, lse = torch_steel.sdpa(*inputs[:3], attn_mask=inputs[3], return_lse=True, **kwargs)
        loss = (out * grad_out.to(out.dtype)).sum()
        loss = loss + (lse * torch.linspace(-1, 1, lse.shape[-1], dtype=lse.dtype)).sum()
        return torch.autograd.grad(loss, inputs)


def check(q, k, v, mask, slack=SLACK, **kwargs):
    """dq, dk, dv and dmask of the kernels against float64 autograd through the reference.

    dmask sums dS over the `n` elements of [*batch, H, L, S] that each mask element broadcasts
    to; each term carries at most the error the other gradients allow (SLACK of the largest
    dS, taken from the same call with the mask expanded to the full shape), so the sum gets n
    times that, plus the rounding of the result to the mask's dtype. `slack`: SLACK per dtype,
    or a larger one for kernels that round more (test_attention_backward_tensor)."""
    gen = torch.Generator().manual_seed(11)
    grad_out = torch.randn(*q.shape[:-1], v.shape[-1], generator=gen, dtype=torch.float64)
    got = grads("sim", q, k, v, mask, grad_out.to(q.dtype), **kwargs)
    q64, k64, v64, m64 = (x.double() for x in (q, k, v, mask))
    want = grads("reference", q64, k64, v64, m64, grad_out, **kwargs)
    full = torch.broadcast_shapes(mask.shape, (*q.shape[:-1], k.shape[-2]))
    ds = grads("reference", q64, k64, v64, m64.expand(full).contiguous(), grad_out, **kwargs)[3]
    n = math.prod(full) // max(mask.numel(), 1)
    for name, g, r in zip(["dq", "dk", "dv", "dmask"], got, want, strict=True):
        assert g.shape == r.shape and g.dtype == (mask if name == "dmask" else q).dtype, name
        assert not bool(g.isnan().any()), f"{name}: NaN"
        mag = float(r.abs().max()) if r.numel() else 0.0
        tol = slack[q.dtype] * mag
        if name == "dmask":
            tol = n * slack[q.dtype] * (float(ds.abs().max()) if ds.numel() else 0.0)
        bound = OUT_ROUNDING[g.dtype] * r.abs() + tol + 1e-6
        err = (g.double() - r).abs()
        assert bool((err <= bound).all()), f"{name}: worst error {float(err.max()):.3g} ({mag:.3g})"
    return got


# Every way a mask can broadcast to [B = 2, H = 3, L, S]: batch, heads, rows, keys, their mixes.
SHAPES = [(2, 3, 33, 47), (33, 47), (2, 1, 33, 47), (1, 3, 33, 47), (3, 1, 47), (2, 3, 1, 47),
          (2, 1, 33, 1), (33, 1), (1, 47), (1, 1, 1, 1), (2, 3, 33, 1), (2, 1, 1, 1)]  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_broadcast(shape):
    q, k, v = qkv(2, 3, 33, 47, 40, dtype=torch.float32)
    mask = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    check(q, k, v, mask, is_causal=True)


@pytest.mark.parametrize("mask_dtype", ["same", "float32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((2, 3, 33, 47), marks=pytest.mark.slow),
        (1, 1, 33, 47),
        pytest.param((2, 3, 1, 1), marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_dtypes(dtype, mask_dtype, shape):
    q, k, v = qkv(2, 3, 33, 47, 64, dtype=dtype)
    mask_t = dtype if mask_dtype == "same" else torch.float32
    mask = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(mask_t)
    check(q, k, v, mask)


@pytest.mark.parametrize("L,S", [(1, 1), (7, 100), (100, 7), (70, 257)])
def test_ragged_lengths_gqa_causal(L, S):
    q, k, v = qkv(2, 4, L, S, 32, Hkv=2, dtype=torch.float32)
    mask = torch.randn(2, 1, L, S, generator=torch.Generator().manual_seed(3))
    check(q, k, v, mask, enable_gqa=True, is_causal=True, causal_align="bottom_right")


def test_with_the_other_options():
    q, k, v = qkv(2, 4, 40, 33, 64, Hkv=1, dtype=torch.float32)
    mask = torch.randn(4, 40, 33, generator=torch.Generator().manual_seed(4))
    check(q, k, v, mask, enable_gqa=True, softcap=5.0, sinks=torch.randn(4), window=(9, 3),
          dropout_p=0.25, seed=5, scale=0.3)  # fmt: skip
    # Hugging Face padding: a row of finfo.min (uniform weights, as in the reference) and
    # finfo.min keys, whose weight and gradient are 0 in every other row.
    mask = torch.zeros(2, 1, 40, 33)
    mask[:, :, 5] = torch.finfo(torch.float32).min
    mask[..., 30:] = torch.finfo(torch.float32).min
    dmask = check(q, k, v, mask, enable_gqa=True)[3]
    assert bool((dmask[:, :, 6:, 30:] == 0).all()) and bool((dmask[:, :, 5] != 0).any())


def test_float32_head_dim_512():
    """The dmask kernel where K and V take turns in one tile buffer (float32 at 512)."""
    q, k, v = qkv(2, 2, 19, 30, 512, Hkv=1, dtype=torch.float32)
    mask = torch.randn(2, 1, 19, 30, generator=torch.Generator().manual_seed(8))
    check(q, k, v, mask, enable_gqa=True, is_causal=True, causal_align="bottom_right")


def test_matches_pytorchs_autograd():
    q, k, v = qkv(2, 3, 40, 40, 64, dtype=torch.float32)
    mask = torch.randn(1, 3, 40, 40, generator=torch.Generator().manual_seed(6))
    grad_out = torch.randn(2, 3, 40, 64, generator=torch.Generator().manual_seed(7))
    inputs = [x.clone().requires_grad_() for x in (q, k, v, mask)]
    with strict(), torch_steel.backend("sim"):
        out = torch_steel.sdpa(*inputs[:3], attn_mask=inputs[3], is_causal=False)
        got = torch.autograd.grad((out * grad_out).sum(), inputs)
    ref = [x.double().requires_grad_() for x in (q, k, v, mask)]
    out = F.scaled_dot_product_attention(*ref[:3], attn_mask=ref[3])
    want = torch.autograd.grad((out * grad_out.double()).sum(), ref)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), r, atol=4e-5, rtol=1e-5)


def test_deterministic_and_only_when_asked():
    q, k, v = qkv(2, 3, 70, 90, 32, dtype=torch.float32)
    mask = torch.randn(1, 1, 70, 90)
    go = torch.randn(2, 3, 70, 32)
    first = grads("sim", q, k, v, mask, go)
    second = grads("sim", q, k, v, mask, go)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    args = [go, q, k, v, q, torch.zeros(2, 3, 70), mask, None, None]
    kernels = [d.kernel for d in sim.plan("sdpa_backward", args, {"scale": 0.1}).dispatches]
    assert not any("dmask" in name for name in kernels)
    asked = sim.plan("sdpa_backward", args, {"scale": 0.1, "mask_grad": True})
    assert [d.kernel for d in asked.dispatches][-1] == "steel_attention_bwd_dmask_f32_e32_v32"
    # row blocks of 32, tiles of the backward's 16 keys at f32 d32 (params.h steel_attn_bwd_bk),
    # entries
    assert tuple(asked.dispatches[-1].grid) == (3, 6, 1)
