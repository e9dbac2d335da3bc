"""Property-based differential tests of attention over a quantized KV cache (torch_steel.kv):
steel::sdpa_quantized_forward and steel::sdpa_varlen_quantized_forward, packed and paged.

For calls drawn by strategies.quant_calls() (sdpa_calls(), varlen_calls() and paged_calls()
draws, every format a head dim takes for K and V independently, float16 / float32 scales, rows
of zeros and constant rows, every data / scales / mins tensor a guarded view with offsets and
strides): out and lse agree with float64 attention over K and V dequantized in float64 from the
codes by the documented formula (x = q * s, or q * s + m for 4-bit: dequantize64 below, not
kv.dequantize), within the bound of check_quantized, and no guard byte changed.

Which path ran: the op is served by the simulated kernels where the plan takes it (issue 27
wires the quantized loader into them), and falls back to reference math (dequantize, then the
float attention) where it refuses. The test runs strict first; on a refusal it runs the same
call on the reference backend, and the campaign counts the example as "quantized (reference)"
instead of "quantized". So the same test covers the kernels once their plan serves the calls.
"""

from __future__ import annotations

import math

import torch
from attn_helpers import OUT_ROUNDING, oracle, score_error
from fuzz_helpers import (
    fixed,
    fuzz,
    fuzz_mark,
    reference_scores,
    requires_simulator,
    row_score_error,
    strict_sim,
)
from hypothesis import given
from strategies import QUANT_BITS_GROUP, SdpaCall, quant_calls
from test_fuzz_varlen import gather_pages

import torch_steel
from torch_steel.errors import PlanRefused

pytestmark = requires_simulator

EPS32 = 2.0**-24
# The dequantization's error per element, relative to |q * s| + |m|: the kernels and the
# reference path compute q * s (+ m) in fp32 (two roundings of 2^-24) and round the value to
# the compute dtype (half an ulp of it: OUT_ROUNDING), as kv.py documents.
DEQUANT = {d: u + 2 * EPS32 for d, u in OUT_ROUNDING.items()}

PATH = {}  # what the last check ran on: "kernel" or "reference" (the campaign's kernel name)


def dequantize64(x):
    """(values, magnitudes) of a QuantizedKV in float64: x = q * s (+ m), by group, and |q * s|
    + |m| (what the fp32 dequantization's rounding is relative to)."""
    bits, group = QUANT_BITS_GROUP[x.format]
    data = x.data.to(torch.int64)
    if bits == 4:  # element 2j in the low nibble of byte j, 2j + 1 in the high one
        data = torch.stack((data & 15, data >> 4), -1).flatten(-2)
    E = data.shape[-1]
    codes = data.double().unflatten(-1, (E // (group or E), group or E))
    qs = codes * x.scales.double().unsqueeze(-1)
    m = 0.0 if x.mins is None else x.mins.double().unsqueeze(-1)
    value = (qs + m).flatten(-2)
    size = (qs.abs() + (m.abs() if x.mins is not None else 0.0)).flatten(-2)
    return value, size


def run(call, t, backend):
    """(out, lse) of the op on `backend` ("sim" strict, or "reference")."""
    b = call.base
    if isinstance(b, SdpaCall):
        args = (t["q"], t["k"], t["v"], t["attn_mask"])
        kwargs = {"sinks": t["sinks"], **b.kwargs()}
        op = torch_steel.sdpa
    else:
        cu_q, cu_k = b.cu_seqlens()
        paged = {"block_table": t["block_table"], "seqused_k": t["seqused_k"]}
        args = (t["q"], t["k"], t["v"], cu_q, None if b.page_size else cu_k, *b.max_seqlens())
        kwargs = {"sinks": t["sinks"], **b.kwargs(), **(paged if b.page_size else {})}
        op = torch_steel.sdpa_varlen
    with torch.no_grad():
        if backend == "sim":
            with strict_sim():
                return op(*args, return_lse=True, **kwargs)
        with torch_steel.backend("reference"):
            return op(*args, return_lse=True, **kwargs)


def check_quantized(call):
    """The op vs float64 attention over the dequantized cache, then the guard buffers.

    The bound is test_fuzz_sdpa.check_sdpa's (dense) or test_fuzz_varlen.check_varlen's (packed,
    paged: the score error over the whole batch) with the dequantization's error added: each K
    value is off by at most dk = DEQUANT * (|q s| + |m|), so a score by scale * sum_d |q_d| dk_d
    (the largest over the row's keys; softcap's tanh has slope at most 1), and each V value by
    dv, which moves the weighted mean by at most max dv.
    """
    t, guards = call.build()
    b = call.base
    try:
        out, lse = run(call, t, "sim")
        PATH["last"] = "kernel"
    except PlanRefused as refusal:
        assert str(refusal).strip(), "refused without a reason"
        out, lse = run(call, t, "reference")
        PATH["last"] = "reference"
    (k64, k_size), (v64, v_size) = dequantize64(t["k"]), dequantize64(t["v"])
    u = DEQUANT[b.dtype]
    dk, dv = u * k_size, u * v_size
    scale = abs(b.scale) if b.scale is not None else 1 / math.sqrt(b.E)
    group = b.Hq // b.Hkv
    dv_max = float(dv.max()) if dv.numel() else 0.0
    if isinstance(b, SdpaCall):
        t64 = dict(t, k=k64, v=v64)
        ref_out, ref_lse = oracle(t["q"], k64, v64, t["attn_mask"], sinks=t["sinks"],
                                  **b.kwargs())  # fmt: skip
        err = row_score_error(b, t64, reference_scores(b, t64))  # [..., L, 1]
        shift = t["q"].double().abs() @ dk.repeat_interleave(group, -3).mT
        if shift.shape[-1]:  # no keys: no score to shift
            err = err + scale * shift.amax(-1, keepdim=True)
        v_max = float(v64.abs().max()) if v64.numel() else 0.0
    else:
        if b.page_size:
            k64, v64 = gather_pages(b, dict(t, k=k64, v=v64))
            dk, _ = gather_pages(b, dict(t, k=dk, v=dv))
        cu_q, cu_k = b.cu_seqlens()
        sinks = None if t["sinks"] is None else t["sinks"].double()
        with torch_steel.backend("reference"):
            ref_out, ref_lse = torch_steel.sdpa_varlen(t["q"].double(), k64, v64, cu_q, cu_k,
                                                       *b.max_seqlens(), sinks=sinks,
                                                       return_lse=True, **b.kwargs())  # fmt: skip
        qh = t["q"].double().abs().transpose(0, 1)
        err = score_error(t["q"].transpose(0, 1), k64.transpose(0, 1), b.scale)
        if b.softcap:
            err += 8 * EPS32 * b.softcap
        shift = 0.0  # the largest dequantization shift of a score, head by head (memory)
        for h in range(b.Hq):
            if qh.shape[1] and dk.shape[0]:
                shift = max(shift, float((qh[h] @ dk[:, h // group].mT).max()))
        err += scale * shift
        v_max = float(v64.abs().max()) if v64.numel() else 0.0
    assert out.dtype == b.dtype and out.shape == ref_out.shape, (out.shape, ref_out.shape)
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert bool((out.isnan() == ref_out.isnan()).all()), "out: NaN where the reference differs"
    diff = (out.double() - ref_out).abs()
    bound = OUT_ROUNDING[b.dtype] * ref_out.abs() + 2 * err * v_max + dv_max + 1e-5
    bad = (diff > bound) & ~ref_out.isnan()
    assert not bool(bad.any()), (
        f"out ({PATH['last']}): {int(bad.sum())} of {bad.numel()} elements off, worst error "
        f"{float(diff[bad].max()):.3g} at {bad.nonzero()[0].tolist()}"
    )
    assert bool((lse.isneginf() == ref_lse.isneginf()).all()), "lse: rows that see nothing differ"
    assert bool((lse.isnan() == ref_lse.isnan()).all()), "lse: NaN rows differ"
    finite = torch.isfinite(ref_lse)
    lerr = (lse.double() - ref_lse).abs()
    lerr_bound = 2e-6 * ref_lse.abs() + (err.squeeze(-1) if torch.is_tensor(err) else err) + 1e-5
    lbad = finite & (lerr > lerr_bound)
    assert not bool(lbad.any()), f"lse ({PATH['last']}) off by {float(lerr[lbad].max()):.3g}"
    for g in guards:
        g.check()


@fixed(40)
@given(quant_calls())
def test_quantized_matches_float64(call):
    """Fixed-seed subset: 40 drawn calls over a quantized cache agree with float64 attention
    over its float64 dequantization and leave their guard bytes untouched."""
    check_quantized(call)


def quantized_path(call):
    """The campaign's kernel name of the example just run (check_quantized sets PATH)."""
    return ["quantized" if PATH.get("last") == "kernel" else "quantized (reference)"]


@fuzz_mark
@fuzz(quantized_path)
@given(quant_calls())
def test_fuzz_quantized(call):
    """-m fuzz: random calls over a quantized cache agree with float64 math."""
    PATH.pop("last", None)
    check_quantized(call)
