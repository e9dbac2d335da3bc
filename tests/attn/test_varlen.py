"""Packed variable-length attention (steel::sdpa_varlen) on the prefill kernel with
STEEL_ATTN_FC_VARLEN, in the Metal simulator with the checkers on, against a loop of float64
dense reference calls, one per sequence.

Every case is one launch for the whole packed batch, in strict mode (a refused plan fails the
test). Lengths are off the tile edges (BQ = 32 query rows, BK = 8 to 32 keys) and include empty
sequences; the checkers report any read or write outside q, k, v, out, lse or the offsets, so a
threadgroup that strays past its sequence fails here even where the numbers would not show it.
"""

from __future__ import annotations

import os

import pytest
import torch
from attn_helpers import (
    DTYPES,
    assert_attention_close,
    oracle,
    rand,
    requires_simulator,
    score_error,
)

import torch_steel
from torch_steel import sim

pytestmark = requires_simulator

RAGGED = [1, 7, 100, 257, 0]


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed(lq, lk, Hq, Hkv, E, Ev=None, dtype=torch.float16, seed=0):
    """Random packed q [total_q, Hq, E], k [total_k, Hkv, E], v [total_k, Hkv, Ev]."""
    gen = torch.Generator().manual_seed(seed)
    Ev = E if Ev is None else Ev
    q = rand(sum(lq), Hq, E, dtype=dtype, gen=gen)
    k = rand(sum(lk), Hkv, E, dtype=dtype, gen=gen)
    v = rand(sum(lk), Hkv, Ev, dtype=dtype, gen=gen)
    return q, k, v


def steel_varlen(q, k, v, lq, lk, **kwargs):
    """(out, lse) of torch_steel.sdpa_varlen on the simulator, strict."""
    previous = os.environ.get("TORCH_STEEL_STRICT")
    os.environ["TORCH_STEEL_STRICT"] = "1"
    try:
        with torch_steel.backend("sim"):
            return torch_steel.sdpa_varlen(q, k, v, cu(lq), cu(lk), max(lq, default=0),
                                           max(lk, default=0), return_lse=True,
                                           **kwargs)  # fmt: skip
    finally:
        if previous is None:
            del os.environ["TORCH_STEEL_STRICT"]
        else:
            os.environ["TORCH_STEEL_STRICT"] = previous


def dense_loop(q, k, v, lq, lk, **kwargs):
    """The oracle: each sequence as its own dense [1, heads, n, dim] float64 reference call."""
    Hq, Ev = q.shape[1], v.shape[2]
    out = torch.zeros(q.shape[0], Hq, Ev, dtype=torch.float64)
    lse = torch.full((Hq, q.shape[0]), float("-inf"), dtype=torch.float64)
    cq, ck = cu(lq).tolist(), cu(lk).tolist()
    for b in range(len(lq)):
        if lq[b] == 0:
            continue
        qs = q[cq[b] : cq[b + 1]].transpose(0, 1).unsqueeze(0)
        ks = k[ck[b] : ck[b + 1]].transpose(0, 1).unsqueeze(0)
        vs = v[ck[b] : ck[b + 1]].transpose(0, 1).unsqueeze(0)
        o, l_ = oracle(qs, ks, vs, enable_gqa=True, **kwargs)
        out[cq[b] : cq[b + 1]] = o[0].transpose(0, 1)
        lse[:, cq[b] : cq[b + 1]] = l_[0]
    return out, lse


def check_varlen(q, k, v, lq, lk, weight_rounding=0.0, **kwargs):
    out, lse = steel_varlen(q, k, v, lq, lk, **kwargs)
    ref_out, ref_lse = dense_loop(q, k, v, lq, lk, **kwargs)
    v_max = float(v.double().abs().max()) if v.numel() else 0.0
    err = score_error(q.transpose(0, 1), k.transpose(0, 1), kwargs.get("scale"))
    assert_attention_close(out, lse, ref_out, ref_lse, q.dtype, v_max, err, weight_rounding)
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ragged_lengths(dtype):
    q, k, v = packed(RAGGED, RAGGED, 2, 2, 64, dtype=dtype)
    check_varlen(q, k, v, RAGGED, RAGGED)


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize(
    "lq,lk",
    [([1, 7, 100, 257, 0], [100, 7, 33, 300, 5]),  # S >= L and S < L
     ([257, 33, 0, 7, 1], [7, 100, 3, 0, 1])],  # S < L (rows that see nothing), S = 0
)  # fmt: skip
def test_causal_with_l_ne_s(lq, lk, align):
    q, k, v = packed(lq, lk, 2, 1, 32, dtype=torch.float32)
    check_varlen(q, k, v, lq, lk, is_causal=True, causal_align=align)


@pytest.mark.parametrize("Hq,Hkv", [(8, 2), (6, 3), (4, 1)])
def test_gqa_and_mqa(Hq, Hkv):
    lq, lk = [33, 7, 0, 70], [40, 7, 9, 64]
    q, k, v = packed(lq, lk, Hq, Hkv, 40, dtype=torch.float16)
    check_varlen(q, k, v, lq, lk, is_causal=True, causal_align="bottom_right")


@pytest.mark.parametrize(
    "window,align,causal",
    [((16, 0), "top_left", False), ((5, 9), "bottom_right", False), ((40, -1), "top_left", True),
     ((-1, 3), "bottom_right", True), ((0, 0), "bottom_right", False)],
)  # fmt: skip
def test_window(window, align, causal):
    lq, lk = [100, 1, 0, 57], [77, 30, 4, 120]
    q, k, v = packed(lq, lk, 2, 2, 64, dtype=torch.float16)
    check_varlen(q, k, v, lq, lk, window=window, causal_align=align, is_causal=causal)


@pytest.mark.parametrize("sinks_dtype", [torch.float16, torch.float32], ids=str)
def test_sinks_softcap_scale(sinks_dtype):
    lq, lk = [7, 0, 100, 33], [7, 5, 0, 70]  # a sequence without keys: lse is its sink
    q, k, v = packed(lq, lk, 4, 2, 64, dtype=torch.float16)
    sinks = rand(4, dtype=sinks_dtype, gen=torch.Generator().manual_seed(3))
    out, lse = check_varlen(q, k, v, lq, lk, sinks=sinks, softcap=5.0, scale=0.3, is_causal=True)
    assert bool((out[7:107] == 0).all())
    torch.testing.assert_close(lse[:, 7:107], sinks.float()[:, None].expand(4, 100))


@pytest.mark.parametrize("E,Ev,dtype", [(128, 128, torch.bfloat16), (192, 128, torch.float16),
                                        (256, 256, torch.float16), (80, 80, torch.float32),
                                        (48, 24, torch.float16)])  # fmt: skip
def test_head_dims(E, Ev, dtype):
    lq, lk = [40, 1, 9], [33, 17, 64]
    q, k, v = packed(lq, lk, 2, 1, E, Ev, dtype=dtype)
    check_varlen(q, k, v, lq, lk, is_causal=True)


def test_empty_sequences_and_empty_batch():
    lq, lk = [0, 0, 5, 0], [3, 0, 0, 9]
    q, k, v = packed(lq, lk, 2, 2, 32)
    out, lse = check_varlen(q, k, v, lq, lk)
    assert bool((out == 0).all()) and bool(lse.isneginf().all())  # its one sequence has no keys
    q, k, v = packed([0, 0], [0, 4], 2, 2, 32)
    out, lse = steel_varlen(q, k, v, [0, 0], [0, 4])
    assert out.shape == (0, 2, 32) and lse.shape == (2, 0)


def test_strided_packed_views_are_read_in_place():
    """q, k, v as views of one fused [tokens, 3, heads, dim] projection (PyTorch's own varlen
    test builds them so): the plan copies nothing."""
    lq = [33, 7, 64]
    qkv = rand(sum(lq), 3, 2, 64, dtype=torch.float16, gen=torch.Generator().manual_seed(1))
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    opts = {"max_seqlen_q": 64, "max_seqlen_k": 64}
    p = sim.plan("sdpa_varlen", [q, k, v, cu(lq), cu(lq), None], opts)
    assert p.ok and p.contiguous_inputs == []
    check_varlen(q, k, v, lq, lq, is_causal=True)


def test_one_launch_for_the_batch_and_early_exit():
    """One dispatch over (ceil(max_seqlen_q / 32), Hq, sequences); blocks past a sequence's end
    leave before reading q, k or v: the counters see exactly the rows and keys of the batch."""
    lq, lk = [100, 1, 0, 7], [100, 50, 3, 7]
    q, k, v = packed(lq, lk, 2, 2, 64, dtype=torch.float16)
    inputs = [q, k, v, cu(lq), cu(lk), None]
    opts = {"scale": 0.125, "max_seqlen_q": 100, "max_seqlen_k": 100}
    p = sim.plan("sdpa_varlen", inputs, opts)
    (d,) = p.dispatches
    assert d.grid == (4, 2, 4)
    _, counters = sim.run_op("sdpa_varlen", inputs, opts, counters=True, checkers=False)
    assert counters[0]["buffers"][0]["read"] == q.numel() * 2  # every query row once
    assert counters[0]["buffers"][5]["written"] == q.numel() * 2  # out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_sweep(dtype, align):
    gen = torch.Generator().manual_seed(7)
    lq = torch.randint(0, 300, (9,), generator=gen).tolist()
    lk = torch.randint(0, 300, (9,), generator=gen).tolist()
    q, k, v = packed(lq, lk, 6, 2, 96, dtype=dtype)
    sinks = rand(6, dtype=torch.float32, gen=gen)
    check_varlen(q, k, v, lq, lk, is_causal=True, causal_align=align, window=(50, 10),
                 sinks=sinks)  # fmt: skip
