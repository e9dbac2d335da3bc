"""The GEMV kernels (shaders/steel/gemm/gemv.h: steel_gemv_rows_*, M <= 8, and steel_gemv_cols_*,
N <= 8 by transposition, and steel_gemv_nn_*, M <= 8 with b row-major) in the Metal simulator
against torch.matmul in float64 (issue 25).

The plan (mps_src/plan/gemm_plan.cpp) picks rows and cols when a is row-major and b is stored
column by column (x @ W^T, as torch_steel.linear calls it), nn when both are row-major (x @ W,
W stored [K, N]); every case here first asserts which it picked, so a test cannot silently run
the tiled kernel instead. The checkers are on (out-of-bounds reads of
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


# steel_gemv_nn_: M <= 8 rows, b row-major [K, N] (N = 1 is a K-contiguous line: the rows
# kernel). N off the 4-column lane and the 32-column threadgroup strip (2, 3, 31, 33, 97); K
# below a lane's 4 rows, off the 64-row step of the 16 K slots, and long.
NN_SHAPES = [
    (1, 2, 1),
    (1, 3, 5),
    (2, 31, 63),
    (3, 33, 64),
    (4, 32, 65),
    (8, 97, 257),
    (7, 160, 1000),  # (7, 64, 1000) is split-K's: few strips, long K
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", NN_SHAPES)
def test_gemm_gemv_nn_shapes(m, n, k, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    check(rand(m, k, dtype=dtype, gen=gen), rand(k, n, dtype=dtype, gen=gen), kernel="nn")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("c_kind", C_KINDS)
def test_gemm_gemv_nn_epilogue(c_kind, use_bias, activation):
    gen = torch.Generator().manual_seed(ACTIVATIONS.index(activation) * 10 + use_bias + 100)
    m, n, k = 5, 45, 70
    a, b = rand(m, k, dtype=torch.float32, gen=gen), rand(k, n, dtype=torch.float32, gen=gen)
    bias, c = epilogue_operands(m, n, c_kind, use_bias, torch.float32, gen)
    check(a, b, bias, c, 0.75, -1.5 if c is not None else 1.0, activation, "nn")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gemm_gemv_nn_epilogue_half_types(dtype):
    gen = torch.Generator().manual_seed(12)
    m, n, k = 3, 40, 37
    a, b = rand(m, k, dtype=dtype, gen=gen), rand(k, n, dtype=dtype, gen=gen)
    check(a, b, rand(n, dtype=dtype, gen=gen), rand(m, n, dtype=dtype, gen=gen), 0.5, 2.0,
          "gelu", "nn")  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemm_gemv_nn_batched_strided_and_offset(dtype):
    """Batched and broadcast operands (HAS_BATCH offsets per threadgroup z), b shared by a
    folded batch, row strides past N, and storage offsets that are no multiple of the 4-element
    vector (scalar loads) or are (vector loads)."""
    gen = torch.Generator().manual_seed(9)
    check(rand(3, 2, 40, dtype=dtype, gen=gen), rand(3, 40, 21, dtype=dtype, gen=gen),
          c=rand(3, 1, 21, dtype=dtype, gen=gen), kernel="nn")  # fmt: skip
    check(rand(1, 3, 40, dtype=dtype, gen=gen), rand(4, 40, 9, dtype=dtype, gen=gen), kernel="nn")
    # x[B, T, K] @ W with W shared: the batch folds into M = 6 rows, one dispatch.
    check(rand(3, 2, 40, dtype=dtype, gen=gen), rand(40, 21, dtype=dtype, gen=gen),
          bias=rand(21, dtype=dtype, gen=gen), kernel="nn")  # fmt: skip
    big_a = rand(10, 75, dtype=dtype, gen=gen)
    big_w = rand(70, 80, dtype=dtype, gen=gen)
    for off in (0, 1, 3, 4):
        check(big_a[1:6, off : off + 61], big_w[2:63, off : off + 70], kernel="nn")
