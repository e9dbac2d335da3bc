"""bench_gemm.py --predict: steel's GEMM against MPS matmul (what torch.matmul runs on MPS) on one
chip of the timing model's table (issue 24, deliverable 5).

steel: the plan run in the simulator with counters, each dispatch predicted by the timing model
(side_by_side.py). MPS matmul: its kernels are not public, so it is modelled at the roofline of
the chip's table (side_by_side.composite_time): 2 M N K FLOPs at the matrix peak, or A, B read
and C written once at the DRAM bandwidth, whichever is longer, plus one dispatch overhead. No
published MPS efficiency is applied: this is the fastest MPS could be, and the ratio
(MPS / steel) a lower bound on steel's advantage.
"""

from __future__ import annotations

import math
from pathlib import Path

import side_by_side as sbs
import torch

# (name, batch, M, N, K[, "nt" | "bmm"]): b is a K x N row-major tensor, or with "nt" the
# transpose of an N x K one (W^T, torch_steel.linear's layout, which takes the GEMV kernels at
# M = 1), or with "bmm" a [batch, K, N] one (torch.bmm: no batch folds into M)
SHAPES = [
    ("square 256", 1, 256, 256, 256),
    ("square 512", 1, 512, 512, 512),
    ("square 1024", 1, 1024, 1024, 1024),
    ("square 2048", 1, 2048, 2048, 2048),
    ("square 4096", 1, 4096, 4096, 4096),
    ("decode 1x4096x4096", 1, 1, 4096, 4096),
    ("GEMV 1x4096x4096 (x @ W^T)", 1, 1, 4096, 4096, "nt"),
    ("MLP 32x11008x4096", 1, 32, 11008, 4096),
    ("batched 8x128x128x64", 8, 128, 128, 64),
    ("bmm 4x32x32x8192 (split-K)", 4, 32, 32, 8192, "bmm"),
]
QUICK = [("ragged 33x65x47", 1, 33, 65, 47)]
# docs/performance.md's table, every chip: issue 25's GEMM targets (>= 75% of the roofline from
# 1024^3, fitted; the GEMV within 80% of the bandwidth bound) and the MLP row
MODEST = [SHAPES[i] for i in (1, 2, 3, 4, 5, 6, 7)]


# Fitted shapes (big_shapes.py): the same kernel at these values of K (multiples of every bk),
# counters linear in K; on the whole output when it has at most FIT_MN^2 elements, else on
# FIT_MN x FIT_MN of it, scaled by the threadgroups.
FIT_MN = 1024
FIT_K = (128, 256)


def _fit(shape, dtype):
    """The fit= of sbs.steel_records for a GEMM over the budget (None when K is no larger than
    the fit's points, or M or N is cut to FIT_MN but not a multiple of 64: then the big grid's
    threadgroups would not all do the small run's work). An output of at most FIT_MN^2
    elements is kept whole: its grid is the big shape's, so the plan's tile rule (which sees
    the grid against the cores, gemm_plan.cpp) picks the same kernel; cut, a narrow output
    such as 32 x 11008 would plan a smaller tile (bn32 at 32 x 1024, not bn128) and no fit would
    be exact."""
    import big_shapes  # noqa: PLC0415

    _, batch, m, n, k, *layout = shape
    whole = m * n <= FIT_MN * FIT_MN
    if layout:  # the fit's operands are row-major (no shape of the lists is fitted otherwise)
        return None
    if k <= max(FIT_K) or k % 32:
        return None
    if not whole and ((m > FIT_MN and m % 64) or (n > FIT_MN and n % 64)):
        return None
    m0, n0 = (m, n) if whole else (min(m, FIT_MN), min(n, FIT_MN))

    def make_at(k0):
        def make(device, reduced):
            shape_a = (batch, m0, k0) if batch > 1 else (m0, k0)
            g = torch.Generator().manual_seed(k0)
            if device == "meta":
                return [torch.empty(shape_a, dtype=dtype, device="meta"),
                        torch.empty(k0, n0, dtype=dtype, device="meta"), None, None]  # fmt: skip
            return [torch.randn(shape_a, generator=g).to(dtype),
                    torch.randn(k0, n0, generator=g).to(dtype), None, None]  # fmt: skip

        return make

    geometry = {"M": m, "N": n, "K": k, "es": sbs._ES[dtype]}
    return {
        "points": FIT_K,
        "x": k,
        "make_at": make_at,
        "reduced": False,
        "work_at": lambda k0: batch * m0 * n0 * k0,
        "scale": lambda full, small: (
            math.prod(full.dispatches[0].grid) / math.prod(small.dispatches[0].grid)
        ),
        "pieces": lambda kernel, grid: big_shapes.gemm_pieces(kernel, grid, geometry),
    }


def pair(shape, dtype, chip, budget):
    """(steel, MPS matmul) predictions of out = a @ b."""
    _, batch, m, n, k, *layout = shape
    nt = layout == ["nt"]
    bmm = layout == ["bmm"]

    def make(device, reduced):
        shape_a = (batch, m, k) if batch > 1 else (m, k)
        shape_b = (n, k) if nt else (batch, k, n) if bmm else (k, n)
        if device == "meta":
            a = torch.empty(shape_a, dtype=dtype, device="meta")
            b = torch.empty(shape_b, dtype=dtype, device="meta")
        else:
            g = torch.Generator().manual_seed(m + n + k)
            a, b = (torch.randn(s, generator=g).to(dtype) for s in (shape_a, shape_b))
        return [a, b.mT if nt else b, None, None]

    fit = _fit(shape, dtype)
    ours = sbs.steel_records("gemm", make, {}, 1, chip, budget, batch * m * n * k, fit)
    es = sbs._ES[dtype]
    ops = [sbs.op("MPS matmul", 2 * batch * m * n * k,
                  (batch * m * k + (batch if bmm else 1) * k * n) * es, batch * m * n * es,
                  matmul=True)]  # fmt: skip
    theirs = sbs.composite_time(ops, chip, dtype)
    theirs["how"] = "matrix/DRAM roofline"
    return ours, theirs


def run(chips, dtype, quick, out_dir: Path, budget: float, modest=False) -> list[str]:
    lines: list[str] = []

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    for chip in chips:
        say(f"\n== {chip}: predicted time, steel GEMM against MPS matmul at its roofline "
            f"(ratio = MPS / steel), {dtype}")  # fmt: skip
        say(sbs.HEADER)
        series: dict[str, list] = {}
        for shape in QUICK if quick else MODEST if modest else SHAPES:
            _, batch, m, n, k, *_ = shape
            flops = 2 * batch * m * n * k
            ours, theirs = pair(shape, dtype, chip, budget)
            say(sbs.row(shape[0], flops, ours, theirs))
            if shape[0].startswith("square"):
                for side, r in (("steel", ours), ("MPS roofline", theirs)):
                    if "time_s" in r:
                        series.setdefault(side, []).append(
                            (m, flops / r["time_s"] / 1e12, sbs.dram_bytes(r) / r["time_s"] / 1e9)
                        )
        path = sbs.plot(out_dir / f"gemm_{chip.replace(' ', '_')}.png", chip, series,
                        sbs.roofline_peaks(chip, dtype), x_label="M = N = K")  # fmt: skip
        if path is not None:
            say(f"plot: {path}")
    return lines
