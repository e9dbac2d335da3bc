"""The timing model (DESIGN.md section 7, layer 3): a dispatch's predicted time on an Apple GPU
from the simulator's counters, at the occupancy the dispatch reaches, on one chip of chips.json.

    chips()                                   the chips of the table
    chip(name)                                one chip: every figure, and where each comes from
    predict_dispatch(counters, geometry, chip, kernel_info=None)
                                              one dispatch: its times, the bound that binds
    steel_kernel_info(kernel)                 the register estimate of one of steel's kernels
    torch_steel.sim.predict(op, tensors, options, chip=...)
                                              a steel op call: run it, predict every dispatch

The model (README, "Timing model", lists every assumption):
  - compute: the instructions a dispatch issues, per class, at the chip's rates. The ALU
    instructions, the simdgroup MMAs and (without a neural accelerator) the matmul2d work share
    the FP pipeline and its issue slots; transcendentals and conversions also occupy the complex
    pipeline, shuffles the shuffle network, matmul2d on M5 the neural accelerator. These pipes
    overlap: compute is the busiest of them. Taken at the ALU efficiency of the occupancy the
    dispatch reaches (the table's alu_occupancy_efficiency).
  - threadgroup memory: bytes loaded and stored at the per-core threadgroup-memory bandwidth.
  - cache: device bytes through each core's path to L2.
  - DRAM: DRAM bytes (part 24B's cache model) at the chip's bandwidth; without them, the bytes of
    the dispatch's tensors as the simulator counts them (every re-read counted: pessimistic).
  - per-core times are quantized in waves: the threadgroups resident at once are cores x
    threadgroups per core (threads, threadgroup memory, registers), and the last wave is short.
  - the prediction is the largest of the four plus the dispatch overhead; `bound` names it.
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CHIPS_FILE = Path(__file__).with_name("chips.json")
UNCONFIRMED = "unconfirmed"

# Simdgroup width, and the multiply-adds of one 8x8x8 simdgroup MMA.
_LANES = 32
_MMA_FMAS = 512
# Instruction classes of part 24A's `instructions` counter and the rate field each is costed at.
_ALU_RATES = {
    "fp32": ("alu_fp32_flop_per_core_cycle", 2),  # FLOP per lane op (an FMA is 2)
    "half": ("alu_fp16_flop_per_core_cycle", 2),
    "int": ("int_ops_per_core_cycle", 1),
    "compare_select": ("compare_select_ops_per_core_cycle", 1),
    "branch": ("branch_ops_per_core_cycle", 1),
    "other": ("int_ops_per_core_cycle", 1),
}
_COMPLEX_RATES = {
    "transcendental": "transcendental_ops_per_core_cycle",
    "convert": "convert_ops_per_core_cycle",
}
_MMA_RATES = {
    "half": "simdgroup_matrix_fma_half_per_core_cycle",
    "bfloat": "simdgroup_matrix_fma_bfloat_per_core_cycle",
    "float": "simdgroup_matrix_fma_float_per_core_cycle",
}
# Memory instructions (part 24A's counters): one issue slot each.
_MEMORY_INSTRUCTIONS = ("device_loads", "device_stores", "threadgroup_loads", "threadgroup_stores")
# A simd reduction (simd_sum, prefix sums) is costed as log2(32) = 5 shuffle steps.
_REDUCTION_SHUFFLES = 5
# 32-bit registers per lane that every kernel holds besides its fragments (indices, pointers,
# loop bounds, a row's softmax statistics): an assumption, see steel_kernel_info.
_BASE_REGISTERS = 24
# STEEL_ATTN_DECODE_VECTOR_ROWS of shaders/steel/params.h: the vector decode kernel's packed rows,
# over its row sets (1, 2 or 4: the fewest whose packed rows' registers let a core hold as many
# threadgroups as the K/V tiles do; steel_attn_decode_vector_row_sets), and a row's q or o
# elements per lane (steel_attn_decode_vector_elems).
_DECODE_VECTOR_ROWS = 8
# STEEL_ATTN_FC_DECODE_ROWS: the packed rows the vector decode pipeline runs (its rows past them
# are dead code the pipeline's constants fold away, so they hold no registers).
_FC_DECODE_ROWS = 340
# STEEL_ATTN_SIMDGROUPS: the simdgroups of an MMA attention threadgroup, 8 query rows each.
_ATTN_SIMDGROUPS = 4
# STEEL_ATTN_BUF_PARAMS: the params binding (setBytes) of the attention kernels.
_BUF_PARAMS = 7
# AttnDecodeParams' int32 fields after the forward's AttnParams (params.h, which asserts that
# `splits` is at byte 312): the MMA decode kernel's packed rows, heads_per_tg x row_block, are
# in its params, not its constants.
DECODE_PARAMS_FIELDS = ("splits", "split_keys", "heads_per_tg", "rows", "page_size", "pages",
                        "max_pages", "table_stride", "row_block")  # fmt: skip
_DECODE_PARAMS_OFFSET = 312


def decode_params_fields(raw: bytes) -> dict[str, int]:
    """The AttnDecodeParams fields of DECODE_PARAMS_FIELDS from a decode dispatch's params."""
    values = struct.unpack_from(f"<{len(DECODE_PARAMS_FIELDS)}i", raw, _DECODE_PARAMS_OFFSET)
    return dict(zip(DECODE_PARAMS_FIELDS, values, strict=True))


def _decode_vector_elems(d: int) -> int:
    vec = 4 if d % 128 == 0 else 2 if d % 64 == 0 else 1
    return -(-d // (32 * vec)) * vec


def _decode_vector_row_sets(de: int, dv: int, elem_bytes: int, rows: int) -> int:
    row = _decode_vector_elems(de) + _decode_vector_elems(dv) + 3
    by_tiles = min(24, 61440 // _attn_threadgroup_bytes(de, dv, elem_bytes))
    budget = 212992 // 4 // (by_tiles * 128) - _BASE_REGISTERS
    return next((s for s in (1, 2) if -(-max(rows, 1) // s) * row <= budget), 4)


BOUNDS = ("compute", "threadgroup_memory", "cache", "dram")


@functools.cache
def _table() -> dict:
    return json.loads(CHIPS_FILE.read_text())


def _resolved(name: str) -> dict[str, dict]:
    table = _table()
    record = table["chips"][name]
    entries = dict(table["families"][record["family"]])
    entries.update({k: e for k, e in record.items() if k != "family"})
    return entries


def chips() -> list[str]:
    """The chips of the table, in its order."""
    return list(_table()["chips"])


def chip(name: str) -> dict[str, Any]:
    """One chip: {"name", "family", every figure by field name, "provenance": {field: its
    table entry (value, source, note / basis, alternatives)}, "sources": the table's sources}."""
    table = _table()
    if name not in table["chips"]:
        raise KeyError(f"unknown chip {name!r}; the table has {', '.join(chips())}")
    entries = _resolved(name)
    record: dict[str, Any] = {"name": name, "family": table["chips"][name]["family"]}
    record.update({k: e["value"] for k, e in entries.items()})
    record["provenance"] = entries
    record["sources"] = table["sources"]
    return record


def _efficiency(points: Sequence[Sequence[float]], simdgroups: float) -> float:
    """Piecewise-linear ALU efficiency against resident simdgroups per core (flat past the last
    point)."""
    if simdgroups >= points[-1][0]:
        return float(points[-1][1])
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= simdgroups <= x1:
            return y0 + (y1 - y0) * (simdgroups - x0) / (x1 - x0)
    return float(points[0][1])


# --- register estimates of steel's kernels ---------------------------------------------------

_ELEM_BYTES = {"f16": 2, "bf16": 2, "f32": 4}
_TG_BUDGET = 20480  # STEEL_ATTN_TG_BUDGET (shaders/steel/params.h)


def _attn_ld(d: int, elem: int) -> int:
    return d + 16 // elem


def _attn_shared(de: int, dv: int, elem: int) -> bool:
    """steel_attn_shared_kv: K and V take turns in one buffer."""
    return 16 * (_attn_ld(de, elem) + _attn_ld(dv, elem)) * elem > _TG_BUDGET


def _attn_row_bytes(de: int, dv: int, elem: int) -> int:
    """Bytes of one key row of the K/V tile(s): both rows, or the wider one when shared."""
    ldk, ldv = _attn_ld(de, elem), _attn_ld(dv, elem)
    return (max(ldk, ldv) if _attn_shared(de, dv, elem) else ldk + ldv) * elem


def _attn_bk(de: int, dv: int, elem: int) -> int:
    """steel_attn_bk of shaders/steel/params.h: the key tile of the forward."""
    row = _attn_row_bytes(de, dv, elem)
    if not _attn_shared(de, dv, elem):
        return 32 if 32 * row <= _TG_BUDGET else 16
    return next((bk for bk in (32, 16) if bk * row <= _TG_BUDGET), 8)


def _attn_residency(tg_bytes: int, registers: int) -> int:
    """steel_attn_prefill_residency of shaders/steel/params.h: threadgroups of 128 threads a
    core holds by the figures params.h assumes for every chip (3072 threads, 61440 bytes of
    threadgroup memory, 212992 of registers a core)."""
    return min(3072 // 128, 61440 // tg_bytes, 212992 // (registers * 4 * 128))


def _attn_bwd_registers(kind: str, bk: int, de: int, dv: int, elem: int) -> int:
    """steel_attn_bwd_dkdv_registers ("bwd_dkdv") and steel_attn_bwd_dq_registers ("bwd_dq") of
    shaders/steel/params.h with tiles of bk rows: K and V (dK/dV) or Q and dO (dQ) rows as MMA
    operands of the inputs' dtype (one 32-bit register a fragment for 16-bit types, two for
    float), and the dK and dV rows or the dQ row and two score tiles of bk keys in fp32
    fragments (two each)."""
    operands = (de // 8 + dv // 8) * (2 if elem == 4 else 1)
    rows = de // 8 + dv // 8 if kind == "bwd_dkdv" else de // 8
    return operands + 2 * (rows + 2 * (bk // 8)) + _BASE_REGISTERS


def _attn_bwd_fits(bk: int, de: int, dv: int, elem: int) -> int:
    """steel_attn_bwd_fits of shaders/steel/params.h: the bytes of two separate tiles of bk rows
    and three floats a row where they fit the budget, else 0."""
    tile = bk * (_attn_ld(de, elem) + _attn_ld(dv, elem)) * elem + 3 * bk * 4
    return tile if tile <= _TG_BUDGET else 0


def _attn_bwd_shared(de: int, dv: int, elem: int) -> bool:
    """steel_attn_bwd_shared of shaders/steel/params.h: not even two 8-row tiles fit, so the
    dK/dV kernel's take turns in one buffer (and it reads Q twice)."""
    return not _attn_bwd_fits(8, de, dv, elem)


def _attn_bwd_bk(de: int, dv: int, elem: int) -> int:
    """steel_attn_bwd_bk of shaders/steel/params.h: the backward kernels' streamed tile rows,
    the most of 32, 16, 8 among those whose two tiles and three floats a row fit the budget and
    let a core hold the most dK/dV threadgroups, up to the 24 simdgroups at which the ALU
    efficiency is flat (8 rows in one shared buffer where none fits; 0 where not even that)."""
    best, most = 0, 0
    for bk in (32, 16, 8):
        tile = _attn_bwd_fits(bk, de, dv, elem)
        if not tile:
            continue
        # at least 1 (an estimate past the register file would spill), at most 768 threads: the
        # 24 simdgroups from which the ALU efficiency is flat
        resident = _attn_residency(tile, _attn_bwd_registers("bwd_dkdv", bk, de, dv, elem))
        resident = min(768 // 128, max(1, resident))
        if resident > most:
            best, most = bk, resident
    if best:
        return best
    shared = 8 * max(_attn_ld(de, elem), _attn_ld(dv, elem)) * elem + 3 * 8 * 4
    return 8 if shared <= _TG_BUDGET else 0


def _attn_threadgroup_bytes(de: int, dv: int, elem: int) -> int:
    """steel_attn_threadgroup_bytes of shaders/steel/params.h: the decode kernels' K and V
    tiles."""
    return _attn_bk(de, dv, elem) * _attn_row_bytes(de, dv, elem)


def _attn_prefill_registers(de: int, dv: int, elem: int) -> int:
    """steel_attn_prefill_registers of shaders/steel/params.h: Q in operand fragments of the
    inputs' dtype (one register a lane for 16-bit types, two for float), the O and score
    fragments and one operand in fp32 (two each), and _BASE_REGISTERS scalars."""
    td, tv, tk = de // 8, dv // 8, _attn_bk(de, dv, elem) // 8
    return (2 if elem == 4 else 1) * td + 2 * (tv + tk + 1) + _BASE_REGISTERS


def _attn_prefill_layout(de: int, dv: int, elem: int, v_elem: int) -> tuple[int, int]:
    """(bytes, threadgroups a core) of the prefill's K and V tiles with V in v_elem-byte
    elements, shared wherever that lets more threadgroups reside (steel_attn_prefill_shared_as
    of shaders/steel/params.h)."""
    bk = _attn_bk(de, dv, elem)
    k, v = bk * _attn_ld(de, elem) * elem, bk * _attn_ld(dv, v_elem) * v_elem
    regs = _attn_prefill_registers(de, dv, elem)
    shared, separate = max(k, v), k + v
    if _attn_shared(de, dv, elem) or _attn_residency(shared, regs) > _attn_residency(
        separate, regs
    ):
        return shared, _attn_residency(shared, regs)
    return separate, _attn_residency(separate, regs)


def _attn_prefill_threadgroup_bytes(de: int, dv: int, elem: int) -> int:
    """steel_attn_prefill_threadgroup_bytes of shaders/steel/params.h: the prefill's K and V
    tiles, one shared buffer wherever that lets more threadgroups reside on a core (at the same
    key tile) than separate tiles do, V in fp32 for 16-bit inputs wherever that keeps as many
    threadgroups resident within the threadgroup-memory budget (steel_attn_prefill_v_f32)."""
    as_t = _attn_prefill_layout(de, dv, elem, elem)
    if elem < 4:
        as_f32 = _attn_prefill_layout(de, dv, elem, 4)
        if as_f32[0] <= _TG_BUDGET and as_f32[1] >= as_t[1]:
            return as_f32[0]
    return as_t[0]


# The matmul2d backward (shaders/steel/attn_tensor/backward_tensor.h): 128 threads, key tiles of
# 32, the dK/dV block's keys as params.h's steel_attn_tensor_bwd_keys chooses them.
_TENSOR_THREADS, _TENSOR_ROWS, _TENSOR_BK = 128, 64, 32


def attn_tensor_bwd_keys(d: int) -> int:
    """steel_attn_tensor_bwd_keys of shaders/steel/params.h: the dK/dV block's keys."""
    return 32 if d > 128 else _TENSOR_ROWS


def attn_tensor_bwd_registers(kind: str, d: int, rows: int) -> tuple[int, str]:
    """(32-bit registers per thread, basis) of a matmul2d backward kernel ("dkdv", "dq",
    "dmask") at head dim d with `rows` keys (dK/dV) or query rows a block: the elements of the
    cooperative tensors it keeps live across its tile loop, spread evenly over the threadgroup's
    threads (the layout is the driver's; padding slots are not counted), 16-bit operands two to
    a register, plus _BASE_REGISTERS scalars."""
    per = rows * d // _TENSOR_THREADS  # elements of one rows x d tensor per thread
    tile = rows * _TENSOR_BK // _TENSOR_THREADS  # of one rows x BK score tile
    if kind == "dkdv":
        regs, what = per + 2 * per + 2 * tile, "K, V (16-bit), dK, dV (fp32), S^T, dP^T"
    elif kind == "dq":
        regs, what = per + per + 2 * tile, "Q, dO (16-bit), dQ (fp32), S, dP"
    else:
        regs, what = per + 3 * tile, "Q, dO (16-bit), the dmask sum, S, dP (fp32)"
    basis = (
        f"{regs} registers of cooperative tensors ({what}, {rows} rows x {d} over "
        f"{_TENSOR_THREADS} threads) + {_BASE_REGISTERS} scalars"
    )
    return regs + _BASE_REGISTERS, basis


def steel_kernel_info(
    kernel: str, constants: Mapping[int, Any] | None = None, params: bytes | None = None
) -> dict[str, Any]:
    """The register estimate of one of steel's kernels, from its host name (and, for the vector
    decode kernel, the dispatch's function constants: its live rows; for the MMA decode kernel,
    its params struct's bytes: the simdgroups that hold rows, `active_simdgroups`).

    Apple's compiler cannot be asked here, so the estimate counts the 8x8 fp32 fragments
    (simdgroup_matrix<float, 8, 8>: 2 registers per lane) that the kernel keeps live across its
    inner loop, read off its source, plus _BASE_REGISTERS scalars. Returns {"registers": per
    thread or None when unknown, "register_basis": how, "mma_dtype": "float" (steel's fragments
    are all simdgroup_matrix<float, 8, 8>, fragment.h, whatever the tensors' dtype)}. Unknown
    kernels (PyTorch's) get registers None: registers then do not limit occupancy,
    and the result says so."""
    m = re.match(r"steel_attention_bwd_tensor_(dkdv|dq|dmask)_(?:f16|bf16)_e(\d+)_v\d+$", kernel)
    if m:
        kind, d = m.group(1), int(m.group(2))
        rows = attn_tensor_bwd_keys(d) if kind == "dkdv" else _TENSOR_ROWS
        registers, basis = attn_tensor_bwd_registers(kind, d, rows)
        return {"registers": registers, "register_basis": basis, "mma_dtype": "float"}
    m = re.match(r"steel_attention_decode_vector_(f16|bf16|f32)_e(\d+)_v(\d+)$", kernel)
    if m:
        dt, de, dv = m.group(1), int(m.group(2)), int(m.group(3))
        qe, qv = _decode_vector_elems(de), _decode_vector_elems(dv)
        packed = min(int((constants or {}).get(_FC_DECODE_ROWS, _DECODE_VECTOR_ROWS) or 1),
                     _DECODE_VECTOR_ROWS)  # fmt: skip
        sets = _decode_vector_row_sets(de, dv, _ELEM_BYTES[dt], packed)
        rows = -(-packed // sets)
        registers = rows * (qe + qv + 3) + _BASE_REGISTERS
        basis = (f"{rows} rows a lane x ({qe} q + {qv} o elements + the running max and sum, the "
                 f"score) + {_BASE_REGISTERS} scalars")  # fmt: skip
        return {"registers": registers, "register_basis": basis, "mma_dtype": "float",
                "threadgroup_memory": _attn_threadgroup_bytes(de, dv, _ELEM_BYTES[dt])}  # fmt: skip
    m = re.match(
        r"steel_attention_(?:(decode|tensor|bwd_dkdv|bwd_dq)_)?(f16|bf16|f32)_e(\d+)_v(\d+)$",
        kernel,
    )
    if m:
        kind, dt, de, dv = m.group(1), m.group(2), int(m.group(3)), int(m.group(4))
        td, tv, tk = de // 8, dv // 8, _attn_bk(de, dv, _ELEM_BYTES[dt]) // 8
        if kind in ("bwd_dkdv", "bwd_dq"):
            tk = _attn_bwd_bk(de, dv, _ELEM_BYTES[dt]) // 8  # the backward's own tile
            # K and V (dK/dV kernel) or Q and dO (dQ) rows as MMA operands of the inputs' dtype
            # (backward.h, forward.h's AttnOperandRow: one 32-bit register a lane a fragment
            # for 16-bit types, two for float); dK and dV or dQ rows and two score tiles (S^T
            # and dP^T, then (P o Z)^T and dS^T in their place) in fp32 fragments.
            es = _ELEM_BYTES[dt]
            if kind == "bwd_dkdv":
                frags, what = td + tv + 2 * tk, "dK, dV rows and 2 score tiles"
                rows = "K and V"
            else:
                frags, what = td + 2 * tk, "the dQ row and 2 score tiles"
                rows = "Q and dO"
            basis = (
                f"{rows}'s {td + tv} operand fragments in {dt} x {2 if es == 4 else 1} + "
                f"{frags} live 8x8 fp32 fragments ({what}) x 2 + {_BASE_REGISTERS} scalars"
            )
            registers = _attn_bwd_registers(kind, tk * 8, de, dv, es)
            return {"registers": registers, "register_basis": basis, "mma_dtype": "float"}
        elif kind == "tensor":
            frags, what = 0, "matmul2d keeps its operands in cooperative tensors: not counted"
        elif kind is None:  # the prefill: Q in operand fragments of its dtype (forward.h)
            es = _ELEM_BYTES[dt]
            basis = (
                f"Q's {td} operand fragments in {dt} x {2 if es == 4 else 1} + {tv + tk + 1} live "
                f"8x8 fp32 fragments (O row, the score tile, one operand) x 2 + "
                f"{_BASE_REGISTERS} scalars"
            )
            return {"registers": _attn_prefill_registers(de, dv, es), "register_basis": basis,
                    "mma_dtype": "float",
                    "threadgroup_memory": _attn_prefill_threadgroup_bytes(de, dv, es)}  # fmt: skip
        else:
            frags, what = td + tv + tk + 1, "Q and O rows, the score tile and one operand"
        basis = f"{frags} live 8x8 fp32 fragments ({what}) x 2 + {_BASE_REGISTERS} scalars"
        info = {"registers": 2 * frags + _BASE_REGISTERS, "register_basis": basis,
                "mma_dtype": "float"}  # fmt: skip
        if kind == "decode":  # the decode kernels' K/V tiles (decode.h uses AttnForward's)
            info["threadgroup_memory"] = _attn_threadgroup_bytes(de, dv, _ELEM_BYTES[dt])
            if params is not None:
                # simdgroups of all-empty rows load tiles and wait (decode.h `live`): no ALU work
                f = decode_params_fields(params)
                packed = max(1, f["heads_per_tg"] * f["row_block"])
                info["active_simdgroups"] = min(_ATTN_SIMDGROUPS, -(-packed // 8))
        return info
    m = re.match(r"steel_gemm_\w+?_(f16|bf16|f32)_bm(\d+)_bn(\d+)_bk(\d+)_wm(\d+)_wn(\d+)$", kernel)
    if m:
        bm, bn, wm, wn = (int(m.group(i)) for i in (2, 3, 5, 6))
        tm, tn = bm // (8 * wm), bn // (8 * wn)
        frags = tm * tn + tm + tn
        basis = (
            f"{frags} live 8x8 fp32 fragments ({tm}x{tn} accumulators, {tm} A and {tn} B) "
            f"x 2 + {_BASE_REGISTERS} scalars"
        )
        return {
            "registers": 2 * frags + _BASE_REGISTERS,
            "register_basis": basis,
            "mma_dtype": "float",
        }
    m = re.match(r"steel_\w+?_(f16|bf16|f32)(?:_|$)", kernel)
    if m:
        return {
            "registers": _BASE_REGISTERS,
            "register_basis": f"no fragments held: {_BASE_REGISTERS} scalars",
            "mma_dtype": "float",
        }
    return {
        "registers": None,
        "register_basis": "unknown kernel: registers not limiting",
        "mma_dtype": None,
    }


_chip_record = chip


def _occupancy(c: Mapping, tg_simdgroups: int, tgmem: int, registers: int | None):
    """(limits by resource, the limiting one, threadgroups resident per core (at least 1))."""
    limits = {"threads": int(c["max_threads_per_core"]) // (tg_simdgroups * _LANES)}
    if tgmem:
        limits["threadgroup_memory"] = int(c["threadgroup_memory_bytes_per_core"]) // tgmem
    if registers:
        limits["registers"] = int(c["register_file_bytes_per_core"]) // (
            int(registers) * 4 * tg_simdgroups * _LANES
        )
    limiter = min(limits, key=limits.get)
    return limits, limiter, max(1, limits[limiter])


def dram_bytes_per_core_cycle(c: Mapping[str, Any]) -> float:
    """The chip's DRAM bandwidth in bytes a core-cycle (its bytes a second over its cores and
    clock): the decode planner's DRAM floor (mps_src/plan/device.h)."""
    return float(c["dram_bytes_per_s"]) / (int(c["gpu_cores"]) * float(c["clock_ghz"]) * 1e9)


def resident_threadgroups(geometry: Any, chip: str | Mapping, kernel_info=None) -> int:
    """Threadgroups of a dispatch resident on the whole GPU at once (cores x per core), from
    what is known before it runs: its threads, its threadgroup-memory lengths and, for steel's
    kernels, the declared threadgroup memory and registers of steel_kernel_info. The wave size
    for part 24B's cache model (sim.predict passes it)."""
    c = chip if isinstance(chip, Mapping) else _chip_record(chip)
    _, threads, tgmem, _ = _geometry(geometry)
    kernel = getattr(geometry, "kernel", None) or (
        geometry.get("kernel", "") if isinstance(geometry, Mapping) else ""
    )
    info = (
        kernel_info
        if kernel_info is not None
        else steel_kernel_info(kernel, _constants(geometry), _params(geometry))
    )
    tgmem = max(tgmem, int(info.get("threadgroup_memory", 0) or 0))
    simdgroups = max(1, math.ceil(math.prod(threads) / _LANES))
    return int(c["gpu_cores"]) * _occupancy(c, simdgroups, tgmem, info.get("registers"))[2]


# --- one dispatch ----------------------------------------------------------------------------


def _geometry(geometry: Any) -> tuple[tuple[int, int, int], tuple[int, int, int], int, list]:
    """(grid in threadgroups, threads per threadgroup, threadgroup-memory bytes set by the
    dispatch, bindings or None) from a sim.Dispatch or a mapping with the same keys."""
    get = (
        geometry.get if isinstance(geometry, Mapping) else lambda k, d=None: getattr(geometry, k, d)
    )
    grid = tuple(int(x) for x in get("grid")) + (1, 1)
    threads = tuple(int(x) for x in get("threads")) + (1, 1)
    tgmem = get("threadgroup_memory", 0) or 0
    if isinstance(tgmem, Mapping):
        tgmem = sum(tgmem.values())
    return grid[:3], threads[:3], int(tgmem), get("bindings", None)


def _constants(geometry: Any) -> dict[int, Any] | None:
    """The dispatch's function constants {index: value}, where the geometry carries them."""
    if isinstance(geometry, Mapping):
        return geometry.get("constants")
    return getattr(geometry, "constants", None)


def _params(geometry: Any) -> bytes | None:
    """The bytes of the dispatch's params binding (STEEL_ATTN_BUF_PARAMS, setBytes), where the
    geometry carries its bindings."""
    for b in _geometry(geometry)[3] or ():
        get = b.get if isinstance(b, Mapping) else lambda k, b=b: getattr(b, k, None)
        if get("index") == _BUF_PARAMS and get("kind") == "bytes":
            return get("bytes")
    return None


def _device_bytes(counters: Mapping, bindings) -> tuple[int, int]:
    """(all device bytes, bytes of tensor bindings): with the bindings known, setBytes data
    (params structs, read through the constant cache) are told apart from tensors."""
    inline = set()
    if bindings is not None:
        inline = {
            b.index if hasattr(b, "index") else b["index"]
            for b in bindings
            if (b.kind if hasattr(b, "kind") else b["kind"]) == "bytes"
        }
    total = tensors = 0
    for index, b in counters.get("buffers", {}).items():
        n = int(b["read"]) + int(b["written"])
        total += n
        if int(index) not in inline:
            tensors += n
    return total, tensors  # buffers include constant_read (part 24A keeps it in both)


def predict_dispatch(
    counters: Mapping[str, Any],
    geometry: Any,
    chip: str | Mapping[str, Any],
    kernel_info: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Predicted time of one dispatch.

    counters: the simulator's counters of the dispatch (sim.run_op / run_kernel, counters=True).
    geometry: its sim.Dispatch (grid in threadgroups, threads, threadgroup_memory {index: bytes},
        bindings) or a mapping with those keys.
    chip: a name of chips() or a chip() record.
    kernel_info: {"registers": 32-bit registers per thread, "register_basis": str, "mma_dtype":
        "half" / "bfloat" / "float" (the MMA operands when mma_by_dtype is absent),
        "threadgroup_memory": bytes a threadgroup declares, "active_simdgroups": the simdgroups
        of a threadgroup that issue its ALU work, where fewer than all (the ALU efficiency
        counts them)}; default: the estimate for steel's kernels (steel_kernel_info).

    Returns {"time_s", "bound", "compute_s", "threadgroup_memory_s", "cache_s", "dram_s",
    "overhead_s", "occupancy": {...}, "pipes": core-cycles per pipe, "dram_bytes",
    "dram_source", "notes": [...]}.
    """
    c = chip if isinstance(chip, Mapping) else _chip_record(chip)
    info = (
        dict(kernel_info)
        if kernel_info is not None
        else steel_kernel_info(counters.get("kernel", ""), _constants(geometry), _params(geometry))
    )
    grid, threads, dispatch_tgmem, bindings = _geometry(geometry)
    notes: list[str] = []

    cores = int(c["gpu_cores"])
    clock = float(c["clock_ghz"]) * 1e9
    threadgroups = int(counters.get("threadgroups") or math.prod(grid))
    tg_threads = math.prod(threads)
    tg_simdgroups = max(1, math.ceil(tg_threads / _LANES))

    # Occupancy: threadgroups resident on one core at once.
    tgmem = max(
        dispatch_tgmem,
        int(counters.get("threadgroup_memory_bytes", 0)),
        int(info.get("threadgroup_memory", 0) or 0),
    )
    if "threadgroup_memory_bytes" not in counters and not info.get("threadgroup_memory"):
        notes.append(
            "threadgroup memory declared in the kernel unknown: only the dispatch's lengths count"
        )
    registers = info.get("registers")
    limits, limiter, resident = _occupancy(c, tg_simdgroups, tgmem, registers)
    if not registers:
        notes.append("no register estimate: registers assumed not to limit occupancy")
    if limits[limiter] < 1:
        notes.append(
            f"one threadgroup exceeds a core's {limiter}: the compiler would spill; costed as 1"
        )
    slots = cores * resident
    full_waves, rest = divmod(threadgroups, slots)
    waves = full_waves + (1 if rest else 0)
    per_core_last = math.ceil(rest / cores) if rest else 0
    points = c["alu_occupancy_efficiency"]
    # The simdgroups a threadgroup keeps issuing ALU work (kernel_info's active_simdgroups: the
    # MMA decode kernel's simdgroups of empty rows only load tiles and wait at barriers); the
    # others hide no latency, so the efficiency counts these.
    active = min(tg_simdgroups, int(info.get("active_simdgroups") or tg_simdgroups))

    def eff(k: int) -> float:
        return _efficiency(points, k * active)

    # Pipes, in core-cycles summed over the whole dispatch.
    instructions = counters.get("instructions")
    fp_pipe = complex_pipe = 0.0
    if instructions is not None:
        for cls, n in instructions.items():
            if cls in _COMPLEX_RATES:
                complex_pipe += n * _LANES / float(c[_COMPLEX_RATES[cls]])
                fp_pipe += n / 4  # its issue slot: one instruction per scheduler-cycle, 4 per core
            else:
                field, per_op = _ALU_RATES.get(cls, _ALU_RATES["other"])
                fp_pipe += n * _LANES * per_op / float(c[field])
        # Loads and stores take an issue slot each; their bytes are the memory components' cost.
        memory_ops = sum(counters.get(k, 0) for k in _MEMORY_INSTRUCTIONS)
        fp_pipe += memory_ops / 4
    else:
        notes.append("no instruction-class counters (part 24A): ALU instructions not costed")
    by_dtype = counters.get("mma_by_dtype")
    if by_dtype is None and counters.get("mma"):
        dt = info.get("mma_dtype") or "half"
        by_dtype = {dt: counters["mma"]}
        notes.append(f"MMAs costed as {dt} (no mma_by_dtype counter)")
    mma_pipe = sum(n * _MMA_FMAS / float(c[_MMA_RATES[dt]]) for dt, n in (by_dtype or {}).items())
    tensor_pipe = (
        2.0 * counters.get("tensor_multiply_adds", 0) / float(c["matmul2d_flop_per_core_cycle"])
    )
    neural = c["family"] == "apple10"
    if not neural:
        fp_pipe += tensor_pipe  # matmul2d runs on the simdgroup-matrix units
        tensor_pipe = 0.0
    fp_pipe += mma_pipe
    shuffle_pipe = (
        (
            counters.get("shuffles", 0)
            + counters.get("ballots", 0)
            + _REDUCTION_SHUFFLES * counters.get("reductions", 0)
        )
        * _LANES
        * 4
        / float(c["shuffle_bytes_per_core_cycle"])
    )
    pipes = {
        "fp": fp_pipe,
        "complex": complex_pipe,
        "shuffle": shuffle_pipe,
        "neural_accelerator": tensor_pipe,
    }
    compute_cycles = max(pipes.values())

    def per_core_time(total: float, rate_per_cycle: float, use_eff: bool) -> float:
        """Seconds for `total` units spread evenly over the threadgroups, each core running its
        resident threadgroups wave after wave at `rate_per_cycle` units per core-cycle."""
        if total == 0:
            return 0.0
        per_tg = total / threadgroups / rate_per_cycle / clock
        t = full_waves * resident * per_tg / (eff(resident) if use_eff else 1.0)
        if rest:
            t += per_core_last * per_tg / (eff(per_core_last) if use_eff else 1.0)
        return t

    compute_s = per_core_time(compute_cycles, 1.0, True)
    tg_bytes = counters.get("threadgroup_read", 0) + counters.get("threadgroup_written", 0)
    tgmem_s = per_core_time(tg_bytes, float(c["threadgroup_memory_bytes_per_core_cycle"]), False)
    device_bytes, tensor_bytes = _device_bytes(counters, bindings)
    cache_s = per_core_time(device_bytes, float(c["l2_bytes_per_core_cycle"]), False)
    if "dram_read" in counters or "dram_written" in counters:
        dram_bytes = int(counters.get("dram_read", 0)) + int(counters.get("dram_written", 0))
        dram_source = counters.get("dram_source", "cache model (part 24B)")
    else:
        dram_bytes = tensor_bytes if bindings is not None else device_bytes
        dram_source = (
            "device bytes of the tensors, no cache model"
            if bindings is not None
            else "device bytes, no cache model"
        )
        notes.append(f"DRAM bytes are {dram_source}: every re-read is counted")
    dram_s = dram_bytes / float(c["dram_bytes_per_s"])
    times = {"compute": compute_s, "threadgroup_memory": tgmem_s, "cache": cache_s, "dram": dram_s}
    bound = max(BOUNDS, key=lambda k: times[k])
    overhead = float(c["dispatch_overhead_s"])
    return {
        "kernel": counters.get("kernel"),
        "chip": c["name"],
        "time_s": times[bound] + overhead,
        "bound": bound,
        "compute_s": compute_s,
        "threadgroup_memory_s": tgmem_s,
        "cache_s": cache_s,
        "dram_s": dram_s,
        "overhead_s": overhead,
        "occupancy": {
            "threadgroups": threadgroups,
            "threads_per_threadgroup": tg_threads,
            "threadgroup_memory": tgmem,
            "registers": registers,
            "register_basis": info.get("register_basis"),
            "limits": limits,
            "limiter": limiter,
            "threadgroups_per_core": resident,
            "simdgroups_per_core": resident * tg_simdgroups,
            "active_simdgroups_per_core": resident * active,
            "alu_efficiency": eff(resident),
            "last_wave_threadgroups_per_core": per_core_last or resident,
            "slots": slots,
            "waves": waves,
        },
        "pipes": pipes,
        "dram_bytes": dram_bytes,
        "dram_source": dram_source,
        "device_bytes": device_bytes,
        "notes": notes,
    }


def predict_call(
    dispatches: Sequence[Any],
    counters: Sequence[Mapping],
    chip: str | Mapping,
    kernel_infos: Sequence[Mapping | None] | None = None,
) -> dict[str, Any]:
    """The sum over one call's dispatches (geometry and counters in dispatch order). The call's
    bound is the bound of the dispatch that takes longest."""
    if len(dispatches) != len(counters):
        raise ValueError(f"{len(dispatches)} dispatches but {len(counters)} counter records")
    infos = kernel_infos or [None] * len(dispatches)
    parts = [predict_dispatch(k, d, chip, i) for d, k, i in zip(dispatches, counters, infos)]
    longest = max(parts, key=lambda p: p["time_s"]) if parts else None
    return {
        "chip": chip if isinstance(chip, str) else chip["name"],
        "time_s": sum(p["time_s"] for p in parts),
        "bound": longest["bound"] if longest else None,
        "dispatches": parts,
    }
