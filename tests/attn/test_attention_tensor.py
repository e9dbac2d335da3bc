"""The attention prefill forward on Metal 4's matmul2d (shaders/steel/attn_tensor/), planned by
mps_src/plan/attention_plan.cpp (attn::tensor_serves) only for a device described as
M5-generation (Apple10) with Metal 4 and the tensor-op library, float16 / bfloat16, head-dim
pairs 64, 96, 128, 256 (and the head dims padded to them); run in the simulator emulating such
a device (torch_steel.sim.device), checkers on, under several cooperative-tensor layout seeds,
against float64 reference math (torch_steel.reference) and F.scaled_dot_product_attention.

Lengths sit off the kernel's tiles (BQ = 64 query rows, BK = 32 keys): 1, 7, 100, 257, with
L != S both ways. Every run asserts that the matmul2d kernel served it, so a plan that quietly
kept the simdgroup kernel fails here.

Tolerance: the simdgroup kernel's bound (attn_helpers.assert_attention_close) plus the rounding
of the unnormalised weights to the inputs' dtype before O += P V (the operation's left operand
is the probability tile in threadgroup memory, in T): at most T's unit roundoff times max|v|.
"""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from attn_helpers import check, oracle, qkv, rand, requires_planner, requires_simulator
from gemm_helpers import M5, NOT_M5
from test_varlen import check_varlen, packed

from torch_steel import sim

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_attention  # noqa: E402

HALF_TYPES = [torch.float16, torch.bfloat16]
SEEDS = [0, 3, 11]
# The unit roundoff of the weights' storage dtype (see the module docstring).
WEIGHT_ROUNDING = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@contextlib.contextmanager
def m5_kernels(monkeypatch, layout_seed):
    """Runs the block as on an M5 with the cooperative-tensor layouts of `layout_seed`; yields
    the list of the kernels of every plan the block runs (filled as it runs). Calls of at most
    8 query rows would go to the decode kernels: the plan option "decode" = 0 (what the
    backward's plans pass) keeps them on the prefill, so that L = 1 and 7 test this kernel."""
    monkeypatch.setenv("TORCH_STEEL_SIM_LAYOUT_SEED", str(layout_seed))
    kernels = []
    run_op = sim.run_op

    def recording(op, tensors, options=None, **kwargs):
        p = sim.plan(op, tensors, options)
        kernels.extend(d.kernel for d in p.dispatches)
        return run_op(op, tensors, options, **kwargs)

    monkeypatch.setattr(sim, "run_op", recording)
    with sim.device({**M5, "decode": 0}):
        yield kernels
    monkeypatch.setattr(sim, "run_op", run_op)


@contextlib.contextmanager
def on_m5(monkeypatch, layout_seed):
    """m5_kernels, checking that every attention launch in the block ran the matmul2d kernel."""
    with m5_kernels(monkeypatch, layout_seed) as kernels:
        yield
    assert kernels and all(k.startswith("steel_attention_tensor_") for k in kernels), kernels


def tensor_check(monkeypatch, layout_seed, q, k, v, attn_mask=None, **kwargs):
    with on_m5(monkeypatch, layout_seed):
        return check(q, k, v, attn_mask, weight_rounding=WEIGHT_ROUNDING[q.dtype], **kwargs)


@pytest.fixture(params=SEEDS)
def seed(request):
    return request.param


# ---- planning: who gets the kernel ---------------------------------------------------------


def plan_kernels(q, k, v, options, op="sdpa", mask=None):
    p = sim.plan(op, [q, k, v, mask, None], options)
    assert p.ok, p.reason
    return [d.kernel for d in p.dispatches], p


@requires_planner
@pytest.mark.parametrize("name", sorted(NOT_M5))
def test_only_m5_devices_get_the_matmul2d_kernel(name):
    q, k, v = (torch.zeros(1, 2, 100, 64, dtype=torch.float16) for _ in range(3))
    kernels, _ = plan_kernels(q, k, v, NOT_M5[name])
    assert kernels == ["steel_attention_f16_e64_v64"]
    kernels, p = plan_kernels(q, k, v, M5)
    assert kernels == ["steel_attention_tensor_f16_e64_v64"]
    d = p.dispatches[0]
    assert d.grid == (2, 2, 1) and d.threads == (128, 1, 1)  # BQ = 64 rows, 4 simdgroups
    assert d.threadgroup_memory == {}  # P's tile and the row factors are declared in the kernel


@requires_planner
@pytest.mark.parametrize(
    "E,Ev,dtype,want",
    [(64, 64, torch.bfloat16, "steel_attention_tensor_bf16_e64_v64"),
     (96, 96, torch.float16, "steel_attention_tensor_f16_e96_v96"),
     (100, 100, torch.float16, "steel_attention_tensor_f16_e128_v128"),
     (64, 128, torch.float16, "steel_attention_tensor_f16_e128_v128"),
     (256, 256, torch.bfloat16, "steel_attention_tensor_bf16_e256_v256"),
     (32, 32, torch.float16, "steel_attention_f16_e32_v32"),
     (80, 80, torch.float16, "steel_attention_f16_e80_v80"),
     (192, 128, torch.float16, "steel_attention_f16_e192_v128"),
     (512, 512, torch.float16, "steel_attention_f16_e512_v512"),
     (64, 64, torch.float32, "steel_attention_f32_e64_v64")],
)  # fmt: skip
def test_head_dims_and_dtypes_the_kernel_takes(E, Ev, dtype, want):
    q, k = torch.zeros(1, 2, 100, E, dtype=dtype), torch.zeros(1, 2, 70, E, dtype=dtype)
    v = torch.zeros(1, 2, 70, Ev, dtype=dtype)
    assert plan_kernels(q, k, v, M5)[0] == [want]


@requires_planner
def test_decode_keeps_its_kernels_on_m5():
    # The backward follows the forward onto matmul2d: test_attention_backward_tensor.py.
    q, k, v = (torch.zeros(1, 2, n, 64, dtype=torch.float16) for n in (4, 300, 300))
    kernels, _ = plan_kernels(q, k, v, M5)
    assert all(k_.startswith("steel_attention_decode_") for k_ in kernels), kernels
    q = torch.zeros(1, 2, 100, 64, dtype=torch.float16)
    off = sim.plan("sdpa", [q, k, v, None, None], {**M5, "tensor_ops": 0})
    assert off.dispatches[0].kernel == "steel_attention_f16_e64_v64"


# ---- the kernel against float64 math -------------------------------------------------------

CORE = [(64, torch.float16), (96, torch.bfloat16), (128, torch.float16), (256, torch.bfloat16)]


@requires_simulator
@pytest.mark.parametrize("E,dtype", CORE, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(E, dtype, causal, seed, monkeypatch):
    q, k, v = qkv(1, 2, 100, 257, E, dtype=dtype, gen=torch.Generator().manual_seed(E))
    tensor_check(monkeypatch, seed, q, k, v, is_causal=causal)


# S = 63: a last key tile one key short of BK, where a bound off by one would take the
# unchecked static slice.
LENGTHS = [(1, 1), (1, 257), (7, 7), (100, 33), (257, 100), (64, 64), (65, 257), (33, 63)]


@requires_simulator
@pytest.mark.parametrize("L,S", LENGTHS)
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
def test_lengths(L, S, dtype, monkeypatch):
    # Each case under one of the seeds, in turn; @slow sweeps them all.
    g = torch.Generator().manual_seed(L * 1000 + S)
    q, k, v = qkv(2, 2, L, S, 64, dtype=dtype, gen=g)
    tensor_check(monkeypatch, SEEDS[(L + S) % len(SEEDS)], q, k, v)


@requires_simulator
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("L,S", [(1, 100), (100, 257), (257, 100), (257, 257)])
def test_causal(L, S, align, seed, monkeypatch):
    q, k, v = qkv(1, 2, L, S, 64, dtype=torch.float16, gen=torch.Generator().manual_seed(S))
    out, _ = tensor_check(monkeypatch, seed, q, k, v, is_causal=True, causal_align=align)
    if align == "top_left":  # PyTorch's is_causal
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
        keep = ~ref.isnan().any(-1, keepdim=True)  # F.sdpa gives NaN where we give 0
        bound = 2.0**-11 * (ref.abs().nan_to_num(0.0) + float(v.abs().max())) + 1e-4
        assert bool(((out.double() * keep - ref.nan_to_num(0.0)).abs() <= bound).all())


@requires_simulator
@pytest.mark.parametrize(
    "window,align,causal",
    [((16, 0), "top_left", False), ((5, 40), "bottom_right", False), ((40, -1), "top_left", True),
     ((-1, 3), "bottom_right", True), ((0, 0), "top_left", False)],
)  # fmt: skip
def test_window(window, align, causal, monkeypatch):
    q, k, v = qkv(1, 2, 100, 130, 64, dtype=torch.bfloat16)
    tensor_check(monkeypatch, sum(window) % 13, q, k, v, window=window, causal_align=align,
                 is_causal=causal)  # fmt: skip


MASK_SHAPES = {
    "LS": lambda B, H, L, S: (L, S),
    "B1LS": lambda B, H, L, S: (B, 1, L, S),
    "BHLS": lambda B, H, L, S: (B, H, L, S),
    "11L1": lambda B, H, L, S: (1, 1, L, 1),
    "BH1S": lambda B, H, L, S: (B, H, 1, S),
}


@requires_simulator
@pytest.mark.parametrize("shape", list(MASK_SHAPES))
@pytest.mark.parametrize("kind", ["bool", "same", "float32"])
def test_masks(shape, kind, monkeypatch):
    B, H, L, S = 2, 2, 70, 100
    dtype = torch.float16 if kind != "same" else torch.bfloat16
    q, k, v = qkv(B, H, L, S, 64, dtype=dtype)
    gen = torch.Generator().manual_seed(len(shape))
    mshape = MASK_SHAPES[shape](B, H, L, S)
    if kind == "bool":
        mask = torch.rand(mshape, generator=gen) > 0.3
    else:
        mask = torch.randn(mshape, generator=gen).to(dtype if kind == "same" else torch.float32)
    tensor_check(monkeypatch, len(shape) + len(kind), q, k, v, mask)


@requires_simulator
def test_mask_with_causal_and_fully_masked_rows(seed, monkeypatch):
    q, k, v = qkv(1, 2, 70, 90, 64, dtype=torch.float16)
    keep = torch.rand(70, 90, generator=torch.Generator().manual_seed(seed)) > 0.4
    keep[3] = False
    keep[69] = False
    out, lse = tensor_check(monkeypatch, seed, q, k, v, keep, is_causal=True)
    assert bool((out[:, :, 3] == 0).all()) and bool(lse[:, :, 3].isneginf().all())
    bias = torch.randn(70, 90)
    bias[7] = float("-inf")
    out, _ = tensor_check(monkeypatch, seed, q, k, v, bias, is_causal=True,
                          causal_align="bottom_right")  # fmt: skip
    assert bool((out[:, :, 7] == 0).all())
    # Causal bottom-right with L > S: the first L - S rows see nothing.
    q, k, v = qkv(1, 1, 100, 9, 64, dtype=torch.bfloat16)
    out, lse = tensor_check(monkeypatch, seed, q, k, v, is_causal=True, causal_align="bottom_right")
    assert bool((out[:, :, :91] == 0).all()) and bool(lse[:, :, :91].isneginf().all())


@requires_simulator
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
def test_sinks_softcap_scale(dtype, seed, monkeypatch):
    q, k, v = qkv(1, 4, 70, 100, 64, dtype=dtype, gen=torch.Generator().manual_seed(seed))
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(seed))
    tensor_check(monkeypatch, seed, q, k, v, sinks=sinks)
    tensor_check(monkeypatch, seed, q, k, v, sinks=sinks.to(dtype), is_causal=True,
                 causal_align="bottom_right")  # fmt: skip
    tensor_check(monkeypatch, seed, q, k, v, softcap=30.0, scale=0.3, is_causal=True)
    bias = torch.randn(70, 100, generator=torch.Generator().manual_seed(seed))
    tensor_check(monkeypatch, seed, q, k, v, bias, softcap=4.0, sinks=sinks, window=(20, 3))


@requires_simulator
def test_sinks_rows_that_see_nothing(monkeypatch):
    q, k, v = qkv(1, 2, 8 + 64, 5 + 64, 64, dtype=torch.float16)
    sinks = torch.tensor([0.5, -1.0])
    out, lse = tensor_check(monkeypatch, 5, q, k, v, is_causal=True, causal_align="bottom_right",
                            sinks=sinks)  # fmt: skip
    assert bool((out[0, :, :3] == 0).all())
    torch.testing.assert_close(lse[0, :, :3], sinks[:, None].expand(2, 3))


@requires_simulator
@pytest.mark.parametrize("H,Hkv", [(8, 2), (6, 1)])
def test_gqa(H, Hkv, monkeypatch):
    q, k, v = qkv(1, H, 70, 47, 64, Hkv=Hkv, dtype=torch.float16)
    out, _ = tensor_check(monkeypatch, H, q, k, v, enable_gqa=True, is_causal=True)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                         enable_gqa=True)  # fmt: skip
    torch.testing.assert_close(out.double(), ref, atol=4e-3, rtol=0)


@requires_simulator
def test_blhd_views_batch_dims_and_padded_head_dims(monkeypatch):
    g = torch.Generator().manual_seed(7)
    # [B, L, H, E] projections transposed: read in place, out keeps the layout.
    q = rand(2, 70, 3, 96, dtype=torch.bfloat16, gen=g).transpose(1, 2)
    k = rand(2, 100, 3, 96, dtype=torch.bfloat16, gen=g).transpose(1, 2)
    v = rand(2, 100, 3, 96, dtype=torch.bfloat16, gen=g).transpose(1, 2)
    out, _ = tensor_check(monkeypatch, 1, q, k, v, is_causal=True)
    assert out.stride() == q.stride()
    # Two batch dims; head dims below the kernel's (E 100 and Ev 64 on the 128 kernel).
    q, k, v = qkv(0, 2, 33, 70, 100, 64, batch=(2, 2), dtype=torch.float16, gen=g)
    tensor_check(monkeypatch, 2, q, k, v)


@requires_simulator
def test_dropout_matches_the_reference(monkeypatch):
    q, k, v = qkv(1, 4, 70, 100, 64, Hkv=2, dtype=torch.float16)
    tensor_check(monkeypatch, 4, q, k, v, dropout_p=0.2, seed=99, enable_gqa=True, is_causal=True)


@requires_simulator
def test_inf_nan_and_no_keys_like_the_reference(monkeypatch):
    q, k, v = qkv(1, 1, 70, 40, 64, dtype=torch.float16)
    v[0, 0, 4, 3] = float("nan")  # every row that weighs key 4 gets NaN in column 3
    q[0, 0, 2, 0] = float("inf")
    out, _ = tensor_check(monkeypatch, 6, q, k, v)
    assert bool(out[0, 0, :, 3].isnan().all())
    q, k, v = qkv(1, 2, 7, 0, 64, dtype=torch.float16)
    out, lse = tensor_check(monkeypatch, 6, q, k, v)
    assert bool((out == 0).all()) and bool(lse.isneginf().all())


@requires_simulator
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_varlen(align, seed, monkeypatch):
    lq, lk = [1, 7, 100, 257, 0], [100, 7, 33, 300, 5]
    q, k, v = packed(lq, lk, 4, 2, 64, dtype=HALF_TYPES[seed % 2], seed=seed)
    with on_m5(monkeypatch, seed):
        check_varlen(q, k, v, lq, lk, is_causal=True, causal_align=align,
                     weight_rounding=WEIGHT_ROUNDING[q.dtype])  # fmt: skip


# ---- the bench's model of the kernel against the simulator's counters -----------------------


@requires_simulator
@pytest.mark.parametrize(
    "B,Hq,Hkv,L,S,E,Ev,options,mask_shape,sinks,dtype",
    [
        (1, 2, 2, 100, 257, 64, 64, {}, None, False, torch.float16),
        (2, 4, 2, 70, 100, 128, 128, {"is_causal": True}, (70, 100), True, torch.bfloat16),
        (1, 2, 1, 50, 30, 96, 96, {"is_causal": True, "bottom_right": True}, (1, 2, 1, 30),
         False, torch.float16),
        (1, 1, 1, 130, 200, 256, 256, {"window_left": 20, "window_right": 5}, None, True,
         torch.bfloat16),
        (1, 2, 2, 33, 47, 100, 64, {}, None, False, torch.float16),  # the 128 kernel, padded
    ],
)  # fmt: skip
def test_traffic_and_multiply_adds_match_the_bench_model(B, Hq, Hkv, L, S, E, Ev, options,
                                                         mask_shape, sinks, dtype):  # fmt: skip
    """bench_attention's model of the matmul2d kernel (bytes per buffer: Q, out and lse once,
    the K and V rows of every visited key tile once per query block, the mask per visited
    element; 64 x 32 x (DE + DV) multiply-adds per visited tile) equals the simulator's count,
    and no simdgroup MMA runs."""
    q, k, v, mask = bench_attention.inputs(B, Hq, Hkv, L, S, E, Ev, mask_shape, dtype, "cpu")
    s = torch.randn(Hq, dtype=dtype) if sinks else None
    opts = {**bench_attention.run_options(E, options), **M5}
    p = sim.plan("sdpa", [q, k, v, mask, s], opts)
    assert p.dispatches[0].kernel.startswith("steel_attention_tensor_")
    es = torch.finfo(dtype).bits // 8
    predicted, mma, _, _ = bench_attention.model(p, B, es, 1, es)
    _, counters = sim.run_op("sdpa", [q, k, v, mask, s], opts, counters=True, checkers=False)
    assert bench_attention.counted(counters) == predicted
    assert counters[0]["mma"] == 0
    assert bench_attention.counted_mma(counters) == mma


@requires_simulator
def test_varlen_traffic_matches_the_bench_model():
    lq, lk = [40, 0, 70, 1], [100, 5, 30, 64]
    tensors = bench_attention.varlen_inputs(lq, lk, 4, 2, 64, torch.float16, "cpu")
    tensors[-1] = torch.randn(4, dtype=torch.float32)  # sinks
    opts = {**bench_attention.run_options(64, {"is_causal": True, "bottom_right": True}),
            "max_seqlen_q": max(lq), "max_seqlen_k": max(lk), **M5}  # fmt: skip
    p = sim.plan("sdpa_varlen", tensors, opts)
    assert p.dispatches[0].kernel == "steel_attention_tensor_f16_e64_v64"
    predicted, mma, _, _ = bench_attention.varlen_model(p, lq, lk, 2, 4)
    _, counters = sim.run_op("sdpa_varlen", tensors, opts, counters=True, checkers=False)
    assert bench_attention.counted(counters) == predicted
    assert bench_attention.counted_mma(counters) == mma


# ---- the layout is never assumed -----------------------------------------------------------


@requires_simulator
def test_results_do_not_depend_on_the_layout(monkeypatch):
    """The same call under many layout seeds gives the same bits: the kernel only reaches its
    cooperative tensors' elements through the index API, so the (randomly drawn) element-to-
    thread maps cannot change any sum's order or any element's row."""
    q, k, v = qkv(1, 2, 100, 70, 64, dtype=torch.bfloat16)
    mask = torch.rand(100, 70, generator=torch.Generator().manual_seed(2)) > 0.2
    first = None
    for layout_seed in range(8):
        out, lse = tensor_check(monkeypatch, layout_seed, q, k, v, mask, is_causal=True)
        if first is None:
            first = out, lse
        else:
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), layout_seed


LAYOUT_KERNELS = Path(__file__).parent / "kernels" / "attention_tensor_layout_msl4.metal"


def run_test_kernel(name, q, k, v, mask, **options):
    """(out, lse) of a test build of the kernel (LAYOUT_KERNELS), launched as the M5 plan of
    this call launches the shipped one: its grid, threads, constants and bindings."""
    tensors = [q, k, v, mask, None]
    opts = {**bench_attention.run_options(q.shape[-1], options), **M5}
    p = sim.plan("sdpa", tensors, opts)
    (d,) = p.dispatches
    assert d.kernel == "steel_attention_tensor_f16_e64_v64"
    slots = tensors + [torch.zeros(a.sizes, dtype=a.dtype) for a in p.allocations]
    buffers = {b.index: slots[b.slot] if b.kind == "tensor" else b.bytes for b in d.bindings}
    sim.run_kernel(name, sources=[LAYOUT_KERNELS], grid=d.grid, threads=d.threads,
                   buffers=buffers, constants=d.constants, checkers=True)  # fmt: skip
    return slots[5], slots[6]


@requires_simulator
def test_a_softmax_that_assumes_a_layout_fails(monkeypatch):
    """The kernel with its online softmax as shipped (index API) agrees with float64 math under
    every seed; with one that assumes where a thread's scores lie (every score in the row of its
    first row-reduction slot, instead of map_iterator) it is wrong under every seed."""
    q, k, v = qkv(1, 2, 100, 70, 64, dtype=torch.float16)
    mask = torch.rand(100, 70, generator=torch.Generator().manual_seed(4)) > 0.2
    ref, _ = oracle(q, k, v, mask, is_causal=True)
    for layout_seed in SEEDS + [5, 8]:
        monkeypatch.setenv("TORCH_STEEL_SIM_LAYOUT_SEED", str(layout_seed))
        out, _ = run_test_kernel("attention_tensor_index_api", q, k, v, mask, is_causal=True)
        # out's rounding and the weights' (2^-11 each, see the module docstring), twice over.
        bound = 2.0**-10 * (ref.abs() + float(v.abs().max())) + 1e-4
        assert bool(((out.double() - ref).abs() <= bound).all()), layout_seed
        out, _ = run_test_kernel("attention_tensor_layout_assumed", q, k, v, mask, is_causal=True)
        assert not bool(((out.double() - ref).abs() <= bound).all()), layout_seed


# ---- wider sweeps ----------------------------------------------------------------------------


@pytest.mark.slow
@requires_simulator
@pytest.mark.parametrize("layout_seed", SEEDS)
@pytest.mark.parametrize("L,S", LENGTHS)
@pytest.mark.parametrize("E,dtype", CORE, ids=str)
def test_lengths_every_seed_and_head_dim(E, dtype, L, S, layout_seed, monkeypatch):
    g = torch.Generator().manual_seed(L * 1000 + S)
    q, k, v = qkv(1, 2, L, S, E, dtype=dtype, gen=g)
    tensor_check(monkeypatch, layout_seed, q, k, v, is_causal=L <= S,
                 causal_align="bottom_right", scale=1.5 / math.sqrt(E))  # fmt: skip
