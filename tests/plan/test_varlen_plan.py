"""The varlen attention launch plan (mps_src/plan/varlen_plan.cpp) through torch_steel.sim.plan:
one dispatch for the packed batch, the varlen constants and the cu_seqlens bindings, the params
(token counts, packed strides, output strides), the outputs, and each refusal with its reason."""

from __future__ import annotations

import struct

import pytest
import torch
from test_attention_plan import (
    ALIGN_L,
    ALIGN_S,
    BUF_PARAMS,
    HAS_HI,
    HAS_LO,
    SINKS,
    VEC_K,
    VEC_V,
    params,
    t,
)

from torch_steel import sim

VARLEN, VARLEN_BR = 316, 317
BUF_CU_Q, BUF_CU_K = 8, 9


def cu(*offsets, dtype=torch.int32):
    return torch.tensor(offsets, dtype=dtype)


def options(**kw):
    base = {"dropout_p": 0.0, "is_causal": False, "scale": 0.125, "softcap": 0.0,
            "window_left": -1, "window_right": -1, "bottom_right": False,
            "max_seqlen_q": 100, "max_seqlen_k": 120}  # fmt: skip
    return {**base, **kw}


def plan(q, k, v, cu_q=None, cu_k=None, sinks=None, **kw):
    cu_q = cu(0, 50, 100, 150) if cu_q is None else cu_q
    cu_k = cu(0, 120, 130, 200) if cu_k is None else cu_k
    return sim.plan("sdpa_varlen", [q, k, v, cu_q, cu_k, sinks], options(**kw))


def one(p):
    assert p.ok, p.reason
    assert len(p.dispatches) == 1
    return p.dispatches[0]


def test_one_dispatch_over_the_longest_sequence():
    p = plan(t(150, 8, 64), t(200, 2, 64), t(200, 2, 64))
    d = one(p)
    assert d.kernel == "steel_attention_f16_e64_v64" and d.threads == (128, 1, 1)
    assert d.grid == (4, 8, 3)  # ceil(100 / 32) blocks, Hq, sequences
    assert d.constants[VARLEN] and not d.constants[VARLEN_BR]
    assert not d.constants[ALIGN_L] and not d.constants[ALIGN_S]  # no length is known
    assert d.constants[VEC_K] and d.constants[VEC_V]
    bound = {b.index: b.slot for b in d.bindings if b.kind == "tensor"}
    assert bound[BUF_CU_Q] == 3 and bound[BUF_CU_K] == 4
    assert [a.name for a in p.allocations] == ["out", "lse"]
    assert p.allocations[0].sizes == (150, 8, 64) and p.allocations[1].sizes == (8, 150)
    assert p.allocations[1].dtype == torch.float32


def test_params_hold_token_counts_and_packed_strides():
    q = t(150, 3, 8, 64)[:, 0]  # a view of a fused projection: row stride 3 * 8 * 64
    pr = params(one(plan(q, t(200, 2, 64), t(200, 2, 48))))
    assert (pr["L"], pr["S"], pr["Hq"], pr["group"], pr["E"], pr["Ev"]) == (150, 200, 8, 4, 64, 48)
    assert (pr["q_rs"], pr["q_hs"], pr["k_rs"], pr["k_hs"]) == (3 * 8 * 64, 64, 128, 64)
    assert (pr["o_bs"], pr["o_hs"], pr["o_rs"], pr["batch_ndim"]) == (0, 48, 8 * 48, 0)


def test_grid_is_bounded_by_the_token_count():
    d = one(plan(t(150, 2, 64), t(200, 2, 64), t(200, 2, 64), max_seqlen_q=10**6))
    assert d.grid[0] == 5  # no sequence is longer than the 150 query tokens


def test_diagonals_and_bottom_right():
    d = one(plan(t(150, 2, 64), t(200, 2, 64), t(200, 2, 64), is_causal=True, bottom_right=True,
                 window_left=7))  # fmt: skip
    assert d.constants[HAS_HI] and d.constants[HAS_LO] and d.constants[VARLEN_BR]
    pr = params(d)
    assert (pr["hi_off"], pr["lo_off"], pr["shift"]) == (0, 7, 0)  # shift is per sequence
    # Without a diagonal the alignment is irrelevant: the top-left pipeline serves it.
    assert not one(plan(t(150, 2, 64), t(200, 2, 64), t(200, 2, 64), bottom_right=True)).constants[
        VARLEN_BR
    ]
    # A window side at least max_seqlen_q + max_seqlen_k wide hides nothing in any sequence.
    d = one(plan(t(150, 2, 64), t(200, 2, 64), t(200, 2, 64), window_left=220, window_right=219))
    assert not d.constants[HAS_LO] and d.constants[HAS_HI]


def test_copies_only_what_the_kernel_cannot_read_in_place():
    q = t(150, 64, 2).transpose(1, 2)  # last stride 64: copied
    p = plan(q, t(200, 2, 64), t(200, 2, 64), cu_q=cu(0, 0, 50, 0, 100, 0, 150)[::2],
             cu_k=cu(0, 120, 130, 200), sinks=t(4)[::2])  # fmt: skip
    assert p.ok and p.contiguous_inputs == [0, 3, 5]
    odd = t(200 * 128 + 3)[3:].view(200, 2, 64)
    d = one(plan(t(150, 2, 64), odd, t(200, 2, 64), sinks=t(2, dtype=torch.float32)))
    assert not d.constants[VEC_K] and d.constants[VEC_V] and d.constants[SINKS] == 2


def test_dense_plans_are_not_varlen():
    d = sim.plan("sdpa", [t(1, 2, 33, 64), t(1, 2, 40, 64), t(1, 2, 40, 64), None, None],
                 {"scale": 0.125}).dispatches[0]  # fmt: skip
    assert not d.constants[VARLEN] and not d.constants[VARLEN_BR]
    assert {b.index for b in d.bindings} == set(range(BUF_PARAMS + 1))  # no cu_seqlens buffers


def test_empty_batch_has_no_dispatch():
    p = plan(t(0, 2, 64), t(5, 2, 64), t(5, 2, 64), cu_q=cu(0, 0), cu_k=cu(0, 5), max_seqlen_q=0)
    assert p.ok and p.dispatches == [] and p.allocations[0].sizes == (0, 2, 64)


def test_params_are_the_attention_params_layout():
    raw = next(b.bytes for b in one(plan(t(150, 2, 64), t(200, 2, 64), t(200, 2, 64))).bindings
               if b.index == BUF_PARAMS)  # fmt: skip
    assert len(raw) == 312 and struct.unpack_from("2i", raw, 0) == (150, 200)


@pytest.mark.parametrize(
    "case,reason",
    [
        (lambda: plan(t(150, 2, 64), t(200, 2, 64), t(200, 2, 64), max_seqlen_q=2**30 + 1),
         "32-bit row indexing"),
        (lambda: plan(t(150, 2, 64), t(200, 2, 64), t(200, 2, 64), max_seqlen_k=2**31),
         "32-bit row indexing"),
        (lambda: plan(t(150, 2, 64), t(200, 2, 64), t(200, 2, 64), dropout_p=1.0), "dropout"),
        (lambda: plan(t(150, 2, 64, dtype=torch.float64), t(200, 2, 64, dtype=torch.float64),
                      t(200, 2, 64, dtype=torch.float64)), "float64"),
        (lambda: plan(t(150, 2, 64), t(200, 2, 64), t(200, 2, 64),
                      cu_q=cu(0, 50, 100, 150, dtype=torch.int64)), "int32"),
        (lambda: plan(t(150, 2, 64), t(200, 2, 64), t(200, 2, 64), cu_k=cu(0, 200)), "one length"),
        (lambda: plan(t(1, 150, 2, 64), t(1, 200, 2, 64), t(1, 200, 2, 64)), "packed [tokens"),
        (lambda: plan(t(150, 3, 64), t(200, 2, 64), t(200, 2, 64)), "do not make"),
        (lambda: plan(t(150, 2, 584), t(200, 2, 584), t(200, 2, 584)), "head dims"),
        (lambda: plan(t(150, 2, 64), t(200, 2, 64), t(200, 2, 64), sinks=t(3)), "sinks"),
        (lambda: plan(t(150, 2, 64), t(200, 2, 64), t(200, 2, 64), cu_q=cu(0), cu_k=cu(0)),
         "0 sequences"),
        (lambda: sim.plan("sdpa_varlen", [t(5, 2, 64), t(5, 2, 64), t(5, 2, 64), cu(0, 5),
                                          cu(0, 5), None], {}), "max_seqlen_q and max_seqlen_k"),
        (lambda: sim.plan("sdpa_varlen", [t(5, 2, 64), t(5, 2, 64), t(5, 2, 64), None, None,
                                          None], {}), "takes tensors"),
    ],
)  # fmt: skip
def test_refusals_name_the_limit(case, reason):
    p = case()
    assert not p.ok and reason in p.reason, p.reason


def test_offsets_past_two_to_the_31_are_64_bit():
    """2^20 packed tokens of 32 heads x 128 (2^32 elements): row strides reach the kernel whole
    and its token offsets are 64-bit products (cu_seqlens[b] * row stride)."""
    q = torch.empty(2**20, 32, 128, dtype=torch.float16, device="meta")
    d = one(plan(q, q, q, cu_q=cu(0, 2**19, 2**20), cu_k=cu(0, 2**19, 2**20),
                 max_seqlen_q=2**19, max_seqlen_k=2**19))  # fmt: skip
    pr = params(d)
    assert (pr["L"], pr["q_rs"], pr["o_rs"]) == (2**20, 32 * 128, 32 * 128)
    assert d.grid == (2**14, 32, 2)


BWD_CU_Q, BWD_CU_K, BWD_PARAMS = 19, 20, 17
GRAD_LSE, ALIGN_Q = 320, 321


def backward(q, k, v, sinks=None, grad_lse=False, **kw):
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    lse = torch.empty(q.shape[1], q.shape[0])
    tensors = [out, q, k, v, out, lse, cu(0, 50, 100, 150), cu(0, 120, 130, 200), sinks,
               lse if grad_lse else None]  # fmt: skip
    return sim.plan("sdpa_varlen_backward", tensors, options(**kw))


def test_backward_dispatches_bind_the_offsets_and_cover_the_longest_sequence():
    p = backward(t(150, 8, 64), t(200, 2, 64), t(200, 2, 64), sinks=t(8), is_causal=True,
                 bottom_right=True)  # fmt: skip
    assert p.ok, p.reason
    kernels = [d.kernel for d in p.dispatches]
    names = ["delta_f16", "dkdv_f16_e64_v64", "dq_f16_e64_v64", "dsinks_f16"]
    assert kernels == ["steel_attention_bwd_" + name for name in names]
    grids = [tuple(d.grid) for d in p.dispatches]
    # 100 rows / 32 a pre-pass threadgroup, 120 keys / 32, 100 rows / 32; 3 sequences each.
    assert grids == [(4, 8, 3), (4, 2, 3), (4, 8, 3), (8, 1, 1)]
    for d in p.dispatches[:3]:
        assert d.constants[VARLEN] and d.constants[VARLEN_BR] and not d.constants[ALIGN_Q]
        assert not d.constants[GRAD_LSE]
        bound = {b.index: b.slot for b in d.bindings}
        assert (bound[BWD_CU_Q], bound[BWD_CU_K]) == (6, 7)
    assert BWD_CU_Q not in {b.index for b in p.dispatches[3].bindings}
    raw = next(b.bytes for b in p.dispatches[2].bindings if b.index == BWD_PARAMS)
    assert struct.unpack_from("2i", raw, 0) == (150, 200)  # token counts bound every sequence
    assert struct.unpack_from("fi", raw, 312) == (0.125, 1)  # scale, one plane of rows
    names = [(a.name, tuple(a.sizes), a.is_output) for a in p.allocations]
    assert names == [("dq", (150, 8, 64), True), ("dk", (200, 2, 64), True),
                     ("dv", (200, 2, 64), True), ("dsinks", (8,), True),
                     ("delta", (2, 1200), False)]  # fmt: skip


def test_float32_head_dim_512_backward_is_planned():
    p = backward(t(150, 2, 512, dtype=torch.float32), t(200, 2, 512, dtype=torch.float32),
                 t(200, 2, 512, dtype=torch.float32))  # fmt: skip
    assert p.ok, p.reason
    assert [d.kernel for d in p.dispatches] == [
        "steel_attention_bwd_delta_f32",
        "steel_attention_bwd_dkdv_f32_e512_v512",
        "steel_attention_bwd_dq_f32_e512_v512",
    ]


def test_backward_refusals_name_the_limit():
    p = backward(t(150, 2, 64), t(200, 2, 64), t(200, 2, 64), max_seqlen_q=-1)
    assert not p.ok and "max_seqlen_q" in p.reason
    out = torch.empty(150, 2, 64, dtype=torch.float16)
    args = [out, t(150, 2, 64), t(200, 2, 64), t(200, 2, 64), out, torch.empty(150, 2),
            cu(0, 150), cu(0, 200), None, None]  # fmt: skip
    p = sim.plan("sdpa_varlen_backward", args, options())
    assert not p.ok and "lse and grad_lse must be float32 [2, 150]" in p.reason
