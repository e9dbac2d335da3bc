"""steel::gemm kernels in the Metal simulator against torch.matmul in float64 (issue 4, item 5).

Every case runs the kernels of shaders/steel/gemm/gemm.metal through the plan of
mps_src/plan/gemm_plan.cpp with the simulator's checkers on (out-of-bounds accesses and
threadgroup-memory races raise SimulatorError), and compares with float64 reference math.
The default sweep keeps shapes small (primes, ragged edges of both tiles); @slow goes bigger.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from gemm_helpers import (
    C_KINDS,
    DTYPES,
    assert_close,
    epilogue_operands,
    rand,
    reference,
    requires_simulator,
)

from torch_steel import sim
from torch_steel.errors import PlanRefused

pytestmark = requires_simulator

ACTIVATIONS = ["none", "relu", "gelu", "gelu_tanh", "silu"]


def operand(rows, cols, *, transposed, dtype, gen, batch=(), scale=1.0):
    """A [*batch, rows, cols] operand, stored row-major or (transposed) column-major."""
    if transposed:
        return rand(*batch, cols, rows, dtype=dtype, gen=gen, scale=scale).transpose(-1, -2)
    return rand(*batch, rows, cols, dtype=dtype, gen=gen, scale=scale)


def run(a, b, bias=None, c=None, alpha=1.0, beta=1.0, activation="none"):
    options = {"alpha": alpha, "beta": beta, "activation": activation}
    (out,) = sim.run_op("gemm", [a, b, bias, c], options, checkers=True)
    return out


def check(a, b, bias=None, c=None, alpha=1.0, beta=1.0, activation="none"):
    out = run(a, b, bias, c, alpha, beta, activation)
    ref, mag = reference(a, b, bias, c, alpha, beta, activation)
    assert_close(out, ref, mag, a.shape[-1], a.dtype)
    return out


# M, N, K: 1, primes, and sizes just off the 32 and 64 tile edges (and the 16 K step).
SHAPES = [
    (1, 1, 1),
    (1, 7, 5),
    (7, 1, 13),
    (3, 5, 2),
    (17, 31, 29),
    (33, 65, 16),
    (64, 64, 64),
    (65, 63, 17),
    (97, 130, 47),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gemm_shapes(m, n, k, dtype):
    gen = torch.Generator().manual_seed(m * 10007 + n * 101 + k)
    check(rand(m, k, dtype=dtype, gen=gen), rand(k, n, dtype=dtype, gen=gen))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("m,n,k", [(37, 45, 23), (64, 128, 32), (129, 67, 71)])
def test_gemm_transposes(m, n, k, ta, tb, dtype):
    gen = torch.Generator().manual_seed(m + 7 * n + 13 * k + 2 * ta + tb)
    a = operand(m, k, transposed=ta, dtype=dtype, gen=gen)
    b = operand(k, n, transposed=tb, dtype=dtype, gen=gen)
    kernel = sim.plan("gemm", [a, b, None, None], {}).dispatches[0].kernel
    assert kernel.startswith(f"steel_gemm_{'t' if ta else 'n'}{'t' if tb else 'n'}_")
    check(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], repeat=2)))
def test_gemm_thin_tile(ta, tb, dtype):
    # Few rows, many columns: the 32x128 tile (1x4 simdgroups), with ragged N and K.
    gen = torch.Generator().manual_seed(21 + 2 * ta + tb)
    m, n, k = 13, 8200, 21
    a = operand(m, k, transposed=ta, dtype=dtype, gen=gen)
    b = operand(k, n, transposed=tb, dtype=dtype, gen=gen)
    bias = rand(n, dtype=dtype, gen=gen)
    assert "_bm32_bn128_" in sim.plan("gemm", [a, b, bias, None], {}).dispatches[0].kernel
    check(a, b, bias, activation="gelu_tanh")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], repeat=2)))
def test_gemm_tall_tile(ta, tb, dtype):
    # Many rows, few columns: the 128x32 tile (4x1 simdgroups), with ragged M and K.
    gen = torch.Generator().manual_seed(41 + 2 * ta + tb)
    m, n, k = 8200, 11, 19
    a = operand(m, k, transposed=ta, dtype=dtype, gen=gen)
    b = operand(k, n, transposed=tb, dtype=dtype, gen=gen)
    c = rand(m, 1, dtype=dtype, gen=gen)
    assert "_bm128_bn32_" in sim.plan("gemm", [a, b, None, c], {}).dispatches[0].kernel
    check(a, b, c=c, beta=0.5, activation="silu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "a_batch,b_batch",
    [((3,), ()), ((), (2,)), ((2, 3), (2, 3)), ((2, 1), (1, 3)), ((4,), (1,))],
)
def test_gemm_batched_broadcast(a_batch, b_batch, dtype):
    gen = torch.Generator().manual_seed(len(a_batch) * 31 + len(b_batch))
    a = rand(*a_batch, 19, 24, dtype=dtype, gen=gen)
    b = rand(*b_batch, 24, 35, dtype=dtype, gen=gen)
    check(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemm_batched_transposed_views(dtype):
    # Batch dims that cannot be merged (a permuted batch) and transposed batched operands.
    gen = torch.Generator().manual_seed(5)
    a = rand(3, 2, 21, 40, dtype=dtype, gen=gen).permute(1, 0, 3, 2)  # [2, 3, 40, 21], "t"
    b = rand(2, 3, 21, 9, dtype=dtype, gen=gen)
    check(a, b)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("c_kind", C_KINDS)
def test_gemm_epilogue(c_kind, use_bias, activation):
    dtype = torch.float32
    gen = torch.Generator().manual_seed(ACTIVATIONS.index(activation) * 10 + use_bias)
    m, n, k = 23, 41, 19
    a, b = rand(m, k, dtype=dtype, gen=gen), rand(k, n, dtype=dtype, gen=gen)
    bias, c = epilogue_operands(m, n, c_kind, use_bias, dtype, gen)
    check(a, b, bias, c, alpha=0.75, beta=-1.5 if c is not None else 1.0, activation=activation)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gemm_epilogue_half_types(activation, dtype):
    gen = torch.Generator().manual_seed(11)
    m, n, k = 40, 36, 33
    a, b = rand(2, m, k, dtype=dtype, gen=gen), rand(k, n, dtype=dtype, gen=gen)
    bias = rand(n, dtype=dtype, gen=gen)
    c = rand(2, 1, n, dtype=dtype, gen=gen)
    check(a, b, bias, c, alpha=0.5, beta=2.0, activation=activation)


def test_gemm_beta_zero_ignores_c():
    gen = torch.Generator().manual_seed(3)
    a, b = rand(9, 10, dtype=torch.float32, gen=gen), rand(10, 11, dtype=torch.float32, gen=gen)
    c = torch.full((9, 11), float("nan"))
    out = run(a, b, c=c, beta=0.0)
    ref, mag = reference(a, b)
    assert_close(out, ref, mag, 10, torch.float32)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gemm_epilogue_propagates_nan(activation):
    """A NaN product stays NaN through every activation, as in torch (relu included)."""
    a = torch.ones(8, 4)
    a[3, 1] = float("nan")
    b = torch.ones(4, 8)
    out = run(a, b, activation=activation)
    ref, _ = reference(a, b, activation=activation)
    assert torch.equal(out.isnan(), ref.isnan())
    assert out.isnan()[3].all() and out.isnan().sum() == 8


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gemm_epilogue_infinities_and_large_values(activation):
    """Pre-activation values of +-inf and of magnitudes where exp and x**3 overflow in fp32
    give what float64 torch gives: inf stays inf, -inf gives 0 (relu) or NaN (0 * inf in the
    gelu and silu formulas, as in torch), and large negative values give a signed zero."""
    vals = [float("inf"), float("-inf"), 3e38, -3e38, 1e13, -1e13, 100.0, -100.0, -89.0, 89.0]
    pre = torch.tensor(vals, dtype=torch.float32)
    c = pre[:, None].expand(len(vals), 8)  # out = 0 @ 0 + c: the epilogue sees exactly `pre`
    out = run(torch.zeros(len(vals), 4), torch.zeros(4, 8), c=c, activation=activation)
    ref, _ = reference(torch.zeros(len(vals), 4), torch.zeros(4, 8), c=c, activation=activation)
    assert torch.equal(out.isnan(), ref.isnan()), (out[:, 0], ref[:, 0])
    finite = ~ref.isnan()
    assert torch.equal(out[finite].isinf(), ref[finite].isinf())
    torch.testing.assert_close(out[finite].double(), ref[finite], rtol=1e-6, atol=1e-30)


def test_gemm_gelu_negative_tail_is_relatively_accurate():
    """gelu(v) for v in -2..-12 is tiny (-0.045 down to -2e-32) but representable in fp32; the
    kernel keeps it to 4% of float64 torch instead of cancelling 1 + erf(v / sqrt 2) to a few
    ulps of 1 (which is 4% off at v = -5 and exactly 0 below -5.5)."""
    vals = [-2.0, -3.0, -4.0, -5.0, -5.5, -6.0, -7.0, -8.0, -10.0, -12.0, 0.5, 2.0, 4.0]
    pre = torch.tensor(vals, dtype=torch.float32)
    c = pre[:, None].expand(len(vals), 8)
    out = run(torch.zeros(len(vals), 4), torch.zeros(4, 8), c=c, activation="gelu")[:, 0]
    # float64 gelu as 0.5 v erfc(-v / sqrt 2) (torch's float64 gelu itself cancels below -8)
    ref = torch.tensor(
        [0.5 * v * math.erfc(-v / math.sqrt(2.0)) for v in vals], dtype=torch.float64
    )
    rel = ((out.double() - ref) / ref).abs()
    assert bool((rel < 0.04).all()), list(zip(vals, out.tolist(), ref.tolist(), strict=True))
    assert bool((rel[:4] < 2e-3).all()), rel[:4]  # |v| <= 5: the approximation's 0.16%


def test_gemm_gelu_tanh_negative_tail_is_relatively_accurate():
    """gelu_tanh(v) = 0.5 v (1 + tanh(u)) for v in -2..-6 (-0.045 down to -1e-12) to 1e-4 of
    float64 torch: in fp32, 1 + tanh(u) cancels to a few ulps of 1 (30% off at v = -5)."""
    vals = [-2.0, -3.0, -4.0, -5.0, -5.5, -6.0, 0.5, 2.0, 4.0]
    pre = torch.tensor(vals, dtype=torch.float32)
    c = pre[:, None].expand(len(vals), 8)
    out = run(torch.zeros(len(vals), 4), torch.zeros(4, 8), c=c, activation="gelu_tanh")[:, 0]
    ref = F.gelu(pre.double(), approximate="tanh")
    rel = ((out.double() - ref) / ref).abs()
    assert bool((rel < 1e-4).all()), list(zip(vals, out.tolist(), ref.tolist(), strict=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemm_batch_folded_into_m(dtype):
    # x @ W with W shared by the batch runs as one GEMM over the batch's rows: W (b) is read
    # once per 32-row block of all rows, not once per batch entry (8 decode rows: once, not 8
    # times). Rows strided by the batch stride (M = 1), a full c and a row-broadcast c.
    gen = torch.Generator().manual_seed(21)
    k, n = 40, 72
    w = rand(k, n, dtype=dtype, gen=gen)
    x = rand(8, 1, k + 8, dtype=dtype, gen=gen)[:, :, :k]  # 8 decode rows, row stride k + 8
    (out,), counters = sim.run_op("gemm", [x, w, None, None], {}, counters=True)
    (reads,) = [c["buffers"][1]["read"] for c in counters]
    assert reads == k * n * w.element_size()
    ref, mag = reference(x, w)
    assert_close(out, ref, mag, k, dtype)
    x = rand(3, 2, 11, k, dtype=dtype, gen=gen)
    bias = rand(n, dtype=dtype, gen=gen)
    check(x, w, bias, rand(3, 2, 11, n, dtype=dtype, gen=gen), beta=0.5, activation="gelu")
    check(x, w, None, rand(n, dtype=dtype, gen=gen), alpha=2.0)
    # Not folded: an entry's 7 rows do not end where the next entry's begin.
    check(x[:, :, :7], w, bias, rand(2, 7, n, dtype=dtype, gen=gen))


def test_gemm_batch_folded_into_m_then_split_k():
    # 4 x [4, 1024] @ [1024, 16]: folded to one 16 x 16 x 1024 GEMM, which split-K takes.
    gen = torch.Generator().manual_seed(22)
    dtype = torch.float16
    x, w = rand(4, 4, 1024, dtype=dtype, gen=gen), rand(1024, 16, dtype=dtype, gen=gen)
    c, bias = rand(4, 4, 16, dtype=dtype, gen=gen), rand(16, dtype=dtype, gen=gen)
    p = sim.plan("gemm", [x, w, bias, c], {})
    assert [d.kernel.split("_")[2] for d in p.dispatches] == ["splitk", "splitk"]
    check(x, w, bias, c, beta=0.5, activation="silu")


def test_gemm_batched_c_broadcast():
    gen = torch.Generator().manual_seed(4)
    a = rand(3, 2, 17, 8, dtype=torch.float16, gen=gen)
    b = rand(8, 26, dtype=torch.float16, gen=gen)
    c = rand(3, 1, 17, 1, dtype=torch.float16, gen=gen)
    check(a, b, c=c, beta=1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", [(8, 16, 1024), (20, 33, 777), (1, 5, 600)])
def test_gemm_split_k(m, n, k, dtype):
    gen = torch.Generator().manual_seed(m + n + k)
    a, b = rand(m, k, dtype=dtype, gen=gen), rand(k, n, dtype=dtype, gen=gen)
    bias, c = rand(n, dtype=dtype, gen=gen), rand(m, n, dtype=dtype, gen=gen)
    p = sim.plan("gemm", [a, b, bias, c], {"activation": "silu"})
    assert [d.kernel.split("_")[2] for d in p.dispatches] == ["splitk", "splitk"]
    check(a, b, bias, c, alpha=1.25, beta=0.5, activation="silu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["broadcast", "transposed", "strided"])
def test_gemm_batched_split_k(case, dtype):
    # Batched products over a long K that b's batch keeps from folding into M: 6 entries of one
    # ragged 20 x 24 block each (a [3, 1, ...] against b [2, ...]), K = 600 cut into partitions
    # of every entry; c per entry (or broadcast over one batch dim) added in the reduction.
    gen = torch.Generator().manual_seed(len(case))
    a = rand(3, 1, 20, 600, dtype=dtype, gen=gen)
    b = rand(2, 600, 24, dtype=dtype, gen=gen)
    c = rand(3, 2, 20, 24, dtype=dtype, gen=gen)
    if case == "transposed":  # a and b column-major, c broadcast along the first batch dim
        a = rand(3, 1, 600, 20, dtype=dtype, gen=gen).transpose(-1, -2)
        b = rand(2, 24, 600, dtype=dtype, gen=gen).transpose(-1, -2)
        c = rand(2, 20, 24, dtype=dtype, gen=gen)
    elif case == "strided":  # every operand a padded view at a storage offset
        a = rand(3, 1, 21, 610, dtype=dtype, gen=gen)[:, :, 1:, 3:603]
        b = rand(2, 601, 30, dtype=dtype, gen=gen)[:, 1:, 2:26]
        c = rand(3, 2, 20, 25, dtype=dtype, gen=gen)[..., 1:]
    bias = rand(24, dtype=dtype, gen=gen)
    p = sim.plan("gemm", [a, b, bias, c], {"beta": 0.5, "activation": "gelu"})
    assert [d.kernel.split("_")[2] for d in p.dispatches] == ["splitk", "splitk"]
    assert p.dispatches[0].grid[2] > 6  # every entry's partitions
    check(a, b, bias, c, alpha=0.75, beta=0.5, activation="gelu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemm_storage_offsets(dtype):
    # Views into bigger buffers: odd storage offsets (no 16-byte vector loads) and aligned ones.
    gen = torch.Generator().manual_seed(6)
    big_a = rand(80, 90, dtype=dtype, gen=gen)
    big_b = rand(80, 90, dtype=dtype, gen=gen)
    big_c = rand(100, 100, dtype=dtype, gen=gen)
    for ao, bo in [(1, 3), (8, 8)]:
        a = big_a[ao : ao + 64, ao : ao + 64]
        b = big_b[bo : bo + 64, 8:72]
        c = big_c[5:69, 7:71]
        assert a.storage_offset() > 0 and b.storage_offset() > 0
        check(a, b, c=c, beta=1.0)
        check(a.transpose(0, 1), b.transpose(0, 1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemm_vector_loads_with_partial_k_step(dtype):
    # Rows 16-byte aligned (vector loads on) while K = 40 ends inside the third 16-wide K step.
    gen = torch.Generator().manual_seed(9)
    a = rand(64, 48, dtype=dtype, gen=gen)[:, :40]
    b = rand(40, 72, dtype=dtype, gen=gen)[:, :64]
    d = sim.plan("gemm", [a, b, None, None], {}).dispatches[0]
    assert d.constants[210] and d.constants[211] and not d.constants[202]  # VEC_A/B, ALIGN_K
    check(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, True)])
@pytest.mark.parametrize("m,n", [(33, 64), (64, 33), (1, 96)])
def test_gemm_edge_tiles_with_vector_loads(m, n, ta, tb, dtype):
    # 16-byte aligned operands (vector loads allowed) with M or N, or both, ending inside a tile:
    # an edge tile checks bounds only for the operand that crosses the edge (A for M, B for N)
    # and streams the other one unchecked, with vector loads; K = 40 adds a partial K step.
    gen = torch.Generator().manual_seed(m * 7 + n)
    k = 40

    def padded(rows, cols, transposed):  # leading dim rounded up to 16 elements
        if transposed:
            return rand(cols, -(-rows // 16) * 16, dtype=dtype, gen=gen)[:, :rows].t()
        return rand(rows, -(-cols // 16) * 16, dtype=dtype, gen=gen)[:, :cols]

    a, b = padded(m, k, ta), padded(k, n, tb)
    d = sim.plan("gemm", [a, b, None, None], {}).dispatches[0]
    assert d.constants[210] and d.constants[211], (a.stride(), b.stride())  # VEC_A, VEC_B
    check(a, b, rand(n, dtype=dtype, gen=gen), rand(m, n, dtype=dtype, gen=gen), activation="silu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, True)])
def test_gemm_eight_byte_vector_loads(ta, tb, dtype):
    # The 32x32 tile loads 4 half-width elements (8 bytes) per access, so rows that start on
    # 8-byte but not 16-byte boundaries (storage offset 4, leading dim 68) still take the vector
    # path. M = 60, N = 52, K = 44: edge tiles and a partial K step too.
    gen = torch.Generator().manual_seed(11)
    big_a, big_b = rand(64, 68, dtype=dtype, gen=gen), rand(64, 68, dtype=dtype, gen=gen)
    a = big_a[:44, 4:64].t() if ta else big_a[:60, 4:48]
    b = big_b[:52, 4:48].t() if tb else big_b[:44, 4:56]
    assert a.shape == (60, 44) and b.shape == (44, 52)
    p = sim.plan("gemm", [a, b, None, None], {})
    d = p.dispatches[0]
    assert "_bm32_bn32_" in d.kernel and d.constants[210] and d.constants[211], d.kernel
    check(a, b)


@pytest.mark.parametrize("k,barriers", [(16, 1), (64, 7), (40, 5), (7, 1)])
def test_gemm_barriers_per_k_step(k, barriers):
    # Per BK = 16 step: one barrier after the tile loads (before the fragment reads) and one
    # before the next step's loads overwrite the tiles; the first loads need none before them,
    # since nothing has read the tiles yet. K = 40: two full steps and a partial one.
    gen = torch.Generator().manual_seed(k)
    a, b = rand(32, k, dtype=torch.float16, gen=gen), rand(k, 32, dtype=torch.float16, gen=gen)
    (out,), counters = sim.run_op("gemm", [a, b, None, None], {}, counters=True)
    assert counters[0]["threadgroups"] == 1
    assert counters[0]["barriers"] == barriers
    ref, mag = reference(a, b)
    assert_close(out, ref, mag, k, torch.float16)


def test_gemm_strided_bias_and_c():
    gen = torch.Generator().manual_seed(10)
    a, b = rand(20, 30, dtype=torch.float32, gen=gen), rand(30, 50, dtype=torch.float32, gen=gen)
    bias = rand(100, dtype=torch.float32, gen=gen)[::2]
    c = rand(50, 20, dtype=torch.float32, gen=gen).t()  # column-major c
    check(a, b, bias, c, alpha=-1.0, beta=0.25, activation="relu")


def test_gemm_strided_operands_are_copied():
    gen = torch.Generator().manual_seed(7)
    a = rand(30, 50, dtype=torch.float32, gen=gen)[:, ::2]  # strides (50, 2): neither is 1
    b = rand(25, 60, dtype=torch.float32, gen=gen)[:, ::3]
    assert sim.plan("gemm", [a, b, None, None], {}).contiguous_inputs == [0, 1]
    check(a, b)


def test_gemm_expanded_operands():
    # Stride-0 rows (expand) are read in place, not copied.
    gen = torch.Generator().manual_seed(8)
    a = rand(1, 40, dtype=torch.float16, gen=gen).expand(24, 40)
    b = rand(40, 1, dtype=torch.float16, gen=gen).expand(40, 12)
    assert sim.plan("gemm", [a, b, None, None], {}).contiguous_inputs == []
    check(a, b)


def test_gemm_empty_and_k_zero():
    a, b = torch.zeros(0, 5), torch.zeros(5, 7)
    assert run(a, b).shape == (0, 7)
    bias = torch.arange(7, dtype=torch.float32)
    out = run(torch.zeros(4, 0), torch.zeros(0, 7), bias=bias, activation="relu")
    assert torch.equal(out, bias.expand(4, 7))


def test_gemm_refuses_float64():
    with pytest.raises(PlanRefused, match="float64|not supported"):
        sim.run_op("gemm", [torch.zeros(2, 2, dtype=torch.float64)] * 2 + [None, None], {})


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("m,n,k", [(257, 129, 263), (300, 200, 100), (128, 256, 512)])
def test_gemm_large(m, n, k, ta, tb, dtype):
    gen = torch.Generator().manual_seed(m * n + k)
    a = operand(m, k, transposed=ta, dtype=dtype, gen=gen)
    b = operand(k, n, transposed=tb, dtype=dtype, gen=gen)
    check(a, b, rand(n, dtype=dtype, gen=gen), activation="gelu")


@pytest.mark.slow
def test_gemm_512_cubed_f16():
    gen = torch.Generator().manual_seed(512)
    a = rand(512, 512, dtype=torch.float16, gen=gen)
    b = rand(512, 512, dtype=torch.float16, gen=gen)
    check(a, b)
