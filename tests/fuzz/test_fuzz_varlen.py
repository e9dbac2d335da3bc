"""Property-based differential tests of packed variable-length attention steel::sdpa_varlen
(the prefill kernel under STEEL_ATTN_FC_VARLEN, plan mps_src/plan/varlen_plan.cpp) in the Metal
simulator, checkers on.

For calls drawn by strategies.varlen_calls() (1 to 5 sequences, empty ones included, query and
key lengths independent and on or off the tile edges, max_seqlen bounds above the longest,
GQA ratios, head dims on and between the instantiations, heads-outer / strided / padded /
offset / stride-0 views and fused QKV slices, causal in both alignments, windows, sinks,
softcap, scale, dropout, all three dtypes): out and lse agree with float64 reference math (a
dense reference call per sequence, dropout keyed the same way), and no byte of any input's
guard buffer changed. The same for calls against a paged KV cache drawn by
strategies.paged_calls() (the decode kernels: 0 to 8 query rows or a prefill chunk per sequence,
up to 2000 keys on shuffled pages of 1 to 64 slots, spare pool pages, table entries past a
sequence's pages outside the pool, any num_splits), whose oracle gathers each sequence's keys
from its pages into a packed cu_seqlens_k batch. For calls drawn by
strategies.varlen_refusals(): the plan refuses with a reason.
"""

from __future__ import annotations

import torch
from attn_helpers import assert_attention_close, score_error
from fuzz_helpers import assert_refused, fixed, fuzz, fuzz_mark, requires_simulator, strict_sim
from hypothesis import given
from hypothesis import strategies as st
from strategies import paged_calls, paged_stream, varlen_calls, varlen_refusals

import torch_steel

pytestmark = requires_simulator

EPS32 = 2.0**-24


def gather_pages(call, t):
    """The paged cache's keys and values as a packed [sum(lk), Hkv, D] batch: sequence b's
    first lk[b] slots of its pages, in table order (the oracle's own reading of the table)."""
    ks, vs = [], []
    for b, (n, pages) in enumerate(zip(call.lk, call.pages_of())):
        rows = t["block_table"][b, :pages].long()
        ks.append(t["k"][rows].flatten(0, 1)[:n])
        vs.append(t["v"][rows].flatten(0, 1)[:n])
    return torch.cat(ks), torch.cat(vs)


def check_varlen(call):
    """Kernel vs float64 oracle, then the guard buffers.

    The bound is attn_helpers.assert_attention_close's: out within half an ulp of its dtype plus
    2 * (score error) * max|v|, lse within the score error. The score error is score_error's
    over the whole packed batch (an upper bound for each sequence's), plus 8 fp32 ulps of the
    softcap (tanh in fp32). Dropout scales the kept weights by 1 / (1 - p) in fp32, which
    scales the weighted sum's error bound by the same factor.
    """
    t, guards = call.build()
    cu_q, cu_k = call.cu_seqlens()
    max_q, max_k = call.max_seqlens()
    kwargs = call.kwargs()
    k, v = t["k"], t["v"]
    paged = {}
    if call.page_size:
        paged = {"block_table": t["block_table"], "seqused_k": t["seqused_k"]}
        k, v = gather_pages(call, t)
    with strict_sim():
        out, lse = torch_steel.sdpa_varlen(t["q"], t["k"], t["v"], cu_q,
                                           None if paged else cu_k, max_q, max_k,
                                           sinks=t["sinks"], return_lse=True, **paged,
                                           **kwargs)  # fmt: skip
    sinks = None if t["sinks"] is None else t["sinks"].double()
    with torch_steel.backend("reference"):
        ref_out, ref_lse = torch_steel.sdpa_varlen(t["q"].double(), k.double(), v.double(), cu_q,
                                                   cu_k, max_q, max_k, sinks=sinks,
                                                   return_lse=True, **kwargs)  # fmt: skip
    err = score_error(t["q"].transpose(0, 1), k.transpose(0, 1), call.scale)
    if call.softcap:
        err += 8 * EPS32 * call.softcap
    v_max = float(v.double().abs().max()) if v.numel() else 0.0
    v_max /= 1.0 - call.dropout_p
    assert_attention_close(out, lse, ref_out, ref_lse, call.dtype, v_max, err)
    for g in guards:
        g.check()


@fixed(100)
@given(varlen_calls())
def test_varlen_matches_float64(call):
    """Fixed-seed subset: 100 drawn calls agree with float64 math and leave their inputs and
    guard bytes untouched."""
    check_varlen(call)


@fixed(60)
@given(paged_calls())
def test_paged_matches_float64(call):
    """Fixed-seed subset: 60 drawn calls on a paged KV cache agree with float64 math on the
    gathered cache and leave their inputs, pools and guard bytes untouched."""
    check_varlen(call)


@fixed(30)
@given(varlen_refusals())
def test_varlen_refusals_have_a_reason(case):
    """Fixed-seed subset: calls outside the plan's envelope are refused with a reason."""
    what, tensors, options = case
    assert_refused("sdpa_varlen", tensors, options)


@fuzz_mark
@fuzz(lambda call: ["varlen"] + ["dropout"] * (call.dropout_p > 0))
@given(varlen_calls())
def test_fuzz_varlen(call):
    """-m fuzz: random calls agree with float64 math and leave their guard buffers untouched."""
    check_varlen(call)


@fuzz_mark
@fuzz(lambda call: ["paged"])
@given(paged_calls())
def test_fuzz_paged(call):
    """-m fuzz: random calls on a paged KV cache agree with float64 math on the gathered cache
    and leave their guard buffers untouched."""
    check_varlen(call)


@fixed(10)
@given(paged_calls(), st.integers(1, 3))
def test_paged_streams_match_float64(call, steps):
    """Fixed-seed subset: paged decode streams (one more key a sequence per call) agree with
    float64 math."""
    for c in paged_stream(call, steps):
        check_varlen(c)


@fuzz_mark
@fuzz(lambda call, steps: ["paged"])
@given(paged_calls(), st.integers(1, 3))
def test_fuzz_paged_stream(call, steps):
    """-m fuzz: random paged decode streams agree with float64 math and leave their guard
    buffers untouched: from the second call on, the plan cache hands out the first call's plan
    wherever the pools and table keep their shape."""
    for c in paged_stream(call, steps):
        check_varlen(c)


@fuzz_mark
@fuzz(lambda case: ["refusals"])
@given(varlen_refusals())
def test_fuzz_varlen_refusals(case):
    """-m fuzz: random calls outside the envelope are refused with a reason."""
    what, tensors, options = case
    assert_refused("sdpa_varlen", tensors, options)
