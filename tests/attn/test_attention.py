"""The attention forward kernel (shaders/steel/attn, plan mps_src/plan/attention_plan.cpp) in the
Metal simulator, checkers on, against float64 reference math (torch_steel.reference) and
PyTorch's own F.scaled_dot_product_attention.

Every case goes through torch_steel.sdpa on the "sim" backend in strict mode, so a refused plan
fails instead of falling back. Lengths are chosen off the tile edges (BQ = 32 query rows, BK = 8
to 32 keys): 1, 7, 33, 100, 257. The default run covers every instantiated head-dim pair and
dtype once, and each option alone and in the combinations that ship; @slow widens the sweeps.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from attn_helpers import (
    DTYPES,
    OUT_ROUNDING,
    assert_attention_close,
    check,
    oracle,
    qkv,
    rand,
    requires_simulator,
    steel,
)

pytestmark = requires_simulator

# The (E, Ev) pairs instantiated in attention.metal.
INSTANTIATED = [(32, 32), (40, 40), (64, 64), (72, 72), (80, 80), (96, 96), (128, 128),
                (160, 160), (192, 128), (192, 192), (256, 256), (512, 512)]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E,Ev", INSTANTIATED)
def test_every_instantiation(E, Ev, dtype):
    q, k, v = qkv(1, 2, 33, 47, E, Ev, dtype=dtype)
    check(q, k, v)


@pytest.mark.parametrize("E,Ev", [(8, 8), (16, 24), (100, 100), (136, 136), (200, 200),
                                  (64, 256), (256, 64), (48, 80), (300, 300)])  # fmt: skip
def test_head_dims_between_instantiations(E, Ev):
    q, k, v = qkv(1, 2, 40, 21, E, Ev, dtype=torch.float16)
    check(q, k, v, is_causal=True)


@pytest.mark.parametrize("L,S", [(1, 1), (1, 257), (7, 7), (33, 100), (100, 33), (257, 7)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lengths(L, S, dtype):
    q, k, v = qkv(2, 2, L, S, 64, dtype=dtype)
    check(q, k, v)


# Keys one past and one short of a whole number of 32-key tiles (S % 32 in {1, 31}; 16-key
# tiles see 1 and 15) behind interior tiles: the forward loads and scores a tile that crosses no
# boundary without bounds or element tests (forward.h), so the tile that does cross one must be
# told apart exactly. Query rows likewise 1 past and 1 short of the 32-row blocks.
@pytest.mark.parametrize("L,S", [(97, 95), (95, 97), (64, 129)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "D,dtype",
    [(64, torch.float16), (128, torch.float16), (128, torch.bfloat16), (64, torch.float32)],
    ids=str,
)
def test_interior_and_edge_key_tiles(L, S, causal, D, dtype):
    q, k, v = qkv(1, 4, L, S, D, Hkv=2, dtype=dtype)
    check(q, k, v, is_causal=causal, causal_align="bottom_right", enable_gqa=True)


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("L,S", [(1, 100), (7, 7), (33, 100), (100, 33), (257, 257)])
def test_causal(L, S, align):
    q, k, v = qkv(1, 2, L, S, 64, dtype=torch.float32)
    out, lse = check(q, k, v, is_causal=True, causal_align=align)
    if align == "top_left":  # PyTorch's is_causal
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
        keep = ~ref.isnan().any(-1, keepdim=True)  # F.sdpa gives NaN where we give 0
        torch.testing.assert_close(out.double() * keep, ref.nan_to_num(0.0), atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    "window,align", [((16, 0), "top_left"), ((0, 16), "top_left"), ((5, 9), "bottom_right"),
                     ((40, -1), "top_left"), ((-1, 3), "bottom_right"), ((0, 0), "top_left"),
                     ((1000, 1000), "top_left")],
)  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
def test_window(window, align, causal):
    q, k, v = qkv(1, 2, 100, 77, 32, dtype=torch.float16)
    check(q, k, v, window=window, causal_align=align, is_causal=causal)


MASK_SHAPES = {
    "LS": lambda B, H, L, S: (L, S),
    "B1LS": lambda B, H, L, S: (B, 1, L, S),
    "1H1S": lambda B, H, L, S: (1, H, 1, S),
    "BHLS": lambda B, H, L, S: (B, H, L, S),
    "BH1S": lambda B, H, L, S: (B, H, 1, S),
}


@pytest.mark.parametrize("shape", list(MASK_SHAPES))
@pytest.mark.parametrize("kind", ["bool", "same", "float32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_masks(shape, kind, dtype):
    B, H, L, S = 2, 3, 33, 47
    q, k, v = qkv(B, H, L, S, 40, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    mshape = MASK_SHAPES[shape](B, H, L, S)
    if kind == "bool":
        mask = torch.rand(mshape, generator=gen) > 0.3
    else:
        mask = torch.randn(mshape, generator=gen).to(dtype if kind == "same" else torch.float32)
    check(q, k, v, mask)


def test_mask_float32_inputs_and_strided_mask():
    q, k, v = qkv(2, 2, 33, 47, 64, dtype=torch.float32)
    base = torch.randn(2, 2, 47, 33)  # stored key-major: the mask's last stride is not 1
    check(q, k, v, base.transpose(-1, -2))
    keep = (torch.rand(47, 33) > 0.5).t()
    check(q, k, v, keep)


def test_mask_with_causal_applies_both():
    q, k, v = qkv(1, 2, 40, 40, 64, dtype=torch.float32)
    mask = torch.rand(40, 40) > 0.2
    out, _ = check(q, k, v, mask, is_causal=True)
    bias = torch.randn(40, 40)
    check(q, k, v, bias, is_causal=True, causal_align="bottom_right")


def test_fully_masked_rows_are_zero():
    q, k, v = qkv(1, 2, 33, 40, 64, dtype=torch.float16)
    keep = torch.rand(33, 40) > 0.5
    keep[3] = False
    keep[32] = False
    out, lse = check(q, k, v, keep)
    assert bool((out[:, :, 3] == 0).all()) and bool(lse[:, :, 3].isneginf().all())
    # Causal bottom-right with L > S: the first L - S rows see nothing.
    q, k, v = qkv(1, 1, 50, 9, 32, dtype=torch.float32)
    out, lse = check(q, k, v, is_causal=True, causal_align="bottom_right")
    assert bool((out[:, :, :41] == 0).all()) and bool(lse[:, :, :41].isneginf().all())
    # Additive -inf everywhere on a row.
    bias = torch.zeros(50, 9)
    bias[7] = float("-inf")
    out, _ = check(q, k, v, bias)
    assert bool((out[:, :, 7] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finfo_min_padding_rows(dtype):
    """Hugging Face's padding masks: finfo(dtype).min on the padded keys, and on every key of a
    padded query row.

    bfloat16 and float32: finfo.min swamps the scores in fp32 (its ulp there is 2^100 or more),
    so a fully padded row is exactly uniform over the keys, not 0 and not NaN. float16: finfo.min
    is -65504, whose fp32 ulp is 2^-8: the row is softmax(scores) (shift invariance) with scores
    rounded to 2^-8 by the addition, which moves each weight by at most 2^-8 relative, so the
    bound there is 2^-8 * max|v| more than the ordinary one.
    """
    q, k, v = qkv(1, 2, 20, 30, 64, dtype=dtype)
    mask = torch.zeros(1, 1, 20, 30, dtype=dtype)
    mask[..., 5, :] = torch.finfo(dtype).min
    mask[..., :, 25:] = torch.finfo(dtype).min
    out, lse = steel(q, k, v, mask)
    ref_out, ref_lse = oracle(q, k, v, mask)
    assert not bool(out.isnan().any())
    rows = [r for r in range(20) if r != 5]
    assert_attention_close(out[:, :, rows], lse[:, :, rows], ref_out[:, :, rows],
                           ref_lse[:, :, rows], dtype)  # fmt: skip
    if dtype == torch.float16:
        slack = 2.0**-8 * float(v.double().abs().max())
        torch.testing.assert_close(out[:, :, 5].double(), ref_out[:, :, 5], atol=slack, rtol=0)
    else:  # exactly uniform: the analytic answer
        uniform = v.double().mean(-2)
        bound = OUT_ROUNDING[dtype] * uniform.abs() + 1e-5
        assert bool(((out[:, :, 5].double() - uniform).abs() <= bound).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_sinks_softcap_scale(dtype):
    q, k, v = qkv(2, 4, 33, 70, 64, dtype=dtype)
    sinks = torch.randn(4)
    check(q, k, v, sinks=sinks)
    check(q, k, v, sinks=sinks.to(dtype), is_causal=True, causal_align="bottom_right")
    check(q, k, v, softcap=5.0)
    check(q, k, v, softcap=30.0, scale=0.3, is_causal=True)
    check(q, k, v, scale=2.5)
    bias = torch.randn(33, 70)
    check(q, k, v, bias, softcap=4.0, sinks=sinks, window=(20, 3))


def test_sinks_rows_that_see_nothing():
    """With a sink, a row that sees no key has lse = sink and output 0."""
    q, k, v = qkv(1, 2, 8, 5, 32, dtype=torch.float32)
    sinks = torch.tensor([0.5, -1.0])
    out, lse = check(q, k, v, is_causal=True, causal_align="bottom_right", sinks=sinks)
    assert bool((out[0, :, 0] == 0).all())
    torch.testing.assert_close(lse[0, :, 0], sinks)


@pytest.mark.parametrize("H,Hkv", [(8, 2), (8, 1), (6, 3)])
def test_gqa(H, Hkv):
    q, k, v = qkv(2, H, 33, 47, 64, Hkv=Hkv, dtype=torch.float16)
    out, _ = check(q, k, v, enable_gqa=True, is_causal=True)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                         enable_gqa=True)  # fmt: skip
    torch.testing.assert_close(out.double(), ref, atol=4e-3, rtol=0)


def test_blhd_views_keep_their_layout():
    """BLHD-strided q, k, v (a [B, L, H, E] projection transposed) are read in place, and out
    comes back BLHD as F.sdpa's does, so out.transpose(1, 2).view(B, L, H * Ev) works."""
    B, L, S, H, E = 2, 33, 40, 4, 64
    gen = torch.Generator().manual_seed(3)
    q = rand(B, L, H, E, dtype=torch.float16, gen=gen).transpose(1, 2)
    k = rand(B, S, H, E, dtype=torch.float16, gen=gen).transpose(1, 2)
    v = rand(B, S, H, E, dtype=torch.float16, gen=gen).transpose(1, 2)
    out, _ = check(q, k, v, is_causal=True)
    assert out.transpose(1, 2).is_contiguous()
    out.transpose(1, 2).view(B, L, H * E)


def test_kv_cache_slices_expanded_and_offset_inputs():
    gen = torch.Generator().manual_seed(4)
    cache_k = rand(2, 4, 300, 64, dtype=torch.bfloat16, gen=gen)
    cache_v = rand(2, 4, 300, 64, dtype=torch.bfloat16, gen=gen)
    q = rand(2, 4, 9, 64, dtype=torch.bfloat16, gen=gen)
    k, v = cache_k[:, :, 3:260], cache_v[:, :, 3:260]  # storage offset, row stride 64, S = 257
    check(q, k, v, is_causal=True, causal_align="bottom_right")
    # Batch and heads expanded (stride 0): one K/V shared by every batch entry.
    k1 = rand(1, 1, 50, 64, dtype=torch.bfloat16, gen=gen).expand(3, 4, 50, 64)
    v1 = rand(1, 1, 50, 64, dtype=torch.bfloat16, gen=gen).expand(3, 4, 50, 64)
    check(rand(3, 4, 20, 64, dtype=torch.bfloat16, gen=gen), k1, v1)


def test_odd_strides_are_copied():
    """A head dim that is not contiguous (here every other element) goes through the plan's
    copy; a 4-byte aligned row start keeps the kernel off 16-byte vector loads."""
    gen = torch.Generator().manual_seed(5)
    q = rand(1, 2, 17, 128, dtype=torch.float16, gen=gen)[..., ::2]
    k = rand(1, 2, 23, 66, dtype=torch.float16, gen=gen)[..., 2:]
    v = rand(1, 2, 23, 64, dtype=torch.float16, gen=gen)
    check(q, k, v)


def test_batch_dims_and_rank3():
    q, k, v = qkv(0, 2, 20, 30, 32, dtype=torch.float32, batch=(2, 3))
    check(q, k, v)
    q3, k3, v3 = q[0, 0], k[0, 0], v[0, 0]  # [H, L, E]
    check(q3, k3, v3)
    # Non-mergeable batch dims: q's batch dims permuted.
    qp = q.permute(1, 0, 2, 3, 4).contiguous().permute(1, 0, 2, 3, 4)
    check(qp, k, v, is_causal=True)


def test_empty_and_degenerate():
    q, k, v = qkv(1, 2, 0, 5, 32, dtype=torch.float16)
    out, lse = steel(q, k, v)
    assert out.shape == (1, 2, 0, 32) and lse.shape == (1, 2, 0)
    q, k, v = qkv(1, 2, 5, 0, 32, dtype=torch.float16)
    out, lse = check(q, k, v)
    assert bool((out == 0).all()) and bool(lse.isneginf().all())


def test_inf_and_nan_propagate_like_the_reference():
    q, k, v = qkv(1, 1, 9, 12, 32, dtype=torch.float32)
    v[0, 0, 4, 3] = float("nan")  # every row that weighs key 4 gets NaN in column 3
    q[0, 0, 2, 0] = float("inf")
    out, lse = steel(q, k, v)
    ref_out, ref_lse = oracle(q, k, v)
    assert bool((out.isnan() == ref_out.isnan()).all())
    assert_attention_close(out, lse, ref_out, ref_lse, q.dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E,Ev", INSTANTIATED)
@pytest.mark.parametrize("causal,mask", [(True, None), (False, "bool"), (True, "add")])
def test_instantiations_sweep(E, Ev, dtype, causal, mask):
    L, S = 100, 257
    q, k, v = qkv(1, 2, L, S, E, Ev, dtype=dtype)
    m = None
    if mask == "bool":
        m = torch.rand(L, S) > 0.4
    elif mask == "add":
        m = torch.randn(1, 2, L, S).to(dtype)
    check(q, k, v, m, is_causal=causal, sinks=torch.randn(2), softcap=20.0)


@pytest.mark.slow
@pytest.mark.parametrize("L,S", list(itertools.product([1, 7, 33, 100, 257], repeat=2)))
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_lengths_sweep(L, S, align):
    q, k, v = qkv(1, 2, L, S, 96, dtype=torch.bfloat16)
    check(q, k, v, is_causal=True, causal_align=align, window=(31, -1))


@pytest.mark.slow
def test_offsets_past_two_to_the_31():
    """q, k and v whose batch entries lie 2^32 elements apart in one buffer (8 GiB of address
    space, only the touched pages backed): 32-bit offsets would wrap onto the first entry."""
    storage = torch.empty(2**32 + 3 * 4096, dtype=torch.float16)
    gen = torch.Generator().manual_seed(6)

    def view(at):
        x = storage.as_strided((2, 2, 9, 64), (2**32, 9 * 64, 64, 1), at)
        x.copy_(rand(2, 2, 9, 64, dtype=torch.float16, gen=gen))
        return x

    q, k, v = view(0), view(4096), view(2 * 4096)
    check(q, k, v, is_causal=True)


def test_backward_runs_from_the_kernels_out_and_lse():
    """Autograd through the kernel's forward: the backward op (reference math until its kernel
    lands) rebuilds the probabilities from the kernel's lse and matches float64 autograd."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (rand(1, 2, 33, 64, dtype=torch.float32, gen=gen).requires_grad_() for _ in "qkv")
    bias = rand(33, 33, dtype=torch.float32, gen=gen).requires_grad_()
    out, lse = steel(q, k, v, bias, is_causal=True)
    grad_out = rand(1, 2, 33, 64, dtype=torch.float32, gen=gen)
    grads = torch.autograd.grad((out * grad_out).sum() + lse.sum(), (q, k, v, bias))
    ref_inputs = [x.detach().double().requires_grad_() for x in (q, k, v, bias)]
    ref_out, ref_lse = oracle(*ref_inputs[:3], ref_inputs[3], is_causal=True)
    ref_grads = torch.autograd.grad((ref_out * grad_out.double()).sum() + ref_lse.sum(),
                                    ref_inputs)  # fmt: skip
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)
