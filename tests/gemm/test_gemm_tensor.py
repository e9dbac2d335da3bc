"""steel::gemm on Metal 4's matmul2d (shaders/steel/gemm_tensor/), planned only for devices
that describe themselves as M5-generation (Apple10 family) with Metal 4 and the tensor-op
library (mps_src/plan/device.h), run in the simulator emulating such a device, with checkers
on and several cooperative-tensor layout seeds, against float64 torch.matmul.
"""

from __future__ import annotations

import pytest
import torch
from gemm_helpers import (
    M5,
    NOT_M5,
    assert_close,
    rand,
    reference,
    requires_planner,
    requires_simulator,
)

from torch_steel import sim

SEEDS = [0, 3, 11]
HALF_TYPES = [torch.float16, torch.bfloat16]


def operand(rows, cols, *, transposed, dtype, gen, batch=()):
    if transposed:
        return rand(*batch, cols, rows, dtype=dtype, gen=gen).transpose(-1, -2)
    return rand(*batch, rows, cols, dtype=dtype, gen=gen)


def check(a, b, bias=None, c=None, activation="none", alpha=1.0, beta=1.0,
          kernel="steel_gemm_tensor_"):  # fmt: skip
    options = {"alpha": alpha, "beta": beta, "activation": activation, **M5}
    p = sim.plan("gemm", [a, b, bias, c], options)
    assert p.ok, p.reason
    assert p.dispatches[0].kernel.startswith(kernel), p.dispatches[0].kernel
    (out,) = sim.run_op("gemm", [a, b, bias, c], options, checkers=True)
    ref, mag = reference(a, b, bias, c, alpha, beta, activation)
    assert_close(out, ref, mag, a.shape[-1], a.dtype)


@pytest.fixture(params=SEEDS)
def seed(request, monkeypatch):
    monkeypatch.setenv("TORCH_STEEL_SIM_LAYOUT_SEED", str(request.param))
    return request.param


@requires_planner
@pytest.mark.parametrize("name", sorted(NOT_M5))
def test_only_m5_devices_get_the_matmul2d_kernels(name):
    a, b = torch.zeros(100, 70, dtype=torch.float16), torch.zeros(70, 90, dtype=torch.float16)
    p = sim.plan("gemm", [a, b, None, None], NOT_M5[name])
    assert p.ok and p.dispatches[0].kernel.startswith("steel_gemm_nn_f16"), p.dispatches[0].kernel
    m5 = sim.plan("gemm", [a, b, None, None], M5)
    assert m5.dispatches[0].kernel == "steel_gemm_tensor_nn_f16_bm64_bn64_bk32_sg4"
    assert m5.dispatches[0].threads == (128, 1, 1) and m5.dispatches[0].threadgroup_memory == {}


@requires_planner
def test_float32_keeps_the_simdgroup_kernels_on_m5():
    a, b = torch.zeros(64, 64), torch.zeros(64, 64)
    assert sim.plan("gemm", [a, b, None, None], M5).dispatches[0].kernel.startswith("steel_gemm_nn")


SHAPES = [(1, 7, 5), (65, 63, 33), (97, 130, 47)]
TRANSPOSES = [(False, False), (False, True), (True, False), (True, True)]
CASES = [
    (m, n, k, ta, tb, dtype) for m, n, k in SHAPES for ta, tb in TRANSPOSES for dtype in HALF_TYPES
]


def shapes_and_transposes(layout_seed, m, n, k, ta, tb, dtype, monkeypatch):
    monkeypatch.setenv("TORCH_STEEL_SIM_LAYOUT_SEED", str(layout_seed))
    g = torch.Generator().manual_seed(layout_seed * 100 + m)
    a = operand(m, k, transposed=ta, dtype=dtype, gen=g)
    b = operand(k, n, transposed=tb, dtype=dtype, gen=g)
    # a row-major (a single row always is) and b column by column with at most 8 rows or
    # columns, or b row-major with at most 8 rows: the GEMV kernels serve it on every device
    # (docs/gemm.md), M5 included; the other layouts run matmul2d.
    gemv = (not ta or m == 1) and (min(m, n) <= 8 if tb else m <= 8)
    check(a, b, kernel="steel_gemv_" if gemv else "steel_gemm_tensor_")


@requires_simulator
@pytest.mark.parametrize("i", range(len(CASES)))
def test_shapes_and_transposes(i, monkeypatch):
    # Each case under one of the seeds, in turn; @slow runs every case under every seed.
    shapes_and_transposes(SEEDS[i % len(SEEDS)], *CASES[i], monkeypatch)


@pytest.mark.slow
@requires_simulator
@pytest.mark.parametrize("layout_seed", SEEDS)
@pytest.mark.parametrize("i", range(len(CASES)))
def test_shapes_and_transposes_every_seed(layout_seed, i, monkeypatch):
    shapes_and_transposes(layout_seed, *CASES[i], monkeypatch)


@requires_simulator
@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
def test_epilogue(seed, activation):
    g = torch.Generator().manual_seed(seed)
    a, b = rand(70, 40, dtype=torch.bfloat16, gen=g), rand(40, 66, dtype=torch.bfloat16, gen=g)
    bias = rand(66, dtype=torch.bfloat16, gen=g)
    c = rand(70, 1, dtype=torch.bfloat16, gen=g)  # broadcast along N
    check(a, b, bias, c, activation, alpha=0.5, beta=-2.0)


@requires_simulator
def test_batched_broadcast(seed):
    g = torch.Generator().manual_seed(seed)
    a = rand(3, 1, 20, 36, dtype=torch.float16, gen=g)
    b = rand(2, 36, 70, dtype=torch.float16, gen=g).transpose(-1, -2).contiguous().transpose(-1, -2)
    check(a, b)


@requires_simulator
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
def test_split_k(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    a, b = rand(20, 1000, dtype=dtype, gen=g), rand(1000, 33, dtype=dtype, gen=g)
    options = {**M5}
    p = sim.plan("gemm", [a, b, None, None], options)
    assert [d.kernel for d in p.dispatches] == [
        "steel_gemm_tensor_splitk_nn_"
        + ("f16" if dtype == torch.float16 else "bf16")
        + "_bm64_bn64_bk32_sg4",
        "steel_gemm_splitk_reduce_" + ("f16" if dtype == torch.float16 else "bf16"),
    ]
    bias = rand(33, dtype=dtype, gen=g)
    (out,) = sim.run_op("gemm", [a, b, bias, None], {"activation": "gelu", **M5}, checkers=True)
    ref, mag = reference(a, b, bias, activation="gelu")
    assert_close(out, ref, mag, 1000, dtype)


@requires_simulator
def test_batched_split_k(seed):
    # 3 entries of b (no fold into M), one 64x64 block each over K = 1000: every entry's K split
    # on the matmul2d kernel, c per entry added by the shared reduction.
    g = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    a, b = rand(3, 20, 1000, dtype=bf16, gen=g), rand(3, 1000, 33, dtype=bf16, gen=g)
    c = rand(3, 20, 33, dtype=bf16, gen=g)
    options = {"beta": -1.5, "activation": "silu", **M5}
    p = sim.plan("gemm", [a, b, None, c], options)
    assert p.dispatches[0].kernel.startswith("steel_gemm_tensor_splitk_nn_bf16")
    assert p.dispatches[0].grid[2] > 3
    (out,) = sim.run_op("gemm", [a, b, None, c], options, checkers=True)
    ref, mag = reference(a, b, None, c, beta=-1.5, activation="silu")
    assert_close(out, ref, mag, 1000, bf16)


@requires_simulator
def test_traffic_and_multiply_adds_counted():
    # 100 x 90 x 70 f16: 2 x 2 blocks of 64, 3 K steps of 32 (the last ragged): every block
    # reads its rows of a and columns of b once over K, writes its outputs once.
    g = torch.Generator().manual_seed(1)
    a, b = rand(100, 70, dtype=torch.float16, gen=g), rand(70, 90, dtype=torch.float16, gen=g)
    _, counters = sim.run_op("gemm", [a, b, None, None], M5, counters=True)
    (c,) = counters
    assert c["buffers"][0]["read"] == 2 * 100 * 70 * 2
    assert c["buffers"][1]["read"] == 2 * 90 * 70 * 2
    assert c["buffers"][4]["written"] == 100 * 90 * 2
    assert c["tensor_ops"] == 4 * 3
    assert c["tensor_multiply_adds"] == 4 * 3 * 64 * 64 * 32
    assert c["mma"] == 0
