"""Property-based differential tests of the attention backward steel::sdpa_backward
(shaders/steel/attn/backward.h, plan "sdpa_backward") in the Metal simulator, checkers on.

For the forward's calls (strategies.sdpa_calls()) that the backward's plan serves, plus a
dropout draw: the gradients of q, k, v and the sinks through the forward and backward kernels
agree with float64 autograd through the reference, and no guard byte changed.
"""

from __future__ import annotations

import math

import torch
from attn_helpers import OUT_ROUNDING, score_error
from fuzz_helpers import fixed, fuzz, fuzz_mark, requires_simulator, strict_sim
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import sdpa_calls

import torch_steel
from torch_steel import sim

pytestmark = requires_simulator

# test_attention_backward.SLACK: the fp32 error (float32) or four ulps of the dtype (delta reads
# the forward's out rounded to it), relative to the largest gradient element.
SLACK = {torch.float32: 2e-5, torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8}


def gradients(t, kwargs, dropout, backend, dtype):
    inputs = {n: t[n].detach().to(dtype).requires_grad_() for n in ("q", "k", "v")}
    sinks = t["sinks"]
    if sinks is not None:
        inputs["sinks"] = sinks.detach().to(torch.float64 if dtype == torch.float64 else
                                            sinks.dtype).requires_grad_()  # fmt: skip
    mask = t["attn_mask"]
    if mask is not None and mask.is_floating_point() and dtype == torch.float64:
        mask = mask.double()
    with torch_steel.backend(backend):
        out, lse = torch_steel.sdpa(inputs["q"], inputs["k"], inputs["v"], mask,
                                    sinks=inputs.get("sinks"), return_lse=True, dropout_p=dropout,
                                    seed=1234, **kwargs)  # fmt: skip
        gen = torch.Generator().manual_seed(5)
        g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        w = torch.linspace(-1, 1, lse.shape[-1], dtype=torch.float64)
        finite = torch.isfinite(lse)
        loss = (out * g.to(out.dtype)).sum() + (torch.where(finite, lse, 0) * w.to(lse.dtype)).sum()
        return out, g, torch.autograd.grad(loss, list(inputs.values()))


def check_backward(call, dropout):
    t, guards = call.build()
    kwargs = call.kwargs()
    q, k, v = t["q"], t["k"], t["v"]
    qe, ke, ve = torch_steel.ops._broadcast_qkv(q, k, v, kwargs["enable_gqa"])
    probe = torch.empty(*qe.shape[:-1], ve.shape[-1], dtype=q.dtype)
    lse = torch.empty(qe.shape[:-1])
    p = sim.plan("sdpa_backward", [probe, qe, ke, ve, probe, lse, t["attn_mask"], t["sinks"], lse],
                 {"scale": 0.1, "dropout_p": dropout})  # fmt: skip
    assume(p.ok)
    with strict_sim():
        _, _, got = gradients(t, kwargs, dropout, "sim", q.dtype)
    out, g, want = gradients(t, kwargs, dropout, "reference", torch.float64)
    err = score_error(q, k, call.scale) + (8 * 2.0**-24 * call.softcap if call.softcap else 0)
    # delta = rowsum(dO * O) reads out rounded to its dtype: an error of half an ulp of each
    # |dO O| term in every dS of the row, which dq sees times scale * |k| (its weights sum to
    # 1), dk times scale * |q| summed over the rows (L at most), and dsinks summed over every
    # row of the batch (its weights are at most 1).
    scale = abs(call.scale) if call.scale is not None else call.E**-0.5
    d_err = OUT_ROUNDING[q.dtype] * float((g.abs() * out.abs().nan_to_num(0.0)).sum(-1).max())
    q_max, k_max = float(q.double().abs().max()), float(k.double().abs().max())
    rows = math.prod(call.batch) * call.L
    extra = {
        "dq": d_err * scale * k_max,
        "dk": d_err * scale * q_max * call.L,
        "dsinks": d_err * rows,
    }
    for name, a, r in zip(["dq", "dk", "dv", "dsinks"], got, want, strict=False):
        assert bool((a.isnan() == r.isnan()).all()), f"{name}: NaN where the reference differs"
        r0 = r.nan_to_num(0.0)
        mag = float(r0.abs().max()) if r.numel() else 0.0
        slack = (
            OUT_ROUNDING[a.dtype] * r0.abs()
            + (SLACK[q.dtype] + 4 * err) * mag
            + extra.get(name, 0.0)
            + 1e-6
        )
        diff = (a.double().nan_to_num(0.0) - r0).abs()
        assert bool((diff <= slack).all()), (
            f"{name}: worst error {float(diff.max()):.3g} ({mag:.3g})"
        )
    for guard in guards:
        guard.check()


@fixed(30)
@given(sdpa_calls(), st.sampled_from([0.0, 0.0, 0.3]))
def test_sdpa_backward_matches_float64(call, dropout):
    """Fixed-seed subset: 30 drawn calls' gradients agree with float64 autograd."""
    check_backward(call, dropout)


@fuzz_mark
@fuzz()
@given(sdpa_calls(), st.sampled_from([0.0, 0.0, 0.3]))
def test_fuzz_sdpa_backward(call, dropout):
    """-m fuzz: random calls' gradients agree with float64 autograd."""
    check_backward(call, dropout)
