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

from pathlib import Path

import side_by_side as sbs
import torch

# (name, batch, M, N, K)
SHAPES = [
    ("square 256", 1, 256, 256, 256),
    ("square 512", 1, 512, 512, 512),
    ("square 1024", 1, 1024, 1024, 1024),
    ("square 2048", 1, 2048, 2048, 2048),
    ("square 4096", 1, 4096, 4096, 4096),
    ("decode 1x4096x4096", 1, 1, 4096, 4096),
    ("MLP 32x11008x4096", 1, 32, 11008, 4096),
    ("batched 8x128x128x64", 8, 128, 128, 64),
]
QUICK = [("ragged 33x65x47", 1, 33, 65, 47)]
MODEST = [("square 512", 1, 512, 512, 512), ("decode 1x4096x4096", 1, 1, 4096, 4096)]


def pair(shape, dtype, chip, budget):
    """(steel, MPS matmul) predictions of out = a @ b."""
    _, batch, m, n, k = shape

    def make(device, reduced):
        shape_a = (batch, m, k) if batch > 1 else (m, k)
        if device == "meta":
            return [torch.empty(shape_a, dtype=dtype, device="meta"),
                    torch.empty(k, n, dtype=dtype, device="meta"), None, None]  # fmt: skip
        g = torch.Generator().manual_seed(m + n + k)
        return [torch.randn(shape_a, generator=g).to(dtype),
                torch.randn(k, n, generator=g).to(dtype), None, None]  # fmt: skip

    ours = sbs.steel_records("gemm", make, {}, 1, chip, budget, batch * m * n * k)
    es = sbs._ES[dtype]
    ops = [sbs.op("MPS matmul", 2 * batch * m * n * k,
                  (batch * m * k + k * n) * es, batch * m * n * es, matmul=True)]  # fmt: skip
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
            _, batch, m, n, k = shape
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
