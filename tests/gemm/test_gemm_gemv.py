"""The GEMV kernels (shaders/steel/gemm/gemv.h: steel_gemv_rows_*, M <= 8, and steel_gemv_cols_*,
N <= 8 by transposition) in the Metal simulator against torch.matmul in float64 (issue 25).

The plan (mps_src/plan/gemm_plan.cpp) picks them when a is row-major and b is stored column by
column (x @ W^T, as torch_steel.linear calls it); every case here first asserts that it did, so
a test cannot silently run the tiled kernel instead. The checkers are on (out-of-bounds reads of
the ragged K end or of the lines past the last one raise SimulatorError). Tolerances are those of
gemm_helpers.assert_close: the dtype's rounding of the result plus K fp32 ulps of sum |a||b|
(the GEMV adds the same products in another order, bounded the same way).
"""

from __future__ import annotations

import pytest
import torch
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

pytestmark = requires_simulator

ACTIVATIONS = ["none", "relu", "gelu", "gelu_tanh", "silu"]


def weight_t(k, n, *, dtype, gen, batch=()):
    """b = W^T with W [*batch, n, k] row-major: b's columns are contiguous (the GEMV layout)."""
    return rand(*batch, n, k, dtype=dtype, gen=gen).transpose(-1, -2)


def check(a, b, bias=None, c=None, alpha=1.0, beta=1.0, activation="none", kernel="rows"):
    options = {"alpha": alpha, "beta": beta, "activation": activation}
    p = sim.plan("gemm", [a, b, bias, c], options)
    assert [d.kernel for d in p.dispatches] == [f"steel_gemv_{kernel}_" + _tag(a.dtype)]
    (out,) = sim.run_op("gemm", [a, b, bias, c], options, checkers=True)
    ref, mag = reference(a, b, bias, c, alpha, beta, activation)
    assert_close(out, ref, mag, a.shape[-1], a.dtype)
    return out


def _tag(dtype):
    return {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]


# M <= 8 rows; N a multiple of no simdgroup's 4 lines or threadgroup's 16; K 1, below one lane's
# 4, off the 4-element vector and the 128-element simdgroup step, and above it.
ROWS_SHAPES = [
    (1, 1, 1),
    (1, 17, 3),
    (2, 5, 131),
    (3, 33, 45),
    (5, 16, 128),
    (8, 37, 257),
    (7, 1, 64),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", ROWS_SHAPES)
def test_gemm_gemv_rows_shapes(m, n, k, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    check(rand(m, k, dtype=dtype, gen=gen), weight_t(k, n, dtype=dtype, gen=gen))


# N <= 8 columns with M > 8 rows: a's rows are the weight lines.
COLS_SHAPES = [(9, 1, 7), (37, 3, 130), (64, 8, 33), (101, 5, 256)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", COLS_SHAPES)
def test_gemm_gemv_cols_shapes(m, n, k, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    check(rand(m, k, dtype=dtype, gen=gen), weight_t(k, n, dtype=dtype, gen=gen), kernel="cols")


# Every epilogue the kernels ship: c (none, full, a row broadcast, a column, a scalar), bias,
# each activation, for both kernels.
@pytest.mark.parametrize("kernel", ["rows", "cols"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("c_kind", C_KINDS)
def test_gemm_gemv_epilogue(c_kind, use_bias, activation, kernel):
    dtype = torch.float32
    gen = torch.Generator().manual_seed(ACTIVATIONS.index(activation) * 10 + use_bias)
    m, n, k = (6, 23, 19) if kernel == "rows" else (23, 6, 19)
    a, b = rand(m, k, dtype=dtype, gen=gen), weight_t(k, n, dtype=dtype, gen=gen)
    bias, c = epilogue_operands(m, n, c_kind, use_bias, dtype, gen)
    check(a, b, bias, c, 0.75, -1.5 if c is not None else 1.0, activation, kernel)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gemm_gemv_epilogue_half_types(activation, dtype):
    gen = torch.Generator().manual_seed(11)
    m, n, k = 4, 36, 33
    a, b = rand(m, k, dtype=dtype, gen=gen), weight_t(k, n, dtype=dtype, gen=gen)
    check(a, b, rand(n, dtype=dtype, gen=gen), rand(m, n, dtype=dtype, gen=gen), 0.5, 2.0,
          activation)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemm_gemv_batched_and_broadcast(dtype):
    gen = torch.Generator().manual_seed(5)
    # Both operands batched: HAS_BATCH offsets per threadgroup z.
    a = rand(3, 2, 40, dtype=dtype, gen=gen)
    check(a, weight_t(40, 21, dtype=dtype, gen=gen, batch=(3,)),
          c=rand(3, 1, 21, dtype=dtype, gen=gen))  # fmt: skip
    # a broadcast over b's batch (stride 0).
    check(rand(1, 3, 40, dtype=dtype, gen=gen), weight_t(40, 9, dtype=dtype, gen=gen, batch=(4,)))
    # b shared (x[B, T, K] @ W^T): the batch folds into M = B * T = 6 <= 8, one dispatch.
    check(a, weight_t(40, 21, dtype=dtype, gen=gen), bias=rand(21, dtype=dtype, gen=gen))
    # ... and N <= 8 with a batched a, b broadcast: folded into 30 rows, the cols kernel.
    check(rand(3, 10, 40, dtype=dtype, gen=gen), weight_t(40, 7, dtype=dtype, gen=gen),
          kernel="cols")  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemm_gemv_strided_and_offset_operands(dtype):
    """Row strides past K, storage offsets that are no multiple of the 4-element vector (scalar
    loads) and ones that are (vector loads), decode rows taken from a [B, T, K] cache by a
    stride-T view."""
    gen = torch.Generator().manual_seed(8)
    big_a = rand(10, 75, dtype=dtype, gen=gen)
    big_w = rand(40, 75, dtype=dtype, gen=gen)
    for off in (0, 1, 3, 4):
        a = big_a[1:6, off : off + 61]
        b = big_w[2:35, off : off + 61].t()
        check(a, b)
        check(big_w[3:40, off : off + 61], big_a[2:7, off : off + 61].t(), kernel="cols")
    # x[:, -1, :] of a [4, 9, K] activation: M = 4 rows at stride 9 * K.
    x = rand(4, 9, 64, dtype=dtype, gen=gen)[:, -1, :]
    check(x, weight_t(64, 30, dtype=dtype, gen=gen))


def test_gemm_gemv_decode_linear_shape():
    """A decode-sized projection (1 x 1024 x 512, f16) against float64: long K walked by all 32
    lanes in several 128-element steps, 64 threadgroups."""
    gen = torch.Generator().manual_seed(2)
    a = rand(1, 512, dtype=torch.float16, gen=gen)
    check(a, weight_t(512, 1024, dtype=torch.float16, gen=gen),
          bias=rand(1024, dtype=torch.float16, gen=gen), activation="silu")  # fmt: skip
