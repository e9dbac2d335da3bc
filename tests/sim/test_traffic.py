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
    # A streaming kernel does the same in every threadgroup and wave, so the weighted samples
    # give the full run's counters exactly (the last wave is partial: 50 threadgroups, waves of 4).
    n = 50 * 64
    x = torch.randn(n)
    cache = {"l2_bytes": 4 * KIB, "slc_bytes": 8 * KIB, "resident_threadgroups": 4}
    full = sim.run_kernel("exec_stream", sources=SRC, grid=(50,), threads=(64,),
                          buffers={0: x, 1: torch.zeros(n)}, counters=True,
                          cache=cache)  # fmt: skip
    out = torch.zeros(n)
    sample = {"threadgroups": 8, "waves": 2}
    part = sim.run_kernel("exec_stream", sources=SRC, grid=(50,), threads=(64,),
                          buffers={0: x, 1: out}, counters=True, cache=cache,
                          sample=sample)  # fmt: skip
    info = part.pop("sampled")
    # 10 threadgroups (both ends, 8 strata), 7 waves of 4 but the last of 2 (both ends, 2 strata,
    # each after one warm-up wave).
    assert info == {"extrapolated": True, "waves": 13, "resident_threadgroups": 4,
                    "waves_run": 7, "threadgroups_run": 10 + 26}  # fmt: skip
    assert part == full
    assert 0 < (out == 0).sum() < n  # outputs of the threadgroups run only


def test_sampling_runs_a_short_dispatch_whole():
    x = torch.randn(8 * 64)
    c = sim.run_kernel("exec_stream", sources=SRC, grid=(8,), threads=(64,),
                       buffers={0: x, 1: torch.zeros(8 * 64)}, counters=True,
                       sample={"threadgroups": 6})  # fmt: skip
    assert c["sampled"] == {"extrapolated": False, "threadgroups_run": 8}
    assert c["threadgroups"] == 8
    assert c["buffers"][0]["read"] == 8 * 64 * 4


def test_sample_needs_counters():
    with pytest.raises(ValueError, match="counters=True"):
        sim.run_kernel("exec_stream", sources=SRC, grid=(1,), threads=(64,),
                       buffers={0: torch.zeros(64), 1: torch.zeros(64)}, sample=2)  # fmt: skip


def _numbers(counters, prefix=""):
    """Every numeric counter of a dispatch, nested dicts flattened ("buffers.0.read")."""
    out = {}
    for key, value in counters.items():
        if isinstance(value, dict):
            out.update(_numbers(value, f"{prefix}{key}."))
        elif isinstance(value, int) and not isinstance(value, bool):
            out[prefix + key] = value
    return out


_CACHE = {"dram_read", "dram_written", "l2_hits", "l2_misses", "slc_hits", "slc_misses"}


def _case(name):
    """op, tensors, options, resident threadgroups and sample of a validation case: waves of 1 or
    2 threadgroups so that each dispatch has 16 to 64 waves, and the strata that keep the sampled
    run smaller than the full one."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import bench_attention as ba

    torch.manual_seed(0)
    if name in ("prefill", "causal"):
        q, k, v, _ = ba.inputs(1, 8, 2, 256, 256, 64, 64, None, torch.float16, "cpu")
        opts = ba.run_options(64, {"is_causal": name == "causal"})
        return "sdpa", [q, k, v, None, None], opts, 2, {"threadgroups": 32, "waves": 4}
    if name == "decode":
        tensors, opts, _ = ba.decode_inputs(1, 32, 8, 1, 2048, 128, {}, None, torch.float16, "cpu")
        return "sdpa", tensors, opts, 1, {"threadgroups": 8, "waves": 4}
    a = torch.randn(256, 256, dtype=torch.float16)
    b = torch.randn(256, 512, dtype=torch.float16)
    return "gemm", [a, b, None, None], {}, 2, {"threadgroups": 32, "waves": 4}


def _check_sampling(name):
    op, tensors, opts, resident, sample = _case(name)
    # Caches smaller than the working set (K and V of one KV head are 64 KiB here, the GEMM's
    # operands 384 KiB, decode's K and V 8 MiB).
    cache = {"l2_bytes": 32 * KIB, "slc_bytes": 128 * KIB, "resident_threadgroups": resident}
    _, full = sim.run_op(op, tensors, opts, counters=True, checkers=False, cache=cache)
    outputs, part = sim.run_op(op, tensors, opts, counters=True, checkers=False, cache=cache,
                               sample=sample)  # fmt: skip
    assert outputs is None
    assert len(part) == len(full)
    info = {"sampled.waves", "sampled.resident_threadgroups", "sampled.waves_run",
            "sampled.threadgroups_run"}  # fmt: skip
    for f, p in zip(full, part, strict=True):
        assert p["sampled"]["extrapolated"]
        assert p["sampled"]["threadgroups_run"] < f["threadgroups"]
        exact, estimated = _numbers(f), _numbers(p)
        assert estimated.keys() - info == exact.keys()
        assert estimated["threadgroups"] == exact["threadgroups"]
        assert estimated["lanes"] == exact["lanes"]
        for key, value in exact.items():
            # Measured on these shapes: work and device bytes within 0.4% (threadgroup reads of
            # causal attention, whose work per threadgroup grows with its query block, x; the
            # others exact, decode's split with its short last partition too), DRAM bytes
            # within 17% (a few waves carry the first reads of each K/V head or GEMM panel, and
            # a stratum of waves is represented by one). Strata of linear ids, before the
            # x-major order, were 3.0% off on causal and 8.2% on decode (it missed every short
            # partition). Tolerances: 1% (over twice the first) and 1.5 times the second. The
            # line hit and miss counts follow the work of the few waves measured (causal: off by
            # up to 58%): not checked.
            if key in ("dram_read", "dram_written"):
                assert estimated[key] == pytest.approx(value, rel=0.25, abs=256), key
            elif key not in _CACHE:
                assert estimated[key] == pytest.approx(value, rel=0.01, abs=256), key


@pytest.mark.parametrize("name", ["causal", "gemm"])
def test_sampled_run_matches_the_full_run(name):
    _check_sampling(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["prefill", "decode"])
def test_sampled_run_matches_the_full_run_slow(name):
    _check_sampling(name)


def test_sampled_waves_start_from_empty_caches():
    # 64 threadgroups cycling over 8 chunks of 1 KiB, waves of 1, an L2 of two waves' lines: in
    # the full run every read misses (each chunk comes back 8 waves later). The sampled run
    # measures wave 16 (chunk 0) after warming with wave 15, and ran wave 0 (chunk 0 too) just
    # before: kept, the caches would give wave 16 hits that the 14 waves skipped had evicted.
    x = torch.randn(8 * 256)
    cache = {"l2_bytes": 4 * KIB, "slc_bytes": 0, "resident_threadgroups": 1}
    sample = {"threadgroups": 8, "waves": 2}
    counters = [
        sim.run_kernel(
            "exec_chunk_cycle",
            sources=SRC,
            grid=(64,),
            threads=(256,),
            buffers={0: x, 1: torch.zeros(64 * 256)},
            counters=True,
            cache=cache,
            sample=s,
        )  # fmt: skip
        for s in (None, sample)
    ]
    full, part = counters
    assert full["dram_read"] == 64 * KIB
    assert part["sampled"]["waves_run"] == 7
    assert part["dram_read"] == full["dram_read"]
