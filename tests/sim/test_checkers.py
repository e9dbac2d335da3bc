"""The simulator's checkers: every broken kernel must be caught with the kernel's name, its
correct twin must not be flagged (kernels: tests/sim/kernels/exec_checkers.metal)."""

import shutil
import struct
from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel import sim
from torch_steel.errors import SimulatorError

KERNELS = Path(__file__).parent / "kernels"
SRC = [KERNELS / "exec_checkers.metal"]
ROOT = Path(__file__).resolve().parents[2]


pytestmark = requires_clang


def run(name, **kw):
    return sim.run_kernel(name, sources=SRC, **kw)


def i32(v: int) -> bytes:
    return struct.pack("<i", v)


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def flag(v: bool) -> bytes:
    return struct.pack("<?", v)


# ------------------------------------------------------------------------------ device memory


def test_read_past_the_end_names_kernel_buffer_and_offset():
    x = torch.arange(60, dtype=torch.float32)
    match = (
        r"exec_read_shifted.*threadgroup \(1,0,0\) thread \(28,0,0\).*out-of-bounds device "
        r"read of 4 bytes at byte offset 240 of \[\[buffer\(0\)\]\] \(240 bytes bound\)"
    )
    with pytest.raises(SimulatorError, match=match):
        run(
            "exec_read_shifted",
            grid=(2,),
            threads=(32,),
            buffers={0: x, 1: torch.zeros(64), 2: i32(0)},
        )


def test_read_before_the_start_has_a_negative_offset():
    with pytest.raises(SimulatorError, match=r"byte offset -4 of \[\[buffer\(0\)\]\]"):
        run(
            "exec_read_shifted",
            grid=(1,),
            threads=(32,),
            buffers={0: torch.zeros(32), 1: torch.zeros(32), 2: i32(-1)},
        )


def test_guarded_twin_is_not_flagged():
    x = torch.arange(60, dtype=torch.float32)
    out = torch.zeros(64)
    run(
        "exec_read_guarded",
        grid=(2,),
        threads=(32,),
        buffers={0: x, 1: out, 2: i32(-1), 3: u32(60)},
    )
    expected = torch.cat([torch.zeros(1), x, torch.zeros(3)])
    assert torch.equal(out, expected)


def test_write_past_the_end_is_caught_and_nothing_is_written_back():
    out = torch.full((40,), 7.0)
    with pytest.raises(SimulatorError, match=r"exec_write_shifted.*device write.*buffer\(0\)"):
        run("exec_write_shifted", grid=(2,), threads=(32,), buffers={0: out, 1: i32(0)})
    assert torch.equal(out, torch.full((40,), 7.0))


def test_view_is_bound_from_its_storage_offset_to_its_extent():
    # A view [4, 8) of a 16-element storage: elements outside the view exist in memory but are
    # not bound, as on the GPU where the host binds the view's own buffer range.
    storage = torch.arange(16, dtype=torch.float32)
    view = storage[4:8]
    with pytest.raises(SimulatorError, match=r"byte offset 16 of \[\[buffer\(0\)\]\] \(16 bytes"):
        run(
            "exec_read_shifted",
            grid=(1,),
            threads=(8,),
            buffers={0: view, 1: torch.zeros(8), 2: i32(0)},
        )
    target = torch.zeros(16)
    run("exec_write_shifted", grid=(1,), threads=(4,), buffers={0: target[8:12], 1: i32(0)})
    assert torch.equal(target, torch.tensor([0.0] * 8 + [0.0, 1.0, 2.0, 3.0] + [0.0] * 4))


def test_strided_view_extent():
    # Column 1 of a 4x3 matrix: 4 elements reachable from offset 1, extent 3*3+1 = 10 elements.
    m = torch.arange(12, dtype=torch.float32).view(4, 3)
    col = m[:, 1]
    out = torch.zeros(10)
    run(
        "exec_read_guarded",
        grid=(1,),
        threads=(10,),
        buffers={0: col, 1: out, 2: i32(0), 3: u32(10)},
    )
    assert torch.equal(out, torch.arange(1, 11, dtype=torch.float32))
    with pytest.raises(SimulatorError, match=r"byte offset 40 of \[\[buffer\(0\)\]\] \(40 bytes"):
        run(
            "exec_read_shifted",
            grid=(1,),
            threads=(11,),
            buffers={0: col, 1: torch.zeros(11), 2: i32(0)},
        )


def test_inline_bytes_are_bounded_too():
    params = struct.pack("<4I", 10, 20, 30, 40)
    out = torch.zeros(1, dtype=torch.int32)
    run("exec_read_params", grid=(1,), threads=(1,), buffers={0: params, 1: out, 2: u32(3)})
    assert out.item() == 40
    with pytest.raises(SimulatorError, match=r"exec_read_params.*byte offset 16 of \[\[buffer\(0"):
        run("exec_read_params", grid=(1,), threads=(1,), buffers={0: params, 1: out, 2: u32(4)})


def test_wild_pointer_is_an_error_not_a_crash():
    with pytest.raises(SimulatorError, match=r"exec_wild_pointer.*invalid memory access"):
        run("exec_wild_pointer", grid=(1,), threads=(1,), buffers={0: torch.zeros(4)})


def test_checkers_off_lets_out_of_bounds_reads_through():
    x = torch.arange(60, dtype=torch.float32)
    out = torch.zeros(64)
    run(
        "exec_read_shifted",
        grid=(2,),
        threads=(32,),
        checkers=False,
        buffers={0: x, 1: out, 2: i32(0)},
    )
    assert torch.equal(out[:60], x)


# ------------------------------------------------------------------------- threadgroup memory


@pytest.mark.parametrize("threads", [32, 64])
def test_missing_barrier_is_a_race(threads):
    with pytest.raises(SimulatorError, match=r"exec_neighbour.*data race on threadgroup memory"):
        run(
            "exec_neighbour",
            grid=(1,),
            threads=(threads,),
            buffers={0: torch.zeros(threads), 1: flag(False)},
        )


def test_barrier_twin_is_not_a_race():
    out = torch.zeros(2, 128)
    run("exec_neighbour", grid=(2,), threads=(128,), buffers={0: out, 1: flag(True)})
    assert torch.equal(out, ((torch.arange(128) + 1) % 128).float().expand(2, 128))


def test_simdgroup_barrier_orders_lanes_of_one_simdgroup():
    out = torch.zeros(64)
    run("exec_simd_neighbour", grid=(1,), threads=(64,), buffers={0: out, 1: u32(32)})
    base = torch.arange(64) // 32 * 32
    assert torch.equal(out, (base + (torch.arange(64) + 1 - base) % 32).float())


def test_simdgroup_barrier_does_not_order_other_simdgroups():
    with pytest.raises(SimulatorError, match=r"exec_simd_neighbour.*data race.*simdgroup 1"):
        run(
            "exec_simd_neighbour",
            grid=(1,),
            threads=(64,),
            buffers={0: torch.zeros(64), 1: u32(64)},
        )


def test_write_write_race():
    with pytest.raises(SimulatorError, match=r"exec_all_write.*writes it after thread 0"):
        run(
            "exec_all_write", grid=(1,), threads=(64,), buffers={0: torch.zeros(64), 1: flag(False)}
        )
    out = torch.zeros(64)
    run("exec_all_write", grid=(1,), threads=(64,), buffers={0: out, 1: flag(True)})
    assert torch.equal(out, torch.zeros(64))


def test_read_then_write_race():
    with pytest.raises(SimulatorError, match=r"exec_read_then_write.*data race"):
        run(
            "exec_read_then_write",
            grid=(1,),
            threads=(64,),
            buffers={0: torch.zeros(64), 1: flag(False)},
        )
    out = torch.zeros(64)
    run("exec_read_then_write", grid=(1,), threads=(64,), buffers={0: out, 1: flag(True)})
    assert torch.equal(out, ((torch.arange(64) + 1) % 64).float() * 2)


def test_threadgroup_array_over_32k():
    with pytest.raises(SimulatorError, match=r"exec_too_much_threadgroup.*36000 bytes.*32 KiB"):
        run("exec_too_much_threadgroup", grid=(1,), threads=(32,), buffers={0: torch.zeros(32)})


def test_threadgroup_argument_over_32k():
    with pytest.raises(SimulatorError, match=r"exec_threadgroup_arg.*40000 bytes.*32 KiB"):
        run(
            "exec_threadgroup_arg",
            grid=(1,),
            threads=(32,),
            threadgroup_memory={0: 40000},
            buffers={0: torch.zeros(32), 1: u32(0)},
        )


def test_threadgroup_argument_bounds():
    out = torch.zeros(32)
    run(
        "exec_threadgroup_arg",
        grid=(1,),
        threads=(32,),
        threadgroup_memory={0: 128},
        buffers={0: out, 1: u32(0)},
    )
    assert torch.equal(out, torch.arange(32).float())
    with pytest.raises(
        SimulatorError,
        match=r"exec_threadgroup_arg.*out-of-bounds threadgroup"
        r" write of 4 bytes at byte offset 128",
    ):
        run(
            "exec_threadgroup_arg",
            grid=(1,),
            threads=(32,),
            threadgroup_memory={0: 128},
            buffers={0: out, 1: u32(1)},
        )


# ------------------------------------------------------------------------------------ limits


def test_more_than_1024_threads():
    with pytest.raises(SimulatorError, match=r"exec_plain.*1056 threads per threadgroup"):
        run("exec_plain", grid=(1,), threads=(33, 32), buffers={0: torch.zeros(1056)})


def test_simd_op_in_a_partial_simdgroup_covers_its_lanes():
    # 48 threads: the second simdgroup has 16 lanes, and a reduction covers those (MSL).
    out = torch.zeros(48)
    run("exec_simd_sum", grid=(1,), threads=(48,), buffers={0: out})
    assert torch.equal(out, torch.cat([torch.full((32,), 32.0), torch.full((16,), 16.0)]))
    run("exec_plain", grid=(1,), threads=(48,), buffers={0: out})
    assert torch.equal(out, torch.arange(48).float())


def test_buffer_index_limit():
    with pytest.raises(SimulatorError, match=r"buffer\(31\)\]\]: Metal has 31 buffer slots"):
        run(
            "exec_plain", grid=(1,), threads=(32,), buffers={0: torch.zeros(32), 31: torch.zeros(1)}
        )


SHIM_PASSES_FLAGS = "threadgroup_barrier_flags" in "".join(
    p.read_text() for p in (ROOT / "mps_src" / "sim" / "shim").rglob("*") if p.is_file()
)


@pytest.mark.skipif(
    not SHIM_PASSES_FLAGS,
    reason="the shim (sim-lang) does not pass mem_flags "
    "to steel_sim::threadgroup_barrier_flags yet",
)
def test_mem_none_barrier_does_not_order_threadgroup_memory():
    # Not across simdgroups, and not within one either: only mem_threadgroup orders memory.
    for wrap in (64, 32):
        with pytest.raises(SimulatorError, match=r"exec_mem_none_neighbour.*data race"):
            run(
                "exec_mem_none_neighbour",
                grid=(1,),
                threads=(64,),
                buffers={0: torch.zeros(64), 1: u32(wrap)},
            )


def test_threadgroups_writing_the_same_bytes_race():
    with pytest.raises(
        SimulatorError,
        match=r"exec_overlapping_tiles.*threadgroup \(1,0,0\).*"
        r"device memory race: writes byte offset 64 of "
        r"\[\[buffer\(0\)\]\], which threadgroup \(0,0,0\)",
    ):
        run(
            "exec_overlapping_tiles",
            grid=(2,),
            threads=(32,),
            buffers={0: torch.zeros(64), 1: u32(16)},
        )
    out = torch.zeros(64)
    run("exec_overlapping_tiles", grid=(2,), threads=(32,), buffers={0: out, 1: u32(32)})
    assert torch.equal(out, torch.arange(64).div(32, rounding_mode="floor").float())


def test_reading_another_threadgroups_output_races():
    with pytest.raises(SimulatorError, match=r"exec_read_other_tile.*device memory race: reads"):
        run("exec_read_other_tile", grid=(2,), threads=(32,), buffers={0: torch.zeros(64)})
    # One threadgroup: ordered, fine.
    data = torch.zeros(64)
    run("exec_read_other_tile", grid=(1,), threads=(32,), buffers={0: data})
    assert torch.equal(data[:32], torch.ones(32))


@pytest.mark.skipif(
    shutil.which("llvm-symbolizer-19") is None and shutil.which("llvm-symbolizer") is None,
    reason="llvm-symbolizer (part of clang-19's LLVM) is not installed",
)
def test_errors_name_the_shader_source_line():
    lines = SRC[0].read_text().splitlines()
    line = 1 + next(i for i, x in enumerate(lines) if "out[gid] = in[int(gid) + shift];" in x)
    with pytest.raises(
        SimulatorError,
        match=rf"\n    at tests/sim/kernels/exec_checkers.metal:"
        rf"{line}:\d+ \(exec_read_shifted",
    ):
        run(
            "exec_read_shifted",
            grid=(2,),
            threads=(32,),
            buffers={0: torch.zeros(60), 1: torch.zeros(64), 2: i32(0)},
        )


def test_threadgroup_memory_length_must_be_a_multiple_of_16():
    with pytest.raises(SimulatorError, match=r"exec_threadgroup_arg.*length 100 is not a multiple"):
        run(
            "exec_threadgroup_arg",
            grid=(1,),
            threads=(32,),
            threadgroup_memory={0: 100},
            buffers={0: torch.zeros(32), 1: u32(0)},
        )


@pytest.mark.parametrize("offset", [0, 4, 8])
def test_vector_loads_keep_the_bindings_alignment(offset):
    # A tensor bound at storage offset 4 or 8 floats is 16-byte aligned on the GPU (MTLBuffer
    # contents, like CPU storage, are at least 64-byte aligned): float4 loads are fine.
    src = torch.arange(64.0)[offset : offset + 16]
    dst = torch.zeros(16)
    run("exec_vector_copy", grid=(1,), threads=(4,), buffers={0: src, 1: dst})
    assert torch.equal(dst, src)


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_misaligned_vector_load_is_an_error(offset):
    # At storage offset 1 to 3 floats the same binding is only 4- or 8-byte aligned on the GPU,
    # where a float4 load may read the wrong bytes; on x86 it would silently work.
    src = torch.arange(64.0)[offset : offset + 16]
    dst = torch.zeros(16)
    with pytest.raises(SimulatorError, match=r"misaligned device read of 16 bytes .*buffer\(0\)"):
        run("exec_vector_copy", grid=(1,), threads=(4,), buffers={0: src, 1: dst})


# ---------------------------------------------------------------------------- function constants


def test_dead_read_through_a_disabled_buffer_does_not_fault():
    out = torch.zeros(64)
    run("exec_fc_dead_read", grid=(2,), threads=(32,), buffers={0: out}, constants={0: False})
    assert torch.equal(out, torch.arange(64.0))
    params = struct.pack("<fi", 2.0, 1)
    run(
        "exec_fc_dead_read",
        grid=(2,),
        threads=(32,),
        buffers={0: out, 1: params},
        constants={0: True},
    )
    assert torch.equal(out, torch.arange(64.0) * 2 + 1)


def test_used_read_through_a_disabled_buffer_is_reported():
    out = torch.zeros(64)
    match = (
        r"exec_fc_used_read.*reads \[\[buffer\(1\)\]\], which a function constant disables.*"
        r"changes the results"
    )
    with pytest.raises(SimulatorError, match=match):
        run("exec_fc_used_read", grid=(2,), threads=(32,), buffers={0: out}, constants={0: False})
    assert torch.equal(out, torch.zeros(64))  # nothing written back


def test_write_through_a_disabled_buffer_is_reported():
    with pytest.raises(SimulatorError, match=r"write of 4 bytes .*\[\[buffer\(1\)\]\], which a"):
        run(
            "exec_fc_write",
            grid=(1,),
            threads=(32,),
            buffers={0: torch.zeros(32)},
            constants={0: False},
        )


def test_unbound_buffer_that_the_kernel_does_not_read_is_fine():
    out = torch.zeros(32)
    run("exec_unbound_unused", grid=(1,), threads=(32,), buffers={0: out})
    assert torch.equal(out, torch.arange(32.0))


def test_read_of_an_unbound_buffer_is_reported():
    match = r"exec_unbound_read.*reads \[\[buffer\(1\)\]\], which the dispatch does not bind"
    with pytest.raises(SimulatorError, match=match):
        run("exec_unbound_read", grid=(1,), threads=(32,), buffers={0: torch.zeros(32)})


# ------------------------------------------------------------------------- memory intrinsics


def test_fill_loop_past_the_end_is_reported_and_counted():
    out = torch.ones(64)
    c = run("exec_fill_loop", grid=(1,), threads=(32,), buffers={0: out, 1: u32(64)}, counters=True)
    assert torch.equal(out, torch.zeros(64))
    assert c["buffers"][0]["written"] == 256
    with pytest.raises(SimulatorError, match=r"out-of-bounds device write of \d+ bytes"):
        run("exec_fill_loop", grid=(1,), threads=(32,), buffers={0: torch.ones(64), 1: u32(65)})


def test_copy_loop_past_the_end_is_reported_and_counted():
    src = torch.arange(64.0)
    out = torch.zeros(64)
    c = run(
        "exec_copy_loop",
        grid=(1,),
        threads=(32,),
        buffers={0: out, 1: src, 2: u32(64)},
        counters=True,
    )
    assert torch.equal(out, src)
    assert c["buffers"][1]["read"] == 256 and c["buffers"][0]["written"] == 256
    with pytest.raises(SimulatorError, match=r"out-of-bounds device (read|write) of \d+ bytes"):
        run(
            "exec_copy_loop",
            grid=(1,),
            threads=(32,),
            buffers={0: torch.zeros(80), 1: src, 2: u32(80)},
        )


def test_struct_copy_past_the_end_is_reported():
    src = torch.arange(32 * 16.0)
    out = torch.zeros(32 * 16)
    c = run("exec_struct_copy", grid=(1,), threads=(32,), buffers={0: out, 1: src}, counters=True)
    assert torch.equal(out, src)
    assert c["buffers"][1]["read"] == 32 * 64
    with pytest.raises(SimulatorError, match=r"out-of-bounds device read of 64 bytes"):
        run("exec_struct_copy", grid=(1,), threads=(32,), buffers={0: out, 1: src[: 31 * 16]})


def test_struct_copy_into_threadgroup_memory_races():
    src = torch.arange(32 * 16.0)
    with pytest.raises(SimulatorError, match=r"data race on threadgroup memory"):
        run(
            "exec_struct_copy_race",
            grid=(1,),
            threads=(32,),
            buffers={0: torch.zeros(32 * 16), 1: src},
        )


# ------------------------------------------------------------------------- memory ordering


@pytest.mark.parametrize("stride", [63, 1])
def test_device_memory_inside_a_threadgroup_needs_a_mem_device_barrier(stride):
    for kind in (0, 2):
        with pytest.raises(
            SimulatorError, match=r"data race on device memory.*\[\[buffer\(0\)\]\]"
        ):
            run(
                "exec_device_neighbour",
                grid=(1,),
                threads=(64,),
                buffers={0: torch.zeros(64), 1: torch.zeros(64), 2: u32(kind), 3: u32(stride)},
            )
    out = torch.zeros(64)
    run(
        "exec_device_neighbour",
        grid=(1,),
        threads=(64,),
        buffers={0: torch.zeros(64), 1: out, 2: u32(1), 3: u32(stride)},
    )
    assert torch.equal(out, ((torch.arange(64) + stride) % 64).float())


@pytest.mark.parametrize("stride", [63, 1])
def test_device_write_after_another_threads_read_needs_a_mem_device_barrier(stride):
    # The read is of bytes nothing wrote yet, which the checker records only once the buffer is
    # seen to be written too (the dispatch then starts over): the race must still be found, and
    # the ordered twin must give its results and the counters of one run.
    for kind in (0, 2):
        with pytest.raises(
            SimulatorError, match=r"data race on device memory.*\[\[buffer\(0\)\]\]"
        ):
            run(
                "exec_device_read_then_write",
                grid=(1,),
                threads=(64,),
                buffers={0: torch.zeros(64), 1: torch.zeros(64), 2: u32(kind), 3: u32(stride)},
            )
    data = torch.full((64,), -1.0)
    out = torch.zeros(64)
    counters = run(
        "exec_device_read_then_write",
        grid=(1,),
        threads=(64,),
        counters=True,
        buffers={0: data, 1: out, 2: u32(1), 3: u32(stride)},
    )
    assert torch.equal(data, torch.arange(64).float())
    assert torch.equal(out, torch.full((64,), -1.0))
    assert counters["threadgroups"] == 1
    assert counters["lanes"] == 64
    assert counters["buffers"][0] == {"read": 64 * 4, "written": 64 * 4}


def test_only_barriers_with_mem_threadgroup_order_a_simdgroup():
    for kind in (0, 1):
        with pytest.raises(SimulatorError, match=r"exec_simd_op_neighbour.*data race"):
            run(
                "exec_simd_op_neighbour",
                grid=(1,),
                threads=(32,),
                buffers={0: torch.zeros(32), 1: u32(kind)},
            )
    out = torch.zeros(32)
    run("exec_simd_op_neighbour", grid=(1,), threads=(32,), buffers={0: out, 1: u32(2)})
    assert torch.equal(out, ((torch.arange(32) + 1) % 32).float())


def test_index_past_a_threadgroup_array_into_the_next_is_reported():
    out = torch.zeros(33)
    run("exec_tg_overflow", grid=(1,), threads=(32,), buffers={0: out, 1: u32(31)})
    assert out[0] == 1 and torch.equal(out[1:], torch.full((32,), 2.0))
    match = r"out-of-bounds threadgroup read of 4 bytes at byte offset 160 of a threadgroup array"
    with pytest.raises(SimulatorError, match=match):
        run("exec_tg_overflow", grid=(1,), threads=(32,), buffers={0: out, 1: u32(40)})


def test_index_past_a_threadgroup_argument_into_the_next_is_reported():
    out = torch.zeros(33)
    tg = {0: 128, 1: 128}
    run(
        "exec_tg_arg_overflow",
        grid=(1,),
        threads=(32,),
        buffers={0: out, 1: u32(31)},
        threadgroup_memory=tg,
    )
    match = (
        r"out-of-bounds threadgroup read .* offset 160 of \[\[threadgroup\(0\)\]\] \(128 bytes\)"
    )
    with pytest.raises(SimulatorError, match=match):
        run(
            "exec_tg_arg_overflow",
            grid=(1,),
            threads=(32,),
            buffers={0: out, 1: u32(40)},
            threadgroup_memory=tg,
        )


def test_scalar_loop_on_a_4_byte_aligned_view_is_not_misaligned():
    src = torch.arange(101.0)
    out = torch.zeros(101)
    run(
        "exec_scalar_loop",
        grid=(1,),
        threads=(32,),
        buffers={0: out[1:], 1: src[1:], 2: u32(100)},
    )
    assert torch.equal(out[1:], src[1:] * 2 + 1)


def test_thread_private_array_out_of_bounds_is_reported():
    out = torch.zeros(32)
    run("exec_private_array", grid=(1,), threads=(32,), buffers={0: out, 1: u32(7)})
    assert torch.equal(out, torch.arange(32.0) * 7)
    with pytest.raises(SimulatorError, match=r"exec_private_array.*index 8 out of bounds"):
        run("exec_private_array", grid=(1,), threads=(32,), buffers={0: out, 1: u32(8)})


def test_reads_before_a_shuffle_are_ordered_before_the_lanes_later_writes():
    # A row maximum in threadgroup memory read by every lane, combined through simd_shuffle_xor
    # and written by lane 0: the write depends on each read through the shuffles, so no GPU runs
    # it first (kernel exec_running_max, two simdgroups).
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    out = torch.zeros(64)
    run("exec_running_max", grid=(1,), threads=(64,), buffers={0: out, 1: x, 2: u32(0)})
    # max is exact in float32: equality.
    assert torch.equal(out, x.view(2, 32).amax(1).repeat_interleave(32))
    # One reader that took part in a shuffle of lanes 0-15 with the writer.
    run("exec_running_max", grid=(1,), threads=(64,), buffers={0: out, 1: x, 2: u32(4)})
    assert torch.equal(out, x.view(2, 32)[:, :16].amax(1).repeat_interleave(32))


@pytest.mark.parametrize(
    "mode, match",
    [
        # Write, shuffle, read by another lane: a collective does not make a write visible.
        (1, r"thread \d+ \(simdgroup 0\) reads it after thread 0 \(simdgroup 0\) wrote it"),
        # Two lanes writing after the shuffle.
        (2, r"thread 1 \(simdgroup 0\) writes it after thread 0 \(simdgroup 0\) wrote it"),
        # Lanes 16-31 read, then took part in no collective with the writer.
        (3, r"thread 0 \(simdgroup 0\) writes it after another thread read it"),
    ],
)
def test_a_shuffle_does_not_order_writes_or_lanes_outside_it(mode, match):
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(
        SimulatorError, match=r"exec_running_max.*data race on threadgroup.*" + match
    ):
        run(
            "exec_running_max",
            grid=(1,),
            threads=(64,),
            buffers={0: torch.zeros(64), 1: x, 2: u32(mode)},
        )
