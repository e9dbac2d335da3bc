"""The traffic model of bench/bench_gemm.py against the simulator's counters: the bytes each
dispatch of a GEMM plan reads and writes per buffer, predicted from the plan alone, must equal what
the simulator counts, and the model must never beat the minimum (each operand moved once)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gemm_helpers import rand, requires_simulator

from torch_steel import sim

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_gemm  # noqa: E402

pytestmark = requires_simulator


@pytest.mark.parametrize(
    "batch,m,n,k,epilogue,weight_t",
    [
        (1, 64, 64, 64, False, False),
        (1, 33, 65, 47, True, False),
        (3, 40, 24, 16, True, False),
        (1, 16, 16, 1024, True, False),  # split-K: partials written and re-read
        (1, 1, 200, 96, False, False),
        (1, 3, 37, 45, True, True),  # GEMV rows: ragged lines and K
        (2, 3, 37, 45, False, True),  # folded into 6 rows
        (1, 29, 5, 45, True, True),  # GEMV cols
        (1, 3, 37, 45, True, False),  # GEMV nn: ragged strip and K
        (2, 3, 37, 45, False, False),  # folded into 6 rows
    ],
)
def test_traffic_model_matches_counters(batch, m, n, k, epilogue, weight_t):
    dtype = torch.float16
    gen = torch.Generator().manual_seed(m + n + k)
    a = rand(*((batch,) if batch > 1 else ()), m, k, dtype=dtype, gen=gen)
    b = rand(n, k, dtype=dtype, gen=gen).t() if weight_t else rand(k, n, dtype=dtype, gen=gen)
    bias = rand(n, dtype=dtype, gen=gen) if epilogue else None
    options = {"activation": "relu" if epilogue else "none"}
    p = sim.plan("gemm", [a, b, bias, None], options)
    assert p.dispatches[0].kernel.startswith("steel_gemv_") == (weight_t or m <= 8)
    predicted = bench_gemm.model(p, batch, m, n, k, 2, use_c=False, use_bias=epilogue)
    _, counters = sim.run_op("gemm", [a, b, bias, None], options, counters=True)
    assert bench_gemm.counted(counters) == predicted
    minimum = (batch * m * k + k * n + (n if epilogue else 0) + batch * m * n) * 2
    assert bench_gemm.total(predicted) >= minimum


def test_traffic_model_matches_counters_of_a_batched_split_k():
    # 3 x [20, 600] @ [3, 600, 24] (b batched: no fold into M): 3 one-block entries over a
    # long K, split into partitions of every entry; partials written once and re-read once.
    dtype = torch.float16
    gen = torch.Generator().manual_seed(7)
    a, b = rand(3, 20, 600, dtype=dtype, gen=gen), rand(3, 600, 24, dtype=dtype, gen=gen)
    bias = rand(24, dtype=dtype, gen=gen)
    p = sim.plan("gemm", [a, b, bias, None], {"activation": "relu"})
    assert [d.kernel.split("_")[2] for d in p.dispatches] == ["splitk", "splitk"]
    predicted = bench_gemm.model(p, 3, 20, 24, 600, 2, use_c=False, use_bias=True)
    _, counters = sim.run_op("gemm", [a, b, bias, None], {"activation": "relu"}, counters=True)
    assert bench_gemm.counted(counters) == predicted
