"""The simulator's execution half: lanes, barriers, simd rendezvous, exits, divergence errors,
function constants, faults, and the build cache (kernels: tests/sim/kernels/exec_runtime.metal).
"""

from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel import sim
from torch_steel.errors import SimulatorError

KERNELS = Path(__file__).parent / "kernels"
SRC = [KERNELS / "exec_runtime.metal"]
ROOT = Path(__file__).resolve().parents[2]


pytestmark = requires_clang


def run(name, **kw):
    return sim.run_kernel(name, sources=SRC, **kw)


def test_thread_position_attributes():
    grid, threads = (2, 3, 2), (8, 4, 2)
    total = [g * t for g, t in zip(grid, threads, strict=True)]
    out = torch.full((total[0] * total[1] * total[2], 16), -1, dtype=torch.int32)
    run("exec_lane_ids", grid=grid, threads=threads, buffers={0: out})
    for gz in range(total[2]):
        for gy in range(total[1]):
            for gx in range(total[0]):
                row = out[gx + total[0] * (gy + total[1] * gz)].tolist()
                pos = (gx, gy, gz)
                tg = tuple(p // t for p, t in zip(pos, threads, strict=True))
                local = tuple(p % t for p, t in zip(pos, threads, strict=True))
                index = local[0] + threads[0] * (local[1] + threads[1] * local[2])
                expected = [*pos, *tg, *local, *threads, index, index // 32, index % 32, 1]
                assert row == expected, (pos, row, expected)


@pytest.mark.parametrize(
    "threads_grid, threads", [((37, 5, 3), (16, 4, 2)), ((70, 1, 1), (64, 1, 1)), ((5,), (8,))]
)
def test_dispatch_threads_partial_threadgroups(threads_grid, threads):
    # dispatchThreads: ceil(grid / threads) threadgroups, the last one in each dimension holding
    # what is left (Metal: threads_per_threadgroup is that size, dispatch_threads_per_threadgroup
    # the dispatch's, positions step by the dispatch's size, and simdgroups are formed from the
    # partial threadgroup's own linear indices).
    grid3 = (*threads_grid, 1, 1)[:3]
    threads3 = (*threads, 1, 1)[:3]
    groups = tuple(-(-n // t) for n, t in zip(grid3, threads3, strict=True))
    count = grid3[0] * grid3[1] * grid3[2]
    out = torch.full((count, 24), -1, dtype=torch.int32)
    counters = run(
        "exec_grid_ids", threads_grid=threads_grid, threads=threads, buffers={0: out}, counters=True
    )
    assert counters["threadgroups"] == groups[0] * groups[1] * groups[2]
    assert counters["lanes"] == count
    for gz in range(grid3[2]):
        for gy in range(grid3[1]):
            for gx in range(grid3[0]):
                pos = (gx, gy, gz)
                tg = tuple(p // t for p, t in zip(pos, threads3, strict=True))
                local = tuple(p % t for p, t in zip(pos, threads3, strict=True))
                size = tuple(min(t, n - g * t) for t, n, g in zip(threads3, grid3, tg, strict=True))
                index = local[0] + size[0] * (local[1] + size[1] * local[2])
                lanes = size[0] * size[1] * size[2]
                simdgroups = -(-lanes // 32)
                in_simdgroup = min(32, lanes - index // 32 * 32)
                expected = [
                    *pos, *tg, *local, *size, *threads3, *groups, *grid3, index,
                    index // 32 * 1000 + index % 32, simdgroups * 1000 + in_simdgroup,
                ]  # fmt: skip
                row = out[gx + grid3[0] * (gy + grid3[1] * gz)].tolist()
                assert row == expected, (pos, row, expected)


def test_dispatch_threads_refuses_both_grids():
    with pytest.raises(ValueError, match="not both"):
        run("exec_grid_ids", grid=(1,), threads_grid=(5,), threads=(8,), buffers={0: b""})


def test_tree_sum_with_barriers_in_a_loop():
    # Small integers: every partial sum is exact in float32, so the tree order does not matter.
    x = torch.randint(0, 100, (3, 256)).float()
    out = torch.zeros(3)
    run("exec_tree_sum", grid=(3,), threads=(256,), buffers={0: x, 1: out})
    assert torch.equal(out, x.sum(dim=1))


def test_exited_lanes_leave_the_barrier():
    count = 200
    x = torch.arange(256, dtype=torch.float32) + 1
    out = torch.zeros(256)
    run(
        "exec_early_exit",
        grid=(1,),
        threads=(256,),
        buffers={0: x, 1: out, 2: count.to_bytes(4, "little")},
    )
    expected = torch.zeros(256)
    expected[: count - 1] = x[1:count]
    expected[count - 1] = x[count - 1]
    assert torch.equal(out, expected)


def test_simd_reduction_over_the_lanes_that_did_not_exit():
    out = torch.zeros(32)
    run(
        "exec_simd_after_exit",
        grid=(1,),
        threads=(32,),
        buffers={0: out, 1: (20).to_bytes(4, "little")},
    )
    assert torch.equal(out[:20], torch.full((20,), 210.0))
    assert torch.equal(out[20:], torch.zeros(12))


def test_barrier_reached_by_one_simdgroup_only_is_an_error():
    match = r"exec_divergent_barrier.*different threadgroup_barrier"
    with pytest.raises(SimulatorError, match=match):
        run("exec_divergent_barrier", grid=(1,), threads=(64,), buffers={0: torch.zeros(64)})


def test_barrier_and_simd_op_in_one_simdgroup():
    # A reduction in divergent control flow covers the lanes that reach it (MSL); the barrier
    # completes with the lanes that do not exit, as always. (Lanes of one simdgroup at two
    # different barriers, or at a barrier and a simdgroup-matrix operation, stay errors.)
    out = torch.zeros(32)
    run("exec_barrier_vs_simd", grid=(1,), threads=(32,), buffers={0: out})
    assert torch.equal(out, torch.cat([torch.ones(16), torch.full((16,), 16.0)]))


def test_simd_op_in_divergent_branch_covers_the_active_lanes():
    # MSL defines simd reductions over the active lanes: lanes 0-7 sum among themselves (28),
    # then the maximum over all 32 lanes is 31.
    out = torch.zeros(32)
    run("exec_divergent_simd", grid=(1,), threads=(32,), buffers={0: out})
    assert torch.equal(out, torch.full((32,), 31.0))


def test_divergent_reductions_and_partial_simdgroups():
    # 48 threads: a second simdgroup of 16 lanes. In the loop, iteration i has the lanes with
    # lane % 4 > i, 24 - 8 i of a full simdgroup, 12 - 4 i of the half one.
    out = torch.zeros(96)
    run("exec_divergent_reductions", grid=(1,), threads=(48,), buffers={0: out})
    v, w = out[0::2], out[1::2]
    assert torch.equal(v[:32], torch.full((32,), 31.0))
    assert torch.equal(v[32:], torch.full((16,), 28.0))
    lanes = torch.arange(48) % 32
    size = torch.where(torch.arange(48) < 32, 8, 4)  # lanes per residue class mod 4
    expected = torch.zeros(48)
    for i in range(3):
        active = lanes % 4 > i
        expected += torch.where(active, (3 - i) * size, 0).float()
    assert torch.equal(w, expected)


def test_convergent_simd_twin_runs():
    out = torch.zeros(32)
    run("exec_convergent_simd", grid=(1,), threads=(32,), buffers={0: out})
    v = [496.0 if lane < 8 else float(lane) for lane in range(32)]
    expected = torch.tensor([max(v) + v[lane ^ 1] for lane in range(32)])
    assert torch.equal(out, expected)


@pytest.mark.parametrize("threads", [32, 96, 1024])
def test_ring_of_barriers_across_simdgroups(threads):
    rounds = 5
    out = torch.zeros(2, threads)
    counters = run(
        "exec_ring",
        grid=(2,),
        threads=(threads,),
        counters=True,
        buffers={0: out, 1: rounds.to_bytes(4, "little")},
    )
    expected = ((torch.arange(threads) + rounds) % threads).float()
    assert torch.equal(out, expected.expand(2, threads))
    assert counters["barriers"] == 2 * 2 * rounds
    # Per simdgroup and round: one simd_shuffle_down and one simdgroup_barrier.
    assert counters["simd_ops"] == 2 * (threads // 32) * rounds * 2


def test_function_constants():
    out = torch.zeros(64)
    run(
        "exec_constants",
        grid=(2,),
        threads=(32,),
        buffers={0: out},
        constants={0: True, 1: 3, 2: 0.5},
    )
    assert torch.equal(out, -(torch.arange(64) * 3 + 0.5))
    run(
        "exec_constants",
        grid=(2,),
        threads=(32,),
        buffers={0: out},
        constants={0: False, 1: -2, 2: 0.25},
    )
    assert torch.equal(out, torch.arange(64) * -2 + 0.25)


def test_missing_function_constant_is_an_error():
    with pytest.raises(SimulatorError, match=r"exec_constants.*function constant 1"):
        run(
            "exec_constants",
            grid=(1,),
            threads=(32,),
            buffers={0: torch.zeros(32)},
            constants={0: True, 2: 0.5},
        )


def test_large_private_array_fits_on_a_lane_stack():
    idx = torch.randint(0, 1 << 20, (64,), dtype=torch.int32)
    out = torch.zeros(64, dtype=torch.int32)
    run("exec_private_array", grid=(2,), threads=(32,), buffers={0: idx, 1: out})
    assert torch.equal(out, (idx % 2048) * 3 + torch.arange(64, dtype=torch.int32))


def test_unknown_kernel_names_the_known_ones():
    with pytest.raises(SimulatorError, match=r"'exec_nope' not found.*exec_ring"):
        run("exec_nope", grid=(1,), threads=(32,), buffers={})


def test_unbound_buffer_is_an_error():
    with pytest.raises(SimulatorError, match=r"exec_tree_sum.*buffer\(1\)"):
        run("exec_tree_sum", grid=(1,), threads=(32,), buffers={0: torch.zeros(32)})


def test_build_cache_rebuilds_when_the_source_changes(tmp_path):
    src = tmp_path / "exec_cache_probe.metal"
    body = """#include <metal_stdlib>
using namespace metal;
kernel void exec_cache_probe(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = VALUE;
}
"""
    out = torch.zeros(32)
    src.write_text(body.replace("VALUE", "1.0f"))
    sim.run_kernel("exec_cache_probe", sources=[src], grid=(1,), threads=(32,), buffers={0: out})
    assert torch.equal(out, torch.ones(32))
    src.write_text(body.replace("VALUE", "2.0f"))
    sim.run_kernel("exec_cache_probe", sources=[src], grid=(1,), threads=(32,), buffers={0: out})
    assert torch.equal(out, torch.full((32,), 2.0))
    src.write_text(body.replace("VALUE", "1.0f"))  # back to the first version: cached, no build
    sim.run_kernel("exec_cache_probe", sources=[src], grid=(1,), threads=(32,), buffers={0: out})
    assert torch.equal(out, torch.ones(32))


def test_spin_wait_on_another_thread_is_reported_not_a_hang():
    with pytest.raises(SimulatorError, match=r"exec_spin_wait.*thread \(0,0,0\).*spin-waiting"):
        run(
            "exec_spin_wait",
            grid=(1,),
            threads=(32,),
            buffers={0: torch.zeros(32, dtype=torch.int32)},
        )


def test_ctrl_c_interrupts_a_long_launch():
    # In a child process, so that a late SIGINT cannot reach pytest itself.
    import subprocess
    import sys

    script = f"""
import os, signal, struct, threading, time, torch
from torch_steel import sim
src = [{str(KERNELS / "exec_counters.metal")!r}]
out = torch.zeros(64 * 1000)
sim.run_kernel("exec_simd_rounds", sources=src, grid=(1,), threads=(64,),
               buffers={{0: out[:64], 1: struct.pack("<I", 1)}})
threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
t = time.time()
try:
    # One long threadgroup: interrupted at a lane switch, not only between threadgroups.
    sim.run_kernel("exec_simd_rounds", sources=src, grid=(1,), threads=(64,),
                   buffers={{0: out[:64], 1: struct.pack("<I", 5000000)}})
    print("finished")
except KeyboardInterrupt:
    print("interrupted", time.time() - t)
"""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.stdout.startswith("interrupted"), proc.stdout + proc.stderr[-3000:]
    assert float(proc.stdout.split()[1]) < 30


def test_endless_loop_is_reported_not_a_hang(monkeypatch):
    monkeypatch.setenv("TORCH_STEEL_SIM_LANE_TIMEOUT", "2")
    out = torch.zeros(32, dtype=torch.int32)
    run(
        "exec_endless_loop",
        grid=(1,),
        threads=(32,),
        buffers={0: out, 1: (8).to_bytes(4, "little")},
    )
    assert torch.equal(out, torch.full((32,), 8, dtype=torch.int32))
    with pytest.raises(SimulatorError, match=r"exec_endless_loop.*ran for 2 s.*endless loop"):
        run(
            "exec_endless_loop",
            grid=(1,),
            threads=(32,),
            buffers={0: out, 1: (7).to_bytes(4, "little")},
        )


@pytest.mark.parametrize("what", [0, 1], ids=["barrier", "simdgroup_barrier"])
def test_helper_reached_from_two_divergent_call_sites_is_reported(what):
    import struct

    out = torch.zeros(64)
    run(
        "exec_helper_divergent",
        grid=(1,),
        threads=(64,),
        buffers={0: out, 1: struct.pack("<II", what, 64)},
    )
    with pytest.raises(SimulatorError, match=r"exec_helper_divergent.*divergent control flow"):
        split = 16 if what == 1 else 32
        run(
            "exec_helper_divergent",
            grid=(1,),
            threads=(64,),
            buffers={0: torch.zeros(64), 1: struct.pack("<II", what, split)},
        )


def test_max_total_threads_per_threadgroup_is_enforced():
    out = torch.zeros(128)
    run("exec_max_threads", grid=(2,), threads=(64,), buffers={0: out})
    assert torch.equal(out, torch.arange(128.0))
    with pytest.raises(
        SimulatorError, match=r"128 threads per threadgroup exceed its \[\[max_total"
    ):
        run("exec_max_threads", grid=(1,), threads=(128,), buffers={0: out})


def test_function_constant_of_the_wrong_type_is_refused():
    out = torch.zeros(32)
    run(
        "exec_fc_types",
        grid=(1,),
        threads=(32,),
        buffers={0: out},
        constants={10: True, 11: 3, 12: 0.5},
    )
    assert torch.equal(out, torch.full((32,), 2.5))
    for wrong in ({10: 1, 11: 3, 12: 0.5}, {10: True, 11: 3.0, 12: 0.5}, {10: True, 11: 3, 12: 2}):
        with pytest.raises(SimulatorError, match=r"function constant 1[012] is declared .* sets a"):
            run("exec_fc_types", grid=(1,), threads=(32,), buffers={0: out}, constants=wrong)
