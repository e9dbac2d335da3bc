"""Property-based differential tests of the varlen attention backward
steel::sdpa_varlen_backward (shaders/steel/attn/backward.h with STEEL_ATTN_FC_VARLEN, plan
"sdpa_varlen_backward") in the Metal simulator, checkers on.

For the varlen forward's drawn packed batches (strategies.varlen_calls(): 1 to 5 sequences,
empty ones, L != S, max_seqlen bounds above the longest, GQA, fused QKV slices, causal both
alignments, window, sinks, softcap, scale, dropout, any layout) that the backward serves: the
gradients of q, k, v and the sinks through the varlen forward and backward kernels agree with
float64 autograd through the reference, within test_fuzz_sdpa_backward's bound, and no guard
byte changed.
"""

from __future__ import annotations

import torch
from fuzz_helpers import fixed, fuzz, fuzz_mark, loss_weights, requires_simulator, strict_sim
from hypothesis import assume, given
from strategies import MAX_BACKWARD_HEAD_DIM, varlen_calls
from test_fuzz_sdpa_backward import assert_gradients_close, sink_terms

import torch_steel
from torch_steel import sim

pytestmark = requires_simulator


def gradients(call, t, backend, dtype):
    """(out, grad_out, {name: gradient}, lse) of <out, grad_out> + <lse, ramp>."""
    inputs = {n: t[n].detach().to(dtype).requires_grad_() for n in ("q", "k", "v")}
    if t["sinks"] is not None:
        sinks_dtype = torch.float64 if dtype == torch.float64 else t["sinks"].dtype
        inputs["sinks"] = t["sinks"].detach().to(sinks_dtype).requires_grad_()
    cu_q, cu_k = call.cu_seqlens()
    max_q, max_k = call.max_seqlens()
    with torch_steel.backend(backend):
        out, lse = torch_steel.sdpa_varlen(inputs["q"], inputs["k"], inputs["v"], cu_q, cu_k,
                                           max_q, max_k, sinks=inputs.get("sinks"),
                                           return_lse=True, **call.kwargs())  # fmt: skip
        g, w = loss_weights(out.shape, lse.shape[-1], call.dtype)
        finite = torch.where(torch.isfinite(lse), lse, 0)
        loss = (out * g.to(out.dtype)).sum() + (finite * w.to(lse.dtype)).sum()
        grads = torch.autograd.grad(loss, list(inputs.values()))
    return out, g, {"d" + n: x for n, x in zip(inputs, grads, strict=True)}, lse


def check_varlen_backward(call):
    t, guards = call.build()
    cu_q, cu_k = call.cu_seqlens()
    max_q, max_k = call.max_seqlens()
    out = torch.empty(*t["q"].shape[:2], call.Ev, dtype=call.dtype)
    lse = torch.empty(call.Hq, t["q"].shape[0])
    options = {"scale": 0.1, "dropout_p": call.dropout_p, "max_seqlen_q": max_q,
               "max_seqlen_k": max_k}  # fmt: skip
    tensors = [out, t["q"], t["k"], t["v"], out, lse, cu_q, cu_k, t["sinks"], lse]
    p = sim.plan("sdpa_varlen_backward", tensors, options)
    assume(p.ok)
    with strict_sim():
        _, _, got, _ = gradients(call, t, "sim", call.dtype)
    out, g, want, lse = gradients(call, t, "reference", torch.float64)
    sinks_sum = 0.0
    if t["sinks"] is not None:  # sink_terms over [Hq, tokens] planes
        w = torch.linspace(-1, 1, lse.shape[-1], dtype=torch.float64)
        sinks_sum = sink_terms(out.transpose(0, 1), g.transpose(0, 1), lse, w, t["sinks"])
    # A packed batch is one plane of rows: every sequence's rows count for dsinks, the longest
    # sequence's for dk.
    q, k = t["q"].transpose(0, 1), t["k"].transpose(0, 1)  # [heads, tokens, dim]
    rows = sum(call.lq)
    assert_gradients_close(got, want, q, k, out, g, call.scale, call.E, call.softcap, rows, max_q,
                           sinks_sum=sinks_sum)  # fmt: skip
    for guard in guards:
        guard.check()


@fixed(20)
@given(varlen_calls(max_head_dim=MAX_BACKWARD_HEAD_DIM))
def test_sdpa_varlen_backward_matches_float64(call):
    """Fixed-seed subset: 20 drawn packed batches' gradients agree with float64 autograd."""
    check_varlen_backward(call)


@fuzz_mark
@fuzz(lambda call: ["backward"] + ["dropout"] * (call.dropout_p > 0))
@given(varlen_calls(max_head_dim=MAX_BACKWARD_HEAD_DIM))
def test_fuzz_sdpa_varlen_backward(call):
    """-m fuzz: random packed batches' gradients agree with float64 autograd."""
    check_varlen_backward(call)
