"""GEMM benchmark (issue 4, item 6): device traffic of the chosen plan against the minimum,
checked against the simulator's counters, and MPS timings on a Mac.

For every shape of the table:
  - the plan (torch_steel.sim.plan, the same plan the Mac encodes) and a traffic model of it:
    the bytes each dispatch reads from and writes to each buffer, derived from the tile sizes,
    the grid and the kernel's access pattern (every threadgroup reads its BM rows of A and BN
    columns of B over its K range once; the epilogue reads c and bias once per output element;
    split-K writes and re-reads fp32 partials);
  - the minimum: read a, b (and c, bias) once, write out once;
  - bytes per FLOP of both (FLOP = 2 * M * N * K * batch);
  - on shapes the simulator runs in seconds (M*N*K <= --sim-limit), the simulator's counted
    bytes next to the model (they must agree exactly; a mismatch is reported and fails);
  - on a Mac with MPS: steel.gemm against torch.matmul and against addmm + activation, same
    inputs, median of --iters runs, and GFLOP/s, all from the same run.

--device m5 plans for an M5-generation GPU (Metal 4 matrix units: the matmul2d kernels of
shaders/steel/gemm_tensor/) and the simulator emulates one; the table then also gives the
matmul2d operations' MMA-equivalents (8x8x8 multiply-adds: BM * BN * BK / 512 per K step of
every block, ragged edges included, as the matrix units compute them), checked against the
simulator's count. On a Mac the plan follows the real device whatever --device says.

    python bench/bench_gemm.py [--dtype float16] [--sim-limit 134217728] [--iters 20]
                               [--device default|m5]
"""

from __future__ import annotations

import argparse
import statistics
import struct
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch_steel import sim  # noqa: E402

# (name, batch, M, N, K)
SHAPES = [
    ("square 256", 1, 256, 256, 256),
    ("square 512", 1, 512, 512, 512),
    ("square 1024", 1, 1024, 1024, 1024),
    ("square 2048", 1, 2048, 2048, 2048),
    ("square 4096", 1, 4096, 4096, 4096),
    ("LLM proj 4096x4096x4096", 1, 4096, 4096, 4096),
    ("decode 1x4096x4096", 1, 1, 4096, 4096),
    ("decode x8 8x1x4096x4096", 8, 1, 4096, 4096),
    # b = W^T, W [N, K] row-major (torch_steel.linear's layout): the GEMV kernels.
    ("decode 1x4096x4096 W^T", 1, 1, 4096, 4096),
    ("decode x8 8x1x4096x4096 W^T", 8, 1, 4096, 4096),
    ("few columns 4096x8x4096 W^T", 1, 4096, 8, 4096),
    ("MLP 32x11008x4096", 1, 32, 11008, 4096),
    ("split-K 16x16x4096", 1, 16, 16, 4096),
    ("batched 8x128x128x64", 8, 128, 128, 64),
    ("small ragged 33x65x47", 1, 33, 65, 47),
    ("small split-K 20x33x777", 1, 20, 33, 777),
]

BUF_A, BUF_B, BUF_C, BUF_BIAS, BUF_OUT, BUF_PARAMS = 0, 1, 2, 3, 4, 5

# Device descriptions of the plan (mps_src/plan/device.h).
DEVICES = {
    "default": {},
    "m5": {"device_apple_family": 10, "device_metal4": True, "device_tensor_ops": True},
}


def tile_of(kernel: str) -> tuple[int, int]:
    parts = dict((p[:2], p[2:]) for p in kernel.split("_") if p[:2] in ("bm", "bn"))
    return int(parts["bm"]), int(parts["bn"])


def tensor_mma(plan) -> int:
    """MMA-equivalents (8x8x8) of the plan's matmul2d operations: each block runs one BM x BN x
    BK operation per K step of its range."""
    total = 0
    for d in plan.dispatches:
        if not d.kernel.startswith("steel_gemm_tensor_"):
            continue
        parts = dict((p[:2], p[2:]) for p in d.kernel.split("_") if p[:2] in ("bm", "bn", "bk"))
        bm, bn, bk = int(parts["bm"]), int(parts["bn"]), int(parts["bk"])
        params = next(b.bytes for b in d.bindings if b.index == BUF_PARAMS)
        # GemmParams (shaders/steel/params.h): K at byte 8, tiles_m, tiles_n at 24, k_split at
        # 36, partitions at 44.
        (k,) = struct.unpack_from("<i", params, 8)
        tiles_m, tiles_n = struct.unpack_from("<2i", params, 24)
        (k_split,) = struct.unpack_from("<i", params, 36)
        (partitions,) = struct.unpack_from("<i", params, 44)
        if "splitk" in d.kernel:
            steps = sum(-(-min(k_split, k - z * k_split) // bk) for z in range(partitions))
            blocks = tiles_m * tiles_n
        else:
            steps = -(-k // bk)
            blocks = tiles_m * tiles_n * d.grid[2]
        total += blocks * steps * bm * bn * bk // 512
    return total


def epilogue(buffers, out_bytes, use_c, use_bias):
    """The epilogue's bytes: one store per output element, c and bias read once per output
    (bias through its broadcast row, as the kernel indexes it)."""
    buffers[BUF_OUT] = {"read": 0, "written": out_bytes}
    if use_c:
        buffers[BUF_C] = {"read": out_bytes, "written": 0}
    if use_bias:
        buffers[BUF_BIAS] = {"read": out_bytes, "written": 0}


def model(plan, batch, m, n, k, es, use_c, use_bias):
    """Predicted {dispatch index: {binding: {"read": bytes, "written": bytes}}}."""
    # The plan may fold a batch into M (b shared by every entry, a's entries row after row):
    # the kernel then runs one [batch * m, k] @ [k, n] GEMM. Its M is the params' first field.
    params = next(b.bytes for b in plan.dispatches[0].bindings if b.index == BUF_PARAMS)
    kernel_m = struct.unpack_from("<i", params, 0)[0]
    batch, m = batch * m // kernel_m, kernel_m
    out = []
    for d in plan.dispatches:
        buffers: dict[int, dict[str, int]] = {}
        if "splitk_reduce" in d.kernel:
            partitions = plan.allocations[1].sizes[0]
            buffers[BUF_A] = {"read": partitions * batch * m * n * 4, "written": 0}
            epilogue(buffers, batch * m * n * es, use_c, use_bias)
        elif d.kernel.startswith("steel_gemv_nn_"):
            # Each threadgroup reads its strip of 32 columns of b over K (every element once) and
            # all m rows of a once (shared by shuffles); one store per output.
            strips = -(-n // 32)
            buffers[BUF_B] = {"read": batch * k * n * es, "written": 0}
            buffers[BUF_A] = {"read": batch * strips * m * k * es, "written": 0}
            epilogue(buffers, batch * m * n * es, use_c, use_bias)
        elif d.kernel.startswith("steel_gemv_"):
            # Each simdgroup reads its 4 lines of the weight (the last one re-reads its first
            # line in place of the missing ones) and all R <= 8 lines of the other operand over
            # K; one store per output, c and bias read once per output.
            cols = d.kernel.startswith("steel_gemv_cols_")
            lines, rows = (m, n) if cols else (n, m)
            groups = -(-lines // 4)
            w, x = (BUF_A, BUF_B) if cols else (BUF_B, BUF_A)
            buffers[w] = {"read": batch * groups * 4 * k * es, "written": 0}
            buffers[x] = {"read": batch * groups * rows * k * es, "written": 0}
            epilogue(buffers, batch * m * n * es, use_c, use_bias)
        else:
            bm, bn = tile_of(d.kernel)
            tiles_m, tiles_n = -(-m // bm), -(-n // bn)
            buffers[BUF_A] = {"read": batch * tiles_n * m * k * es, "written": 0}
            buffers[BUF_B] = {"read": batch * tiles_m * n * k * es, "written": 0}
            if "splitk" in d.kernel:  # grid z: every batch entry's partitions
                buffers[BUF_OUT] = {"read": 0, "written": d.grid[2] * m * n * 4}
            else:
                epilogue(buffers, batch * m * n * es, use_c, use_bias)
        out.append(buffers)
    return out


def total(buffers_list) -> int:
    return sum(v["read"] + v["written"] for b in buffers_list for v in b.values())


def counted(counters) -> list[dict[int, dict[str, int]]]:
    """The simulator's per-binding bytes, without the params struct: it is set with setBytes
    (constant address space, read by every thread from cache), not device traffic."""
    return [
        {
            i: dict(v)
            for i, v in c["buffers"].items()
            if (v["read"] or v["written"]) and i != BUF_PARAMS
        }
        for c in counters
    ]


def tensors(batch, m, n, k, dtype, device, with_epilogue, weight_t=False):
    """a, b, bias; weight_t: b = W^T of a row-major W [n, k] (columns contiguous)."""
    shape_a = (batch, m, k) if batch > 1 else (m, k)
    a = torch.randn(shape_a, dtype=dtype, device=device)
    if weight_t:
        b = torch.randn(n, k, dtype=dtype, device=device).t()
    else:
        b = torch.randn(k, n, dtype=dtype, device=device)
    bias = torch.randn(n, dtype=dtype, device=device) if with_epilogue else None
    return a, b, bias


def time_ms(fn, iters):
    fn()
    torch.mps.synchronize()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.mps.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def time_mps(batch, m, n, k, dtype, iters, weight_t):
    """Milliseconds of steel.gemm(+bias, gelu), torch.matmul, and addmm + gelu on MPS."""
    gelu = torch.nn.functional.gelu
    a, b, bias = tensors(batch, m, n, k, dtype, "mps", True, weight_t)
    steel = time_ms(lambda: torch.ops.steel.gemm(a, b, bias=bias, activation="gelu"), iters)
    mm = time_ms(lambda: torch.matmul(a, b), iters)
    if batch > 1:
        fused = time_ms(lambda: gelu(torch.baddbmm(bias, a, b.expand(batch, k, n))), iters)
    else:
        fused = time_ms(lambda: gelu(torch.addmm(bias, a, b)), iters)
    return steel, mm, fused


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument(
        "--sim-limit",
        type=float,
        default=2**27,
        help="run the simulator on shapes with batch*M*N*K up to this",
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="default", choices=sorted(DEVICES))
    parser.add_argument(
        "--predict",
        metavar="CHIP",
        help="predicted times of steel and MPS matmul on CHIP of the timing model's table "
        "(or 'all'), from simulator counters",
    )
    parser.add_argument("--quick", action="store_true", help="--predict on a tiny shape")
    parser.add_argument("--modest", action="store_true", help="--predict on the docs' shapes")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "out", help="--predict's plots"
    )
    parser.add_argument(
        "--sim-budget",
        type=float,
        default=1e9,
        help="--predict: simulate whole a shape of at most this many multiply-adds, sample the "
        "others",
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.predict:
        import gemm_predict  # noqa: PLC0415
        import side_by_side  # noqa: PLC0415

        chips = side_by_side.chip_names(args.predict)
        gemm_predict.run(chips, dtype, args.quick, args.out, args.sim_budget, args.modest)
        return 0
    es = torch.finfo(dtype).bits // 8
    run_sim = sim.available()
    on_mps = torch.backends.mps.is_available()
    failures = 0

    print(f"steel GEMM, {args.dtype}; traffic in MB, bytes/FLOP x1000; epilogue = bias + gelu")
    header = (
        f"{'shape':26} {'kernel':44} {'model MB':>9} {'min MB':>8} {'B/kFLOP':>8} "
        f"{'min':>6} {'ratio':>6} {'sim MB':>8}"
    )
    if args.device == "m5":
        header += f" {'MMA-eq':>10} {'sim MMA-eq':>10}"
    if on_mps:
        header += f" {'steel ms':>9} {'matmul ms':>9} {'addmm+act':>9} {'GFLOP/s':>8}"
    print(header)
    for name, batch, m, n, k in SHAPES:
        meta = "meta"
        weight_t = name.endswith("W^T")
        a, b, bias = tensors(batch, m, n, k, dtype, meta, True, weight_t)
        options = {"activation": "gelu", **DEVICES[args.device]}
        p = sim.plan("gemm", [a, b, bias, None], options)
        if not p.ok:
            print(f"{name:26} refused: {p.reason}")
            continue
        predicted = model(p, batch, m, n, k, es, use_c=False, use_bias=True)
        flop = 2 * batch * m * n * k
        minimum = (batch * m * k + k * n + n + batch * m * n) * es
        moved = total(predicted)
        kernel = p.dispatches[0].kernel.replace("steel_gemm_", "").replace("steel_", "")
        if len(p.dispatches) > 1:
            kernel += f" x{p.dispatches[0].grid[2]}"
        line = (
            f"{name:26} {kernel:44} {moved / 1e6:9.3f} {minimum / 1e6:8.3f} "
            f"{1e3 * moved / flop:8.3f} {1e3 * minimum / flop:6.3f} {moved / minimum:6.2f}"
        )
        sim_col = "-"
        sim_mma = "-"
        if run_sim and batch * m * n * k <= args.sim_limit:
            ca, cb, cbias = tensors(batch, m, n, k, dtype, "cpu", True, weight_t)
            _, counters = sim.run_op(
                "gemm", [ca, cb, cbias, None], options, counters=True, checkers=False
            )
            got = counted(counters)
            sim_col = f"{total(got) / 1e6:.3f}"
            if got != predicted:
                failures += 1
                sim_col += " MISMATCH"
                print(f"  model {predicted}\n  sim   {got}", file=sys.stderr)
            counted_mma = sum(c["tensor_multiply_adds"] for c in counters) // 512
            sim_mma = str(counted_mma)
            if counted_mma != tensor_mma(p):
                failures += 1
                sim_mma += " MISMATCH"
        line += f" {sim_col:>8}"
        if args.device == "m5":
            line += f" {tensor_mma(p):10d} {sim_mma:>10}"
        if on_mps:
            steel, mm, fused = time_mps(batch, m, n, k, dtype, args.iters, weight_t)
            line += f" {steel:9.3f} {mm:9.3f} {fused:9.3f} {flop / steel / 1e6:8.1f}"
        print(line)
    if failures:
        print(f"{failures} shape(s) where the traffic model and the simulator disagree")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
