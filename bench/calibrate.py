"""The timing model (torch_steel/sim/timing.py) beside published measurements of other projects'
kernels, each with its source, shape and setup (issue 24, deliverable 6).

    python bench/calibrate.py            # the table (a few minutes: small simulated runs)

What is predicted for a published point is steel's kernel on the same shape and chip, or
PyTorch's own kernel where the point is PyTorch's; the published kernel itself (MLX's,
metal-flash-attention's, mtlattn's) cannot run here. Big shapes are not simulated whole: the
same kernel runs on a small shape and its work counters are scaled (attention: per visited key
tile, with the device bytes and MMAs of the big plan from bench_attention.py's traffic model,
which tests/attn/test_attention_traffic.py checks against the simulator; GEMM: per
multiply-add; decode: per batch entry), and the big plan's grid gives the waves. Each row says
which. `roofline` rows are the chip table's peak alone, for the points whose kernel has no
counterpart here. A row whose prediction is off by more than 25% says so.

The chip table is never adjusted to these points: a figure changes only with a source for it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention  # noqa: E402
import pytorch_mps  # noqa: E402

from torch_steel import sim  # noqa: E402
from torch_steel.sim import timing  # noqa: E402

M5_DEVICE = {"device_apple_family": 10, "device_metal4": True, "device_tensor_ops": True}
WORK = ("mma", "shuffles", "reductions", "ballots", "threadgroup_read", "threadgroup_written",
        "tensor_ops", "tensor_multiply_adds", "barriers", "simd_ops", "threadgroup_loads",
        "threadgroup_stores", "device_loads", "device_stores")  # fmt: skip
NESTED_WORK = ("instructions", "mma_by_dtype")
# Counted once per block (query rows' setup, Q load, O store) as well as per key tile: fitted
# from two small runs rather than scaled per tile.
PER_BLOCK = ("threadgroup_loads", "threadgroup_stores", "device_loads", "device_stores")
# Counted per key fragment a simdgroup multiplies: whole tiles alike, but a tile that crosses the
# causal diagonal or the end of S runs fewer (forward.h, attn_visible_frags), one such tile per
# block. Fitted the same way; the fit of whole counts is an integer, rounded off its float error.
PER_FRAGMENT = ("mma", "simd_ops", "threadgroup_read")
OFF = 0.25


def _scaled(counters: dict, factor: float) -> dict:
    """Work counters times `factor` (nested instruction classes too), the rest kept."""
    out = dict(counters)
    for key in WORK:
        if key in out:
            out[key] = out[key] * factor
    for key in NESTED_WORK:
        if key in out:
            out[key] = {k: v * factor for k, v in out[key].items()}
    return out


def _both(counters, geometry, chip, compulsory, info=None):
    """(prediction with the model's DRAM fallback, prediction with DRAM = the compulsory bytes
    (each tensor read or written once: what a perfect cache leaves))."""
    upper = timing.predict_dispatch(counters, geometry, chip, info)
    c = dict(counters, dram_read=compulsory[0], dram_written=compulsory[1])
    lower = timing.predict_dispatch(c, geometry, chip, info)
    return upper, lower


def _sum(parts):
    """(time, bound of the longest) of (upper, lower) prediction pairs."""
    out = []
    for i in (0, 1):
        ps = [p[i] for p in parts]
        out.append((sum(p["time_s"] for p in ps), max(ps, key=lambda p: p["time_s"])["bound"]))
    return out


def _device(chip):
    return sim.device(M5_DEVICE) if timing.chip(chip)["family"] == "apple10" else _nothing()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def steel_attention_counters(chip, B, H, L, S, D, causal, dtype=torch.float16, small=256):
    """(counters, dispatch, scale factor) of steel's forward on [B, H, L/S, D] without running
    it: the big plan's traffic model (exact MMAs and tensor bytes) and its grid, the work of the
    same kernel run on L = S = `small`, one head, scaled per visited key tile. The instruction
    classes and memory instruction counts, which a block also spends outside its key loop, are
    a * blocks + b * tiles fitted from the runs on `small` and 2 * `small`."""
    opts = bench_attention.run_options(D, {"is_causal": causal})
    es = torch.finfo(dtype).bits // 8
    with _device(chip):
        big_in = bench_attention.inputs(B, H, H, L, S, D, D, None, dtype, "meta")[:3]
        big = sim.plan("sdpa", [*big_in, None, None], opts)
        (d_big,) = big.dispatches
        runs = []  # (counters, blocks, tiles) of the small runs
        for n in (small, 2 * small):
            small_in = bench_attention.inputs(1, 1, 1, n, n, D, D, None, dtype, "cpu")[:3]
            little = sim.plan("sdpa", [*small_in, None, None], opts)
            assert big.ok and little.ok, (big.reason, little.reason)
            (d_small,) = little.dispatches
            assert d_big.kernel == d_small.kernel and d_big.constants == d_small.constants, (
                "the small runs must be the same kernel with the same constants"
            )
            _, (c_n,) = sim.run_op("sdpa", [*small_in, None, None], opts, counters=True,
                                   checkers=False)  # fmt: skip
            runs.append(
                (c_n, math.prod(d_small.grid), bench_attention.model(little, 1, es, 1, es)[2])
            )
    buffers, mma, tiles, _ = bench_attention.model(big, B, es, 1, es)
    (c_small, blocks1, tiles_small), (c_two, blocks2, tiles2) = runs
    factor = tiles * B * H / tiles_small  # the model's tile count is per (batch entry, head)
    c = _scaled(c_small, factor)
    big_blocks, big_tiles, det = (
        math.prod(d_big.grid),
        tiles * B * H,
        blocks1 * tiles2 - blocks2 * tiles_small,
    )

    def fit(x1, x2):
        per_block = (x1 * tiles2 - x2 * tiles_small) / det
        per_tile = (blocks1 * x2 - blocks2 * x1) / det
        return per_block * big_blocks + per_tile * big_tiles

    for key in PER_BLOCK:
        if key in c_small:
            c[key] = fit(c_small[key], c_two[key])
    for key in PER_FRAGMENT:
        if key in c_small:
            c[key] = round(fit(c_small[key], c_two[key]))
    c["mma_by_dtype"] = {
        k: round(fit(v, c_two["mma_by_dtype"][k])) for k, v in c_small["mma_by_dtype"].items()
    }
    c["instructions"] = {
        k: fit(v, c_two["instructions"][k]) for k, v in c_small["instructions"].items()
    }
    c["buffers"] = buffers
    c["threadgroups"] = math.prod(d_big.grid)
    if c.get("tensor_multiply_adds"):
        assert abs(c["tensor_multiply_adds"] - mma * 512) <= 1e-6 * mma * 512 + 512
    else:
        assert abs(c["mma"] - mma) <= 1e-9 * mma + 1, (c["mma"], mma)
    return c, d_big, factor


def steel_attention(chip, B, H, L, S, D, causal, dtype=torch.float16, small=256):
    """Steel's forward predicted from steel_attention_counters."""
    c, d_big, factor = steel_attention_counters(chip, B, H, L, S, D, causal, dtype, small)
    es = torch.finfo(dtype).bits // 8
    compulsory = (B * H * (L + 2 * S) * D * es, B * H * L * (D * es + 4))
    how = f"steel {d_big.kernel}, per-tile counters of L=S={small}, 1 head x {factor:.0f}"
    return _sum([_both(c, d_big, chip, compulsory)]), how


def steel_decode(chip, B, H, S, D, dtype=torch.float16):
    """Steel's decode (one query token) simulated at batch 1, scaled by B per batch entry."""
    opts = bench_attention.run_options(D, {})
    q, k, v = bench_attention.inputs(1, H, H, 1, S, D, D, None, dtype, "cpu")[:3]
    p = sim.plan("sdpa", [q, k, v, None, None], opts)
    _, raw = sim.run_op("sdpa", [q, k, v, None, None], opts, counters=True, checkers=False)
    es = torch.finfo(dtype).bits // 8
    parts = []
    for i, (d, c) in enumerate(zip(p.dispatches, raw)):
        c = _scaled(c, B)
        c["buffers"] = {j: {"read": b["read"] * B, "written": b["written"] * B}
                        for j, b in c["buffers"].items()}  # fmt: skip
        c["threadgroups"] = c["threadgroups"] * B
        # The first dispatch reads q, k, v; the merge (if any) only partials the first wrote.
        compulsory = (B * H * (1 + 2 * S) * D * es, B * H * D * es) if i == 0 else (0, 0)
        parts.append(_both(c, d, chip, compulsory))
    kernels = "+".join(d.kernel for d in p.dispatches)
    return _sum(parts), f"steel {kernels} (B=1 run x {B})"


def steel_gemm(chip, M, N, K, dtype, small=(1024, 1024, 512)):
    """Steel's GEMM: the big plan's grid, the counters of the same kernel on a `small` (m, n, k)
    problem scaled by the ratio of multiply-adds (every threadgroup of an aligned shape does the
    same work per k step; C's bytes, which scale with M N only, are over-counted by K / k)."""
    m, n, k = small
    meta = [torch.empty(M, K, dtype=dtype, device="meta"),
            torch.empty(K, N, dtype=dtype, device="meta"), None, None]  # fmt: skip
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    with _device(chip):
        big, little = sim.plan("gemm", meta, {}), sim.plan("gemm", [a, b, None, None], {})
        kernels = [d.kernel for d in big.dispatches]
        assert kernels == [d.kernel for d in little.dispatches], (kernels, little.dispatches)
        _, raw = sim.run_op("gemm", [a, b, None, None], {}, counters=True, checkers=False)
    factor = M * N * K / (m * n * k)
    es = torch.finfo(dtype).bits // 8
    parts = []
    for d, c in zip(big.dispatches, raw):
        c = _scaled(c, factor)
        c["buffers"] = {i: {"read": x["read"] * factor, "written": x["written"] * factor}
                        for i, x in c["buffers"].items()}  # fmt: skip
        c["threadgroups"] = math.prod(d.grid)
        parts.append(_both(c, d, chip, ((M * K + K * N) * es, M * N * es)))
    how = f"steel {'+'.join(kernels)}, counters of {m}x{n}x{k} x {factor:.0f}"
    return _sum(parts), how


def pytorch_prefill(chip, H, N, D, dtype=torch.float16, small=256):
    """PyTorch's own prefill kernel (bench/pytorch_mps.py) run at N = `small`, one head, its
    counters scaled by (N / small)^2 x H (each threadgroup walks all keys) and its grid by N and
    H."""
    q, k, v = (torch.randn(1, 1, small, D).to(dtype) for _ in range(3))
    _, (rec,) = pytorch_mps.records(q, k, v)
    factor = (N / small) ** 2 * H
    c = _scaled(rec["counters"], factor)
    c["buffers"] = {i: {"read": x["read"] * factor, "written": x["written"] * factor}
                    for i, x in c["buffers"].items()}  # fmt: skip
    grid = (rec["grid"][0] * N // small, H, 1)
    c["threadgroups"] = math.prod(grid)
    geometry = {"grid": grid, "threads": rec["threads"],
                "threadgroup_memory": rec["threadgroup_memory"]}  # fmt: skip
    info = {"registers": None, "register_basis": "PyTorch's kernel: unknown", "mma_dtype": None}
    es = torch.finfo(dtype).bits // 8
    compulsory = (3 * H * N * D * es, H * N * D * es)
    how = f"PyTorch {rec['kernel']}, counters of N={small} x {factor:.0f}"
    return _sum([_both(c, geometry, chip, compulsory, info)]), how


def roofline_matmul(chip, flops, dtype_field):
    c = timing.chip(chip)
    peak = c["gpu_cores"] * c["clock_ghz"] * 1e9 * c[dtype_field]
    how = f"roofline: {dtype_field} x cores x clock = {peak / 1e12:.1f} TF"
    return [(flops / peak, "compute")] * 2, how


RAPID = "Rapid-MLX PR #258 (github.com/raullenchai/Rapid-MLX/pull/258)"
MTLATTN = "mtlattn docs/PERFORMANCE.md (github.com/lastowl/mtlattn @5f9a926)"
MFA = "metal-flash-attention README (github.com/philipturner/metal-flash-attention @8671cdd)"


MLX_3211 = "MLX PR #3211 (github.com/ml-explore/mlx/pull/3211), a maintainer's figures"
MLX_3295 = "MLX PR #3295 (github.com/ml-explore/mlx/pull/3295)"
F16, BF16 = torch.float16, torch.bfloat16


def points():
    """(source, setup, chip, published seconds, published figure, predictor, its arguments)."""
    pts = []
    for n, pct in ((4096, 0.88), (16384, 0.88), (32768, 0.95)):
        flops = 4 * 32 * n * n * 128 / 2  # the PR's causal count
        setup = f"MLX SDPA, causal f16 B1 H32 D128 N={n}"
        pts.append((RAPID, setup, "M3 Ultra", flops / (pct * 17.4e12), f"{pct:.0%} of 17.4 TF",
                    steel_attention, ("M3 Ultra", 1, 32, n, n, 128, True)))  # fmt: skip
    setup = "MLX matmul peak, f16 square (best of 4096^2, 8192^2)"
    pts.append((RAPID, setup, "M3 Ultra", 2 * 4096**3 / 17.4e12, "17.4 TF",
                steel_gemm, ("M3 Ultra", 4096, 4096, 4096, F16)))  # fmt: skip
    n, d = 4096, 64
    setup = f"MFA forward, 1 head, D={d}, N={n} (any N: 'infinite sequence length')"
    pts.append((MFA, setup, "M1 Max", (2 * d + 5) * n * n / 4400e9, "4400 GINSTRS, 83% ALU",
                steel_attention, ("M1 Max", 1, 1, n, n, d, False)))  # fmt: skip
    n, h = 4096, 12
    flops = 4 * n * n * 128 * h
    setup = f"mtlattn forward (matmul2d), f16 H{h} D128 N={n}, one sequence"
    pts.append((MTLATTN, setup, "M5 Pro", flops / 9.5e12, "~9.5 TF",
                steel_attention, ("M5 Pro", 1, h, n, n, 128, False)))  # fmt: skip
    setup = f"native MPS SDPA, f16 H{h} D128 N={n}"
    pts.append((MTLATTN, setup, "M5 Pro", flops / 2.9e12, "~2.9 TF",
                pytorch_prefill, ("M5 Pro", h, n, 128)))  # fmt: skip
    for b, s, ms in ((1, 8192, 0.24), (8, 8192, 1.65)):
        setup = f"mtlattn decode (splitKV), f16 B{b} H12 D128 KV={s}, 1 query"
        pts.append((MTLATTN, setup, "M5 Pro", ms * 1e-3, f"{ms} ms",
                    steel_decode, ("M5 Pro", b, 12, s, 128)))  # fmt: skip
    setup, t = "MLX GEMM (NAX), f16 4096^3 nn", 2 * 4096**3 / 58.196e12
    pts.append((MLX_3211, setup, "M5 Max", t, "58.2 TF",
                steel_gemm, ("M5 Max", 4096, 4096, 4096, F16, (256, 256, 512))))  # fmt: skip
    na = "matmul2d_flop_per_core_cycle"
    pts.append((MLX_3211, setup, "M5 Max", t, "58.2 TF",
                roofline_matmul, ("M5 Max", 2 * 4096**3, na)))  # fmt: skip
    pts.append((MLX_3295, "MLX matmul bf16 1280^3", "M5 Pro", 0.3099e-3, "0.310 ms",
                steel_gemm, ("M5 Pro", 1280, 1280, 1280, BF16, (256, 256, 1280))))  # fmt: skip
    return pts


def main() -> int:
    if not sim.available():
        print("calibrate.py needs the simulator (clang-19)", file=sys.stderr)
        return 1
    rows = []
    for source, setup, chip, published, figure, predict, args in points():
        ((upper, ub), (lower, lb)), how = predict(*args)
        errors = (upper / published - 1, lower / published - 1)
        flag = "  OFF BY MORE THAN 25%" if min(abs(e) for e in errors) > OFF else ""
        rows.append((source, setup, chip, published, figure, upper, ub, lower, lb, errors, how,
                     flag))  # fmt: skip
        print(f"{chip:8} {setup}\n  published {published * 1e3:9.3f} ms ({figure}), {source}\n"
              f"  predicted {upper * 1e3:9.3f} ms ({ub}-bound, device bytes as DRAM), "
              f"{lower * 1e3:.3f} ms ({lb}-bound, compulsory DRAM): "
              f"error {errors[0]:+.0%} / {errors[1]:+.0%}{flag}\n  ({how})",
              flush=True)  # fmt: skip
    print("\n| source | chip | shape and setup | published | predicted: device bytes as DRAM "
          "| predicted: compulsory DRAM | error | predicted from |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---|")
    for source, setup, chip, published, figure, upper, ub, lower, lb, errors, how, flag in rows:
        mark = " **>25%**" if flag else ""
        print(f"| {source} | {chip} | {setup} | {published * 1e3:.3f} ms ({figure}) | "
              f"{upper * 1e3:.3f} ms ({ub}) | {lower * 1e3:.3f} ms ({lb}) | "
              f"{errors[0]:+.0%} / {errors[1]:+.0%}{mark} | {how} |")  # fmt: skip
    off = sum(1 for r in rows if r[-1])
    print(f"\n{off} of {len(rows)} points off by more than 25% (both DRAM figures).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
