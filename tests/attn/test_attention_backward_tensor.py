"""The attention backward on Metal 4's matmul2d (shaders/steel/attn_tensor/backward_tensor.h):
its dK/dV and dQ kernels, planned by mps_src/plan/attention_plan.cpp and varlen_plan.cpp
(attn::tensor_backward) exactly where the same call's forward runs on matmul2d
(attn::tensor_serves: an M5-generation device, float16 / bfloat16, head-dim pairs padding to
64, 96, 128, 256). Run in the simulator emulating such a device (torch_steel.sim.device),
checkers on, strict, under several cooperative-tensor layout seeds: gradients of q, k, v (and
sinks) against float64 autograd through the reference and through F.sdpa.

Every run asserts that the matmul2d dK/dV and dQ kernels served it (and that no simdgroup
dK/dV or dQ kernel ran), so a plan that quietly kept the simdgroup backward fails here.
Lengths sit off the tiles (64 keys or query rows per threadgroup, tiles of 32): S % 32 and
L % 32 in {1, 31} among them.

Tolerance: test_attention_backward's bound (the result's rounding to its dtype plus SLACK of
the largest gradient element) plus the rounding of the products' left operands to the inputs'
dtype: P o Z (for dV) and dS (for dK and dQ) go through threadgroup memory in T, as the
forward's P does, each term off by at most T's unit roundoff u; the products' terms are
bounded by the largest gradient element times a few on these unit-scale inputs, so 2u of it.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from attn_helpers import OUT_ROUNDING, qkv, rand, requires_planner, requires_simulator
from gemm_helpers import M5, NOT_M5
from test_attention_backward import SLACK, grads
from test_attention_tensor import m5_kernels
from test_varlen import packed
from test_varlen_backward import dense_grads, varlen_grads

import torch_steel
from torch_steel import sim

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

HALF_TYPES = [torch.float16, torch.bfloat16]
SEEDS = [0, 3, 11]
UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
TENSOR_SLACK = {dt: SLACK[dt] + 2 * UNIT[dt] for dt in HALF_TYPES}


@contextlib.contextmanager
def on_m5(monkeypatch, layout_seed, keys=True):
    """Runs the block as on an M5 with the cooperative-tensor layouts of `layout_seed` and
    checks that its backward ran the matmul2d dQ kernel (and dK/dV one, when there are `keys`),
    and no simdgroup dK/dV or dQ kernel. Decode is off (test_attention_tensor.m5_kernels) so
    that short calls test the prefill forward on matmul2d too."""
    with m5_kernels(monkeypatch, layout_seed) as kernels:
        yield kernels
    tensor = [k for k in kernels if k.startswith("steel_attention_bwd_tensor_")]
    assert any("_dq_" in k for k in tensor), kernels
    assert not keys or any("_dkdv_" in k for k in tensor), kernels
    simdgroup = ("steel_attention_bwd_dkdv_", "steel_attention_bwd_dq_")
    assert not any(k.startswith(simdgroup) for k in kernels), kernels


def assert_grads_close(got, want, dtype):
    names = ["dq", "dk", "dv", "dsinks"][: len(got)]
    for name, g, r in zip(names, got, want, strict=True):
        assert g.shape == r.shape, name
        assert not bool(g.isnan().any()), f"{name}: NaN"
        mag = float(r.abs().max()) if r.numel() else 0.0
        bound = OUT_ROUNDING[g.dtype] * r.abs() + TENSOR_SLACK[dtype] * mag + 1e-6
        err = (g.double() - r).abs()
        assert bool((err <= bound).all()), f"{name}: worst error {float(err.max()):.3g} ({mag:.3g})"


def check(monkeypatch, layout_seed, q, k, v, with_lse=True, **kwargs):
    """Kernel gradients on the M5 path against float64 autograd through the reference."""
    gen = torch.Generator().manual_seed(11)
    grad_out = torch.randn(*q.shape[:-1], v.shape[-1], generator=gen, dtype=torch.float64)
    kwargs64 = dict(kwargs)
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kwargs64["attn_mask"] = mask.double()
    if kwargs.get("sinks") is not None:
        kwargs64["sinks"] = kwargs["sinks"].double()
    with on_m5(monkeypatch, layout_seed, keys=k.shape[-2] > 0):
        _, got = grads(q, k, v, "sim", grad_out.to(q.dtype), with_lse, **kwargs)
    _, want = grads(q.double(), k.double(), v.double(), "reference", grad_out, with_lse,
                    **kwargs64)  # fmt: skip
    assert_grads_close(got, want, q.dtype)
    return got


@pytest.fixture(params=SEEDS)
def seed(request):
    return request.param


# ---- planning: who gets the kernels --------------------------------------------------------


def backward_kernels(q, k, v, options, mask=None, sinks=None, op="sdpa_backward"):
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    lse = torch.zeros(q.shape[:-1])
    p = sim.plan(op, [out, q, k, v, out, lse, mask, sinks, None], options)
    assert p.ok, p.reason
    return p


@requires_planner
@pytest.mark.parametrize("name", sorted(NOT_M5))
def test_only_m5_devices_get_the_matmul2d_backward(name):
    q, k, v = (torch.zeros(1, 2, n, 64, dtype=torch.float16) for n in (100, 70, 70))
    p = backward_kernels(q, k, v, NOT_M5[name])
    assert [d.kernel for d in p.dispatches] == [
        "steel_attention_bwd_delta_f16", "steel_attention_bwd_dkdv_f16_e64_v64",
        "steel_attention_bwd_dq_f16_e64_v64"]  # fmt: skip
    p = backward_kernels(q, k, v, M5)
    assert [d.kernel for d in p.dispatches] == [
        "steel_attention_bwd_delta_f16", "steel_attention_bwd_tensor_dkdv_f16_e64_v64",
        "steel_attention_bwd_tensor_dq_f16_e64_v64"]  # fmt: skip
    kv, dq = p.dispatches[1:]
    assert kv.grid == (2, 2, 1) and dq.grid == (2, 2, 1)  # 64 keys / query rows a threadgroup
    assert kv.threads == dq.threads == (128, 1, 1)  # the forward's four simdgroups


@requires_planner
@pytest.mark.parametrize(
    "E,Ev,dtype,tensor",
    [(64, 64, torch.bfloat16, True), (100, 100, torch.float16, True),
     (64, 128, torch.float16, True), (256, 256, torch.bfloat16, True),
     (32, 32, torch.float16, False), (80, 80, torch.float16, False),
     (192, 128, torch.float16, False), (512, 512, torch.float16, False),
     (64, 64, torch.float32, False)],
)  # fmt: skip
def test_the_backward_follows_the_forward(E, Ev, dtype, tensor):
    """Where the forward of a call runs on matmul2d, so do its dK/dV and dQ; elsewhere both
    keep the simdgroup kernels. "tensor_ops" = 0 turns both off."""
    q, k = torch.zeros(1, 2, 100, E, dtype=dtype), torch.zeros(1, 2, 70, E, dtype=dtype)
    v = torch.zeros(1, 2, 70, Ev, dtype=dtype)
    fwd = sim.plan("sdpa", [q, k, v, None, None], {**M5, "decode": 0}).dispatches[0].kernel
    assert fwd.startswith("steel_attention_tensor_") == tensor
    kernels = [d.kernel for d in backward_kernels(q, k, v, M5).dispatches]
    assert all(("_tensor_" in x) == (tensor and "delta" not in x) for x in kernels), kernels
    off = backward_kernels(q, k, v, {**M5, "tensor_ops": 0}).dispatches
    assert not any("_tensor_" in d.kernel for d in off)


@requires_planner
def test_dmask_stays_on_the_simdgroup_kernel_and_varlen_follows():
    q, k, v = (torch.zeros(1, 2, n, 64, dtype=torch.float16) for n in (100, 70, 70))
    p = backward_kernels(q, k, v, {**M5, "mask_grad": True}, mask=torch.zeros(100, 70))
    assert [d.kernel for d in p.dispatches][1:] == [
        "steel_attention_bwd_tensor_dkdv_f16_e64_v64", "steel_attention_bwd_tensor_dq_f16_e64_v64",
        "steel_attention_bwd_dmask_f16_e64_v64"]  # fmt: skip
    lq, lk = [40, 0, 70], [100, 5, 30]
    q, k, v = packed(lq, lk, 4, 2, 64)
    out, lse = torch.zeros_like(q), torch.zeros(4, sum(lq))
    cu_q = torch.tensor([0, 40, 40, 110], dtype=torch.int32)
    cu_k = torch.tensor([0, 100, 105, 135], dtype=torch.int32)
    opts = {**M5, "max_seqlen_q": 70, "max_seqlen_k": 100}
    p = sim.plan("sdpa_varlen_backward", [out, q, k, v, out, lse, cu_q, cu_k, None, None], opts)
    assert p.ok, p.reason
    assert [(d.kernel, d.grid) for d in p.dispatches][1:] == [
        ("steel_attention_bwd_tensor_dkdv_f16_e64_v64", (2, 2, 3)),
        ("steel_attention_bwd_tensor_dq_f16_e64_v64", (2, 4, 3))]  # fmt: skip


# ---- the kernels against float64 autograd ----------------------------------------------------

CORE = [(64, torch.float16), (96, torch.bfloat16), (128, torch.float16), (256, torch.bfloat16)]


@requires_simulator
@pytest.mark.parametrize("E,dtype", CORE, ids=str)
def test_head_dims(E, dtype, monkeypatch):
    q, k, v = qkv(1, 2, 70, 97, E, dtype=dtype, gen=torch.Generator().manual_seed(E))
    check(monkeypatch, E % 7, q, k, v, is_causal=True)


# L % 32 and S % 32 in {1, 31}; L != S both ways; a single row and key.
LENGTHS = [(1, 1), (33, 63), (97, 31), (65, 129), (31, 95)]


@requires_simulator
@pytest.mark.parametrize("L,S", LENGTHS)
def test_lengths(L, S, monkeypatch):
    dtype = HALF_TYPES[(L + S) % 2]
    q, k, v = qkv(1, 2, L, S, 64, dtype=dtype, gen=torch.Generator().manual_seed(L * 1000 + S))
    check(monkeypatch, SEEDS[(L + S) % len(SEEDS)], q, k, v)


@requires_simulator
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("L,S", [(97, 65), (33, 129)])
def test_causal(L, S, align, monkeypatch):
    q, k, v = qkv(1, 2, L, S, 64, dtype=torch.float16, gen=torch.Generator().manual_seed(S))
    check(monkeypatch, L % 5, q, k, v, is_causal=True, causal_align=align)


@requires_simulator
@pytest.mark.parametrize(
    "window,align,causal",
    [((16, 0), "top_left", False), ((5, 40), "bottom_right", False),
     ((-1, 3), "bottom_right", True)],
)  # fmt: skip
def test_window(window, align, causal, monkeypatch):
    q, k, v = qkv(1, 2, 100, 130, 64, dtype=torch.bfloat16)
    check(monkeypatch, sum(window) % 13, q, k, v, window=window, causal_align=align,
          is_causal=causal)  # fmt: skip


@requires_simulator
@pytest.mark.parametrize("kind", ["bool", "same", "float32"])
@pytest.mark.parametrize("shape", [(70, 97), (2, 1, 70, 97), (1, 2, 1, 97)])
def test_masks(kind, shape, monkeypatch):
    dtype = torch.bfloat16 if kind == "same" else torch.float16
    q, k, v = qkv(2, 2, 70, 97, 64, dtype=dtype)
    gen = torch.Generator().manual_seed(len(shape))
    if kind == "bool":
        mask = torch.rand(shape, generator=gen) > 0.3
        if shape[-2] > 5:
            mask[..., 5, :] = False  # a row that sees nothing
    else:
        mask = torch.randn(shape, generator=gen).to(dtype if kind == "same" else torch.float32)
    check(monkeypatch, len(shape) + len(kind), q, k, v, attn_mask=mask, is_causal=kind == "bool")


@requires_simulator
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
def test_softcap_scale_sinks_gqa(dtype, seed, monkeypatch):
    q, k, v = qkv(1, 8, 70, 97, 64, Hkv=2, dtype=dtype, gen=torch.Generator().manual_seed(seed))
    check(monkeypatch, seed, q, k, v, enable_gqa=True, softcap=5.0, scale=0.3,
          sinks=torch.randn(8, generator=torch.Generator().manual_seed(seed)))  # fmt: skip
    check(monkeypatch, seed, q, k, v, enable_gqa=True, is_causal=True, causal_align="bottom_right",
          sinks=torch.randn(8).to(dtype), attn_mask=torch.randn(70, 97),
          window=(40, 3))  # fmt: skip


@requires_simulator
def test_dropout_matches_the_reference(monkeypatch):
    """The same Philox stream as the reference: the kernels drop exactly its weights, so the
    gradients agree to rounding (a single differing drop moves them by a whole term)."""
    q, k, v = qkv(1, 4, 70, 97, 64, Hkv=2, dtype=torch.float16)
    check(monkeypatch, 4, q, k, v, dropout_p=0.2, seed=99, enable_gqa=True, is_causal=True)


@requires_simulator
def test_finfo_min_padding_rows(monkeypatch):
    """Hugging Face's padding (finfo.min on padded keys and on a padded row): the pre-pass's
    restored normaliser reaches the matmul2d kernels' P as the simdgroup kernels'."""
    q, k, v = qkv(1, 2, 40, 70, 64, dtype=torch.bfloat16)
    mask = torch.zeros(1, 1, 40, 70, dtype=torch.bfloat16)
    mask[..., 5, :] = torch.finfo(torch.bfloat16).min
    mask[..., :, 60:] = torch.finfo(torch.bfloat16).min
    check(monkeypatch, 2, q, k, v, attn_mask=mask)


@requires_simulator
def test_strided_views_batch_dims_and_no_keys(monkeypatch):
    g = torch.Generator().manual_seed(4)
    q = rand(2, 70, 3, 96, dtype=torch.float16, gen=g).transpose(1, 2)  # BLHD, read in place
    k = rand(2, 40, 3, 96, dtype=torch.float16, gen=g).transpose(1, 2)
    cache = rand(2, 3, 100, 96, dtype=torch.float16, gen=g)
    check(monkeypatch, 1, q, k, cache[:, :, 7:47], is_causal=True)
    q, k, v = qkv(0, 2, 33, 70, 100, 64, batch=(2, 2), dtype=torch.bfloat16, gen=g)  # padded
    check(monkeypatch, 2, q, k, v)
    q, k, v = qkv(1, 2, 7, 0, 64, dtype=torch.float16)
    dq, dk, dv = check(monkeypatch, 0, q, k, v)
    assert bool((dq == 0).all()) and dk.numel() == 0


@requires_simulator
def test_matches_pytorchs_autograd(monkeypatch):
    q, k, v = qkv(2, 3, 70, 70, 64, dtype=torch.float16)
    grad_out = torch.randn(2, 3, 70, 64, generator=torch.Generator().manual_seed(2))
    with on_m5(monkeypatch, 3):
        _, got = grads(q, k, v, "sim", grad_out.half(), with_lse=False, is_causal=True)
    ref = [x.double().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=True)
    want = torch.autograd.grad((out * grad_out.half().double()).sum(), ref)
    assert_grads_close(got, want, torch.float16)


@requires_simulator
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_varlen(align, seed, monkeypatch):
    lq, lk = [1, 33, 97, 0, 40], [63, 7, 129, 5, 0]
    dtype = HALF_TYPES[seed % 2]
    q, k, v = packed(lq, lk, 4, 2, 64, dtype=dtype, seed=seed)
    grad_out = torch.randn(sum(lq), 4, 64, generator=torch.Generator().manual_seed(9)).to(dtype)
    kwargs = {"is_causal": True, "causal_align": align, "sinks": torch.randn(4)}
    with on_m5(monkeypatch, seed):
        got = varlen_grads(q, k, v, lq, lk, grad_out, **dict(kwargs))
    want = dense_grads(q, k, v, lq, lk, grad_out, **dict(kwargs))
    assert_grads_close(got, want, dtype)


# ---- determinism and the layout --------------------------------------------------------------


@requires_simulator
def test_results_do_not_depend_on_the_layout_or_the_run(monkeypatch):
    """The same call under several layout seeds, and twice under one, gives the same bits: the
    kernels reach cooperative tensor elements only through the index API, sum in a fixed order
    and use no atomics."""
    q, k, v = qkv(1, 4, 70, 97, 64, Hkv=2, dtype=torch.bfloat16)
    mask = torch.rand(70, 97, generator=torch.Generator().manual_seed(2)) > 0.2
    grad_out = torch.randn(1, 4, 70, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    first = None
    for layout_seed in [0, 0, 1, 2, 7]:
        with on_m5(monkeypatch, layout_seed):
            _, got = grads(q, k, v, "sim", grad_out, attn_mask=mask, is_causal=True,
                           enable_gqa=True)  # fmt: skip
        if first is None:
            first = got
        for a, b in zip(got, first, strict=True):
            assert torch.equal(a, b), layout_seed


LAYOUT_KERNELS = Path(__file__).parent / "kernels" / "attention_bwd_tensor_layout_msl4.metal"


def run_dq_test_kernel(name, q, k, v, mask, grad_out, out, lse, **options):
    """dq of a test build of the matmul2d dQ kernel (LAYOUT_KERNELS), launched as the M5 plan
    of this backward launches the shipped one (grid, threads, constants, bindings), with delta
    = rowsum(dO * O) in fp32 and the normaliser 1 (no |lse| is huge here) in place of the
    pre-pass."""
    import bench_attention

    tensors = [grad_out, q, k, v, out, lse, mask, None, None]
    opts = {**bench_attention.run_options(q.shape[-1], options), **M5}
    p = sim.plan("sdpa_backward", tensors, opts)
    (d,) = [d for d in p.dispatches if d.kernel == "steel_attention_bwd_tensor_dq_f16_e64_v64"]
    slots = tensors + [torch.zeros(a.sizes, dtype=a.dtype) for a in p.allocations]
    delta = slots[len(tensors) + [a.name for a in p.allocations].index("delta")]
    delta[0] = (grad_out.float() * out.float()).sum(-1).flatten()
    delta[1] = 1.0
    buffers = {b.index: slots[b.slot] if b.kind == "tensor" else b.bytes for b in d.bindings}
    sim.run_kernel(name, sources=[LAYOUT_KERNELS], grid=d.grid, threads=d.threads,
                   buffers=buffers, constants=d.constants, checkers=True)  # fmt: skip
    return slots[len(tensors)]


@requires_simulator
def test_a_dq_that_assumes_a_layout_fails(monkeypatch):
    """The dQ kernel with its index as shipped (the index API) agrees with float64 autograd
    under every seed; with one that assumes where a thread's elements lie it is wrong under
    every seed."""
    q, k, v = qkv(1, 2, 100, 70, 64, dtype=torch.float16)
    mask = torch.rand(100, 70, generator=torch.Generator().manual_seed(4)) > 0.2
    grad_out = torch.randn(1, 2, 100, 64, generator=torch.Generator().manual_seed(6)).half()
    with sim.device({**M5, "decode": 0}):
        out, lse = sim.run_op("sdpa", [q, k, v, mask, None], {"is_causal": True})
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    with torch_steel.backend("reference"):
        ref = torch_steel.sdpa(*leaves, mask, is_causal=True)
    (want,) = torch.autograd.grad((ref * grad_out.double()).sum(), leaves[:1])
    bound = OUT_ROUNDING[torch.float16] * want.abs() + TENSOR_SLACK[torch.float16] * float(
        want.abs().max()
    )
    for layout_seed in SEEDS + [5]:
        monkeypatch.setenv("TORCH_STEEL_SIM_LAYOUT_SEED", str(layout_seed))
        args = (q, k, v, mask, grad_out, out, lse)
        dq = run_dq_test_kernel("attention_bwd_tensor_dq_index_api", *args, is_causal=True)
        assert bool(((dq.double() - want).abs() <= bound).all()), layout_seed
        dq = run_dq_test_kernel("attention_bwd_tensor_dq_layout_assumed", *args, is_causal=True)
        assert not bool(((dq.double() - want).abs() <= bound).all()), layout_seed


# ---- wider sweeps ----------------------------------------------------------------------------


@pytest.mark.slow
@requires_simulator
@pytest.mark.parametrize("layout_seed", SEEDS)
@pytest.mark.parametrize("L,S", LENGTHS + [(100, 257), (257, 100)])
@pytest.mark.parametrize("E,dtype", CORE + [(64, torch.bfloat16), (256, torch.float16)], ids=str)
def test_lengths_every_seed_and_head_dim(E, dtype, L, S, layout_seed, monkeypatch):
    q, k, v = qkv(1, 2, L, S, E, dtype=dtype, gen=torch.Generator().manual_seed(L * 1000 + S))
    # No sinks here: dsinks is the simdgroup kernel's, a sum whose terms cancel, which
    # test_fuzz_sdpa_backward bounds as such; test_softcap_scale_sinks_gqa and test_varlen
    # cover the matmul2d kernels with sinks.
    check(monkeypatch, layout_seed, q, k, v, is_causal=L <= S, causal_align="bottom_right",
          softcap=20.0)  # fmt: skip


@pytest.mark.slow
@requires_simulator
@pytest.mark.parametrize("E,dtype", CORE, ids=str)
def test_every_option_every_head_dim(E, dtype, monkeypatch):
    q, k, v = qkv(1, 4, 100, 130, E, Hkv=2, dtype=dtype)
    check(monkeypatch, E, q, k, v, attn_mask=torch.rand(100, 130) > 0.3, softcap=20.0,
          sinks=torch.randn(4), window=(60, 10), enable_gqa=True, dropout_p=0.1,
          seed=5)  # fmt: skip


# ---- the bench's model of the kernels against the simulator's counters ------------------------


@requires_simulator
@pytest.mark.parametrize(
    "B,Hq,Hkv,L,S,E,options,mask_shape,sinks,dtype",
    [
        (1, 2, 2, 97, 129, 64, {}, None, False, torch.float16),
        (2, 4, 2, 70, 100, 128, {"is_causal": True}, (70, 100), True, torch.bfloat16),
        (1, 2, 1, 50, 33, 96, {"is_causal": True, "bottom_right": True}, (1, 2, 1, 33), False,
         torch.float16),
        (1, 1, 1, 130, 70, 256, {"window_left": 20, "window_right": 5}, None, True,
         torch.bfloat16),
        (1, 2, 2, 33, 47, 100, {}, None, False, torch.float16),  # the 128 kernels, padded
    ],
)  # fmt: skip
def test_traffic_and_multiply_adds_match_the_bench_model(B, Hq, Hkv, L, S, E, options,
                                                         mask_shape, sinks, dtype):  # fmt: skip
    """bench_attention.backward_model of every dispatch (the matmul2d dK/dV: K, V once per
    64-key block, each visited query tile's Q and dO twice, its rows' statistics once, four
    64 x 32 x D operations; the matmul2d dQ: Q, dO, statistics once per 64-row block, each
    visited key tile's K twice and V once, three operations) equals the simulator's counters,
    and the matmul2d kernels run no simdgroup MMA."""
    import bench_attention

    es = torch.finfo(dtype).bits // 8
    q, k, v, _ = bench_attention.inputs(B, Hq, Hkv, L, S, E, E, None, dtype, "cpu")
    mask = None if mask_shape is None else torch.randn(mask_shape, dtype=dtype)
    s = torch.randn(Hq, dtype=torch.float32) if sinks else None
    opts = {**bench_attention.run_options(E, options), **M5, "decode": 0}
    out, lse = sim.run_op("sdpa", [q, k, v, mask, s], opts)
    tensors = [torch.randn_like(out), q, k, v, out, lse, mask, s, torch.randn_like(lse)]
    p = sim.plan("sdpa_backward", tensors, opts)
    assert sum("_tensor_" in d.kernel for d in p.dispatches) == 2
    predicted = bench_attention.backward_model(p, [(L, S, B)], es, es, 4)
    _, counters = sim.run_op("sdpa_backward", tensors, opts, counters=True, checkers=False)
    assert bench_attention.counted_backward(counters) == [b for b, _ in predicted]
    assert [bench_attention.counted_mma([c]) for c in counters] == [m for _, m in predicted]
    for c, d in zip(counters, p.dispatches, strict=True):
        assert "_tensor_" not in d.kernel or c["mma"] == 0


@requires_simulator
def test_varlen_traffic_matches_the_bench_model():
    import bench_attention

    lq, lk = [40, 0, 70, 1], [100, 5, 30, 64]
    tensors = bench_attention.varlen_inputs(lq, lk, 4, 2, 64, torch.float16, "cpu")
    tensors[-1] = torch.randn(4, dtype=torch.float32)  # sinks
    opts = {**bench_attention.run_options(64, {"is_causal": True, "bottom_right": True}),
            "max_seqlen_q": max(lq), "max_seqlen_k": max(lk), **M5, "decode": 0}  # fmt: skip
    out, lse = sim.run_op("sdpa_varlen", tensors, opts)
    q, k, v, cu_q, cu_k, sinks = tensors
    args = [torch.randn_like(out), q, k, v, out, lse, cu_q, cu_k, sinks, None]
    p = sim.plan("sdpa_varlen_backward", args, opts)
    assert sum("_tensor_" in d.kernel for d in p.dispatches) == 2
    predicted = bench_attention.backward_model(p, list(zip(lq, lk, [1] * len(lq))), 2, 0, 4)
    _, counters = sim.run_op("sdpa_varlen_backward", args, opts, counters=True, checkers=False)
    assert bench_attention.counted_backward(counters) == [b for b, _ in predicted]
    assert [bench_attention.counted_mma([c]) for c in counters] == [m for _, m in predicted]
