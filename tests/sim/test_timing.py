"""The timing model (torch_steel/sim/timing.py) and its chip table (chips.json): the table's
structure and sources; the model on synthetic counters whose answers are worked out by hand from
the table's figures; sim.predict end to end on small steel calls."""

import math
import subprocess
from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel import sim
from torch_steel.sim import build, timing

REQUIRED_CHIPS = ["M1", "M1 Max", "M2", "M3 Max", "M4", "M4 Pro", "M4 Max", "M5", "M5 Pro",
                  "M5 Max"]  # fmt: skip
# The fields issue 24 asks for, as the table names them.
REQUIRED_FIELDS = {
    "gpu_cores", "clock_ghz", "alu_fp32_flop_per_core_cycle", "alu_fp16_flop_per_core_cycle",
    "simdgroup_matrix_fma_half_per_core_cycle", "simdgroup_matrix_fma_bfloat_per_core_cycle",
    "simdgroup_matrix_fma_float_per_core_cycle", "matmul2d_flop_per_core_cycle",
    "transcendental_ops_per_core_cycle", "threadgroup_memory_bytes_per_core_cycle",
    "register_file_bytes_per_core", "max_threads_per_core", "threadgroup_memory_bytes_per_core",
    "l2_bytes", "slc_bytes", "dram_bytes_per_s", "dispatch_overhead_s",
}  # fmt: skip


def _check_entry(where, entry, sources):
    assert set(entry) >= {"value", "source"}, where
    assert entry["value"] is not None, where
    if entry["source"] == timing.UNCONFIRMED:
        assert entry.get("basis"), f"{where}: unconfirmed without a basis"
    else:
        assert entry["source"] in sources, f"{where}: unknown source {entry['source']!r}"
    for alt in entry.get("alternatives", []):
        _check_entry(f"{where} (alternative)", alt, sources)


def test_chip_table_has_every_chip_and_field_each_with_a_source():
    names = timing.chips()
    assert set(REQUIRED_CHIPS) <= set(names)
    fields = set()
    for name in names:
        fields |= set(timing.chip(name)["provenance"])
    assert REQUIRED_FIELDS <= fields
    for name in names:
        record = timing.chip(name)
        assert set(record["provenance"]) == fields, f"{name} lacks {fields - set(record)}"
        for field, entry in record["provenance"].items():
            _check_entry(f"{name}.{field}", entry, record["sources"])
            assert record[field] == entry["value"]
    for key, source in timing.chip("M1")["sources"].items():
        assert source.get("url") and source.get("says"), key


def test_unknown_chip_is_refused_by_name():
    with pytest.raises(KeyError, match="unknown chip 'M9'"):
        timing.chip("M9")


# A kernel the model does not know: registers not limiting unless the test says so.
UNKNOWN = {"registers": None, "register_basis": "test", "mma_dtype": None}


def _counters(threadgroups, **kw):
    c = {"kernel": "synthetic", "threadgroups": threadgroups, "mma": 0, "shuffles": 0,
         "reductions": 0, "ballots": 0, "threadgroup_read": 0, "threadgroup_written": 0,
         "threadgroup_memory_bytes": 0, "buffers": {}}  # fmt: skip
    c.update(kw)
    return c


@pytest.mark.parametrize("name", ["M1", "M4 Pro", "M5 Max"])
def test_pure_alu_dispatch_is_compute_bound_at_the_fp32_rate(name):
    chip = timing.chip(name)
    cores, clock = chip["gpu_cores"], chip["clock_ghz"] * 1e9
    # 1024 threads: 3 threadgroups per core by threads (3072 / 1024), 96 simdgroups per core,
    # past saturation (efficiency 1). One full wave.
    threadgroups = 3 * cores
    n = 10_000_000  # simdgroup fp32 instructions
    c = _counters(threadgroups, instructions={"fp32": n})
    r = timing.predict_dispatch(c, {"grid": (threadgroups,), "threads": (1024,)}, name, UNKNOWN)
    # Hand: 256 FLOP per core-cycle = 128 FMA lanes = 4 simdgroup instructions per core-cycle.
    fp32_per_cycle = chip["alu_fp32_flop_per_core_cycle"] / 2 / 32
    expected = n / fp32_per_cycle / (cores * clock)
    assert r["bound"] == "compute"
    assert r["occupancy"]["threadgroups_per_core"] == 3
    assert r["occupancy"]["waves"] == 1
    assert r["compute_s"] == pytest.approx(expected, rel=1e-12)
    assert r["time_s"] == pytest.approx(expected + chip["dispatch_overhead_s"], rel=1e-12)
    assert r["dram_s"] == r["cache_s"] == r["threadgroup_memory_s"] == 0


def test_instruction_classes_are_costed_at_their_own_pipes():
    chip = timing.chip("M1")
    cores, clock = chip["gpu_cores"], chip["clock_ghz"] * 1e9
    n = 1_000_000
    c = _counters(3 * cores, instructions={"transcendental": n})
    r = timing.predict_dispatch(c, {"grid": (3 * cores,), "threads": (1024,)}, chip, UNKNOWN)
    # exp2 at 32 lanes per core-cycle: one simdgroup instruction per core-cycle.
    assert r["compute_s"] == pytest.approx(n / (cores * clock), rel=1e-12)
    assert r["pipes"]["complex"] == pytest.approx(n)
    # MMAs: 512 FMAs each at 101.7 FMA per core-cycle (float operands).
    c = _counters(3 * cores, mma=n, mma_by_dtype={"float": n})
    r = timing.predict_dispatch(c, {"grid": (3 * cores,), "threads": (1024,)}, chip, UNKNOWN)
    assert r["compute_s"] == pytest.approx(n * 512 / 101.7 / (cores * clock), rel=1e-12)


def test_memory_instructions_take_issue_slots_and_constant_reads_count_once():
    chip = timing.chip("M1")
    cores, clock = chip["gpu_cores"], chip["clock_ghz"] * 1e9
    n = 4_000_000
    c = _counters(3 * cores, instructions={"fp32": n}, device_loads=n, threadgroup_stores=n,
                  constant_read=1000, buffers={0: {"read": 1000, "written": 0}})  # fmt: skip
    r = timing.predict_dispatch(c, {"grid": (3 * cores,), "threads": (1024,)}, chip, UNKNOWN)
    # fp32 at 4 per core-cycle, each load and store one issue slot of 4 per core-cycle.
    assert r["compute_s"] == pytest.approx(3 * n / 4 / (cores * clock), rel=1e-12)
    assert r["device_bytes"] == 1000  # constant_read is among the buffers' bytes already


@pytest.mark.parametrize("name", ["M2", "M5"])
def test_pure_streaming_dispatch_is_dram_bound(name):
    chip = timing.chip(name)
    nbytes = 1 << 30
    # 256-thread threadgroups, one 128-byte line per lane each way: no arithmetic at all.
    threadgroups = nbytes // 2 // (256 * 128)
    c = _counters(threadgroups, dram_read=nbytes // 2, dram_written=nbytes // 2,
                  buffers={0: {"read": nbytes // 2, "written": 0},
                           1: {"read": 0, "written": nbytes // 2}})  # fmt: skip
    r = timing.predict_dispatch(c, {"grid": (threadgroups,), "threads": (256,)}, name, UNKNOWN)
    assert r["bound"] == "dram"
    assert r["dram_source"].startswith("cache model")
    expected = nbytes / chip["dram_bytes_per_s"]
    assert r["time_s"] == pytest.approx(expected + chip["dispatch_overhead_s"], rel=1e-12)
    # Without 24B's DRAM bytes, the tensors' device bytes stand in, and the result says so.
    del c["dram_read"], c["dram_written"]
    r = timing.predict_dispatch(c, {"grid": (threadgroups,), "threads": (256,)}, name, UNKNOWN)
    assert r["dram_bytes"] == nbytes and "no cache model" in r["dram_source"]


def test_one_threadgroup_more_than_the_slots_takes_a_second_wave():
    name = "M1 Max"
    chip = timing.chip(name)
    cores = chip["gpu_cores"]
    # 32 KiB of threadgroup memory: one threadgroup per core (61440 // 32768), so N = cores slots.
    # 1024 threads = 32 simdgroups: saturated alone, so each wave takes one threadgroup's time.
    per_tg = 1000  # fp32 simdgroup instructions per threadgroup

    def run(threadgroups):
        c = _counters(threadgroups, instructions={"fp32": per_tg * threadgroups},
                      threadgroup_memory_bytes=32768)  # fmt: skip
        geometry = {"grid": (threadgroups,), "threads": (1024,)}
        return timing.predict_dispatch(c, geometry, name, UNKNOWN)

    n, n1 = run(cores), run(cores + 1)
    assert n["occupancy"]["slots"] == cores and n["occupancy"]["limiter"] == "threadgroup_memory"
    assert (n["occupancy"]["waves"], n1["occupancy"]["waves"]) == (1, 2)
    one_tg = per_tg / 4 / (chip["clock_ghz"] * 1e9)  # 4 fp32 instructions per core-cycle
    assert n["compute_s"] == pytest.approx(one_tg, rel=1e-12)
    assert n1["compute_s"] == pytest.approx(2 * one_tg, rel=1e-12)


def test_occupancy_limited_by_threadgroup_memory():
    name = "M1"
    chip = timing.chip(name)
    cores, clock = chip["gpu_cores"], chip["clock_ghz"] * 1e9
    # 128 threads (24 threadgroups by threads), 16 registers (3072-thread worth: not limiting),
    # 20 KiB of threadgroup memory: 61440 // 20480 = 3 per core, 12 simdgroups per core.
    info = {"registers": 16, "register_basis": "test", "mma_dtype": "float"}
    threadgroups = 3 * cores * 5  # five full waves
    n = 3_000_000
    c = _counters(threadgroups, instructions={"fp32": n}, threadgroup_memory_bytes=20480)
    r = timing.predict_dispatch(c, {"grid": (threadgroups,), "threads": (128,)}, chip, info)
    occ = r["occupancy"]
    assert occ["limits"] == {"threads": 24, "threadgroup_memory": 3, "registers": 26}
    assert occ["limiter"] == "threadgroup_memory" and occ["simdgroups_per_core"] == 12
    # Efficiency between metal-benchmarks' points (8, 0.625) and (24, 1.0), linear.
    efficiency = 0.625 + (1.0 - 0.625) * (12 - 8) / (24 - 8)
    assert occ["alu_efficiency"] == pytest.approx(efficiency)
    assert r["compute_s"] == pytest.approx(n / 4 / (cores * clock) / efficiency, rel=1e-12)
    # Registers limit instead: 128 per thread -> 212992 // (128 * 4 * 128) = 3 ... at 160, 2.
    info = {"registers": 160, "register_basis": "test", "mma_dtype": "float"}
    c["threadgroup_memory_bytes"] = 0
    r = timing.predict_dispatch(c, {"grid": (threadgroups,), "threads": (128,)}, chip, info)
    assert r["occupancy"]["limiter"] == "registers"
    assert r["occupancy"]["threadgroups_per_core"] == 212992 // (160 * 4 * 128)


def test_efficiency_counts_only_the_simdgroups_that_issue_alu_work():
    """The MMA decode kernel's simdgroups of empty rows (8 rows each, past the packed rows
    heads_per_tg x row_block of its params) load tiles and wait: the ALU efficiency is that of
    the simdgroups holding rows. 4 heads x 4 tokens: 2 of the 4 simdgroups."""
    kernel = "steel_attention_decode_f16_e128_v128"
    assert "active_simdgroups" not in timing.steel_kernel_info(kernel)
    active = {}
    for hq, L in ((4, 4), (3, 3), (4, 8), (8, 3), (9, 1)):
        q = torch.randn(1, hq, L, 128, dtype=torch.float16)
        k, v = (torch.randn(1, 1, 300, 128, dtype=torch.float16) for _ in range(2))
        (d,) = [x for x in sim.plan("sdpa", [q, k, v, None, None], {"scale": 0.1}).dispatches
                if x.kernel == kernel]  # fmt: skip
        info = timing.steel_kernel_info(d.kernel, d.constants, timing._params(d))
        active[hq, L] = info["active_simdgroups"]
    # hq x L packed rows (the vector kernel takes 8 or fewer)
    assert active == {(4, 4): 2, (3, 3): 2, (4, 8): 4, (8, 3): 3, (9, 1): 2}, active
    chip = timing.chip("M1")
    cores, clock = chip["gpu_cores"], chip["clock_ghz"] * 1e9
    # 128 threads, 20 KiB of threadgroup memory: 3 threadgroups a core (as above), 12 resident
    # simdgroups of which 6 issue the work when 2 of 4 a threadgroup do.
    info = {"registers": 16, "register_basis": "test", "mma_dtype": "float",
            "active_simdgroups": 2}  # fmt: skip
    threadgroups, n = 3 * cores, 3_000_000
    c = _counters(threadgroups, instructions={"fp32": n}, threadgroup_memory_bytes=20480)
    r = timing.predict_dispatch(c, {"grid": (threadgroups,), "threads": (128,)}, chip, info)
    occ = r["occupancy"]
    assert occ["simdgroups_per_core"] == 12 and occ["active_simdgroups_per_core"] == 6
    efficiency = 0.364 + (0.625 - 0.364) * (6 - 4) / (8 - 4)  # metal-benchmarks' points
    assert occ["alu_efficiency"] == pytest.approx(efficiency, abs=1e-3)
    assert r["compute_s"] == pytest.approx(n / 4 / (cores * clock) / occ["alu_efficiency"])


def test_steel_register_estimates_count_live_fragments():
    # Prefill f16 d64: Q in 8 half operand fragments (one register a lane each), O 8 + score
    # tile 4 (BK 32) + 1 operand fp32 fragments (two each).
    info = timing.steel_kernel_info("steel_attention_f16_e64_v64")
    assert info["registers"] == 8 + 2 * 13 + 24 and info["mma_dtype"] == "float"
    # f32 keeps Q in float fragments: two registers each.
    assert timing.steel_kernel_info("steel_attention_f32_e64_v64")["registers"] == 2 * 21 + 24
    # The decode kernel holds Q, O, the score tile and an operand in fp32 fragments.
    info = timing.steel_kernel_info("steel_attention_decode_f16_e128_v128")
    assert info["registers"] == 2 * 37 + 24 and info["threadgroup_memory"] == 32 * 136 * 2 * 2
    # GEMM 32x32 block over 2x2 simdgroups: 2x2 accumulators, 2 A, 2 B fragments.
    info = timing.steel_kernel_info("steel_gemm_nn_f32_bm32_bn32_bk16_wm2_wn2")
    assert info["registers"] == 2 * 8 + 24
    assert timing.steel_kernel_info("a_pytorch_kernel")["registers"] is None
    # Prefill f16 d128: Q 16 half + (O 16 + score tile 4 + 1) fp32; separate K and V tiles
    # (17408 bytes) would hold a core to 3 threadgroups where registers allow 5, so K and V
    # share one buffer of 32 rows of 136 halves (params.h steel_attn_prefill_shared_kv).
    info = timing.steel_kernel_info("steel_attention_f16_e128_v128")
    assert info["registers"] == 16 + 2 * 21 + 24 and info["threadgroup_memory"] == 32 * 136 * 2
    # Resident on an M1: 212992 // (82 * 4 * 128) = 5 by registers (threadgroup memory allows 7).
    geometry = {"kernel": "steel_attention_f16_e128_v128", "grid": (9, 9, 1), "threads": (128,)}
    assert timing.resident_threadgroups(geometry, "M1") == 5 * 8
    # f16 d32: V's tile in fp32 (params.h steel_attn_prefill_v_f32) in one buffer with K's:
    # 32 rows of 36 floats, 4608 bytes, 13 a core where registers allow 9 (fp32 V in separate
    # tiles, 7168 bytes, would allow 8; V in f16, 5120 bytes apart, 12).
    assert timing.steel_kernel_info("steel_attention_f16_e32_v32")["threadgroup_memory"] == 4608
    # f16 d128 keeps V in f16: fp32 V's 16896 bytes would hold a core to 3 where it holds 5.
    assert timing._attn_prefill_layout(128, 128, 2, 4) == (16896, 3)


# (dtype, E, Ev, L): the prefill's K and V tiles apart at BK 16 (bf16 192/128, V in fp32),
# shared where separate tiles would cost residency (f16 d32 and d64 at BK 32, V in fp32; f16
# d128, V in f16), shared by the budget at BK 32 (f32 d256), 16 (f16 576/512) and 8 (f32
# 576/512); L = 1 is the decode kernel, whose tiles follow the budget alone (f16 d128: apart).
DECLARED_TILES = [(torch.float16, 32, 32, 40), (torch.float16, 64, 64, 40),
                  (torch.float16, 128, 128, 40), (torch.bfloat16, 192, 128, 40),
                  (torch.float32, 256, 256, 40), (torch.float16, 576, 512, 40),
                  (torch.float16, 128, 128, 1), (torch.float32, 576, 512, 1)]  # fmt: skip


@requires_clang
@pytest.mark.parametrize("dtype,E,Ev,L", DECLARED_TILES)
def test_declared_threadgroup_memory_is_the_kernels(dtype, E, Ev, L):
    """steel_kernel_info restates params.h's steel_attn_threadgroup_bytes (resident_threadgroups
    needs it before the kernel runs): it must equal the threadgroup memory the compiled kernel
    holds (the simulator's counter), so a change of the tiles or the budget shows here."""
    q = torch.zeros(1, 1, L, E, dtype=dtype)
    k, v = torch.zeros(1, 1, 33, E, dtype=dtype), torch.zeros(1, 1, 33, Ev, dtype=dtype)
    _, counters = sim.run_op("sdpa", [q, k, v, None, None], {"scale": 0.1}, counters=True)
    for c in counters:
        info = timing.steel_kernel_info(c["kernel"])
        assert info["threadgroup_memory"] == c["threadgroup_memory_bytes"], c["kernel"]


# The prefill's head-dim pairs (attention.metal's instantiations).
PREFILL_PAIRS = [(d, d) for d in (32, 40, 64, 72, 80, 96, 128, 160, 192, 256, 512, 576)] + [
    (192, 128),
    (576, 512),
]


def _ask_params_h(tmp_path, cases, exprs) -> list[list[int]]:
    """params.h compiled as C++17 and asked: for each case (de, dv, es), the ints that the
    format strings `exprs` name ({de}, {dv}, {es} filled in), one list a case."""
    root = Path(__file__).resolve().parents[2]
    calls = "".join(
        f'  std::printf("{" ".join(["%d"] * len(exprs))}\\n", '
        + ", ".join(e.format(de=de, dv=dv, es=es) for e in exprs)
        + ");\n"
        for de, dv, es in cases
    )
    src = tmp_path / "ask.cpp"
    src.write_text(f'#include <cstdio>\n#include "steel/params.h"\nint main() {{\n{calls}}}\n')
    exe = tmp_path / "ask"
    subprocess.run([build.CXX, "-std=c++17", f"-I{root / 'shaders'}", str(src), "-o", str(exe)],
                   check=True)  # fmt: skip
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return [[int(x) for x in line.split()] for line in out.splitlines()]


@requires_clang
def test_prefill_tiles_are_params_hs(tmp_path):
    """params.h's prefill tile rules, compiled and asked, against timing's mirror for every
    instantiated pair and element size: the buffer's bytes, and V's tile in fp32
    (steel_attn_prefill_v_f32) only for 16-bit inputs and never at the cost of a resident
    threadgroup (it is chosen at f16 d64, where it saves the four simdgroups' widening)."""
    cases = [(de, dv, es) for de, dv in PREFILL_PAIRS for es in (2, 4)]
    out = _ask_params_h(tmp_path, cases, [
        "steel_attn_prefill_threadgroup_bytes({de}, {dv}, {es})",
        "steel_attn_prefill_v_f32({de}, {dv}, {es})",
        "steel_attn_prefill_residency_as({de}, {dv}, {es}, 4)",
        "steel_attn_prefill_residency_as({de}, {dv}, {es}, {es})",
    ])  # fmt: skip
    chosen = set()
    for (de, dv, es), (tg_bytes, v_f32, resident_f32, resident_t) in zip(cases, out, strict=True):
        assert timing._attn_prefill_threadgroup_bytes(de, dv, es) == tg_bytes, (de, dv, es)
        if v_f32:
            assert es == 2 and resident_f32 >= resident_t, (de, dv, es)
            assert tg_bytes == timing._attn_prefill_layout(de, dv, es, 4)[0], (de, dv, es)
            chosen.add((de, dv))
        else:
            assert tg_bytes == timing._attn_prefill_layout(de, dv, es, es)[0], (de, dv, es)
    assert (64, 64) in chosen and (128, 128) not in chosen


# The backward kernels' head-dim pairs and element sizes (attention_backward.metal: the
# forward's pairs), for the register estimate's mirror below.
BWD_PAIRS = [(d, d) for d in (32, 64, 72, 80, 96, 112, 128, 160, 192, 256, 512)] + [
    (192, 128),
    (576, 512),
]


@requires_clang
def test_backward_register_estimate_is_params_hs(tmp_path):
    """params.h's steel_attn_bwd_dq_registers (which decides the dQ kernel's shared K/V buffer,
    steel_attn_bwd_dq_shared), steel_attn_bwd_dkdv_registers (which, with the tiles' bytes,
    decides the tile rows) and steel_attn_bwd_bk are what steel_kernel_info and the timing model
    assume for every backward pair and element size: params.h compiled and asked. And the
    backward's rows divide the forward's key tile (steel_attn_bk): the dQ and dmask kernels take
    the forward's STEEL_ATTN_FC_ALIGN_S (S a multiple of that tile) as "every key tile of mine
    is whole"."""
    cases = [(de, dv, es) for de, dv in BWD_PAIRS for es in (2, 4)]
    out = _ask_params_h(tmp_path, cases, [
        "steel_attn_bwd_bk({de}, {dv}, {es})",
        "steel_attn_bwd_dq_registers({de}, {dv}, {es})",
        "steel_attn_bk({de}, {dv}, {es})",
        "steel_attn_bwd_dkdv_registers(steel_attn_bwd_bk({de}, {dv}, {es}), {de}, {dv}, {es})",
    ])  # fmt: skip
    for (de, dv, es), (bk, registers, forward_bk, dkdv) in zip(cases, out, strict=True):
        assert timing._attn_bwd_bk(de, dv, es) == bk, (de, dv, es)
        assert bk == 0 or forward_bk % bk == 0, (de, dv, es)
        if bk == 0:
            continue  # the planner refuses the pair
        dt = {2: "f16", 4: "f32"}[es]
        info = timing.steel_kernel_info(f"steel_attention_bwd_dq_{dt}_e{de}_v{dv}", {})
        assert info["registers"] == registers, (de, dv, es)
        info = timing.steel_kernel_info(f"steel_attention_bwd_dkdv_{dt}_e{de}_v{dv}", {})
        assert info["registers"] == dkdv, (de, dv, es)


def _sdpa_inputs(L, S, E, dtype=torch.float16):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, E, generator=g).to(dtype) for n in (L, S, S))
    opts = {"dropout_p": 0.0, "is_causal": False, "scale": E**-0.5, "softcap": 0.0,
            "window_left": -1, "window_right": -1, "bottom_right": False}  # fmt: skip
    return [q, k, v, None, None], opts


@requires_clang
def test_predict_runs_a_steel_attention_call_end_to_end():
    tensors, opts = _sdpa_inputs(33, 47, 64)
    r = sim.predict("sdpa", tensors, opts, chip="M4 Pro")  # with the cache model
    # The outputs are the op's own: compare with PyTorch's attention in float64.
    q, k, v = (t.double() for t in tensors[:3])
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=opts["scale"])
    torch.testing.assert_close(r["outputs"][0].double(), ref, atol=2e-3, rtol=0)  # f16 out
    (d,) = r["dispatches"]
    assert d["kernel"] == "steel_attention_f16_e64_v64"
    assert r["time_s"] == pytest.approx(d["time_s"]) and r["bound"] == d["bound"] in timing.BOUNDS
    # The forward's static threadgroup memory: BK 32 rows, which K (in f16, padded to E + 8)
    # and V (in fp32, padded to Ev + 4) take in turn (the f16 d64 prefill shares one buffer and
    # stages V in fp32: params.h steel_attn_prefill_shared_kv, steel_attn_prefill_v_f32).
    assert d["occupancy"]["threadgroup_memory"] == 32 * (64 + 4) * 4
    # 2 query blocks of 32 rows x 2 heads; 33 rows -> ceil(33 / 32) = 2 blocks.
    assert d["occupancy"]["threadgroups"] == 4
    # Its MMAs (2 key tiles x (QK^T and PV) per block) are costed at the rate of their operands:
    # Q K^T multiplies half fragments (forward.h AttnOperandRow), P V fp32 weights.
    chip = timing.chip("M4 Pro")
    _, counters = sim.run_op("sdpa", tensors, opts, counters=True, checkers=False)
    by_dtype = counters[0]["mma_by_dtype"]
    assert by_dtype["half"] > 0 and by_dtype["float"] > 0
    rate = {dt: chip[f"simdgroup_matrix_fma_{dt}_per_core_cycle"] for dt in by_dtype}
    assert d["pipes"]["fp"] >= sum(n * 512 / rate[dt] for dt, n in by_dtype.items())
    assert d["time_s"] >= chip["dispatch_overhead_s"] and math.isfinite(d["time_s"])
    # DRAM from the cache model: q, k, v once (the two query blocks of a head re-read k and v
    # from the caches, not from DRAM), give or take a line per tensor and the params struct.
    assert d["dram_source"].startswith("cache model")
    compulsory = sum(t.numel() * t.element_size() for t in tensors[:3])
    tensor_reads = sum(counters[0]["buffers"][i]["read"] for i in range(3))
    assert tensor_reads > compulsory  # k and v are read once per query block
    read = d["dram_bytes"] - (33 * 64 * 2 + 33 * 4) * 2  # minus out and lse written
    assert compulsory <= read <= compulsory + 3 * 128 + 4096


@requires_clang
def test_predict_sums_over_the_dispatches_of_a_call():
    a, b = torch.randn(40, 300), torch.randn(300, 24)
    r = sim.predict("gemm", [a, b, None, None], {}, chip="M2")
    torch.testing.assert_close(
        r["outputs"][0].double(), a.double() @ b.double(), atol=1e-4, rtol=1e-4
    )  # fp32 accumulation over K = 300
    assert len(r["dispatches"]) == len(sim.plan("gemm", [a, b, None, None], {}).dispatches)
    assert r["time_s"] == pytest.approx(sum(d["time_s"] for d in r["dispatches"]))
