"""Property-based differential tests of the attention forward steel::sdpa (shaders/steel/attn,
plan mps_src/plan/attention_plan.cpp) in the Metal simulator, checkers on.

For calls drawn by strategies.sdpa_calls() (head dims on and between the instantiations, L and
S on and off the BQ = 32 / BK = 8, 16, 32 tile edges, both ways round, GQA ratios, batch
broadcast, BLHD / transposed / strided / padded / offset / stride-0 q, k, v, bool and additive
masks of every broadcast shape and layout incl. fully hidden rows and padded keys, causal in
both alignments, windows, sinks, softcap, scale, all three dtypes): out and lse agree with the
float64 reference (torch_steel.reference) within the bound below, and no byte of any input's
guard buffer changed. For calls drawn by strategies.sdpa_refusals(): the plan refuses with a
reason.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from attn_helpers import OUT_ROUNDING, check, oracle, qkv
from fuzz_helpers import (
    assert_refused,
    fixed,
    fuzz,
    fuzz_mark,
    reference_scores,
    requires_simulator,
    row_score_error,
    strict_sim,
)
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import Layout, MaskSpec, SdpaCall, decode_stream, sdpa_calls, sdpa_refusals

import torch_steel
from torch_steel import sim

pytestmark = requires_simulator


def check_sdpa(call, weight_rounding=0.0):
    """Kernel vs float64 oracle, then the guard buffers.

    The bound is attn_helpers.assert_attention_close's, with the score error per row
    (row_score_error): out within half an ulp of its dtype relative to |ref| plus 2 * (score
    error) * max|v| plus 1e-5; lse within the score error plus 2e-6 relative plus 1e-5; NaN and
    -inf (rows that see nothing) exactly where the reference has them. weight_rounding: as in
    assert_attention_close, for kernels that round the weights to a storage dtype before P V.
    """
    t, guards = call.build()
    kwargs = call.kwargs()
    with strict_sim():
        out, lse = torch_steel.sdpa(t["q"], t["k"], t["v"], t["attn_mask"], sinks=t["sinks"],
                                    return_lse=True, **kwargs)  # fmt: skip
    ref_out, ref_lse = oracle(t["q"], t["k"], t["v"], t["attn_mask"], sinks=t["sinks"], **kwargs)
    assert out.dtype == call.dtype and out.shape == ref_out.shape, (out.shape, ref_out.shape)
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    v_max = float(t["v"].double().abs().max()) if t["v"].numel() else 0.0
    err = row_score_error(call, t, reference_scores(call, t))
    assert bool((out.isnan() == ref_out.isnan()).all()), "out: NaN where the reference differs"
    diff = (out.double() - ref_out).abs()
    bound = OUT_ROUNDING[call.dtype] * ref_out.abs() + 2 * err * v_max + 1e-5
    bound = bound + weight_rounding * v_max
    bad = (diff > bound) & ~ref_out.isnan()
    assert not bool(bad.any()), (
        f"out: {int(bad.sum())} of {bad.numel()} elements off, worst error "
        f"{float(diff[bad].max()):.3g} at {bad.nonzero()[0].tolist()}"
    )
    assert bool((lse.isneginf() == ref_lse.isneginf()).all()), "lse: rows that see nothing differ"
    assert bool((lse.isnan() == ref_lse.isnan()).all()), "lse: NaN rows differ"
    finite = torch.isfinite(ref_lse)
    lerr = (lse.double() - ref_lse).abs()
    lbound = 2e-6 * ref_lse.abs() + err.squeeze(-1) + 1e-5
    lbad = finite & (lerr > lbound)
    assert not bool(lbad.any()), f"lse off by {float(lerr[lbad].max()):.3g}"
    for g in guards:
        g.check()


@fixed(100)
@given(sdpa_calls())
def test_sdpa_matches_float64(call):
    """Fixed-seed subset: 100 drawn calls agree with float64 math and leave their inputs and
    guard bytes untouched."""
    check_sdpa(call)


@fixed(40)
@given(sdpa_refusals())
def test_sdpa_refusals_have_a_reason(case):
    """Fixed-seed subset: calls outside the plan's envelope are refused with a reason."""
    what, tensors, options = case
    assert_refused("sdpa", tensors, options)


@fuzz_mark
@fuzz(lambda call: campaign_kernels(call))
@given(sdpa_calls())
def test_fuzz_sdpa(call):
    """-m fuzz: random calls agree with float64 math and leave their guard buffers untouched."""
    check_sdpa(call)


@fuzz_mark
@fuzz(lambda call: campaign_kernels(call))
@given(sdpa_calls(max_L=8, max_S=1100))
def test_fuzz_sdpa_decode(call):
    """-m fuzz: random decode-shaped calls (at most 8 query rows, up to 1,100 keys, so that the
    decode plan's vector and MMA kernels, GQA packing and split-K all come up) agree with
    float64 math and leave their guard buffers untouched. test_fuzz_sdpa draws such calls in
    about 1 in 6."""
    check_sdpa(call)


def check_decode_stream(call, steps):
    """check_sdpa of each call of strategies.decode_stream(call, steps), in order: from the
    second on, the plan cache hands out the first one's plan rewritten for the call's length
    wherever their keys agree (the key and value's strides stay, or grow by torch.cat)."""
    for c in decode_stream(call, steps):
        check_sdpa(c)


def stream_kernels(call, steps):
    return sorted({k for c in decode_stream(call, steps) for k in campaign_kernels(c)})


@fixed(12)
@given(sdpa_calls(max_L=8, max_S=1100), st.integers(1, 3))
def test_decode_streams_match_float64(call, steps):
    """Fixed-seed subset: decode streams (one more key per call) agree with float64 math."""
    assume(not call.packed)
    check_decode_stream(call, steps)


def test_a_decode_stream_of_a_grown_key_beside_a_value_view():
    """Campaign 24's failure. The key grows by torch.cat (row-major: its strides hold S), the
    value is a view of a cache (its strides stay). Both are keyed as a decode stream, but
    set_decode_length rescaled the key's strides only where key and value were both row-major:
    the campaign's S = 3 plan reused at S = 2 kept the key's head stride of 3 keys, and the
    vector decode kernel read past the key's binding. Here the stream grows (S = 2, 3, 4), so
    without the fix the reused plan's head stride is short and the kernel reads other heads'
    keys within the binding: the float64 comparison fails, not the guard."""
    sim.build.extension().plan_cache_reset(4096)  # the first call plans afresh
    plain = Layout.contiguous(4)
    call = SdpaCall(
        dtype=torch.float32, batch=(3,), kv_batch=(3,), Hq=3, Hkv=3, L=5, S=2, E=255, Ev=40,
        q_layout=replace(plain, offset=8), k_layout=replace(plain, offset=1),
        v_layout=Layout(order=(0, 2, 1, 3), step=(1, 1, 1, 1), pad=(2, 2, 3, 0), offset=3,
                        expand=(False,) * 4),
        mask=MaskSpec(torch.bool, (3, 3, 1, 2), replace(plain, offset=3), "rows", 0.9, "min"),
        is_causal=True, causal_align="top_left", window=None, sinks=None, softcap=50.0,
        scale=-0.3, seed=84685,
    )  # fmt: skip
    before = sim.build.extension().plan_cache_stats()
    check_decode_stream(call, 2)
    after = sim.build.extension().plan_cache_stats()
    assert after["hits"] - before["hits"] == 2  # the S = 3 and S = 4 calls reuse S = 2's plan


@fuzz_mark
@fuzz(lambda call, steps: stream_kernels(call, steps))
@given(sdpa_calls(max_L=8, max_S=1100), st.integers(1, 3))
def test_fuzz_sdpa_decode_stream(call, steps):
    """-m fuzz: random decode streams agree with float64 math and leave their guard buffers
    untouched."""
    assume(not call.packed)
    check_decode_stream(call, steps)


@fuzz_mark
@fuzz(lambda case: ["refusals"])
@given(sdpa_refusals())
def test_fuzz_sdpa_refusals(case):
    """-m fuzz: random calls outside the envelope are refused with a reason."""
    what, tensors, options = case
    assert_refused("sdpa", tensors, options)


def family(kernel):
    """The plan's kernel family of a kernel name: prefill, decode or merge (split-K)."""
    if kernel.startswith("steel_attention_decode_merge_"):
        return "merge"
    return "decode" if kernel.startswith("steel_attention_decode_") else "prefill"


def campaign_kernels(call):
    """What the fuzz campaign counts a call toward: its kernel families, the split-K merge
    counted as decode."""
    return sorted({"decode" if f == "merge" else f for f in families(call)})


def families(call):
    """The kernel families the plan dispatches for a drawn call ("forward" for the prefill;
    none when refused), as the fuzz campaign counts them."""
    t, _ = call.build()
    q, k, v = torch_steel.ops.attention_ops._broadcast_qkv(
        t["q"], t["k"], t["v"], call.Hq != call.Hkv
    )
    p = sim.plan("sdpa", [q, k, v, t["attn_mask"], t["sinks"]], {"scale": 0.1})
    names = {"prefill": "forward", "decode": "decode", "merge": "merge"}
    return {names[family(d.kernel)] for d in p.dispatches} if p.ok else set()


def test_strategy_reaches_prefill_and_decode():
    """sdpa_calls() reaches both kernel families of the plan: the prefill kernel and, for the
    draws of L <= 8 query rows, the decode kernel in one pass (its keys, at most 300, make one
    partition; the split-K kernel and its merge are fuzzed through paged_calls()' num_splits,
    tests/fuzz/test_fuzz_varlen.py)."""
    seen = set()

    @fixed(40)
    @given(sdpa_calls())
    def draw(call):
        seen.update(families(call))

    draw()
    assert seen == {"forward", "decode"}, seen


@pytest.mark.parametrize("L,S,p", [(1, 1, 0.1), (8, 37, 0.5)])
def test_dropout_at_decode_rows_runs_the_prefill_kernel(L, S, p):
    """Issue 31's fuzz case "dropout" (dropout_p 0.1, q, k, v [1, 1, 1, 8]): the decode kernels
    take no dropout, so a call of at most 8 rows with dropout is served by the prefill kernel,
    not refused, and equals the float64 reference under the same Philox mask; without dropout
    the same call decodes."""
    q, k, v = qkv(1, 1, L, S, 8)

    def families(options):
        plan = sim.plan("sdpa", [q, k, v, None, None], {"scale": 0.125, **options})
        return {family(d.kernel) for d in plan.dispatches}

    assert families({"dropout_p": p}) == {"prefill"}
    assert families({}) == {"decode"}
    check(q, k, v, dropout_p=p, seed=7, scale=0.125)
