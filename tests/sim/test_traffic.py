"""The cache model (mps_src/sim/cache.cpp) and sampled runs (torch_steel/sim/traffic.py).

The oracle of the cache tests is the compulsory traffic counted by hand: kernels without a params
buffer touch only the lines of their two tensors (fresh CPU tensors are 64-byte aligned and the
sizes here are multiples of 256 bytes, so each tensor starts a 128-byte line; the arena keeps a
binding's address modulo 64)."""

from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel import sim

KERNELS = Path(__file__).parent / "kernels"
SRC = [KERNELS / "exec_traffic.metal"]

pytestmark = requires_clang

KIB = 1024


def run(name, grid, threads, buffers, **cache):
    return sim.run_kernel(
        name, sources=SRC, grid=grid, threads=threads, buffers=buffers, counters=True,
        cache=cache,
    )  # fmt: skip


@pytest.mark.parametrize("l2,slc", [(4 * KIB, 8 * KIB), (1024 * KIB, 0), (0, 0)])
def test_streaming_dram_bytes_are_the_compulsory_bytes(l2, slc):
    n = 64 * 256
    x = torch.randn(n)
    out = torch.zeros(n)
    c = run("exec_stream", (64,), (256,), {0: x, 1: out}, l2_bytes=l2, slc_bytes=slc,
            resident_threadgroups=8)  # fmt: skip
    assert torch.equal(out, 2 * x)
    # Whatever the caches, every line of `in` is read from DRAM once and of `out` written once.
    assert c["dram_read"] == n * 4 == c["buffers"][0]["read"]
    assert c["dram_written"] == n * 4 == c["buffers"][1]["written"]
    assert c["l2_hits"] == 0  # no line is touched twice
    assert c["l2_misses"] == 2 * n * 4 // 128


def test_a_small_buffer_read_twice_is_read_from_dram_once():
    n, tgs = 256, 8
    x = torch.randn(n)
    out = torch.zeros(tgs * n)
    c = run("exec_read_twice", (tgs,), (n,), {0: x, 1: out}, l2_bytes=64 * KIB, slc_bytes=0,
            resident_threadgroups=2)  # fmt: skip
    assert torch.equal(out, (x + x.roll(-1)).repeat(tgs))
    assert c["buffers"][0]["read"] == 2 * tgs * n * 4  # the device reads happen
    assert c["dram_read"] == n * 4
    assert c["dram_written"] == tgs * n * 4


# exec_chunk_reuse on 64 threadgroups of 256 threads: 32 chunks of 1 KiB, each read by two
# threadgroups 32 apart in dispatch order; between its two reads a chunk sees the other 31 chunks
# and 32 KiB of output, 62 KiB, against caches of 8 KiB (L2) and 16 KiB (SLC) or 1 MiB each.
WORKING_SET = 32 * KIB


@pytest.mark.parametrize(
    "resident,l2,slc,reads",
    [
        (1, 8 * KIB, 16 * KIB, 2),  # past the cache: read again
        (4, 8 * KIB, 16 * KIB, 2),  # waves of 4: the two readers are still 8 waves apart
        (1, 1024 * KIB, 1024 * KIB, 1),  # fits: the second read hits
        (64, 8 * KIB, 16 * KIB, 1),  # one wave: the two readers interleave and share each line
        (32, 8 * KIB, 16 * KIB, 2),  # adjacent waves: a whole wave of traffic between them
        (32, 0, 128 * KIB, 1),  # ... which the SLC alone holds
    ],
)
def test_reuse_depends_on_the_cache_and_the_waves(resident, l2, slc, reads):
    x = torch.randn(32 * 256)
    out = torch.zeros(64 * 256)
    c = run("exec_chunk_reuse", (64,), (256,), {0: x, 1: out}, l2_bytes=l2, slc_bytes=slc,
            resident_threadgroups=resident)  # fmt: skip
    assert torch.equal(out, x.repeat(2))
    assert c["buffers"][0]["read"] == 2 * WORKING_SET
    assert c["dram_read"] == reads * WORKING_SET
    assert c["dram_written"] == 64 * KIB
    line_reads = 2 * WORKING_SET // 128
    assert c["l2_hits"] + c["slc_hits"] == line_reads - reads * WORKING_SET // 128


def test_counters_without_a_cache_have_no_dram_bytes():
    x = torch.randn(256)
    c = sim.run_kernel("exec_stream", sources=SRC, grid=(1,), threads=(256,),
                       buffers={0: x, 1: torch.zeros(256)}, counters=True)  # fmt: skip
    assert "dram_read" not in c


@pytest.mark.parametrize(
    "cache,message",
    [
        ({"l2_bytes": 1, "slc_bytes": 1}, "resident_threadgroups"),
        ({"l2_bytes": 1, "slc_bytes": 1, "resident_threadgroups": 0}, ">= 1"),
        ({"l2_bytes": 1, "slc_bytes": 1, "resident_threadgroups": 1, "line_bytes": 96}, "power"),
        ({"l2_bytes": -1, "slc_bytes": 1, "resident_threadgroups": 1}, "l2_bytes"),
        ({"l2": 1, "slc_bytes": 1, "resident_threadgroups": 1}, "unknown keys"),
    ],
)
def test_bad_cache_descriptions_are_refused(cache, message):
    x = torch.randn(256)
    with pytest.raises(ValueError, match=message):
        sim.run_kernel("exec_stream", sources=SRC, grid=(1,), threads=(256,),
                       buffers={0: x, 1: torch.zeros(256)}, counters=True, cache=cache)  # fmt: skip


def test_cache_needs_counters():
    with pytest.raises(ValueError, match="counters=True"):
        sim.run_kernel("exec_stream", sources=SRC, grid=(1,), threads=(256,),
                       buffers={0: torch.zeros(256), 1: torch.zeros(256)},
                       cache={"l2_bytes": 1, "slc_bytes": 1,
                              "resident_threadgroups": 1})  # fmt: skip


def test_sampled_streaming_run_extrapolates_every_counter_exactly():
    # A streaming kernel does the same per wave, so the weighted waves give the full run's
    # counters exactly (the last wave is partial: 50 threadgroups in waves of 4).
    n = 50 * 64
    x = torch.randn(n)
    cache = {"l2_bytes": 4 * KIB, "slc_bytes": 8 * KIB, "resident_threadgroups": 4}
    full = sim.run_kernel("exec_stream", sources=SRC, grid=(50,), threads=(64,),
                          buffers={0: x, 1: torch.zeros(n)}, counters=True, cache=cache)  # fmt: skip
    out = torch.zeros(n)
    part = sim.run_kernel("exec_stream", sources=SRC, grid=(50,), threads=(64,),
                          buffers={0: x, 1: out}, counters=True, cache=cache, sample=2)  # fmt: skip
    info = part.pop("sampled")
    assert info == {"extrapolated": True, "waves": 13, "resident_threadgroups": 4,
                    "waves_run": 7, "threadgroups_run": 26}  # fmt: skip
    assert part == full
    assert (out == 0).sum() == (50 - 26) * 64  # only the sampled waves wrote their outputs


def test_sampling_runs_a_short_dispatch_whole():
    x = torch.randn(8 * 64)
    c = sim.run_kernel("exec_stream", sources=SRC, grid=(8,), threads=(64,),
                       buffers={0: x, 1: torch.zeros(8 * 64)}, counters=True,
                       sample={"waves": 2, "resident_threadgroups": 4})  # fmt: skip
    assert c["sampled"] == {"extrapolated": False, "waves": 2, "resident_threadgroups": 4,
                            "waves_run": 2, "threadgroups_run": 8}  # fmt: skip
    assert c["threadgroups"] == 8


def test_sampling_needs_a_wave_size():
    with pytest.raises(ValueError, match="wave size"):
        sim.run_kernel("exec_stream", sources=SRC, grid=(1,), threads=(64,),
                       buffers={0: torch.zeros(64), 1: torch.zeros(64)}, counters=True,
                       sample=2)  # fmt: skip
