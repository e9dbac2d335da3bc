"""The attention backward kernels (shaders/steel/attn/backward.h, plan "sdpa_backward") in the
simulator, checkers on: gradients of q, k, v (and sinks) through torch_steel.sdpa on the "sim"
backend, strict, against float64 autograd through the reference math and through F.sdpa.

The forward runs the forward kernel, the backward the delta pre-pass, dK/dV, dQ (and dsinks)
kernels; lse is differentiated too (grad_lse), except where a test says otherwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attn_helpers import DTYPES, OUT_ROUNDING, qkv, rand, requires_simulator, strict

import torch_steel
from torch_steel import sim

pytestmark = requires_simulator

# Pairs with backward kernels (attention_backward.metal): all the forward's.
PAIRS = [(32, 32), (40, 40), (64, 64), (72, 72), (80, 80), (96, 96), (128, 128), (160, 160),
         (192, 128), (192, 192), (256, 256), (512, 512)]  # fmt: skip
# Gradients are sums of many terms each bounded by the largest gradient element: besides the
# rounding of the result to its dtype, allow the fp32 error (f32: 2e-5 of that magnitude) or, for
# f16/bf16, four ulps of it: delta = rowsum(dO * O) reads the forward's out rounded to the dtype.
SLACK = {torch.float32: 2e-5, torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8}
# Function-constant indices (shaders/steel/params.h): q's and grad_out's rows in 16-byte chunks.
VEC_Q, VEC_G = 334, 335


def grads(q, k, v, backend, grad_out, with_lse=True, **kwargs):
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    sinks = kwargs.pop("sinks", None)
    if sinks is not None:
        sinks = sinks.detach().clone().requires_grad_()
        inputs.append(sinks)
    with strict(backend == "sim"), torch_steel.backend(backend):
        out, lse = torch_steel.sdpa(*inputs[:3], return_lse=True, sinks=sinks, **kwargs)
        loss = (out * grad_out.to(out.dtype)).sum()
        if with_lse:
            loss = loss + (lse * torch.linspace(-1, 1, lse.shape[-1], dtype=lse.dtype)).sum()
        return out, torch.autograd.grad(loss, inputs)


def check(q, k, v, with_lse=True, **kwargs):
    """Kernel gradients against float64 autograd through the reference; returns them."""
    gen = torch.Generator().manual_seed(11)
    Ev = v.shape[-1]
    grad_out = torch.randn(*q.shape[:-1], Ev, generator=gen, dtype=torch.float64).to(q.dtype)
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kwargs64 = {**kwargs, "attn_mask": mask.double()}
    else:
        kwargs64 = dict(kwargs)
    if kwargs.get("sinks") is not None:
        kwargs64["sinks"] = kwargs["sinks"].double()
    _, got = grads(q, k, v, "sim", grad_out, with_lse, **kwargs)
    _, want = grads(q.double(), k.double(), v.double(), "reference", grad_out.double(), with_lse,
                    **kwargs64)  # fmt: skip
    names = ["dq", "dk", "dv", "dsinks"][: len(got)]
    for name, g, r in zip(names, got, want, strict=True):
        assert g.shape == r.shape, name
        assert not bool(g.isnan().any()), f"{name}: NaN"
        mag = float(r.abs().max()) if r.numel() else 0.0
        bound = OUT_ROUNDING[g.dtype] * r.abs() + SLACK[q.dtype] * mag + 1e-6
        err = (g.double() - r).abs()
        assert bool((err <= bound).all()), (
            f"{name}: worst error {float(err.max()):.3g} (max {mag:.3g})"
        )
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E,Ev", PAIRS)
def test_every_instantiation(E, Ev, dtype):
    q, k, v = qkv(1, 2, 33, 47, E, Ev, dtype=dtype)
    check(q, k, v, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E", [32, 40, 64, 72, 96])
@pytest.mark.parametrize("L", [24, 48])
def test_streamed_tile_edges(E, L, dtype):
    """The backward streams 8, 16 or 32 query rows a tile by the pair's residency (params.h
    steel_attn_bwd_bk; 16 or 8 at these pairs for some dtype): 24 rows are whole 8-row tiles
    only, 48 whole 16-row ones but not 32; the dK/dV kernel trusts whole tiles to hold no row
    past L (STEEL_ATTN_FC_ALIGN_Q), so a plan that claims it wrongly reads and sums past q."""
    q, k, v = qkv(1, 2, L, 56, E, E, dtype=dtype)
    check(q, k, v, is_causal=True)


@pytest.mark.parametrize("L,S", [(1, 1), (7, 100), (33, 33), (100, 7), (70, 257)])
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_lengths_and_causal(L, S, align):
    q, k, v = qkv(1, 2, L, S, 64, dtype=torch.float32)
    check(q, k, v, is_causal=True, causal_align=align)


def test_matches_pytorchs_autograd():
    q, k, v = qkv(2, 3, 40, 40, 64, dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    grad_out = torch.randn(2, 3, 40, 64, generator=gen)
    _, got = grads(q, k, v, "sim", grad_out, with_lse=False, is_causal=True)
    ref = [x.double().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=True)
    want = torch.autograd.grad((out * grad_out.double()).sum(), ref)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), r, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [(16, 0), (5, 9), (0, 0), (-1, 3)])
def test_windows(window):
    q, k, v = qkv(1, 2, 100, 77, 32, dtype=torch.float32)
    check(q, k, v, window=window, causal_align="bottom_right")


@pytest.mark.parametrize("kind", ["bool", "same", "float32"])
@pytest.mark.parametrize("shape", [(33, 47), (2, 1, 33, 47), (1, 3, 1, 47)])
def test_masks(kind, shape):
    q, k, v = qkv(2, 3, 33, 47, 40, dtype=torch.float16)
    gen = torch.Generator().manual_seed(3)
    if kind == "bool":
        mask = torch.rand(shape, generator=gen) > 0.3
    else:
        mask = torch.randn(shape, generator=gen).to(
            torch.float16 if kind == "same" else torch.float32
        )
    check(q, k, v, attn_mask=mask)


def test_softcap_scale_sinks_gqa():
    q, k, v = qkv(2, 8, 33, 40, 64, Hkv=2, dtype=torch.float32)
    check(q, k, v, enable_gqa=True, softcap=5.0, scale=0.3, sinks=torch.randn(8))
    q, k, v = qkv(1, 6, 20, 50, 96, Hkv=1, dtype=torch.bfloat16)
    check(q, k, v, enable_gqa=True, is_causal=True, sinks=torch.randn(6).to(torch.bfloat16))
    check(q, k, v, enable_gqa=True, with_lse=False, attn_mask=torch.randn(20, 50).bfloat16())


def test_fully_masked_rows_have_zero_gradients():
    q, k, v = qkv(1, 2, 33, 40, 64, dtype=torch.float32)
    keep = torch.rand(33, 40) > 0.5
    keep[4] = False
    dq, dk, dv = check(q, k, v, attn_mask=keep)
    assert bool((dq[:, :, 4] == 0).all())
    q, k, v = qkv(1, 1, 50, 9, 32, dtype=torch.float16)  # bottom-right: rows 0..40 see nothing
    dq, _, _ = check(q, k, v, is_causal=True, causal_align="bottom_right")
    assert bool((dq[:, :, :41] == 0).all())


def test_strided_and_expanded_inputs():
    gen = torch.Generator().manual_seed(4)
    B, L, S, H, E = 2, 33, 40, 4, 64
    q = rand(B, L, H, E, dtype=torch.float16, gen=gen).transpose(1, 2)
    k = rand(B, S, H, E, dtype=torch.float16, gen=gen).transpose(1, 2)
    cache = rand(B, H, 100, E, dtype=torch.float16, gen=gen)
    v = cache[:, :, 7 : 7 + S]
    check(q, k, v, is_causal=True)
    k1 = rand(1, 1, S, E, dtype=torch.float32, gen=gen).expand(B, H, S, E)
    check(rand(B, H, L, E, dtype=torch.float32, gen=gen), k1, k1 * 0.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_unaligned_q_and_grad_out_rows(dtype):
    """q and grad_out whose rows are not 16-byte aligned: the dK/dV kernel streams them element
    by element (the plan's STEEL_ATTN_FC_VEC_Q/G are false; a 16-byte load there is a misaligned
    access, which the checkers report), and the gradients match float64 autograd."""
    gen = torch.Generator().manual_seed(6)
    B, H, L, S, E = 1, 2, 33, 40, 64
    n = B * H * L * E
    q = rand(n + 3, dtype=dtype, gen=gen)[3 : 3 + n].view(B, H, L, E)  # 3 elements past a chunk
    k, v = rand(B, H, S, E, dtype=dtype, gen=gen), rand(B, H, S, E, dtype=dtype, gen=gen)
    # Rows 67 elements apart from element 1: unaligned, and a row stride other than q's.
    grad_out = rand(B, H, L, E + 3, dtype=dtype, gen=gen)[..., 1 : 1 + E]
    opts = {"scale": E**-0.5, "is_causal": True}
    out, lse = sim.run_op("sdpa", [q, k, v, None, None], opts)
    tensors = [grad_out, q, k, v, out, lse, None, None, None]
    plan = sim.plan("sdpa_backward", tensors, opts)
    dkdv = next(d for d in plan.dispatches if "dkdv" in d.kernel)
    assert (dkdv.constants[VEC_Q], dkdv.constants[VEC_G]) == (False, False)
    got = sim.run_op("sdpa_backward", tensors, opts, checkers=True)
    inputs = [x.double().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*inputs, is_causal=True)
    want = torch.autograd.grad(ref, inputs, grad_out.double())
    for name, g, r in zip(["dq", "dk", "dv"], got[:3], want, strict=True):
        mag = float(r.abs().max())
        bound = OUT_ROUNDING[dtype] * r.abs() + SLACK[dtype] * mag + 1e-6
        err = (g.double() - r).abs()
        assert bool((err <= bound).all()), f"{name}: worst error {float(err.max()):.3g}"


def test_deterministic():
    q, k, v = qkv(1, 4, 70, 90, 64, Hkv=2, dtype=torch.float32)
    grad_out = torch.randn(1, 4, 70, 64)
    _, first = grads(q, k, v, "sim", grad_out, enable_gqa=True, is_causal=True)
    _, second = grads(q, k, v, "sim", grad_out, enable_gqa=True, is_causal=True)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_float32_head_dim_512_with_options():
    """float32 at head dim 512, where Q and dO (K and V) take turns in one tile buffer (params.h):
    ragged L != S both ways, GQA, both causal alignments, window, softcap, sinks, dropout and
    an additive mask, each against the float64 reference."""
    q, k, v = qkv(1, 4, 21, 45, 512, Hkv=2, dtype=torch.float32)
    check(q, k, v, enable_gqa=True, is_causal=True, causal_align="bottom_right",
          sinks=torch.randn(4), softcap=8.0)  # fmt: skip
    check(q, k, v, enable_gqa=True, window=(11, 4), dropout_p=0.2, seed=3,
          attn_mask=torch.randn(21, 45))  # fmt: skip
    q, k, v = qkv(2, 2, 45, 13, 512, dtype=torch.float32)
    check(q, k, v, is_causal=True)


def test_mask_grad_of_a_bool_mask_is_refused_with_a_reason():
    from torch_steel import sim

    q16, k16, v16 = (x.half() for x in qkv(1, 1, 8, 8, 64, dtype=torch.float32))
    mask = torch.ones(8, 8, dtype=torch.bool)
    args = [q16, q16, k16, v16, q16, torch.zeros(1, 1, 8), mask, None, None]
    p = sim.plan("sdpa_backward", args, {"scale": 0.1, "mask_grad": True})
    assert not p.ok and "float attn_mask" in p.reason


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E,Ev", PAIRS)
def test_instantiations_sweep(E, Ev, dtype):
    q, k, v = qkv(1, 2, 100, 130, E, Ev, dtype=dtype)
    check(q, k, v, attn_mask=torch.rand(100, 130) > 0.3, softcap=20.0, sinks=torch.randn(2),
          window=(60, 10))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_finfo_min_padding_rows(dtype):
    """Hugging Face's padding: finfo.min on padded keys and on every key of a padded query row,
    with a nonzero gradient on that row. exp(s - lse) alone gives every key of the padded row a
    weight of 1 (scores and lse round to the same float); the pre-pass restores the normaliser,
    so the gradients match the exact reference."""
    q, k, v = qkv(1, 2, 20, 30, 64, dtype=dtype)
    mask = torch.zeros(1, 1, 20, 30, dtype=dtype)
    mask[..., 5, :] = torch.finfo(dtype).min
    mask[..., :, 25:] = torch.finfo(dtype).min
    check(q, k, v, attn_mask=mask)


def test_compiled_training_step_runs_the_kernels():
    """torch.compile(fullgraph=True) traces a small attention block's forward and backward
    through the ops' fake implementations; run on the "sim" backend, the compiled step's
    gradients equal the eager step's (both on the kernels)."""
    gen = torch.Generator().manual_seed(8)
    proj = torch.nn.Linear(64, 3 * 64)
    x = torch.randn(2, 33, 64, generator=gen)

    def loss(x):
        q, k, v = proj(x).view(2, 33, 3, 4, 16).permute(2, 0, 3, 1, 4)
        out = torch_steel.sdpa(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(2, 33, 64).square().mean()

    def step(fn):
        return torch.autograd.grad(fn(x), [proj.weight, proj.bias])

    with strict(), torch_steel.backend("sim"):
        eager = step(loss)
        compiled = step(torch.compile(loss, backend="aot_eager", fullgraph=True))
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
