"""The attention backward on Metal 4's matmul2d (shaders/steel/attn_tensor/backward_tensor.h):
its dK/dV, dQ and dmask kernels, planned by mps_src/plan/attention_backward_plan.cpp and
varlen_plan.cpp (attn::tensor_backward) exactly where the same call's forward runs on matmul2d
(attn::tensor_serves: an M5-generation device, float16 / bfloat16, head-dim pairs padding to
64, 96, 128, 256). Run in the simulator emulating such a device (torch_steel.sim.device),
checkers on, strict, under several cooperative-tensor layout seeds: gradients of q, k, v (and
sinks) against float64 autograd through the reference and through F.sdpa.

Every run asserts that the matmul2d dK/dV and dQ kernels (and dmask, for a mask's gradient)
served it and that no simdgroup dK/dV, dQ or dmask kernel ran, so a plan that quietly kept the
simdgroup backward fails here. Lengths sit off the tiles (64 keys or query rows per
threadgroup, 32 keys at D = 256, tiles of 32): S % 32 and L % 32 in {1, 31} among them.

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
def on_m5(monkeypatch, layout_seed, keys=True, dmask=False):
    """Runs the block as on an M5 with the cooperative-tensor layouts of `layout_seed` and
    checks that its backward ran the matmul2d dQ kernel (and dK/dV one, when there are `keys`;
    and dmask, when asked), and no simdgroup dK/dV, dQ or dmask kernel. Decode is off
    (test_attention_tensor.m5_kernels) so that short calls test the prefill forward on matmul2d
    too."""
    with m5_kernels(monkeypatch, layout_seed) as kernels:
        yield kernels
    tensor = [k for k in kernels if k.startswith("steel_attention_bwd_tensor_")]
    assert any("_dq_" in k for k in tensor), kernels
    assert not keys or any("_dkdv_" in k for k in tensor), kernels
    assert not dmask or any("_dmask_" in k for k in tensor), kernels
    simdgroup = (
        "steel_attention_bwd_dkdv_",
        "steel_attention_bwd_dq_",
        "steel_attention_bwd_dmask_",
    )
    assert not any(k.startswith(simdgroup) for k in kernels), kernels


def assert_grads_close(got, want, dtype, dsinks_bound=None):
    """dsinks_bound: dsinks' own bound per head (sinks_bound), in place of the elementwise one."""
    names = ["dq", "dk", "dv", "dsinks"][: len(got)]
    for name, g, r in zip(names, got, want, strict=True):
        assert g.shape == r.shape, name
        assert not bool(g.isnan().any()), f"{name}: NaN"
        mag = float(r.abs().max()) if r.numel() else 0.0
        bound = OUT_ROUNDING[g.dtype] * r.abs() + TENSOR_SLACK[dtype] * mag + 1e-6
        if name == "dsinks" and dsinks_bound is not None:
            bound = OUT_ROUNDING[g.dtype] * r.abs() + dsinks_bound + 1e-6
        err = (g.double() - r).abs()
        assert bool((err <= bound).all()), f"{name}: worst error {float(err.max()):.3g} ({mag:.3g})"


def sinks_bound(q, k, v, grad_out, with_lse, **kwargs64):
    """dsinks' error bound per head. dsinks[h] = -sum over the batch's rows of
    exp(sink - lse) * delta (delta = rowsum(dO * O) - grad_lse), a sum whose terms can cancel
    (rows that see few keys), so a bound relative to its largest element can be below the
    terms' own rounding. Each term is off by at most TENSOR_SLACK of itself (the argument of
    the module docstring: exp(sink - lse) from the kernels' lse, an fp32 sum), plus the
    rounding of O to its dtype in delta (OUT_ROUNDING of rowsum |dO * O|, weighted by
    exp(sink - lse) <= 1), so the sum is off by at most those summed: float64 terms from the
    reference's out and lse."""
    with torch_steel.backend("reference"):
        out, lse = torch_steel.sdpa(q.double(), k.double(), v.double(), return_lse=True,
                                    **kwargs64)  # fmt: skip
    ramp = torch.linspace(-1, 1, lse.shape[-1], dtype=lse.dtype) if with_lse else 0.0
    delta = (grad_out * out).sum(-1) - ramp
    rowsum = (grad_out * out).abs().sum(-1)
    weight = torch.where(torch.isfinite(lse), torch.exp(kwargs64["sinks"][:, None] - lse), 0.0)
    per_head = weight * (TENSOR_SLACK[q.dtype] * delta.abs() + OUT_ROUNDING[q.dtype] * rowsum)
    return per_head.transpose(0, -2).flatten(1).sum(-1)  # [H]: every batch entry's rows


def check(monkeypatch, layout_seed, q, k, v, with_lse=True, **kwargs):
    """Kernel gradients on the M5 path against float64 autograd through the reference."""
    gen = torch.Generator().manual_seed(11)
    grad_out = torch.randn(*q.shape[:-1], v.shape[-1], generator=gen, dtype=torch.float64)
    kwargs64 = dict(kwargs)
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kwargs64["attn_mask"] = mask.double()
    bound = None
    if kwargs.get("sinks") is not None:
        kwargs64["sinks"] = kwargs["sinks"].double()
        bound = sinks_bound(q, k, v, grad_out.to(q.dtype).double(), with_lse, **kwargs64)
    with on_m5(monkeypatch, layout_seed, keys=k.shape[-2] > 0):
        _, got = grads(q, k, v, "sim", grad_out.to(q.dtype), with_lse, **kwargs)
    _, want = grads(q.double(), k.double(), v.double(), "reference", grad_out, with_lse,
                    **kwargs64)  # fmt: skip
    assert_grads_close(got, want, q.dtype, bound)
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
def test_dmask_follows_and_varlen_follows():
    """dmask runs on matmul2d with dK/dV and dQ: 64 rows by 32 keys a threadgroup, or one along
    a dim the mask broadcasts over; each mask entry (batch and head element it keeps) its own
    z. Off M5 it keeps the simdgroup kernel."""
    q, k, v = (torch.zeros(2, 2, n, 64, dtype=torch.float16) for n in (100, 70, 70))
    p = backward_kernels(q, k, v, {**M5, "mask_grad": True}, mask=torch.zeros(100, 70))
    assert [d.kernel for d in p.dispatches][1:] == [
        "steel_attention_bwd_tensor_dkdv_f16_e64_v64", "steel_attention_bwd_tensor_dq_f16_e64_v64",
        "steel_attention_bwd_tensor_dmask_f16_e64_v64"]  # fmt: skip
    dm = p.dispatches[-1]
    assert dm.grid == (2, 3, 1) and dm.threads == (128, 1, 1)
    p = backward_kernels(q, k, v, {**M5, "mask_grad": True}, mask=torch.zeros(2, 1, 100, 1))
    assert p.dispatches[-1].grid == (2, 1, 2)  # keys broadcast: one key threadgroup
    p = backward_kernels(q, k, v, {**M5, "mask_grad": True}, mask=torch.zeros(1, 2, 1, 70))
    assert p.dispatches[-1].grid == (1, 3, 2)  # rows broadcast: one row threadgroup
    off = backward_kernels(q, k, v, {"mask_grad": True}, mask=torch.zeros(100, 70))
    assert off.dispatches[-1].kernel == "steel_attention_bwd_dmask_f16_e64_v64"
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


@requires_planner
@pytest.mark.parametrize("D", [64, 96, 128, 256])
def test_every_block_fits_a_cores_register_file(D):
    """The dK/dV block's keys (from the plan's grid) are the larger of 64 and 32 whose
    cooperative tensors fit one threadgroup in an M5 core's register file by the timing model's
    estimate (timing.steel_kernel_info: K, V, dK, dV and two score tiles; 440 registers a
    thread at D = 256 with 64 keys, past the 416 of 212992 bytes over 128 threads), and the dQ
    and dmask blocks of 64 rows fit (312 and 200 registers at D = 256)."""
    from torch_steel.sim import timing

    q, k, v = (torch.zeros(1, 1, n, D, dtype=torch.float16) for n in (100, 256, 256))
    p = backward_kernels(q, k, v, {**M5, "mask_grad": True}, mask=torch.zeros(100, 256))
    by_kind = {d.kernel.split("_")[4]: d for d in p.dispatches if "_tensor_" in d.kernel}
    register_file = timing.chip("M5")["register_file_bytes_per_core"]

    def fits(registers):
        return registers * 4 * by_kind["dq"].threads[0] <= register_file

    keys = 256 // by_kind["dkdv"].grid[0]
    assert keys == timing.attn_tensor_bwd_keys(D)
    assert keys == 64 or not fits(timing.attn_tensor_bwd_registers("dkdv", D, 64)[0])
    for kind in ("dkdv", "dq", "dmask"):
        info = timing.steel_kernel_info(by_kind[kind].kernel)
        assert fits(info["registers"]), (kind, info["register_basis"])


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


def check_dmask(monkeypatch, layout_seed, q, k, v, mask, **kwargs):
    """dq, dk, dv and dmask on the M5 path against float64 autograd
    (test_attention_mask_grad.check: dmask's bound is n terms of the largest dS, n the elements
    each mask element sums). dmask's dS is summed in fp32 straight from the score tile, not
    rounded to T; TENSOR_SLACK covers dq and dk, whose dS is."""
    from test_attention_mask_grad import check as mask_check

    with on_m5(monkeypatch, layout_seed, keys=k.shape[-2] > 0, dmask=True):
        return mask_check(q, k, v, mask, slack=TENSOR_SLACK, **kwargs)


# Every way a mask broadcasts to [B = 2, H = 3, L, S] (batch, heads, rows, keys, their mixes).
DMASK_SHAPES = [(2, 3, 70, 97), (70, 97), (2, 1, 70, 1), (1, 3, 1, 97), (1, 1, 1, 1), (3, 70, 1),
                (2, 3, 1, 1)]  # fmt: skip


@requires_simulator
@pytest.mark.parametrize("shape", DMASK_SHAPES, ids=str)
def test_dmask_every_broadcast(shape, monkeypatch):
    dtype = HALF_TYPES[len(shape) % 2]
    q, k, v = qkv(2, 3, 70, 97, 64, dtype=dtype, gen=torch.Generator().manual_seed(len(shape)))
    mask = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    check_dmask(monkeypatch, sum(shape) % 13, q, k, v, mask, is_causal=True)


@requires_simulator
@pytest.mark.parametrize("E,dtype", CORE, ids=str)
def test_dmask_head_dims_and_mask_dtypes(E, dtype, monkeypatch):
    """L % 64 and S % 32 in {1, 31}; the mask in the inputs' dtype (its dmask too)."""
    q, k, v = qkv(1, 2, 65, 63, E, dtype=dtype, gen=torch.Generator().manual_seed(E))
    mask = torch.randn(1, 2, 65, 63, generator=torch.Generator().manual_seed(2)).to(dtype)
    check_dmask(monkeypatch, E % 5, q, k, v, mask, is_causal=True, causal_align="bottom_right")


@requires_simulator
def test_dmask_with_the_other_options(monkeypatch):
    """GQA, softcap (dmask takes dS before its slope: the mask is added after the softcap),
    sinks, window, dropout, scale; then Hugging Face padding (finfo.min rows and keys: the
    pre-pass's normaliser)."""
    q, k, v = qkv(2, 4, 40, 33, 64, Hkv=1, dtype=torch.float16)
    mask = torch.randn(4, 40, 33, generator=torch.Generator().manual_seed(4))
    check_dmask(monkeypatch, 1, q, k, v, mask, enable_gqa=True, softcap=5.0, sinks=torch.randn(4),
                window=(9, 3), dropout_p=0.25, seed=5, scale=0.3)  # fmt: skip
    mask = torch.zeros(2, 1, 40, 33)
    mask[:, :, 5] = torch.finfo(torch.float32).min
    mask[..., 30:] = torch.finfo(torch.float32).min
    dmask = check_dmask(monkeypatch, 2, q, k, v, mask, enable_gqa=True)[3]
    assert bool((dmask[:, :, 6:, 30:] == 0).all()) and bool((dmask[:, :, 5] != 0).any())


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
    from test_attention_mask_grad import grads as mask_grads

    q, k, v = qkv(1, 4, 70, 97, 64, Hkv=2, dtype=torch.bfloat16)
    mask = torch.rand(70, 97, generator=torch.Generator().manual_seed(2)) > 0.2
    grad_out = torch.randn(1, 4, 70, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    float_mask = torch.randn(1, 70, 1, generator=torch.Generator().manual_seed(3))
    first = None
    for layout_seed in [0, 0, 1, 2, 7]:
        with on_m5(monkeypatch, layout_seed):
            _, got = grads(q, k, v, "sim", grad_out, attn_mask=mask, is_causal=True,
                           enable_gqa=True)  # fmt: skip
        with on_m5(monkeypatch, layout_seed, dmask=True):  # dmask's sums over keys and heads
            got = [*got, mask_grads("sim", q, k, v, float_mask, grad_out, enable_gqa=True)[3]]
        if first is None:
            first = got
        for a, b in zip(got, first, strict=True):
            assert torch.equal(a, b), layout_seed


LAYOUT_KERNELS = Path(__file__).parent / "kernels" / "attention_bwd_tensor_layout_msl4.metal"


def run_test_kernel(name, kind, q, k, v, mask, grad_out, out, lse, **options):
    """dq (kind "dq") or dmask ("dmask") of a test build of the matmul2d kernel
    (LAYOUT_KERNELS), launched as the M5 plan of this backward launches the shipped one (grid,
    threads, constants, bindings), with delta = rowsum(dO * O) in fp32 and the normaliser 1 (no
    |lse| is huge here) in place of the pre-pass."""
    import bench_attention

    tensors = [grad_out, q, k, v, out, lse, mask, None, None]
    opts = {**bench_attention.run_options(q.shape[-1], options), **M5, "mask_grad": kind == "dmask"}
    p = sim.plan("sdpa_backward", tensors, opts)
    (d,) = [d for d in p.dispatches if d.kernel == f"steel_attention_bwd_tensor_{kind}_f16_e64_v64"]
    slots = tensors + [torch.zeros(a.sizes, dtype=a.dtype) for a in p.allocations]
    names = [a.name for a in p.allocations]
    delta = slots[len(tensors) + names.index("delta")]
    delta[0] = (grad_out.float() * out.float()).sum(-1).flatten()
    delta[1] = 1.0
    buffers = {b.index: slots[b.slot] if b.kind == "tensor" else b.bytes for b in d.bindings}
    sim.run_kernel(name, sources=[LAYOUT_KERNELS], grid=d.grid, threads=d.threads,
                   buffers=buffers, constants=d.constants, checkers=True)  # fmt: skip
    return slots[len(tensors) + names.index(kind)]


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
        args = ("dq", q, k, v, mask, grad_out, out, lse)
        dq = run_test_kernel("attention_bwd_tensor_dq_index_api", *args, is_causal=True)
        assert bool(((dq.double() - want).abs() <= bound).all()), layout_seed
        dq = run_test_kernel("attention_bwd_tensor_dq_layout_assumed", *args, is_causal=True)
        assert not bool(((dq.double() - want).abs() <= bound).all()), layout_seed


@requires_simulator
def test_a_dmask_that_assumes_a_layout_fails(monkeypatch):
    """The same for the dmask kernel, on a float mask broadcast over the batch (each element a
    sum of two pairs' dS): within test_attention_mask_grad's bound with the index API, outside
    it with the layout assumed, under every seed."""
    q, k, v = qkv(2, 2, 100, 70, 64, dtype=torch.float16)
    mask = torch.randn(1, 2, 100, 70, generator=torch.Generator().manual_seed(4))
    grad_out = torch.randn(2, 2, 100, 64, generator=torch.Generator().manual_seed(6)).half()
    with sim.device({**M5, "decode": 0}):
        out, lse = sim.run_op("sdpa", [q, k, v, mask, None], {"is_causal": True})

    def reference_grad(m):
        leaves = [x.double().requires_grad_() for x in (q, k, v, m)]
        with torch_steel.backend("reference"):
            ref = torch_steel.sdpa(*leaves[:3], attn_mask=leaves[3], is_causal=True)
        return torch.autograd.grad((ref * grad_out.double()).sum(), leaves[3:])[0]

    want = reference_grad(mask)
    ds = reference_grad(mask.expand(2, 2, 100, 70).contiguous())  # each pair's dS
    # test_attention_mask_grad's bound: two terms an element, each within SLACK of max |dS|.
    bound = OUT_ROUNDING[torch.float32] * want.abs() + 2 * TENSOR_SLACK[torch.float16] * float(
        ds.abs().max()
    )
    for layout_seed in SEEDS + [5]:
        monkeypatch.setenv("TORCH_STEEL_SIM_LAYOUT_SEED", str(layout_seed))
        args = ("dmask", q, k, v, mask, grad_out, out, lse)
        dm = run_test_kernel("attention_bwd_tensor_dmask_index_api", *args, is_causal=True)
        assert bool(((dm.double() - want).abs() <= bound).all()), layout_seed
        dm = run_test_kernel("attention_bwd_tensor_dmask_layout_assumed", *args, is_causal=True)
        assert not bool(((dm.double() - want).abs() <= bound).all()), layout_seed


# ---- wider sweeps ----------------------------------------------------------------------------


@pytest.mark.slow
@requires_simulator
@pytest.mark.parametrize("layout_seed", SEEDS)
@pytest.mark.parametrize("L,S", LENGTHS + [(100, 257), (257, 100)])
@pytest.mark.parametrize("E,dtype", CORE + [(64, torch.bfloat16), (256, torch.float16)], ids=str)
def test_lengths_every_seed_and_head_dim(E, dtype, L, S, layout_seed, monkeypatch):
    q, k, v = qkv(1, 2, L, S, E, dtype=dtype, gen=torch.Generator().manual_seed(L * 1000 + S))
    # Sinks in the dtype: the matmul2d kernels' P carries them through lse; dsinks (a sum whose
    # terms cancel) is bounded by its terms (sinks_bound).
    sinks = torch.randn(2, generator=torch.Generator().manual_seed(L + S)).to(dtype)
    check(monkeypatch, layout_seed, q, k, v, is_causal=L <= S, causal_align="bottom_right",
          softcap=20.0, sinks=sinks)  # fmt: skip


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
@pytest.mark.parametrize(
    "Hq,L,S,E,options,mask_shape,mask_dtype",
    [
        (2, 97, 129, 64, {"is_causal": True}, (2, 2, 97, 129), torch.float16),
        (2, 70, 100, 128, {}, (2, 1, 70, 1), torch.float32),  # keys broadcast
        (4, 130, 33, 96, {"window_left": 20, "window_right": 5}, (1, 4, 1, 33), torch.float16),
        (2, 65, 70, 256, {"is_causal": True, "bottom_right": True}, (65, 70), torch.float32),
    ],
)  # fmt: skip
def test_dmask_traffic_matches_the_bench_model(Hq, L, S, E, options, mask_shape, mask_dtype):
    """bench_attention.backward_model of a backward with the mask's gradient (the matmul2d
    dmask: the dQ kernel's blocks over its own tiles, Q and dO once per block that meets one,
    K and V once per visited tile, two operations a tile; and the 32-key dK/dV blocks at
    D = 256) equals the simulator's counters."""
    import bench_attention

    dtype = torch.float16
    q, k, v, _ = bench_attention.inputs(2, Hq, Hq, L, S, E, E, None, dtype, "cpu")
    mask = torch.randn(mask_shape, dtype=mask_dtype)
    opts = {**bench_attention.run_options(E, options), **M5, "decode": 0, "mask_grad": True}
    out, lse = sim.run_op("sdpa", [q, k, v, mask, None], opts)
    tensors = [torch.randn_like(out), q, k, v, out, lse, mask, None, None]
    p = sim.plan("sdpa_backward", tensors, opts)
    assert sum("_tensor_" in d.kernel for d in p.dispatches) == 3
    mask_es = torch.finfo(mask_dtype).bits // 8
    predicted = bench_attention.backward_model(p, [(L, S, 2)], 2, mask_es)
    _, counters = sim.run_op("sdpa_backward", tensors, opts, counters=True, checkers=False)
    assert bench_attention.counted_backward(counters) == [b for b, _ in predicted]
    assert [bench_attention.counted_mma([c]) for c in counters] == [m for _, m in predicted]


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
