"""The decode launch plan (attn::add_decode in mps_src/plan/decode_plan.cpp, reached from the
"sdpa" and "sdpa_varlen" planners) through torch_steel.sim.plan: when decode serves, GQA packing,
the partition count (one pass vs split-K) from S, the (batch, KV head) threadgroups and the core
count, the partials' scratch, the paged cache's bindings and params, and each refusal."""

from __future__ import annotations

import math
import struct
import sys
from pathlib import Path

import pytest
import torch

from torch_steel import sim
from torch_steel.sim import timing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gemm"))
from gemm_helpers import requires_planner, simulator_ready  # noqa: E402

pytestmark = requires_planner

SPLIT, PAGED, VARLEN = 322, 323, 316
FC_DECODE_ROWS, FC_DECODE_SIMDGROUPS = 340, 341
BUF_PARAMS, BUF_CU_Q, BUF_CU_K, BUF_TABLE, BUF_SEQUSED, BUF_PART_O, BUF_PART_ML = (
    7, 8, 9, 10, 11, 12, 13)  # fmt: skip
DECODE_PARAMS_SIZE = 368


def t(*shape, dtype=torch.float16):
    return torch.empty(*shape, dtype=dtype)


def dense(B, Hq, Hkv, L, S, E=64, **options):
    return sim.plan("sdpa", [t(B, Hq, L, E), t(B, Hkv, S, E), t(B, Hkv, S, E), None, None],
                    {"scale": 0.125, **options})  # fmt: skip


def decode_params(dispatch):
    raw = next(b.bytes for b in dispatch.bindings if b.index == BUF_PARAMS)
    assert len(raw) == DECODE_PARAMS_SIZE
    names = ["splits", "split_keys", "heads_per_tg", "rows", "page_size", "pages", "max_pages",
             "table_stride", "row_block"]  # fmt: skip
    out = dict(zip(names, struct.unpack_from("9i", raw, 312), strict=True))
    out["k_ps"], out["v_ps"] = struct.unpack_from("2q", raw, 352)
    return out


def bound(dispatch):
    return {b.index: b.slot for b in dispatch.bindings if b.kind == "tensor"}


@pytest.mark.parametrize("L", [1, 5, 8])
def test_up_to_eight_rows_take_the_decode_kernel(L):
    p = dense(1, 4, 4, L, 100)  # MHA: L packed rows, at most 8: the vector kernel's
    assert p.ok, p.reason
    assert [d.kernel for d in p.dispatches] == ["steel_attention_decode_vector_f16_e64_v64"]
    # 4 threadgroups on 10 cores, 4 tiles each: one pass in a wider block (decode_simdgroups,
    # with each block's fixed work counted): 8 simdgroups at 1 and 5 rows, 16 at 8 (the timing
    # model on M5, 4 / 8 / 16 simdgroups: 1 row 11.50 / 11.17 / 11.82 us, 5 rows 13.32 / 12.47 /
    # 12.80)
    width = 16 if L == 8 else 8
    assert p.dispatches[0].threads == (32 * width, 1, 1)
    assert p.dispatches[0].constants[FC_DECODE_SIMDGROUPS] == width
    four = dense(1, 4, 4, L, 100, decode_simdgroups=4).dispatches[0]
    assert four.threads == (128, 1, 1) and four.constants[FC_DECODE_SIMDGROUPS] == 4
    # A pipeline capped below 256 threads (the Metal host plans again under max_threads): 4.
    for options in ({"max_threads": 255}, {"max_threads": 255, "decode_simdgroups": 8}):
        capped = dense(1, 4, 4, L, 100, **options).dispatches[0]
        assert capped.threads == (128, 1, 1) and capped.constants[FC_DECODE_SIMDGROUPS] == 4
    assert dense(1, 4, 4, L, 100, max_threads=511, decode_simdgroups=16).dispatches[0].threads == (
        128, 1, 1)  # fmt: skip


@pytest.mark.parametrize(
    "L,options", [(9, {}), (1, {"dropout_p": 0.1}), (1, {"decode": False})],
)  # fmt: skip
def test_prefill_otherwise(L, options):
    p = dense(1, 4, 4, L, 100, **options)
    assert p.ok and [d.kernel for d in p.dispatches] == ["steel_attention_f16_e64_v64"]


@pytest.mark.parametrize(
    "group,L,per_tg",
    [(1, 1, 1), (4, 1, 4), (8, 4, 8), (8, 5, 4), (8, 8, 4), (6, 6, 3), (32, 1, 32)],
)
def test_gqa_packing(group, L, per_tg):
    """The query heads of a KV head share a threadgroup: at most the largest divisor of the
    group whose rows fit 32 (option decode_heads_per_tg caps it; 64 here: no cap); the grid's y
    covers the KV heads times the threadgroups a group needs."""
    p = dense(1, 2 * group, 2, L, 64, num_splits=1, decode_heads_per_tg=64)
    d = p.dispatches[0]
    assert decode_params(d)["heads_per_tg"] == per_tg
    assert d.grid == (1, 2 * group // per_tg, 1)
    # The MMA kernel (beyond 8 packed rows) keeps the full packing unless the option caps it.
    if group * min(L, 32) > 8:
        assert decode_params(dense(1, 2 * group, 2, L, 64, num_splits=1).dispatches[0])[
            "heads_per_tg"] == per_tg  # fmt: skip


@pytest.mark.parametrize(
    "group,L,option,per_tg",
    [(8, 1, 1, 1), (8, 1, 2, 2), (8, 1, 3, 2), (8, 1, 8, 8), (8, 1, 9, 8), (6, 1, 5, 3),
     (4, 2, 2, 2), (4, 8, 2, 2), (8, 5, 8, 4)],
)  # fmt: skip
def test_heads_per_tg_option(group, L, option, per_tg):
    """decode_heads_per_tg = n: the largest divisor of the group at most n whose rows fit the
    threadgroup (the vector kernel's function constant, its packed rows, follows)."""
    d = dense(1, 2 * group, 2, L, 300, decode_heads_per_tg=option).dispatches[0]
    dp = decode_params(d)
    assert dp["heads_per_tg"] == per_tg and d.grid[1] == 2 * group // per_tg
    if d.kernel.startswith("steel_attention_decode_vector_"):
        assert d.constants[FC_DECODE_ROWS] == per_tg * L


@pytest.mark.parametrize(
    "B,Hkv,S,options,splits,split_keys",
    [
        # d64 f16: 6 decode threadgroups resident per core, waves of 60 on the default 10 cores.
        (1, 1, 4096, {}, 16, 256),  # 1 threadgroup: S / 256 bounds it
        (1, 1, 100_000, {}, 32, 3136),  # capped at 32 partitions (the merge's lanes)
        # The wave rule, on the staged tiles (direct reads weigh one pass against it, below).
        (1, 2, 4096, {"gpu_cores": 2, "decode_direct": 0}, 6, 704),  # 2 pairs x 6: a wave of 12
        (4, 8, 4096, {"decode_direct": 0}, 13, 320),  # 32 pairs x 13 = 416 of 7 waves (420)
        # 64 pairs just over a wave of 60: one pass is 2 waves of 4096 keys (+ 2 tiles each,
        # 8320); 8 x 512 keys run 9 waves (9 x 576 + 32 for the merge = 5216): split.
        (8, 8, 4096, {"decode_direct": 0}, 8, 512),
        # Direct reads: one pass where its layout costs no more (decode_split), here at the
        # DRAM floor either way, without the merge (the timing model on M5: 448.7 us against
        # 460.7 split 8 ways; B4 H8: 229.4 against 241.0 split 13 ways).
        (8, 8, 4096, {}, 1, 4096),
        (4, 8, 4096, {}, 1, 4096),
        (6, 10, 4096, {}, 1, 4096),  # 60 pairs: exactly one wave
        (1, 1, 256, {}, 1, 256),  # too short to split
        (1, 1, 4096, {"num_splits": 1}, 1, 4096),  # forced one pass (batch invariance)
        (1, 1, 4096, {"num_splits": 7}, 7, 608),  # forced count, keys rounded to the tile
        (1, 1, 40, {"num_splits": 7}, 2, 32),  # no more partitions than key tiles
        (1, 1, 0, {}, 1, 32),  # no keys: one pass, zeros (or the sink)
    ],
)  # fmt: skip
def test_partitions(B, Hkv, S, options, splits, split_keys):
    p = dense(B, Hkv, Hkv, 1, S, **options)
    assert p.ok, p.reason
    dp = decode_params(p.dispatches[0])
    assert (dp["splits"], dp["split_keys"]) == (splits, split_keys)
    assert p.dispatches[0].grid == (splits, Hkv, B)
    assert p.dispatches[0].constants[SPLIT] == (splits > 1)
    kernels = [d.kernel for d in p.dispatches]
    if splits == 1:  # MHA: one packed row, the vector kernel's (decode_plan.cpp decode_vector)
        assert kernels == ["steel_attention_decode_vector_f16_e64_v64"]
        assert [a.name for a in p.allocations] == ["out", "lse"]
        assert BUF_PART_O not in bound(p.dispatches[0])
    else:
        assert kernels == [
            "steel_attention_decode_vector_f16_e64_v64", "steel_attention_decode_merge_f16"
        ]  # fmt: skip
        # Partials of O(B * Hq * L * splits * Ev) floats, scratch (not outputs), after out, lse.
        scratch = [(a.name, a.sizes, a.dtype, a.is_output) for a in p.allocations[2:]]
        rows = B * Hkv * splits
        assert scratch == [("partial_out", (rows, 64), torch.float32, False),
                           ("partial_max_sum", (rows, 2), torch.float32, False)]  # fmt: skip
        first = p.inputs + 2
        for d in p.dispatches:
            assert bound(d)[BUF_PART_O] == first and bound(d)[BUF_PART_ML] == first + 1
        merge = p.dispatches[1]
        assert merge.grid == (1, Hkv, B) and merge.threads == (32, 1, 1)


@pytest.mark.parametrize(
    "options,splits,split_keys",
    [
        # d128 f16: 8 threadgroups (one per KV head, its 4 query heads packed), 3 resident per
        # core (threadgroup memory: 61440 / 17408 bytes), at most 4096 / 256 = 16 partitions,
        # keys per partition rounded up to the 32-key tile; cost = waves x keys a partition.
        ({"gpu_cores": 8}, 3, 1376),  # M1: 24 = one wave of 24 (6: 2 x 704 = 1408)
        ({"gpu_cores": 10}, 11, 384),  # M2, M3, M4, M5: 88 of 3 waves of 30, 3 x 384 = 1152
        ({"gpu_cores": 20}, 15, 288),  # M4 Pro: 120 = 2 waves of 60, 576 (7: 1 x 608)
        ({"gpu_cores": 40}, 15, 288),  # M4 Max: 120 = one wave of 120 (16: 2 waves)
        ({}, 11, 384),  # no core count described: kDecodeDefaultCores (10)
        ({"gpu_cores": 0}, 11, 384),  # 0: unknown, as absent
    ],
)  # fmt: skip
def test_partitions_follow_the_core_count(options, splits, split_keys):
    """The split fills whole waves of the described GPU (device.h gpu_cores, which the Metal
    host reads from the IORegistry), not one Mac's. (The full packing and staged tiles forced:
    on 8 cores the planner takes 2 heads a threadgroup, test_packing_is_the_cheapest_layout, and
    with direct reads wider one-pass blocks, test_split_fills_the_timing_models_waves.)"""
    dp = decode_params(dense(1, 32, 8, 1, 4096, E=128, decode_heads_per_tg=4, decode_direct=0,
                             **options).dispatches[0])  # fmt: skip
    assert (dp["splits"], dp["split_keys"]) == (splits, split_keys)


def cdiv(a, b):
    return -(-a // b)


EFFICIENCY = [(0, 0), (4, 364), (8, 625), (24, 1000)]  # decode_plan.cpp, in thousandths
KEY_SET_WORK, MERGE_CYCLES = 40, 14000  # attention_plan.h kDecodeKeySetWork, ...MergeCycles
DIRECT_KEY_SET_WORK = 5  # attention_plan.h kDecodeDirectKeySetWork
FC_DECODE_DIRECT = 342  # params.h STEEL_ATTN_FC_DECODE_DIRECT


def efficiency(simdgroups):
    """chips.json's alu_occupancy_efficiency in thousandths, as decode_plan.cpp truncates it."""
    for (x0, y0), (x1, y1) in zip(EFFICIENCY, EFFICIENCY[1:]):
        if simdgroups <= x1:
            return y0 + (y1 - y0) * (simdgroups - x0) // (x1 - x0)
    return EFFICIENCY[-1][1]


def model_time(threadgroups, simdgroups, resident, cores, work):
    """timing.py's per-core time in keys x 1000: waves of cores x resident, a short last one."""
    full, rest = divmod(threadgroups, cores * resident)
    t = full * resident * work * 1_000_000 // efficiency(resident * simdgroups)
    if rest:
        last = cdiv(rest, cores)
        t += last * work * 1_000_000 // efficiency(last * simdgroups)
    return t


ROW_WORK, DIRECT_ROW_WORK = 200, 370  # attention_plan.h kDecodeRowWork, kDecodeDirectRowWork
PARAM_BYTES, DIRECT_PARAM_BYTES, DRAM_BYTES = 16, 125, 8  # kDecodeParamBytes, ...
SIMDGROUP_CYCLES, FIXED_ROW_WORK = 70, 250  # kDecodeDirectSimdgroupCycles, ...FixedRowWork
# decode_plan.cpp decode_key_cycles: (element size, direct reads) -> tenths at de + dv = 128,
# 256, 512
KEY_CYCLES = {
    (2, False): (113, 163, 294), (2, True): (59, 79, 129),
    (4, False): (133, 227, 374), (4, True): (49, 63, 88),
}  # fmt: skip


def key_cycles(de, dv, elem, direct):
    """The one-row 4-simdgroup vector block's fp-pipe cycles a key in tenths, restated."""
    y, x = KEY_CYCLES[4 if elem == 4 else 2, bool(direct)], de + dv
    if x <= 128:
        return y[0]
    if x <= 256:
        return y[0] + (y[1] - y[0]) * (x - 128) // 128
    if x <= 512:
        return y[1] + (y[2] - y[1]) * (x - 256) // 256
    return y[2] * x // 512


def row_factor(direct, packed):
    """A key's work for the packed rows, per mille of a one-row block's."""
    return 1000 + (DIRECT_ROW_WORK if direct else ROW_WORK) * (packed - 1)


def fixed_keys(E, elem, direct, packed, w):
    """decode_fixed_keys restated: a direct-read block's fixed work in keys."""
    if not direct:
        return 0
    cycles = SIMDGROUP_CYCLES * 10 * w * (1000 + FIXED_ROW_WORK * (packed - 1)) // 1000
    return cycles // key_cycles(E, E, elem, True)


def merge_time(E, elem, direct):
    """decode_merge_time restated: the merge dispatch's overhead in keys x 1000."""
    return MERGE_CYCLES * 10 * 1000 // key_cycles(E, E, elem, direct)


def cache_time(E, elem, direct, threadgroups, w, resident, cores, keys):
    """decode_cache_time restated: the L2 path of the most threadgroups a core runs."""
    slots = cores * resident
    per_core = threadgroups // slots * resident + cdiv(threadgroups % slots, cores)
    params = DIRECT_PARAM_BYTES * 32 * w if direct else PARAM_BYTES * w * keys
    return (
        per_core * (keys * 2 * E * elem + params) * 10000 // (32 * key_cycles(E, E, elem, direct))
    )


def wide_choice(threadgroups, keys, bk, cores, resident, splits, sets, direct, E, elem, packed):
    """decode_simdgroups restated: (simdgroups, splits). resident(w): threadgroups of w
    simdgroups a core (timing.py's occupancy). Below one wave of 4-simdgroup blocks, the
    whole-wave split (plus the merge's overhead) against one pass in 8 or 16 simdgroups, whose
    work is 1 + KEY_SET_WORK (DIRECT_KEY_SET_WORK with direct reads) / 1000 x its (w - 4) / sets
    added key sets times a 4-simdgroup block's, with the packed rows' factor and the block's
    fixed work, or the L2 path's time where longer; the cheapest, the split on a tie."""
    keys = max(keys, 1)
    if threadgroups >= cores * resident(4):
        return 4, splits
    per = cdiv(cdiv(keys, splits), bk) * bk
    parts = cdiv(keys, per)
    rows = row_factor(direct, packed)
    res4 = max(1, resident(4))
    best = max(
        model_time(threadgroups * parts, 4, res4, cores,
                   per * rows // 1000 + fixed_keys(E, elem, direct, packed, 4)),
        cache_time(E, elem, direct, threadgroups * parts, 4, res4, cores, per),
    )  # fmt: skip
    best += merge_time(E, elem, direct) if parts > 1 else 0
    choice = (4, splits)
    whole = cdiv(keys, bk) * bk
    for w in (8, 16):
        key_set_work = DIRECT_KEY_SET_WORK if direct else KEY_SET_WORK
        work = whole * rows // 1000 * (1000 + key_set_work * (w - 4) // sets) // 1000
        work += fixed_keys(E, elem, direct, packed, w)
        if resident(w) < 1 or w // sets > bk or threadgroups > cores * resident(w):
            continue
        t = max(
            model_time(threadgroups, w, resident(w), cores, work),
            cache_time(E, elem, direct, threadgroups, w, resident(w), cores, whole),
        )
        if t < best:
            best, choice = t, (w, 1)
    return choice


def whole_wave_splits(threadgroups, keys, bk, wave):
    """The rule, restated: of 1 .. min(32, keys / 256, keys / bk) partitions (rounded to the key
    tile), the fewest waves x keys a partition below one wave; from one wave, the least
    waves x (keys a partition + two tiles of prologue and epilogue), plus one tile for the
    merge when split; the fewest partitions on a tie."""
    best = None
    for m in range(1, min(32, cdiv(keys, 256), cdiv(keys, bk)) + 1):
        per = cdiv(cdiv(keys, m), bk) * bk
        parts = cdiv(keys, per)
        waves = cdiv(threadgroups * parts, wave)
        if threadgroups < wave:
            cost = waves * per
        else:
            cost = waves * (per + 2 * bk) + (bk if parts > 1 else 0)
        if best is None or cost < best[0]:
            best = (cost, parts)
    return best[1]


@pytest.mark.parametrize("chip", ["M1", "M2", "M4 Pro", "M4 Max", "M5", "M3 Ultra"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("E", [64, 128, 256])
@pytest.mark.parametrize("B,Hq,Hkv,S", [(1, 32, 8, 4096), (1, 8, 8, 1000), (2, 4, 1, 30_000)])
@pytest.mark.parametrize("vector", [0, 1])
def test_split_fills_the_timing_models_waves(chip, dtype, E, B, Hq, Hkv, S, vector):
    """The plan's residency (decode_plan.cpp decode_resident: threads, params.h's threadgroup
    memory, the register estimate of the MMA or the vector kernel) is the timing model's
    (timing.resident_threadgroups on the planned dispatch, its steel_kernel_info estimate and
    chips.json's per-core limits): the split it picks is the whole-wave rule's at the model's
    wave, so the two cannot drift apart."""
    cores = timing.chip(chip)["gpu_cores"]
    p = sim.plan("sdpa", [t(B, Hq, 1, E, dtype=dtype), t(B, Hkv, S, E, dtype=dtype),
                          t(B, Hkv, S, E, dtype=dtype), None, None],
                 {"scale": 0.125, "decode_vector": vector, **host_description(chip)})  # fmt: skip
    d = p.dispatches[0]
    assert d.kernel.startswith("steel_attention_decode_vector_") == bool(vector), d.kernel
    threadgroups = B * Hkv * (Hq // Hkv // decode_params(d)["heads_per_tg"])
    bk = timing._attn_bk(E, E, dtype.itemsize)  # params.h's key tile, as the model states it
    width = d.constants.get(FC_DECODE_SIMDGROUPS, 4)
    assert d.threads == (32 * width, 1, 1)

    info = timing.steel_kernel_info(d.kernel, d.constants)
    record = timing.chip(chip)

    def resident(w):  # the model's threadgroups a core at w simdgroups (0: one does not fit)
        limits, limiter, _ = timing._occupancy(record, w, info["threadgroup_memory"],
                                               info["registers"])  # fmt: skip
        return limits[limiter]

    assert timing.resident_threadgroups(d, chip) == cores * max(1, resident(width))

    splits = whole_wave_splits(threadgroups, S, bk, cores * max(1, resident(4)))
    if vector:
        elem, dp = dtype.itemsize, decode_params(d)
        packed = d.constants[FC_DECODE_ROWS]
        sets = timing._decode_vector_row_sets(E, E, elem, packed)
        direct = d.constants[FC_DECODE_DIRECT]
        w, splits = wide_choice(
            threadgroups, S, bk, cores, resident, splits, sets, direct, E, elem, packed
        )
        if splits > 1 and direct and dp["heads_per_tg"] == Hq // Hkv:  # the full packing
            # decode_split: one pass (its own width) where its layout costs no more.
            one_w, _ = wide_choice(threadgroups, S, bk, cores, resident, 1, sets, direct, E,
                                   elem, packed)  # fmt: skip
            per = cdiv(cdiv(S, splits), bk) * bk
            split_layout = {**dp, "splits": cdiv(S, per), "split_keys": per}
            one_layout = {**dp, "splits": 1, "split_keys": cdiv(S, bk) * bk}
            rate = dram_rate(chip)
            times = [
                restated_time(
                    B, Hq, Hkv, 1, S, E, elem, cores, layout, lw, max(1, resident(lw)), direct, rate
                )  # fmt: skip
                for layout, lw in ((split_layout, w), (one_layout, one_w))
            ]
            if times[1] <= times[0]:
                w, splits = one_w, 1
        assert width == w
    assert decode_params(d)["splits"] == splits


def host_description(chip):
    """The device options the Metal host gives the plans on `chip` (library.mm
    describe_device): its core count and Metal's name for it."""
    return {"gpu_cores": timing.chip(chip)["gpu_cores"], "device_name": sim.metal_device_name(chip)}


def dram_rate(chip):
    """The planner's DRAM rate on `chip` in tenths of a byte a core-cycle (decode_layout_time:
    the named chip's, rounded half up): chips.json's bandwidth over cores and clock."""
    return math.floor(timing.dram_bytes_per_core_cycle(timing.chip(chip)) * 10 + 0.5)


def restated_time(B, Hq, Hkv, L, S, E, elem, cores, dp, w, resident, direct, rate):
    """decode_layout_time restated, for a layout's parameters (dp: its decode params) and the
    DRAM rate in tenths of a byte a core-cycle (dram_rate)."""
    group, per_tg = Hq // Hkv, dp["heads_per_tg"]
    packed = per_tg * L
    sets = timing._decode_vector_row_sets(E, E, elem, packed)
    threadgroups = B * Hkv * (group // per_tg) * dp["splits"]
    work = dp["split_keys"] * row_factor(direct, packed) // 1000
    key_set_work = DIRECT_KEY_SET_WORK if direct else KEY_SET_WORK
    work = work * (1000 + key_set_work * (w - 4) // sets) // 1000
    work += fixed_keys(E, elem, direct, packed, w)
    compute = model_time(threadgroups, w, resident, cores, work)
    cache = cache_time(E, elem, direct, threadgroups, w, resident, cores, dp["split_keys"])
    kc = key_cycles(E, E, elem, direct)
    dram = B * Hkv * max(S, 1) * 2 * E * elem * 100000 // (rate * cores * kc)
    return max(compute, cache, dram) + (merge_time(E, elem, direct) if dp["splits"] > 1 else 0)


# Chips, and whether the plan knows the chip's name (its DRAM rate; unnamed: kDecodeDramBytes,
# as on a GPU outside the table, where M1 Max's and M3 Max's one-pass ties fall the other way).
NAMED_CHIPS = [("M1", True), ("M1 Max", True), ("M3 Max", True), ("M4 Pro", True), ("M5", True),
               ("M3 Ultra", True), ("M1 Max", False), ("M3 Max", False)]  # fmt: skip


@pytest.mark.parametrize("chip,named", NAMED_CHIPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("E", [64, 128, 256])
@pytest.mark.parametrize(
    "B,Hq,Hkv,L,S",
    [(1, 8, 2, 1, 512), (1, 8, 2, 1, 1024), (1, 32, 8, 1, 512), (1, 16, 2, 1, 2048),
     (2, 8, 2, 2, 700), (1, 32, 8, 1, 16384), (1, 8, 1, 1, 100),
     # Broadcast batches whose logical K/V (2^49 to 2^54 bytes) take the costs past 64 bits.
     (1 << 20, 32, 8, 1, (1 << 20) - 1), (1 << 30, 8, 2, 1, 1025)],
)  # fmt: skip
@pytest.mark.parametrize("staged", [False, True])
def test_packing_is_the_cheapest_layout(chip, named, dtype, E, B, Hq, Hkv, L, S, staged):
    """decode_layout_time restated: the plan's heads a threadgroup is the divisor of the group
    whose layout (each forced packing's own split and width, as planned) costs least in the
    timing model's terms, the full packing on a tie and the most heads among equals. Staged:
    K and V through threadgroup tiles (decode_direct = 0, as the paged and quantized caches
    read them), with the staged kernel's fits and the wave rule's split."""
    cores = timing.chip(chip)["gpu_cores"]
    elem = dtype.itemsize

    def view(H, n):  # one row broadcast where the batch is too big to allocate
        if B * H * n * E < 1 << 24:
            return t(B, H, n, E, dtype=dtype)
        return t(1, 1, 1, E, dtype=dtype).expand(B, H, n, E)

    def planned(**options):
        staging = {"decode_direct": 0} if staged else {}
        device = host_description(chip) if named else {"gpu_cores": cores}
        p = sim.plan("sdpa", [view(Hq, L), view(Hkv, S), view(Hkv, S), None, None],
                     {"scale": 0.125, **device, **staging, **options})  # fmt: skip
        return p.dispatches[0]

    group = Hq // Hkv
    costs = {}
    for d in (x for x in range(group, 0, -1) if group % x == 0 and x * L <= 8):
        forced = planned(decode_heads_per_tg=d)
        assert forced.kernel.startswith("steel_attention_decode_vector_"), forced.kernel
        dp = decode_params(forced)
        assert dp["heads_per_tg"] == d
        w = forced.constants[FC_DECODE_SIMDGROUPS]
        resident = max(1, timing.resident_threadgroups(forced, chip) // cores)
        direct = forced.constants[FC_DECODE_DIRECT]
        assert not (staged and direct)
        rate = dram_rate(chip) if named else DRAM_BYTES * 10
        costs[d] = restated_time(B, Hq, Hkv, L, S, E, elem, cores, dp, w, resident, direct, rate)
    best = min(costs.values())
    expected = max(d for d, c in costs.items() if c == best)
    auto = planned()
    assert decode_params(auto)["heads_per_tg"] == expected, costs


# The shapes of issue 25's "decode never slower" for few keys: f16 d128 B1 one token, the
# timing model's prediction of each forced packing (us), and the planner's pick.
FEW_KEYS = [
    ("M4 Pro", 8, 2, 512, 1), ("M1", 8, 2, 512, 1), ("M5", 8, 2, 512, 1),
    ("M4 Pro", 8, 2, 1024, 1), ("M4 Pro", 32, 8, 512, 2), ("M1", 32, 8, 512, 4),
    ("M5", 32, 8, 512, 4),
]  # fmt: skip


@pytest.mark.skipif(not simulator_ready()[0], reason=simulator_ready()[1])
@pytest.mark.parametrize("chip,Hq,Hkv,S,pick", FEW_KEYS)
def test_packing_is_the_timing_models_fastest(chip, Hq, Hkv, S, pick):
    """The timing model (sim.predict: the simulator's counters of the planned kernels on the
    chip, its cache model and its wave quantization), an independent judge of the planner's
    costs: of every forced packing, the planner's pick is predicted fastest (M1 H32/8: full and
    2 heads tie at the DRAM bound, and the full packing reads K and V once)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, n, 128, generator=g).half() for h, n in
               ((Hq, 1), (Hkv, S), (Hkv, S)))  # fmt: skip

    def predicted(per_tg):
        r = sim.predict("sdpa", [q, k, v, None, None], {"scale": 0.088,
                        "decode_heads_per_tg": per_tg}, chip=chip)  # fmt: skip
        return r["time_s"] * 1e6

    group = Hq // Hkv
    times = {d: predicted(d) for d in range(1, group + 1) if group % d == 0}
    auto = predicted(0)
    # The same plan as the forced pick; the cache model's DRAM bytes move by a few lines with
    # where the run's buffers fall (0.002 us at M1 H32/8's DRAM bound).
    assert auto == pytest.approx(times[pick], abs=0.05)
    assert auto <= min(times.values()) + 0.05, times
    if pick != group:
        assert auto < times[group] - 1.0, times  # better than the full packing, by over 1 us


@pytest.mark.parametrize(
    "vector,E,per_core",
    # MMA kernel at d256: 2 by its registers (2 x (32 + 32 + 2 + 1) + 24 = 158 a thread); the
    # vector kernel's (2 x (8 + 8 + 6) + 24 = 68) leave threadgroup memory the limit.
    [(0, 64, 6), (0, 128, 3), (0, 256, 2), (1, 64, 6), (1, 128, 3), (1, 256, 3)],
)
def test_resident_decode_threadgroups_per_head_dim(vector, E, per_core):
    """The residency docs/attention.md states, f16 decode threadgroups a core: 6 at d64, 3 at
    d128 (threadgroup memory); at d256 2 for the MMA kernel (its registers), 3 for the vector
    kernel (threadgroup memory), on every chip of the table."""
    d = dense(1, 32, 8, 1, 4096, E=E, gpu_cores=8, decode_vector=vector,
              decode_simdgroups=4).dispatches[0]  # fmt: skip
    assert d.kernel.startswith("steel_attention_decode_vector_") == bool(vector), d.kernel
    for chip in timing.chips():
        cores = timing.chip(chip)["gpu_cores"]
        assert timing.resident_threadgroups(d, chip) == cores * per_core


def test_sim_device_block_describes_the_core_count():
    # The staged tiles' wave rule, which follows the core count alone (direct reads may take
    # one pass: test_partitions).
    with sim.device({"gpu_cores": 40}):
        inside = decode_params(dense(1, 32, 8, 1, 4096, decode_direct=0).dispatches[0])["splits"]
        called = decode_params(
            dense(1, 32, 8, 1, 4096, gpu_cores=8, decode_direct=0).dispatches[0]
        )["splits"]
    assert (inside, called) == (16, 6)  # a call's own options take precedence (d64: 6 per core)


@pytest.mark.skipif(not simulator_ready()[0], reason=simulator_ready()[1])
@pytest.mark.parametrize(
    "chip,options,splits",
    [
        # 8 threadgroups (MHA: one per head) of 2048 keys, at most 2048 / 256 = 8 partitions,
        # d64: 6 resident per core; one row, so one row set and direct reads, where a wider
        # block's key sets add 0.5% each (decode_simdgroups).
        # 8 cores: the whole-wave split is 6 partitions, one wave of 48, 342 keys each and the
        # merge's overhead (decode_merge_time); one pass of 16-simdgroup blocks, one a core
        # (16 simdgroups: ALU efficiency 0.8125), 2048 keys x 1.06 is cheaper (model: 71.5 us
        # against 82.2 split with staged tiles).
        ("M1", {}, 1),
        # 40 cores: the whole-wave split is 8 partitions (waves of 240, 8 at most), but its
        # merge's 10 us (decode_merge_time) outweighs one pass of 16-simdgroup blocks (model:
        # 22.6 us against 28.3 split).
        ("M4 Max", {}, 1),
        # The call's count takes precedence: 2 cores. One pass of 8-simdgroup blocks, 4 a core
        # (32 simdgroups: ALU efficiency 1), 2048 keys x 1.02 each, against 3 partitions in 2
        # waves of 12 and the merge.
        ("M4 Max", {"gpu_cores": 2}, 1),
    ],
)  # fmt: skip
def test_predict_plans_for_the_chips_core_count(chip, options, splits):
    """sim.predict on a chip runs the plan the Metal host makes on it: split by the chip's
    gpu_cores in chips.json, unless the call's options give a count (the DRAM rate by the
    chip's name: tests/plan/test_device.py)."""
    q, k, v = (torch.randn(1, 8, n, 64, dtype=torch.float16) for n in (1, 2048, 2048))
    predicted = sim.predict("sdpa", [q, k, v, None, None], {"scale": 0.125, **options}, chip=chip)
    kernels = [d["kernel"] for d in predicted["dispatches"]]
    merge = ["steel_attention_decode_merge_f16"] if splits > 1 else []
    assert kernels == ["steel_attention_decode_vector_f16_e64_v64", *merge]
    assert predicted["dispatches"][0]["occupancy"]["threadgroups"] == splits * 8


def test_merge_grid_covers_rows_heads_batch():
    p = dense(3, 8, 2, 4, 3000, num_splits=4)
    merge = p.dispatches[1]
    assert merge.grid == (4, 8, 3)
    assert p.allocations[2].sizes == (3 * 8 * 4 * 4, 64)


def cu(*offsets):
    return torch.tensor(offsets, dtype=torch.int32)


def paged_plan(q, k, v, table, seqused, cu_k=None, **options):
    base = {"max_seqlen_q": 2, "max_seqlen_k": 500, "scale": 0.125}
    tensors = [q, k, v, cu(0, 1, 3), cu_k, None, table, seqused]
    return sim.plan("sdpa_varlen", tensors, {**base, **options})


def test_paged_plan_binds_the_table_and_reads_pages_in_place():
    pool = t(30, 16, 2, 64)
    table = torch.empty(2, 40, dtype=torch.int32)[:, :32]  # a strided view: read in place
    seq = torch.empty(2, dtype=torch.int32)
    p = paged_plan(t(3, 8, 64), pool, pool, table, seq, num_splits=2, decode_heads_per_tg=4)
    assert p.ok, p.reason
    d = p.dispatches[0]
    assert d.constants[PAGED] and d.constants[VARLEN]
    slots = bound(d)
    assert slots[BUF_TABLE] == 6 and slots[BUF_SEQUSED] == 7 and slots[BUF_CU_K] == 3
    assert slots[BUF_CU_Q] == 3 and p.contiguous_inputs == []
    dp = decode_params(d)
    assert (dp["page_size"], dp["pages"], dp["max_pages"], dp["table_stride"]) == (16, 30, 32, 40)
    assert (dp["k_ps"], dp["v_ps"]) == (16 * 2 * 64, 16 * 2 * 64)
    assert dp["rows"] == 2 and dp["heads_per_tg"] == 4 and d.grid == (2, 2, 2)
    assert [a.name for a in p.allocations[:2]] == ["out", "lse"]
    assert p.allocations[0].sizes == (3, 8, 64) and p.allocations[2].sizes == (2 * 8 * 2 * 2, 64)


def test_paged_plan_copies_a_table_with_strided_columns():
    pool = t(30, 16, 2, 64)
    table = torch.empty(32, 2, dtype=torch.int32).t()
    p = paged_plan(t(3, 8, 64), pool, pool, table, torch.empty(2, dtype=torch.int32))
    assert p.ok and p.contiguous_inputs == [6]
    assert decode_params(p.dispatches[0])["table_stride"] == 32


def test_paged_plan_copies_pools_with_strided_rows():
    """A pool whose head dim is not contiguous is copied dense (found by the fuzz test of
    tests/fuzz/test_fuzz_varlen.py, where it was refused): page and slot strides are the
    copy's."""
    strided = t(30, 16, 2, 64).transpose(-1, -2).contiguous().transpose(-1, -2)
    pool = t(30, 16, 2, 64)
    table, used = torch.empty(2, 32, dtype=torch.int32), torch.empty(2, dtype=torch.int32)
    p = paged_plan(t(3, 8, 64), pool, strided, table, used)
    assert p.ok and p.contiguous_inputs == [2]
    assert decode_params(p.dispatches[0])["v_ps"] == 16 * 2 * 64
    p = paged_plan(t(3, 8, 64), strided, strided, table, used)
    assert p.ok and p.contiguous_inputs == [1, 2]


@pytest.mark.parametrize(
    "change,reason",
    [
        ({"dropout_p": 0.5}, "a paged KV cache is read by the decode kernels, which have no"),
        ({"table": torch.empty(2, 32, dtype=torch.int64)}, "block_table must be int32"),
        ({"table": torch.empty(3, 32, dtype=torch.int32)}, "block_table must be int32 [2, "),
        ({"seqused": torch.empty(2, dtype=torch.float32)}, "seqused_k int32 [2]"),
        ({"k": t(30 * 16, 2, 64)}, "value pools [pages, page_size, heads_kv, dim]"),
        ({"cu_k": cu(0, 1, 3)}, "a paged KV cache (block_table) takes no cu_seqlens_k"),
        ({"k": t(0, 16, 2, 64), "v": t(0, 16, 2, 64)}, "an empty paged KV cache"),
    ],
)  # fmt: skip
def test_paged_refusals(change, reason):
    args = {"q": t(3, 8, 64), "k": t(30, 16, 2, 64), "v": t(30, 16, 2, 64),
            "table": torch.empty(2, 32, dtype=torch.int32),
            "seqused": torch.empty(2, dtype=torch.int32), "cu_k": None}  # fmt: skip
    options = {key: change.pop(key) for key in list(change) if key in ("max_seqlen_q", "dropout_p")}
    args.update(change)
    p = paged_plan(args["q"], args["k"], args["v"], args["table"], args["seqused"], args["cu_k"],
                   **options)  # fmt: skip
    assert not p.ok and reason in p.reason, p.reason


def test_varlen_decode_without_pages():
    q, k = t(10, 4, 64), t(500, 2, 64)
    p = sim.plan("sdpa_varlen", [q, k, k, cu(0, 2, 10), cu(0, 100, 500), None],
                 {"max_seqlen_q": 8, "max_seqlen_k": 400, "scale": 0.125})  # fmt: skip
    d = p.dispatches[0]
    assert d.kernel == "steel_attention_decode_f16_e64_v64" and not d.constants[PAGED]
    assert bound(d)[BUF_CU_K] == 4 and BUF_TABLE not in bound(d)
    dp = decode_params(d)
    assert dp["rows"] == 8 and dp["heads_per_tg"] == 2
    # 2 sequences x 2 KV heads, 400 keys at most: 2 partitions (the 256-key floor).
    assert (dp["splits"], dp["split_keys"]) == (2, 224)


@pytest.mark.skipif(not simulator_ready()[0], reason=simulator_ready()[1])
def test_every_planned_decode_kernel_is_in_the_library():
    """The plan's head-dim table and decode.metal's instantiations name the same kernels."""
    kernels = set(sim.build.shader_library().handle.kernels())
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for E in range(8, 577, 8):
            for Ev in (8, E, 128, 256, 512, 576):
                p = sim.plan("sdpa", [t(1, 1, 1, E, dtype=dtype), t(1, 1, 600, E, dtype=dtype),
                                      t(1, 1, 600, Ev, dtype=dtype), None, None],
                             {"num_splits": 2})  # fmt: skip
                assert [d.kernel in kernels for d in p.dispatches] == [True, True], p.dispatches


def test_paged_prefill_takes_blocks_of_32_rows():
    """A paged cache with long query sequences (chunked prefill) runs the same kernel in blocks
    of 32 rows of one head: grid x = splits * row blocks."""
    pool = t(100, 16, 2, 64)
    q = t(130, 8, 64)
    p = sim.plan("sdpa_varlen", [q, pool, pool, cu(0, 30, 130), None, None,
                                 torch.empty(2, 100, dtype=torch.int32),
                                 torch.empty(2, dtype=torch.int32)],
                 {"max_seqlen_q": 100, "max_seqlen_k": 1600, "scale": 0.125})  # fmt: skip
    assert p.ok, p.reason
    d = p.dispatches[0]
    dp = decode_params(d)
    assert (dp["row_block"], dp["heads_per_tg"], dp["rows"]) == (32, 1, 100)
    assert d.grid == (dp["splits"] * 4, 8, 2)
