"""The attention launch plan (mps_src/plan/attention_plan.cpp) through torch_steel.sim.plan:
kernel and head-dim choice, tile constants, alignment flags, the params bytes (64-bit offsets),
the output layout, the grid, and each refusal with its reason."""

from __future__ import annotations

import math
import struct
import sys
from pathlib import Path

import pytest
import torch

from torch_steel import sim
from torch_steel.sim import timing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gemm"))
from gemm_helpers import requires_planner, simulator_ready  # noqa: E402

pytestmark = requires_planner

# Function-constant and buffer indices (shaders/steel/params.h).
ALIGN_L, ALIGN_S, ALIGN_E, ALIGN_EV, VEC_K, VEC_V = 300, 301, 302, 303, 304, 305
MASK, HAS_HI, HAS_LO, SINKS, SOFTCAP, HAS_BATCH = 310, 311, 312, 313, 314, 315
BUF_Q, BUF_K, BUF_V, BUF_MASK, BUF_SINKS, BUF_OUT, BUF_LSE, BUF_PARAMS = range(8)
PARAMS_SIZE = 312
LOG2E = 1.4426950408889634
INSTANTIATED = [(32, 32), (40, 40), (64, 64), (72, 72), (80, 80), (96, 96), (128, 128),
                (160, 160), (192, 128), (192, 192), (256, 256), (512, 512), (576, 512),
                (576, 576)]  # fmt: skip
DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}


def params(dispatch):
    raw = next(b.bytes for b in dispatch.bindings if b.index == BUF_PARAMS)
    assert len(raw) == PARAMS_SIZE
    names = ["L", "S", "E", "Ev", "Hq", "group", "shift", "hi_off", "lo_off"]
    out = dict(zip(names, struct.unpack_from("9i", raw, 0), strict=True))
    out["q_scale"], out["softcap"] = struct.unpack_from("2f", raw, 36)
    out["batch_ndim"] = struct.unpack_from("i", raw, 44)[0]
    out["batch_shape"] = struct.unpack_from("4i", raw, 48)
    for i, name in enumerate(["q_bs", "k_bs", "v_bs", "m_bs"]):
        out[name] = struct.unpack_from("4q", raw, 64 + 32 * i)
    rest = ["q_hs", "q_rs", "k_hs", "k_rs", "v_hs", "v_rs", "m_hs", "m_rs", "m_cs", "o_bs",
            "o_hs", "o_rs"]  # fmt: skip
    out.update(zip(rest, struct.unpack_from("12q", raw, 192), strict=True))
    return out


def t(*shape, dtype=torch.float16):
    return torch.empty(*shape, dtype=dtype)


def options(**kw):
    # The prefill kernel's plan: decode (L <= 8) is off here (tests/plan/test_decode_plan.py).
    base = {"dropout_p": 0.0, "is_causal": False, "scale": 0.125, "softcap": 0.0,
            "window_left": -1, "window_right": -1, "bottom_right": False,
            "decode": False}  # fmt: skip
    return {**base, **kw}


def plan(q, k, v, mask=None, sinks=None, **kw):
    return sim.plan("sdpa", [q, k, v, mask, sinks], options(**kw))


def one(p):
    assert p.ok, p.reason
    assert len(p.dispatches) == 1
    return p.dispatches[0]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("E,Ev", INSTANTIATED)
def test_instantiated_head_dims_pick_their_kernel(E, Ev, dtype):
    d = one(plan(t(1, 2, 64, E, dtype=dtype), t(1, 2, 64, E, dtype=dtype),
                 t(1, 2, 64, Ev, dtype=dtype)))  # fmt: skip
    assert d.kernel == f"steel_attention_{DTYPES[dtype]}_e{E}_v{Ev}"
    assert d.constants[ALIGN_E] and d.constants[ALIGN_EV]
    assert d.threads == (128, 1, 1) and d.grid == (2, 2, 1)


@pytest.mark.skipif(not simulator_ready()[0], reason=simulator_ready()[1])
def test_every_planned_kernel_is_in_the_library():
    """The plan's kernel table and attention.metal's instantiations name the same kernels."""
    kernels = set(sim.build.shader_library().handle.kernels())
    for dtype in DTYPES:
        for E in range(8, 577, 8):
            for Ev in (8, E, 128, 256, 512, 576):
                d = one(plan(t(1, 1, 4, E, dtype=dtype), t(1, 1, 4, E, dtype=dtype),
                             t(1, 1, 4, Ev, dtype=dtype)))  # fmt: skip
                assert d.kernel in kernels, d.kernel


@pytest.mark.parametrize(
    "E,Ev,kernel",
    [(100, 100, "e128_v128"), (8, 8, "e32_v32"), (48, 80, "e80_v80"), (192, 100, "e192_v128"),
     (64, 256, "e256_v256"), (257, 1, "e512_v512"), (130, 128, "e160_v160"),
     (520, 520, "e576_v576"), (576, 500, "e576_v512"), (300, 576, "e576_v576"),
     (513, 8, "e576_v512")],
)  # fmt: skip
def test_other_head_dims_take_the_next_instantiation(E, Ev, kernel):
    d = one(plan(t(1, 1, 8, E), t(1, 1, 8, E), t(1, 1, 8, Ev)))
    assert d.kernel == f"steel_attention_f16_{kernel}"
    de, dv = (int(x[1:]) for x in kernel.split("_"))
    assert d.constants[ALIGN_E] == (E == de) and d.constants[ALIGN_EV] == (Ev == dv)


def test_alignment_constants():
    d = one(plan(t(2, 4, 64, 64), t(2, 4, 96, 64), t(2, 4, 96, 64)))
    assert d.constants[ALIGN_L] and d.constants[ALIGN_S] and d.constants[VEC_K]
    d = one(plan(t(2, 4, 33, 64), t(2, 4, 47, 64), t(2, 4, 47, 64)))
    assert not d.constants[ALIGN_L] and not d.constants[ALIGN_S]
    # BK is 16 for head dim 256 in float16: S = 48 is aligned there, not for head dim 64.
    assert one(plan(t(1, 1, 8, 256), t(1, 1, 48, 256), t(1, 1, 48, 256))).constants[ALIGN_S]
    # A KV-cache slice at an odd offset cannot take 16-byte loads.
    flat = t(100 * 64)
    odd = flat[3 : 3 + 47 * 64].view(1, 1, 47, 64)
    d = one(plan(t(1, 1, 8, 64), odd, odd))
    assert not d.constants[VEC_K] and not d.constants[VEC_V]
    even = flat[8 : 8 + 47 * 64].view(1, 1, 47, 64)
    d = one(plan(t(1, 1, 8, 64), even, odd))
    assert d.constants[VEC_K] and not d.constants[VEC_V]


def test_scale_unit_softcap_and_diagonals():
    p = params(one(plan(t(1, 1, 10, 64), t(1, 1, 20, 64), t(1, 1, 20, 64), scale=0.5)))
    assert p["q_scale"] == pytest.approx(0.5 * LOG2E) and p["softcap"] == 0
    # An additive mask keeps scores in nats (finfo.min would overflow times log2 e).
    d = one(plan(t(1, 1, 10, 64), t(1, 1, 20, 64), t(1, 1, 20, 64), t(10, 20), scale=0.5))
    assert params(d)["q_scale"] == pytest.approx(0.5) and d.constants[MASK] == 2
    p = params(one(plan(t(1, 1, 10, 64), t(1, 1, 20, 64), t(1, 1, 20, 64), softcap=30.0)))
    assert p["q_scale"] == pytest.approx(0.125 / 30) and p["softcap"] == pytest.approx(30 * LOG2E)
    d = one(plan(t(1, 1, 10, 64), t(1, 1, 20, 64), t(1, 1, 20, 64), is_causal=True,
                 bottom_right=True, window_left=5, window_right=3))  # fmt: skip
    p = params(d)
    assert d.constants[HAS_HI] and d.constants[HAS_LO]
    assert (p["shift"], p["hi_off"], p["lo_off"]) == (10, 0, 5)
    d = one(plan(t(1, 1, 10, 64), t(1, 1, 20, 64), t(1, 1, 20, 64), window_right=3))
    assert d.constants[HAS_HI] and not d.constants[HAS_LO] and params(d)["hi_off"] == 3
    # A window wider than L + S hides nothing: no element tests at all.
    d = one(plan(t(1, 1, 10, 64), t(1, 1, 20, 64), t(1, 1, 20, 64), window_left=30,
                 window_right=1000))  # fmt: skip
    assert not d.constants[HAS_HI] and not d.constants[HAS_LO]


def test_mask_kinds_and_broadcast_strides():
    q, k, v = t(2, 3, 10, 64), t(2, 3, 20, 64), t(2, 3, 20, 64)
    for mask, kind in [(t(10, 20, dtype=torch.bool), 1), (t(10, 20), 2),
                       (t(10, 20, dtype=torch.float32), 3)]:  # fmt: skip
        d = one(plan(q, k, v, mask))
        assert d.constants[MASK] == kind
        assert next(b.slot for b in d.bindings if b.index == BUF_MASK) == 3
    p = params(one(plan(q, k, v, t(1, 3, 1, 20))))  # key padding per head
    assert (p["m_hs"], p["m_rs"], p["m_cs"]) == (20, 0, 1) and p["m_bs"][0] == 0
    p = params(one(plan(q, k, v, t(20, 10).t())))  # transposed mask: read through its strides
    assert (p["m_rs"], p["m_cs"]) == (1, 10)
    d = one(plan(q, k, v))
    assert d.constants[MASK] == 0
    assert next(b.slot for b in d.bindings if b.index == BUF_MASK) == 0  # q stands in


def test_gqa_group_and_sinks():
    d = one(plan(t(1, 8, 10, 64), t(1, 2, 20, 64), t(1, 2, 20, 64), sinks=t(8)))
    assert params(d)["group"] == 4 and d.constants[SINKS] == 1
    d = one(plan(t(1, 8, 10, 64), t(1, 1, 20, 64), t(1, 1, 20, 64),
                 sinks=t(8, dtype=torch.float32)))  # fmt: skip
    assert params(d)["group"] == 8 and d.constants[SINKS] == 2
    p = plan(t(1, 8, 10, 64), t(1, 1, 20, 64), t(1, 1, 20, 64), sinks=t(16)[::2])
    assert p.ok and p.contiguous_inputs == [4]


def test_blhd_query_gives_blhd_output():
    q = t(2, 33, 4, 64).transpose(1, 2)
    p = plan(q, t(2, 4, 40, 64), t(2, 4, 40, 64))
    out = p.allocations[0]
    assert out.sizes == (2, 4, 33, 64) and out.order == (0, 2, 1, 3)
    pr = params(one(p))
    assert (pr["o_hs"], pr["o_rs"], pr["q_hs"], pr["q_rs"]) == (64, 256, 64, 256)
    p = plan(t(2, 4, 33, 64), t(2, 4, 40, 64), t(2, 4, 40, 64))
    assert p.allocations[0].order == () and params(one(p))["o_rs"] == 64
    assert p.allocations[1].sizes == (2, 4, 33) and p.allocations[1].dtype == torch.float32


def test_batch_dims_merge_and_expand():
    d = one(plan(t(2, 3, 4, 10, 64), t(2, 3, 4, 20, 64), t(2, 3, 4, 20, 64)))
    p = params(d)
    assert p["batch_ndim"] == 1 and p["batch_shape"][0] == 6 and d.grid == (1, 4, 6)
    k = t(1, 3, 4, 20, 64).expand(2, 3, 4, 20, 64)
    p = params(one(plan(t(2, 3, 4, 10, 64), k, k)))
    assert p["batch_ndim"] == 2 and p["k_bs"][:2] == (0, 4 * 20 * 64)
    d = one(plan(t(1, 4, 10, 64), t(1, 4, 20, 64), t(1, 4, 20, 64)))
    assert not d.constants[HAS_BATCH]


def test_offsets_past_two_to_the_31_are_64_bit():
    """Strides whose products pass 2^31 elements reach the kernel whole (PyTorch's MPS kernels
    wrap there): a [2, 32, 8192, 128] BLHD view whose batch entries lie 2^32 elements apart."""
    q = torch.empty_strided((2, 32, 8192, 128), (2**32, 128, 32 * 128, 1), device="meta",
                            dtype=torch.float16)  # fmt: skip
    p = params(one(plan(q, q, q)))
    assert p["q_bs"][0] == 2**32 and p["q_rs"] == 4096 and p["o_bs"] == 32 * 8192 * 128


@pytest.mark.parametrize(
    "case,reason",
    [
        (lambda: plan(t(1, 1, 8, 64), t(1, 1, 8, 64), t(1, 1, 8, 64), dropout_p=1.0),
         "dropout"),
        (lambda: plan(t(1, 1, 8, 64, dtype=torch.float64), t(1, 1, 8, 64, dtype=torch.float64),
                      t(1, 1, 8, 64, dtype=torch.float64)), "float64"),
        (lambda: plan(t(1, 1, 8, 64), t(1, 1, 8, 64, dtype=torch.float32), t(1, 1, 8, 64)),
         "dtype"),
        (lambda: plan(t(1, 1, 8, 584), t(1, 1, 8, 584), t(1, 1, 8, 584)), "head dims"),
        (lambda: plan(t(1, 3, 8, 64), t(1, 2, 8, 64), t(1, 2, 8, 64)), "do not make"),
        (lambda: plan(t(1, 1, 8, 64), t(1, 1, 8, 64), t(1, 1, 8, 64),
                      t(8, 8, dtype=torch.int32)), "attn_mask of dtype"),
        (lambda: plan(t(1, 1, 8, 64), t(1, 1, 8, 64), t(1, 1, 8, 64), t(3, 8)), "broadcast"),
        (lambda: plan(t(1, 2, 8, 64), t(1, 2, 8, 64), t(1, 2, 8, 64), sinks=t(3)), "sinks"),
        (lambda: plan(t(1, 1, 8, 64), t(1, 1, 8, 64), t(1, 1, 8, 64), max_threads=64),
         "threads per threadgroup"),
        (lambda: plan(t(8, 64), t(8, 64), t(8, 64)), "[*batch, heads, seq, dim]"),
        (lambda: plan(t(2, 2, 2, 2, 2, 1, 8, 64).permute(4, 3, 2, 1, 0, 5, 6, 7),
                      t(2, 2, 2, 2, 2, 1, 8, 64), t(2, 2, 2, 2, 2, 1, 8, 64)), "batch dims"),
    ],
)  # fmt: skip
def test_refusals_name_the_limit(case, reason):
    p = case()
    assert not p.ok and reason in p.reason, p.reason


def test_empty_outputs_have_no_dispatch():
    p = plan(t(1, 2, 0, 64), t(1, 2, 5, 64), t(1, 2, 5, 64))
    assert p.ok and p.dispatches == [] and p.allocations[0].sizes == (1, 2, 0, 64)
    assert math.prod(p.allocations[1].sizes) == 0


DMASK_ROWS, DMASK_KEYS, ALIGN_Q = 324, 325, 321


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("E,Ev", [(E, Ev) for E, Ev in INSTANTIATED if E <= 512])
def test_every_pair_has_backward_kernels(E, Ev, dtype):
    """The backward refuses no instantiated pair (float32 at 512 has tiles that share one
    buffer), its kernels are the pair's, and ALIGN_Q says whether L = 24 fills its query tiles
    (8 rows wherever two 16-row tiles and their row statistics exceed the 20 KiB budget)."""
    q, k, v = t(1, 2, 24, E, dtype=dtype), t(1, 2, 40, E, dtype=dtype), t(1, 2, 40, Ev, dtype=dtype)
    out = torch.empty(1, 2, 24, Ev, dtype=dtype)
    args = [out, q, k, v, out, torch.empty(1, 2, 24), None, None, None]
    p = sim.plan("sdpa_backward", args, {"scale": 0.1})
    assert p.ok, p.reason
    tag = f"{DTYPES[dtype]}_e{E}_v{Ev}"
    assert [d.kernel for d in p.dispatches] == [
        f"steel_attention_bwd_delta_{DTYPES[dtype]}",
        f"steel_attention_bwd_dkdv_{tag}",
        f"steel_attention_bwd_dq_{tag}",
    ]
    # L = 24 is whole tiles of the backward's streamed rows only where they are 8 (the timing
    # model's restatement of params.h steel_attn_bwd_bk, which tests/sim/test_timing.py checks)
    eight = timing._attn_bwd_bk(E, Ev, torch.finfo(dtype).bits // 8) == 8
    assert p.dispatches[1].constants[ALIGN_Q] == eight


VEC_Q, VEC_G = 334, 335


def test_backward_vec_constants_follow_q_and_grad_out_rows():
    """The dK/dV kernel streams q and grad_out rows in 16-byte chunks only where every row start
    is aligned: the offset, row, head and merged batch strides (as VEC_K / VEC_V for k, v)."""

    def constants(q, grad):
        k = t(2, 2, 40, 64)
        out = torch.empty(2, 2, 24, 64, dtype=torch.float16)
        args = [grad, q, k, k, out, torch.empty(2, 2, 24), None, None, None]
        p = sim.plan("sdpa_backward", args, {"scale": 0.1})
        assert p.ok, p.reason
        return {(c[VEC_Q], c[VEC_G]) for c in (d.constants for d in p.dispatches)}

    assert constants(t(2, 2, 24, 64), t(2, 2, 24, 64)) == {(True, True)}
    flat = t(2 * 2 * 24 * 64 + 8)
    odd = flat[3 : 3 + 2 * 2 * 24 * 64].view(2, 2, 24, 64)
    assert constants(odd, t(2, 2, 24, 64)) == {(False, True)}
    assert constants(t(2, 2, 24, 64), odd) == {(True, False)}
    wide = t(2, 2, 24, 68)[..., :64]  # rows 68 elements apart: 136 bytes, not whole chunks
    assert constants(t(2, 2, 24, 64), wide) == {(True, False)}
    # Batch entries 2 * 24 * 64 + 4 elements apart: the second entry's rows are 8 bytes off.
    batch = flat.as_strided((2, 2, 24, 64), (2 * 24 * 64 + 4, 24 * 64, 64, 1))
    assert constants(batch, t(2, 2, 24, 64)) == {(False, True)}


@pytest.mark.parametrize(
    "mask_shape,grid,combos,rows,keys",
    [
        ((2, 4, 33, 47), (2, 3, 8), 1, False, False),
        ((33, 47), (2, 3, 1), 8, False, False),
        ((2, 1, 33, 47), (2, 3, 2), 4, False, False),
        ((4, 1, 47), (1, 3, 4), 2, True, False),
        ((2, 4, 33, 1), (2, 1, 8), 1, False, True),
        ((1, 1, 1, 1), (1, 1, 1), 8, True, True),
    ],
)  # fmt: skip
def test_mask_gradient_dispatch_owns_the_mask_elements(mask_shape, grid, combos, rows, keys):
    """The dmask kernel is planned only with mask_grad: one threadgroup per (32 rows, 16 keys:
    the backward's streamed tile at f16 d64, params.h steel_attn_bwd_bk) tile of the mask's own
    extent and element of its kept batch/head dims, summing the (batch, head) pairs it
    broadcasts over; dmask in the mask's shape and dtype."""
    q, k, v = t(2, 4, 33, 64), t(2, 4, 47, 64), t(2, 4, 47, 64)
    out = torch.empty(2, 4, 33, 64, dtype=torch.float16)
    mask = torch.empty(mask_shape, dtype=torch.float32)
    args = [out, q, k, v, out, torch.empty(2, 4, 33), mask, None, None]
    opts = {"scale": 0.125, "is_causal": True}
    assert all("dmask" not in d.kernel for d in sim.plan("sdpa_backward", args, opts).dispatches)
    p = sim.plan("sdpa_backward", args, {**opts, "mask_grad": True})
    assert p.ok, p.reason
    d = p.dispatches[-1]
    assert d.kernel == "steel_attention_bwd_dmask_f16_e64_v64"
    assert (tuple(d.grid), d.constants[DMASK_ROWS], d.constants[DMASK_KEYS]) == (grid, rows, keys)
    raw = next(b.bytes for b in d.bindings if b.index == 17)
    assert struct.unpack_from("i", raw, 472)[0] == combos
    dmask = [a for a in p.allocations if a.name == "dmask"]
    assert [(tuple(a.sizes), a.dtype, a.is_output) for a in dmask] == [
        (mask_shape, torch.float32, True)
    ]


# ---- The K/V alias (STEEL_ATTN_FC_KV_ALIAS): v a prefix view of k, found from the views ----

KV_ALIAS = 319


def latent(S=40, dtype=torch.float16, E=576, Ev=512, B=1):
    """A latent cache [B, 1, S, E] and its first Ev columns as the value (absorbed MLA)."""
    kv = t(B, 1, S, E, dtype=dtype)
    return kv, kv[..., :Ev]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("L,decode", [(1, True), (4, True), (40, False)])
def test_a_prefix_view_of_k_takes_the_alias(dtype, L, decode):
    kv, v = latent(dtype=dtype)
    p = plan(t(1, 16, L, 576, dtype=dtype), kv, v, decode=decode)
    assert p.ok, p.reason
    assert all(d.constants[KV_ALIAS] for d in p.dispatches if KV_ALIAS in d.constants)
    assert p.dispatches[0].kernel.endswith("_e576_v512")


@pytest.mark.parametrize(
    "make_v",
    [
        lambda kv: kv[..., :512].clone(),  # another storage
        lambda kv: kv[..., 1:513],  # offset by one column
        lambda kv: kv[:, :, 1:, :512],  # offset by one row (S differs: a separate shape check)
        lambda kv: kv.view(-1)[: 40 * 512].view(1, 1, 40, 512),  # same storage, other strides
        lambda kv: kv[..., :512].contiguous(),
    ],
)  # fmt: skip
def test_views_that_are_not_a_prefix_of_k_do_not(make_v):
    kv, _ = latent()
    v = make_v(kv)
    p = plan(t(1, 16, 1, 576), kv[:, :, : v.shape[2]], v, decode=True)
    assert p.ok, p.reason
    assert not any(d.constants.get(KV_ALIAS, False) for d in p.dispatches)


def test_alias_needs_the_kernels_dv_within_de():
    # Ev <= E but the instantiation's DV > DE: (64, 128) runs on e128_v128 (DV = DE) and takes
    # it; v wider than k can never be a prefix of it.
    kv = t(1, 1, 40, 128)
    assert one(plan(t(1, 1, 40, 128), kv, kv[..., :64])).constants[KV_ALIAS]
    wide = t(1, 1, 40, 256)
    assert not one(plan(t(1, 1, 40, 64), wide[..., :64], wide)).constants[KV_ALIAS]


def test_the_plan_cache_tells_aliased_calls_apart():
    """Two calls whose tensors differ only in whether v shares k's storage have different plans
    (the cache key holds the shared storage and the offsets' distance)."""
    kv, v = latent()
    q = t(1, 16, 1, 576)
    shared = sim.plan("sdpa", [q, kv, v, None, None], options(decode=True))
    other = sim.plan("sdpa", [q, kv, v.clone(), None, None], options(decode=True))
    same_storage_moved = kv.view(-1)[8:].as_strided(v.shape, v.stride(), v.storage_offset() + 8)
    moved = sim.plan("sdpa", [q, kv, same_storage_moved, None, None], options(decode=True))
    assert shared.dispatches[0].constants[KV_ALIAS]
    assert not other.dispatches[0].constants[KV_ALIAS]
    assert not moved.dispatches[0].constants[KV_ALIAS]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_backward_refuses_head_dims_above_512_with_the_reason(dtype):
    q, k, v = (
        t(1, 2, 24, 576, dtype=dtype),
        t(1, 2, 40, 576, dtype=dtype),
        t(1, 2, 40, 512, dtype=dtype),
    )
    out = torch.empty(1, 2, 24, 512, dtype=dtype)
    p = sim.plan("sdpa_backward", [out, q, k, v, out, torch.empty(1, 2, 24), None, None, None],
                 {"scale": 0.1})  # fmt: skip
    assert not p.ok and "no backward kernel" in p.reason and "576" in p.reason, p.reason


# ---- The lse store (STEEL_ATTN_FC_LSE): off only when the run option "lse" is 0 ----

LSE = 326


@pytest.mark.parametrize(
    "L,S,decode,splits",
    [(100, 100, False, 0), (1, 4096, True, 1), (1, 4096, True, 4), (3, 512, True, 0)],
)
@pytest.mark.parametrize("lse", [None, 1, 0])
def test_the_lse_constant_follows_the_option(L, S, decode, splits, lse):
    extra = {} if lse is None else {"lse": lse}
    p = plan(t(2, 32, L, 128), t(2, 8, S, 128), t(2, 8, S, 128), decode=decode,
             num_splits=splits, **extra)  # fmt: skip
    assert p.ok, p.reason
    assert p.dispatches[0].kernel.startswith(
        "steel_attention_decode_" if decode else "steel_attention_f16"
    )
    if splits > 1:  # the merge stores lse; the split kernel stores its partials either way
        assert [d.kernel.split("_f16")[0] for d in p.dispatches] == [
            "steel_attention_decode_vector", "steel_attention_decode_merge"
        ]  # fmt: skip
    for d in p.dispatches:
        assert d.constants[LSE] == (lse != 0), d.kernel


def test_the_lse_constant_on_the_matmul2d_prefill_and_the_plan_cache():
    from gemm_helpers import M5

    q, k = t(1, 4, 100, 64), t(1, 4, 100, 64)
    with sim.device(M5):
        stored, skipped = plan(q, k, k), plan(q, k, k, lse=0)
    assert one(stored).kernel.startswith("steel_attention_tensor_")
    assert one(stored).constants[LSE] and not one(skipped).constants[LSE]
    again = plan(q, k, k)  # the cache keeps the option in its key
    assert one(again).constants[LSE] and not one(plan(q, k, k, lse=0)).constants[LSE]
