"""Simulator speed: simulated simdgroup MMAs per second and lane switches per second.

    python bench/bench_sim.py [--size 512] [--repeat 3]

Workloads: the steel GEMM through torch_steel.sim.run_op("gemm", ...) (f16, size^3; the target
is 512^3 in under 5 s on one core), and the attention-shaped test kernel
tests/sim/kernels/exec_attention.metal (flash-attention forward, head dim 64). Each runs with the
checkers on (the default) and off, with the counters off (the default; the MMA and switch
figures come from one more, untimed run with them) and, with the checkers on, once more with the
counters on (which adds the instruction counters: docs/simulator.md). The first call (the build)
is not timed. This is a benchmark, not a test: it prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import struct
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torch_steel import sim  # noqa: E402

ATTENTION = ROOT / "tests" / "sim" / "kernels" / "exec_attention.metal"


def best_of(repeat: int, fn):
    best, result = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t)
    return best, result


def report(name: str, seconds: float, counters: list[dict], extra: str = "") -> None:
    mma = sum(c["mma"] for c in counters)
    switches = sum(c["lane_switches"] for c in counters)
    simd = sum(c["simd_ops"] for c in counters)
    print(
        f"{name:44s} {seconds:8.3f} s  {mma / seconds / 1e3:9.1f} k MMA/s  "
        f"{switches / seconds / 1e6:7.2f} M switches/s  ({mma} MMAs, {simd} simd ops, "
        f"{switches} switches){extra}"
    )


def bench_gemm(size: int, repeat: int, checkers: bool, counting: bool) -> None:
    a = torch.randn(size, size).half()
    b = torch.randn(size, size).half()
    sim.run_op("gemm", [a[:32, :32], b[:32, :32], None, None], {})  # build, not timed
    seconds, outs = best_of(
        repeat,
        lambda: sim.run_op("gemm", [a, b, None, None], {}, counters=counting, checkers=checkers),
    )
    if counting:
        outs, counters = outs
    else:
        _, counters = sim.run_op("gemm", [a, b, None, None], {}, counters=True, checkers=checkers)
    err = (outs[0].double() - a.double() @ b.double()).abs().max().item()
    kernels = ",".join(sorted({c["kernel"] for c in counters}))
    report(
        f"gemm f16 {size}^3 checkers={'on' if checkers else 'off'}"
        + (" counters=on" if counting else ""),
        seconds,
        counters,
        f"  max|err| {err:.3g}  [{kernels}]",
    )


def bench_attention(queries: int, keys: int, repeat: int, checkers: bool, counting: bool) -> None:
    dim = 64
    q, k, v = (torch.randn(n, dim) for n in (queries, keys, keys))
    o = torch.zeros(queries, dim)

    def run(counters: bool = counting):
        return sim.run_kernel(
            "exec_attention_d64",
            sources=[ATTENTION],
            grid=(queries // 8,),
            threads=(32,),
            counters=counters,
            checkers=checkers,
            buffers={
                0: q,
                1: k,
                2: v,
                3: o,
                4: struct.pack("<I", keys),
                5: struct.pack("<f", dim**-0.5),
            },
        )

    run()  # build, not timed
    seconds, counters = best_of(repeat, run)
    report(
        f"attention d64 {queries}x{keys} checkers={'on' if checkers else 'off'}"
        + (" counters=on" if counting else ""),
        seconds,
        [counters if counting else run(True)],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512, help="GEMM M = N = K")
    parser.add_argument("--queries", type=int, default=512)
    parser.add_argument("--keys", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    args = parser.parse_args()
    if not sim.available():
        sys.exit(f"the simulator is not available ({sim.build.INSTALL_HINT})")
    torch.manual_seed(0)
    for checkers, counting in ((True, False), (False, False), (True, True)):
        bench_gemm(args.size, args.repeat, checkers, counting)
    for checkers, counting in ((True, False), (False, False), (True, True)):
        bench_attention(args.queries, args.keys, args.repeat, checkers, counting)


if __name__ == "__main__":
    main()
