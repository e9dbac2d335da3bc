"""Property-based differential tests of the attention backward steel::sdpa_backward
(shaders/steel/attn/backward.h, plan "sdpa_backward") in the Metal simulator, checkers on.

For the forward's calls (strategies.sdpa_calls()) that the backward's plan serves, plus a
dropout draw: the gradients of q, k, v and the sinks through the forward and backward kernels
agree with float64 autograd through the reference, and no guard byte changed.
"""

from __future__ import annotations

import math

import pytest
import torch
from attn_helpers import OUT_ROUNDING, score_error
from fuzz_helpers import (
    fixed,
    fuzz,
    fuzz_mark,
    loss_weights,
    reference_scores,
    requires_simulator,
    row_score_error,
    strict_sim,
)
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import MAX_BACKWARD_HEAD_DIM, Layout, MaskSpec, SdpaCall, sdpa_calls

import torch_steel
from torch_steel import sim

pytestmark = requires_simulator

# test_attention_backward.SLACK: the fp32 error (float32) or four ulps of the dtype (delta reads
# the forward's out rounded to it), relative to the largest gradient element.
SLACK = {torch.float32: 2e-5, torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8}


# The forward's calls within the backward's head dims, a dropout draw, and whether a float mask
# is differentiated too.
CALLS = (sdpa_calls(max_head_dim=MAX_BACKWARD_HEAD_DIM), st.sampled_from([0.0, 0.0, 0.3]),
         st.booleans())  # fmt: skip


def gradients(t, kwargs, dropout, backend, dtype, mask_grad=False, mask=None, lse_grad=True):
    """(out, grad_out, {name: gradient}, (lse, grad_lse)) of <out, grad_out> + <lse, ramp> (the
    lse term only with lse_grad; grad_lse is then the ramp, else 0); with mask_grad (and a
    float mask) the mask is differentiated too; `mask` replaces t's."""
    inputs = {n: t[n].detach().to(dtype).requires_grad_() for n in ("q", "k", "v")}
    sinks = t["sinks"]
    if sinks is not None:
        inputs["sinks"] = sinks.detach().to(torch.float64 if dtype == torch.float64 else
                                            sinks.dtype).requires_grad_()  # fmt: skip
    mask = t["attn_mask"] if mask is None else mask
    if mask is not None and mask.is_floating_point() and dtype == torch.float64:
        mask = mask.double()
    if mask_grad and mask is not None and mask.is_floating_point():
        mask = inputs["dmask"] = mask.detach().clone().requires_grad_()
    with torch_steel.backend(backend):
        out, lse = torch_steel.sdpa(inputs["q"], inputs["k"], inputs["v"], mask,
                                    sinks=inputs.get("sinks"), return_lse=True, dropout_p=dropout,
                                    seed=1234, **kwargs)  # fmt: skip
        g, w = loss_weights(out.shape, lse.shape[-1], t["q"].dtype)
        finite = torch.isfinite(lse)
        loss = (out * g.to(out.dtype)).sum()
        if lse_grad:
            loss = loss + (torch.where(finite, lse, 0) * w.to(lse.dtype)).sum()
        grads = torch.autograd.grad(loss, list(inputs.values()))
    names = ["d" + n if n != "dmask" else n for n in inputs]
    return out, g, dict(zip(names, grads, strict=True)), (lse, w if lse_grad else 0 * w)


def sink_terms(out, g, lse, w, sinks):
    """The largest over heads of sum over rows of |exp(sink - lse) * delta|, delta = rowsum(dO *
    O) - grad_lse: the magnitude of what the dsinks kernel adds up (float64, from the
    reference's out and lse; rows that see nothing, lse = -inf, add nothing)."""
    delta = (g * out.detach().double()).sum(-1) - w
    p = torch.exp(sinks.detach().double()[:, None] - lse.detach().double())
    terms = torch.where(torch.isfinite(lse), p * delta.abs(), 0.0)
    return float(terms.transpose(-1, -2).flatten(0, -2).sum(0).max()) if terms.numel() else 0.0


def assert_gradients_close(got, want, q, k, out, g, scale, E, softcap, rows, L,
                           dmask_terms=None, sinks_sum=0.0, rounding=0.0,
                           score_err=None):  # fmt: skip
    """dq, dk, dv (dsinks, dmask) of the kernels within the bound of float64's: the dtype's
    rounding, SLACK and the score error relative to the largest element, and delta's error.

    delta = rowsum(dO * O) reads out rounded to its dtype: an error of half an ulp of each
    |dO O| term in every dS of the row, which dq sees times scale * |k| (its weights sum to
    1), dk times scale * |q| summed over the rows (L at most), dsinks summed over every row of
    the batch (`rows`; its weights are at most 1). dmask sums n dS terms per element (the
    broadcast pairs, rows, keys; dmask_terms = (n, max |dS|) from the unbroadcast call): n times
    one term's bound, and delta's error on each (the weights of a row's dS sum to at most 1,
    over at most rows * heads rows).

    dsinks is a sum of `rows` fp32 terms exp(sink - lse) * delta, and the terms can cancel: with
    every key hidden, O = 0 and delta = -grad_lse, so dsinks is the sum of the lse gradient's
    ramp over the rows, 0 in float64 and a few fp32 ulps of sum |terms| in the kernel (issue
    31: -1.19e-6 over 127 rows whose |terms| sum to 64, exactly the fp32 sum in the kernel's
    order). So it also gets the error of any fp32 sum of `rows` terms, (rows - 1) * 2^-24 of
    sinks_sum (the sum of |terms|, sink_terms), plus each term's own error: a few roundings
    and exp(sink - lse) through lse's error (the score error, 4 * err) relative to that term.
    `rounding`: a further relative slack of the largest element (a kernel that rounds operands
    to a storage dtype, test_fuzz_sdpa_backward_tensor).

    `score_err`: the scores' fp32 error where the caller knows more than q, k and softcap (the
    additive mask's rounding, fuzz_helpers.row_score_error: the kernel rebuilds P from
    s + m - lse in fp32, so a mask near 65504 moves each score by up to 2^-8)."""
    err = score_error(q, k, scale) + (8 * 2.0**-24 * softcap if softcap else 0)
    if score_err is not None:
        err = max(err, score_err)
    scale = abs(scale) if scale is not None else E**-0.5
    rowsums = (g.abs() * out.detach().abs().nan_to_num(0.0)).sum(-1)
    d_err = OUT_ROUNDING[q.dtype] * float(rowsums.max()) if rowsums.numel() else 0.0
    q_max = float(q.double().abs().max()) if q.numel() else 0.0
    k_max = float(k.double().abs().max()) if k.numel() else 0.0
    sum_err = ((rows + 3) * 2.0**-24 + 4 * err) * sinks_sum
    extra = {"dq": d_err * scale * k_max, "dk": d_err * scale * q_max * L,
             "dsinks": d_err * rows + sum_err}  # fmt: skip
    assert got.keys() == want.keys()
    for name in got:
        a, r = got[name], want[name]
        assert bool((a.isnan() == r.isnan()).all()), f"{name}: NaN where the reference differs"
        r0 = r.nan_to_num(0.0)
        mag = float(r0.abs().max()) if r.numel() else 0.0
        if name == "dmask":
            n, ds_max = dmask_terms
            mag, extra["dmask"] = n * ds_max, d_err * rows * q.shape[-3]
        slack = (
            OUT_ROUNDING[a.dtype] * r0.abs()
            + (SLACK[q.dtype] + rounding + 4 * err) * mag
            + extra.get(name, 0.0)
            + 1e-6
        )
        diff = (a.double().nan_to_num(0.0) - r0).abs()
        assert bool((diff <= slack).all()), (
            f"{name}: worst error {float(diff.max()):.3g} ({mag:.3g})"
        )


def backward_serves(call, dropout):
    """Whether the backward's plan serves the call (the forward's calls it refuses are skipped)."""
    t, _ = call.build()
    qe, ke, ve = torch_steel.ops.attention_ops._broadcast_qkv(
        t["q"], t["k"], t["v"], call.Hq != call.Hkv
    )
    probe = torch.empty(*qe.shape[:-1], ve.shape[-1], dtype=call.dtype)
    lse = torch.empty(qe.shape[:-1])
    p = sim.plan("sdpa_backward", [probe, qe, ke, ve, probe, lse, t["attn_mask"], t["sinks"], lse],
                 {"scale": 0.1, "dropout_p": dropout})  # fmt: skip
    return p.ok


def check_backward(call, dropout, mask_grad):
    assume(backward_serves(call, dropout))
    compare_backward(call, dropout, mask_grad)


def compare_backward(call, dropout, mask_grad, rounding=0.0):
    t, guards = call.build()
    kwargs = call.kwargs()
    q, k = t["q"], t["k"]
    qe, ke, _ = torch_steel.ops.attention_ops._broadcast_qkv(q, k, t["v"], kwargs["enable_gqa"])
    with strict_sim():
        _, _, got, _ = gradients(t, kwargs, dropout, "sim", q.dtype, mask_grad)
    out, g, want, (lse, w) = gradients(t, kwargs, dropout, "reference", torch.float64, mask_grad)
    sinks_sum = 0.0 if t["sinks"] is None else sink_terms(out, g, lse, w, t["sinks"])
    score_err = None  # what an additive mask adds to the scores' error (row_score_error)
    if t["attn_mask"] is not None and t["attn_mask"].dtype != torch.bool and qe.numel():
        score_err = float(row_score_error(call, t, reference_scores(call, t)).max())
    terms = None
    if "dmask" in want:  # each dmask element sums dS over what the mask broadcasts along
        mask = t["attn_mask"]
        full = torch.broadcast_shapes(mask.shape, (*qe.shape[:-1], ke.shape[-2]))
        ds = gradients(t, kwargs, dropout, "reference", torch.float64, True,
                       mask.expand(full))[2]["dmask"]  # fmt: skip
        terms = (
            math.prod(full) // max(mask.numel(), 1),
            float(ds.abs().max()) if ds.numel() else 0.0,
        )
    assert_gradients_close(got, want, q, k, out, g, call.scale, call.E, call.softcap,
                           math.prod(call.batch) * call.L, call.L, terms, sinks_sum,
                           rounding, score_err)  # fmt: skip
    for guard in guards:
        guard.check()


@fixed(30)
@given(*CALLS)
def test_sdpa_backward_matches_float64(call, dropout, mask_grad):
    """Fixed-seed subset: 30 drawn calls' gradients (the mask's too, when float and
    mask_grad) agree with float64 autograd."""
    check_backward(call, dropout, mask_grad)


def backward_kernels(call, dropout, mask_grad):
    """What the fuzz campaign counts a drawn call toward: the backward, the dmask kernel (a float
    mask that requires grad), dropout."""
    dmask = mask_grad and call.mask is not None and call.mask.dtype != torch.bool
    return ["backward"] + ["dmask"] * dmask + ["dropout"] * (dropout > 0)


@fuzz_mark
@fuzz(backward_kernels)
@given(*CALLS)
def test_fuzz_sdpa_backward(call, dropout, mask_grad):
    """-m fuzz: random calls' gradients agree with float64 autograd."""
    check_backward(call, dropout, mask_grad)


@fuzz_mark
@fuzz(backward_kernels)
@given(CALLS[0].filter(lambda c: c.mask is not None and c.mask.dtype != torch.bool), CALLS[1],
       st.just(True))  # fmt: skip
def test_fuzz_sdpa_backward_dmask(call, dropout, mask_grad):
    """-m fuzz: random calls with an additive mask that requires grad (the dmask kernel, which
    test_fuzz_sdpa_backward reaches in about 1 call in 8): every gradient, the mask's included,
    agrees with float64 autograd."""
    check_backward(call, dropout, mask_grad)


def test_dsinks_of_rows_that_see_no_key():
    """Issue 31's backward case: f16, L = 127, S = 1, E = 192, Ev = 128, a bool mask [1, 1]
    hiding the key, f16 sinks. Every row's softmax is its sink alone, O = 0, so delta =
    -grad_lse: with the lse term of the loss, dsinks is the fp32 sum of the ramp over 127 rows
    (0 in float64, -1.19e-6 in the kernel), within check_backward's bound for a cancelling sum;
    without it, delta = 0 and every gradient is exactly 0."""
    c = [Layout.contiguous(3)] * 3
    mask = MaskSpec(torch.bool, (1, 1), Layout.contiguous(2), "random", 0.0, "-inf")
    call = SdpaCall(torch.float16, (), (), 1, 1, 127, 1, 192, 128, *c, mask, False, "top_left",
                    None, (torch.float16, Layout.contiguous(1)), None, None, 0)  # fmt: skip
    assert backward_serves(call, 0.0)
    compare_backward(call, 0.0, False)
    t, _ = call.build()
    with strict_sim():
        _, _, got, _ = gradients(t, call.kwargs(), 0.0, "sim", torch.float16, lse_grad=False)
    assert set(got) == {"dq", "dk", "dv", "dsinks"}
    for name, x in got.items():
        assert bool((x == 0).all()), f"{name}: {x.abs().max()}"


def test_dv_of_one_key_seen_by_every_row():
    """The eighth fuzz campaign's case (issue 31, test_fuzz_sdpa_backward_dmask): f16, L = 128,
    S = 1, E = 32, Ev = 1 with V a prefix view of K, an f16 mask [1, 1] (-1.31, the key
    visible) that requires grad. Every row's softmax is the key alone, P = 1, so dv is the
    sum of dO's 128 rows, 0.168 out of a sum of |dO| of 97. The kernel was exact to its
    output's rounding; the oracle differentiated a float64 dO where the kernel receives the
    float16 one (loss_weights), 6.6e-4 apart in that cancelling sum."""
    c = Layout.contiguous(4)
    mask = MaskSpec(torch.float16, (1, 1), Layout.contiguous(2), "random", 0.0, "-inf")
    call = SdpaCall(torch.float16, (1,), (1,), 1, 1, 128, 1, 32, 1, c, c, c, mask, False,
                    "top_left", None, None, None, None, 0, False, True)  # fmt: skip
    t, _ = call.build()
    assert float(t["attn_mask"]) > -2  # the key is visible to every row
    assert backward_serves(call, 0.0)
    compare_backward(call, 0.0, True)
    with strict_sim():
        out, g, got, _ = gradients(t, call.kwargs(), 0.0, "sim", torch.float16, True)
    want = g.sum(-2)  # P = 1: dv is the sum of the dO the kernel received, rounded to f16
    assert float((got["dv"].double() - want).abs().max()) <= 2.0**-11 * float(want.abs().max())


@pytest.mark.parametrize("L,S,packed", [(0, 0, True), (0, 5, False), (5, 0, False)])
def test_sinks_gradient_without_rows_or_keys(L, S, packed):
    """Found by widening sdpa_calls() to L = 0 and S = 0 (issue 31): the float64 reference's
    backward (torch_steel.reference.sdpa_backward) could not reshape the sinks' per-head sum
    of a call without query rows. Now kernel and reference agree: no rows give dsinks 0, no
    keys give every row its sink alone (O = 0)."""
    c, q = Layout.contiguous(3), Layout.contiguous(4 if packed else 3)
    sinks = (torch.float32, Layout.contiguous(1), "+30")
    call = SdpaCall(torch.float16, (), (), 2, 1, L, S, 64, 64, q, c, c, None, False, "top_left",
                    None, sinks, None, None, 0, packed)  # fmt: skip
    assert backward_serves(call, 0.0)
    compare_backward(call, 0.0, False)
    t, _ = call.build()
    with strict_sim():
        got = gradients(t, call.kwargs(), 0.0, "sim", torch.float16)[2]
    if L == 0:
        assert bool((got["dsinks"] == 0).all())


def test_gradients_under_a_float16_min_mask_in_float32():
    """Found by the first fuzz campaign (issue 31): float32, L = S = 2, E = 128, a float32 mask
    [1, 1] holding finfo(float16).min (a mask built for a half model, every key hidden by it).
    The kernel rebuilds P from s + m - lse in fp32, where a score near 65504 is held to 2^-8,
    so dq moved by 5e-4 of 1.88: the forward's bound always had that rounding
    (row_score_error), the backward's now has it too."""
    c = Layout.contiguous(3)
    mask = MaskSpec(torch.float32, (1, 1), Layout.contiguous(2), "cols", 0.0, "min:float16")
    call = SdpaCall(torch.float32, (), (), 1, 1, 2, 2, 128, 128, Layout.contiguous(4), c, c,
                    mask, False, "top_left", None, None, None, None, 43, True)  # fmt: skip
    assert backward_serves(call, 0.0)
    compare_backward(call, 0.0, False)
