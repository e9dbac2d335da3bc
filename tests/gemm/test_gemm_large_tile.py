"""The 64x64 GEMM blocks in the simulator against float64 torch.matmul: kLarge (64x64x32 on 2x4
simdgroups, 256 threads; float32: kLarge32, 64x64x16 on 2x4) and kLarge4 (64x64x16 on 2x2, the
block for pipelines that allow fewer than 256 threads), all of mps_src/plan/gemm_plan.cpp.

The plan takes these blocks for grids of at least 128 of them, or for fewer when the device's
core count says they fill whole waves; here `gpu_cores` = 1 (every grid fills its waves) brings
them to shapes small enough to simulate with the checkers on (out-of-bounds accesses,
threadgroup races, misaligned vector accesses raise). Shapes are multiples of no tile: M and N
end inside a 64-wide block (and inside a simdgroup's 8-row fragment), K inside the 32-wide K
step (and the 16-wide one of kLarge4). Tolerances: gemm_helpers.assert_close.
"""

from __future__ import annotations

import itertools

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
# One core: any grid fills its waves, so the plan keeps the 64x64 block on small shapes.
ONE_CORE = {"gpu_cores": 1}
# (options, the block's kernel-name part for f16/bf16, for f32)
TILES = {
    "large": ({}, "_bm64_bn64_bk32_wm2_wn4", "_bm64_bn64_bk16_wm2_wn4"),
    "large4 (max_threads 128)": ({"max_threads": 128}, "_bm64_bn64_bk16_wm2_wn2",
                                 "_bm64_bn64_bk16_wm2_wn2"),
}  # fmt: skip


def operand(rows, cols, *, transposed, dtype, gen, batch=()):
    if transposed:
        return rand(*batch, cols, rows, dtype=dtype, gen=gen).transpose(-1, -2)
    return rand(*batch, rows, cols, dtype=dtype, gen=gen)


def check(tile, a, b, bias=None, c=None, alpha=1.0, beta=1.0, activation="none"):
    """Plans with one core (and the tile's options), asserts the block, runs, compares."""
    extra, name, name32 = TILES[tile]
    name = name32 if a.dtype == torch.float32 else name
    options = {"alpha": alpha, "beta": beta, "activation": activation, **extra}
    with sim.device(ONE_CORE):
        p = sim.plan("gemm", [a, b, bias, c], options)
        assert p.ok, p.reason
        assert name in p.dispatches[0].kernel, p.dispatches[0].kernel
        (out,) = sim.run_op("gemm", [a, b, bias, c], options, checkers=True)
    ref, mag = reference(a, b, bias, c, alpha, beta, activation)
    assert_close(out, ref, mag, a.shape[-1], a.dtype)
    return p.dispatches[0]


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], repeat=2)))
def test_large_tile_ragged(ta, tb, dtype, tile):
    # 2 x 2 blocks, the second of each ragged (M = 64 + 57, N = 64 + 7); K = 32 + 13 (BK 16:
    # 2 x 16 + 13): full K steps, then a partial one.
    gen = torch.Generator().manual_seed(3 * ta + tb + 7 * DTYPES.index(dtype))
    m, n, k = 121, 71, 45
    a = operand(m, k, transposed=ta, dtype=dtype, gen=gen)
    b = operand(k, n, transposed=tb, dtype=dtype, gen=gen)
    d = check(tile, a, b)
    assert (d.constants[200], d.constants[201], d.constants[202]) == (0, 0, 0)  # ALIGN_M/N/K


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], repeat=2)))
def test_large_tile_aligned_vector_loads(ta, tb, dtype, tile):
    # Whole blocks and K steps (no edge code), 16-byte aligned rows: the unchecked vector path.
    gen = torch.Generator().manual_seed(11 + 2 * ta + tb)
    a = operand(128, 96, transposed=ta, dtype=dtype, gen=gen)
    b = operand(96, 64, transposed=tb, dtype=dtype, gen=gen)
    d = check(tile, a, b)
    assert (d.constants[200], d.constants[201], d.constants[202]) == (1, 1, 1)
    assert d.constants[210] and d.constants[211]  # VEC_A, VEC_B


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n", [(70, 128), (128, 70), (97, 101)])
def test_large_tile_edges_with_vector_loads(m, n, dtype, tile):
    # Rows 16-byte aligned (leading dims padded to 16 elements) while M, N or both end inside a
    # block: the edge tile checks the operand that crosses the edge and streams the other one
    # with vector loads; K = 72 ends inside the third 32-wide step.
    gen = torch.Generator().manual_seed(m + 3 * n)
    k = 72
    a = rand(m, 80, dtype=dtype, gen=gen)[:, :k]
    b = rand(k, -(-n // 16) * 16, dtype=dtype, gen=gen)[:, :n]
    bias, c = rand(n, dtype=dtype, gen=gen), rand(m, n, dtype=dtype, gen=gen)
    d = check(tile, a, b, bias, c, beta=0.5, activation="gelu")
    assert d.constants[210] and d.constants[211]


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_tile_unaligned_rows(dtype, tile):
    # Leading dims and storage offsets off every vector width: element-by-element loads.
    gen = torch.Generator().manual_seed(5)
    a = rand(100, 51, dtype=dtype, gen=gen)[1:, 1:]  # [99, 50], lda 51, offset 52
    b = rand(50, 67, dtype=dtype, gen=gen)[:, 3:]  # [50, 64], ldb 67, offset 3
    d = check(tile, a, b)
    assert not d.constants[210] and not d.constants[211]


# Every epilogue combination on kLarge; kLarge4 runs the same epilogue code (gemm.h) over its own
# fragment grid, so each activation with bias and a full c there.
EPILOGUES = [
    *(("large", c, bias, act) for c in C_KINDS
      for bias in (False, True) for act in ACTIVATIONS),
    *(("large4 (max_threads 128)", "full", True, act) for act in ACTIVATIONS),
]  # fmt: skip


@pytest.mark.parametrize("tile,c_kind,use_bias,activation", EPILOGUES)
def test_large_tile_epilogue(c_kind, use_bias, activation, tile):
    # A ragged 2 x 2 grid of blocks, f16 (half fragments).
    dtype = torch.float16
    gen = torch.Generator().manual_seed(ACTIVATIONS.index(activation) * 10 + use_bias)
    m, n, k = 67, 75, 37
    a, b = rand(m, k, dtype=dtype, gen=gen), rand(k, n, dtype=dtype, gen=gen)
    bias, c = epilogue_operands(m, n, c_kind, use_bias, dtype, gen)
    check(tile, a, b, bias, c, alpha=0.75, beta=-1.5 if c is not None else 1.0,
          activation=activation)  # fmt: skip


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_tile_batched_broadcast(dtype, tile):
    # Batch offsets from the grid's z (b broadcast over one dim, c over the other).
    gen = torch.Generator().manual_seed(17)
    a = rand(2, 3, 65, 40, dtype=dtype, gen=gen)
    b = rand(2, 1, 40, 66, dtype=dtype, gen=gen)
    c = rand(1, 3, 65, 66, dtype=dtype, gen=gen)
    d = check(tile, a, b, c=c, beta=0.25, activation="relu")
    assert d.constants[100] and d.grid[2] == 6  # HAS_BATCH
