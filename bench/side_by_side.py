"""Predicted times side by side (issue 24, deliverable 5): steel's kernels and PyTorch's on one
chip of the timing model's table, from the simulator's counters, as ratios.

Used by bench_attention.py --predict and bench_gemm.py --predict. The pieces:

- steel's side: the op's plan (sim.plan, the dispatches the Mac would encode) run in the
  simulator with counters; each dispatch predicted by torch_steel.sim.timing (part 24C) from its
  counters and the plan's geometry.
- PyTorch's own kernels: bench/pytorch_mps.py (the wheel's kernels with the host's bindings and
  dispatch rules), predicted the same way; the kernels' register use is not estimated (the timing
  model then lets registers not limit their occupancy, and says so in its notes).
- PyTorch's composite paths (F.sdpa with grad, MPS matmul): modelled op by op from the ops they
  run, each op at the roofline of the chip's table: the larger of its FLOPs at the matrix or ALU
  peak and its bytes at the DRAM bandwidth, plus one dispatch overhead. No published efficiency
  of MPS's matmul is used: the roofline is an upper bound on PyTorch's speed, so a ratio against
  it is a lower bound on steel's advantage.

Simulation cost is kept down without changing a count: every KV head group of a batch entry runs
the same code on the same lengths, so a shape is simulated on one KV head group (Hkv = 1, Hq =
the group) and each counter multiplied by Hkv (tests/sim/test_bench_predict.py checks that this
equals the full run; the batch is kept, since steel's kernels read more of their params struct
in batch entries past the first); the full shape's plan
gives the geometry, and the reduction is used only when the reduced plan has the same kernels,
threads and threadgroups per head (else the full shape runs). A shape whose reduced work is over
the simulation budget runs sampled (part 24B's sample=, when the simulator has it: a few waves of
threadgroups, extrapolated); one that sampling would not bring within it is fitted when its
caller says how (big_shapes.py: work counters from small runs of the same kernels, DRAM from a
reuse model, both checked in tests/sim/test_bench_predict.py), or else reported as skipped.
With part 24B's cache model the DRAM bytes come from it (per chip: its L2 and SLC sizes,
waves of the threadgroups resident at once); the
reduction then scales them too, which assumes each KV group's traffic is independent of the
others'.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from torch_steel import sim

# The device description steel plans for on an M5-generation chip (bench_gemm.DEVICES["m5"]).
M5_DEVICE = {"device_apple_family": 10, "device_metal4": True, "device_tensor_ops": True}
_ES = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}
_MMA_FIELD = {
    torch.float16: "simdgroup_matrix_fma_half_per_core_cycle",
    torch.bfloat16: "simdgroup_matrix_fma_bfloat_per_core_cycle",
    torch.float32: "simdgroup_matrix_fma_float_per_core_cycle",
}
_ALU_FIELD = {
    torch.float16: "alu_fp16_flop_per_core_cycle",
    torch.bfloat16: "alu_fp16_flop_per_core_cycle",
    torch.float32: "alu_fp32_flop_per_core_cycle",
}


def timing():
    """torch_steel.sim.timing (part 24C), or SystemExit naming what is missing."""
    try:
        from torch_steel.sim import timing as t  # noqa: PLC0415
    except ImportError as e:
        raise SystemExit(f"--predict needs the timing model (torch_steel.sim.timing): {e}") from e
    return t


def chip_names(spec: str) -> list[str]:
    names = timing().chips()
    if spec == "all":
        return names
    if spec not in names:
        raise SystemExit(f"unknown chip {spec!r}; the table has {', '.join(names)} (or 'all')")
    return [spec]


def chip(name: str) -> dict[str, Any]:
    return timing().chip(name)


def is_m5(name: str) -> bool:
    return chip(name)["family"] == "apple10"


def plan_options(chip_name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options steel's plan is made with on `chip_name`, as the Metal host makes it there
    and sim.predict plans: the chip's core count (mps_src/plan/device.h; the host reads the
    IORegistry's), which sets the decode split and the GEMM's small-grid tile, and its Metal
    name (the decode planner's DRAM rate); on M5-generation chips also the matmul2d device.
    The call's own options take precedence."""
    device = sim.metal_description(chip_name)
    if is_m5(chip_name):
        device.update(M5_DEVICE)
    return {**device, **options}


def _takes(fn, keyword: str) -> bool:
    return keyword in inspect.signature(fn).parameters


def cache_model_available() -> bool:
    return _takes(sim.run_op, "cache")


def sampling_available() -> bool:
    return _takes(sim.run_op, "sample")


# --- counters ------------------------------------------------------------------------------


# Counters that describe one threadgroup or the run, not sums over threadgroups.
_NOT_SUMS = {"sampled", "threadgroup_memory_bytes"}


def scale_counters(c: Mapping[str, Any], factor: int) -> dict[str, Any]:
    """Every count of a dispatch multiplied by `factor` (nested per-binding and per-class counts
    too); names, and the figures of _NOT_SUMS, stay."""
    out: dict[str, Any] = {}
    for key, val in c.items():
        if key in _NOT_SUMS or isinstance(val, bool) or not isinstance(val, (int, float, Mapping)):
            out[key] = val
        elif isinstance(val, Mapping):
            out[key] = scale_counters(val, factor)
        else:
            out[key] = val * factor
    return out


def _resident(name: str, geometry, kernel_info=None) -> int:
    """Threadgroups resident on the whole chip at once for this dispatch (the timing model's
    occupancy), for the cache model's waves."""
    grid = tuple(geometry["grid"]) if isinstance(geometry, Mapping) else geometry.grid
    p = timing().predict_dispatch(
        {"threadgroups": math.prod(grid), "buffers": {}}, geometry, name, kernel_info
    )
    return p["occupancy"]["slots"]


def _cache(name: str, resident) -> dict[str, Any]:
    c = chip(name)
    return {
        "l2_bytes": int(c["l2_bytes"]),
        "slc_bytes": int(c["slc_bytes"]),
        "resident_threadgroups": resident,
    }


# part 24B's sampled run (torch_steel/sim/traffic.py): the work counters from `threadgroups`
# strata of single threadgroups, and with the cache model the DRAM bytes from `waves` strata of
# whole waves besides the first and last, each after `warm` uncounted waves
SAMPLE = {"threadgroups": 64, "waves": 2, "warm": 1}


def _sampling(work: float, budget: float, threadgroups: Sequence[int], residents: Sequence[int]):
    """None (run whole: within the budget), the sample= argument (sampled, within the budget),
    or the reason the shape is skipped. A sampled dispatch runs at most threadgroups + 2
    threadgroups and (2 + waves) x (1 + warm) waves; the dearest dispatch decides."""
    if work <= budget:
        return None
    if not sampling_available():
        return f"{work:.1e} MACs over --sim-budget; no sampling in this simulator"
    waves = (2 + SAMPLE["waves"]) * (1 + SAMPLE["warm"])
    fraction = max(
        min(1.0, (SAMPLE["threadgroups"] + 2 + waves * r) / n)
        for n, r in zip(threadgroups, residents, strict=True)
    )
    if work * fraction > budget:
        return f"{work:.1e} MACs, {work * fraction:.1e} sampled: over --sim-budget"
    return dict(SAMPLE)


# --- steel ---------------------------------------------------------------------------------


def _same_kernels(full: sim.Plan, reduced: sim.Plan, factor: int) -> bool:
    if len(full.dispatches) != len(reduced.dispatches):
        return False
    for a, b in zip(full.dispatches, reduced.dispatches, strict=True):
        if (a.kernel, a.threads, a.constants) != (b.kernel, b.threads, b.constants):
            return False
        if math.prod(a.grid) != factor * math.prod(b.grid):
            return False
    return True


# shaders/steel/params.h STEEL_ATTN_DECODE_MAX_SPLITS: the decode plan's most key partitions
_DECODE_MAX_SPLITS = 32


def _reduced_options(op, make, opts, full: sim.Plan, factor: int) -> tuple[dict, bool]:
    """(options, True) when the shape reduced to one KV group plans the full shape's kernels
    with these options, else (opts, False). Decode's key split is chosen from the whole grid
    (the threadgroups of every head against the chip's waves), so one KV group alone would be
    split more; the split is then pinned (option num_splits, and decode_simdgroups where the
    planner's fixed-split path would take another block width) to the count n for which the
    full shape's plan with num_splits = n is the default plan itself, dispatch for dispatch and
    byte for byte of its params, and the reduced plan with it has the full plan's kernels."""
    reduced = sim.plan(op, make("meta", True), opts)
    if reduced.ok and _same_kernels(full, reduced, factor):
        return opts, True
    if "num_splits" in opts or not any("decode" in d.kernel for d in full.dispatches):
        return opts, False
    # A pinned split takes the planner's fixed-split path, whose block width (simdgroups a
    # threadgroup) is its own; where that is not the full plan's, the width is pinned too.
    width = {"decode_simdgroups": full.dispatches[0].threads[0] // 32}
    for extra, n in itertools.product(({}, width), range(1, _DECODE_MAX_SPLITS + 1)):
        pinned = {**opts, "num_splits": n, **extra}
        again = sim.plan(op, make("meta", False), pinned)
        if (again.dispatches, again.allocations) != (full.dispatches, full.allocations):
            continue
        reduced = sim.plan(op, make("meta", True), pinned)
        if reduced.ok and _same_kernels(full, reduced, factor):
            return pinned, True
    return opts, False


def steel_records(
    op: str,
    make: Callable[[str, bool], list],
    options: Mapping[str, Any],
    factor: int,
    chip_name: str,
    budget: float,
    work: float,
    fit: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """steel's prediction of one call on one chip.

    make(device, reduced) -> the op's tensors ("meta" or "cpu"; the reduced shape when reduced);
    factor: the full shape's KV groups per reduced run (Hkv); work: the reduced run's
    multiply-adds, against `budget`; fit: how a shape over the budget is fitted instead of
    skipped (_fitted). Returns {"time_s", "bound", "dispatches", "records", "how"} or
    {"skipped": reason}."""
    opts = plan_options(chip_name, options)
    full = sim.plan(op, make("meta", False), opts)
    if not full.ok:
        return {"skipped": f"refused: {full.reason}"}
    opts, use_reduced = _reduced_options(op, make, opts, full, factor)
    if not use_reduced:
        work *= factor
    how = "heads reduced" if use_reduced and factor > 1 else "full"
    if "num_splits" in opts and "num_splits" not in options:
        how += f" (split pinned: {opts['num_splits']})"
    kw: dict[str, Any] = {}
    residents = [_resident(chip_name, d) for d in full.dispatches]
    if cache_model_available():
        kw["cache"] = _cache(chip_name, residents)
    run_groups = [math.prod(d.grid) // (factor if use_reduced else 1) for d in full.dispatches]
    sample = _sampling(work, budget, run_groups, residents)
    if isinstance(sample, str) and fit is not None:
        return _fitted(op, full, opts, fit, factor, chip_name, residents, budget)
    if isinstance(sample, str):
        return {"skipped": sample}
    if sample is not None:
        kw["sample"] = sample
    tensors = make("cpu", use_reduced)
    _, counters = sim.run_op(op, tensors, opts, counters=True, checkers=False, **kw)
    if any(c.get("sampled", {}).get("extrapolated") for c in counters):
        how += ", sampled"
    if use_reduced:
        counters = [scale_counters(c, factor) for c in counters]
    result = timing().predict_call(full.dispatches, counters, chip_name)
    result["how"] = how
    result["records"] = [
        {
            "kernel": d.kernel,
            "grid": d.grid,
            "threads": d.threads,
            "threadgroup_memory": sum(d.threadgroup_memory.values()),
            "counters": c,
        }
        for d, c in zip(full.dispatches, counters, strict=True)
    ]
    return result


# The fit's small runs (no cache model: work counters only), by their plan: a plan equal in
# kernels, geometry and params bytes counts the same (the makers draw the same shapes the same
# way, and these kernels' counts do not depend on the values: test_fitted_counters_equal_a_whole_run
# fits runs of other values exactly), so the chips and the shapes that share a fit point (the
# GEMM's 1024 x 1024 corner) simulate it once per bench run.
_FIT_RUNS: dict[tuple, list] = {}


def _fitted(op, full, opts, fit, factor, chip_name, residents, budget) -> dict[str, Any]:
    """A shape over the budget, from big_shapes.py: its work counters fitted from runs of the
    same kernels on fit["points"] (fit["make_at"](n) -> make(device, reduced) at point n,
    reduced to one KV group when fit["reduced"]; fit["scale"](full plan, small plan): the
    counters' factor beyond the fit, 1 for attention), its DRAM bytes from the reuse model
    (fit["pieces"](kernel, grid) -> pieces_of or None; fit["x"]: the big shape's point)."""
    import big_shapes  # noqa: PLC0415 (bench/ is on the path)

    runs, cost = [], 0.0
    small = None
    for n in fit["points"]:
        make = fit["make_at"](n)
        small = sim.plan(op, make("meta", fit["reduced"]), opts)
        if not small.ok or len(small.dispatches) != len(full.dispatches):
            why = small.reason or "other dispatches"
            return {"skipped": f"fit at {n}: the small plan differs ({why})"}
        for a, b in zip(full.dispatches, small.dispatches, strict=True):
            if (a.kernel, a.threads, a.constants) != (b.kernel, b.threads, b.constants):
                return {"skipped": f"fit at {n}: {b.kernel} is not the big plan's {a.kernel}"}
        key = (op, repr(small.dispatches), repr(small.allocations))
        if key not in _FIT_RUNS:
            cost += fit["work_at"](n)
            if cost > 4 * budget:
                return {"skipped": f"fit points cost {cost:.1e} MACs: over 4 x --sim-budget"}
            _FIT_RUNS[key] = sim.run_op(
                op, make("cpu", fit["reduced"]), opts, counters=True, checkers=False
            )[1]
        runs.append(copy.deepcopy(_FIT_RUNS[key]))
    counters = big_shapes.fit_counters(runs, fit["points"], fit["x"], fit["scale"](full, small))
    if fit["reduced"]:
        counters = [scale_counters(c, factor) for c in counters]
    c_chip = chip(chip_name)
    modelled = 0
    for d, c, resident in zip(full.dispatches, counters, residents, strict=True):
        pieces = fit["pieces"](d.kernel, d.grid)
        inline = {b.index for b in d.bindings if b.kind == "bytes"}
        written = sum(int(b["written"]) for i, b in c["buffers"].items() if int(i) not in inline)
        if pieces is not None:
            groups = math.prod(d.grid)
            c["dram_read"] = big_shapes.reuse_dram(
                groups, resident, int(c_chip["slc_bytes"]), pieces, written / groups
            )
            c["dram_written"] = written
            c["dram_source"] = "reuse model (bench/big_shapes.py)"
            modelled += 1
    result = timing().predict_call(full.dispatches, counters, chip_name)
    points = ",".join(map(str, fit["points"]))
    dram = {0: "DRAM = device bytes", len(counters): "reuse-model DRAM"}.get(
        modelled, f"reuse-model DRAM on {modelled} of {len(counters)} dispatches"
    )
    result["how"] = f"fitted ({points}), {dram}"
    result["records"] = [
        {"kernel": d.kernel, "grid": d.grid, "threads": d.threads, "counters": c}
        for d, c in zip(full.dispatches, counters, strict=True)
    ]
    return result


# --- PyTorch's kernels ---------------------------------------------------------------------


def pytorch_records(
    make: Callable[[bool], tuple],
    factor: int,
    chip_name: str,
    budget: float,
    work: float,
    fit: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """PyTorch's kernels' prediction of one F.sdpa call (no grad) on one chip.

    make(reduced) -> (q, k, v, kwargs of pytorch_mps.launches) on CPU; factor and work as for
    steel_records (PyTorch's grids are per query head, so the reduction always applies); fit:
    as for steel_records, its make_at(n) giving make(reduced) at point n."""
    import pytorch_mps  # noqa: PLC0415 (bench/ is on the path of the scripts that use this)

    q, k, v, kw = make(True)
    *full_qkv, full_kw = make(False)
    _, full_launches = pytorch_mps.launches(*full_qkv, **full_kw)
    _, launches = pytorch_mps.launches(q, k, v, **kw)
    geometries = [_pytorch_geometry(x) for x in full_launches]
    infos = [_pytorch_info(x, q.dtype) for x in full_launches]
    how = "heads reduced" if factor > 1 else "full"
    residents = [_resident(chip_name, g, i) for g, i in zip(geometries, infos, strict=True)]
    run_groups = [math.prod(tuple(x["grid"])) for x in launches]
    sample = _sampling(work, budget, run_groups, residents)
    if isinstance(sample, str) and fit is not None:
        return _pytorch_fitted(full_launches, geometries, infos, fit, factor, chip_name, residents)
    if isinstance(sample, str):
        return {"skipped": sample}
    counters = []
    for i, launch in enumerate(launches):
        extra: dict[str, Any] = {}
        if cache_model_available():
            extra["cache"] = _cache(chip_name, residents[i])
        if sample is not None:
            extra["sample"] = sample
        c = pytorch_mps.run(launch, counters=True, checkers=False, **extra)
        if c.get("sampled", {}).get("extrapolated") and "sampled" not in how:
            how += ", sampled"
        counters.append(scale_counters(c, factor))
    result = timing().predict_call(geometries, counters, chip_name, infos)
    result["how"] = how
    result["records"] = [
        {
            "kernel": launch["name"],
            "grid": g["grid"],
            "threads": g["threads"],
            "threadgroup_memory": launch["threadgroup_memory_bytes"],
            "counters": c,
        }
        for launch, g, c in zip(full_launches, geometries, counters, strict=True)
    ]
    return result


def _pytorch_fitted(full_launches, geometries, infos, fit, factor, chip_name, residents):
    """PyTorch's kernels on a shape over the budget, fitted as steel's are (_fitted)."""
    import big_shapes  # noqa: PLC0415
    import pytorch_mps  # noqa: PLC0415

    runs = []
    for n in fit["points"]:
        q, k, v, kw = fit["make_at"](n)(True)
        _, launches = pytorch_mps.launches(q, k, v, **kw)
        names = [(x["name"], tuple(x["threads"])) for x in launches]
        if names != [(x["name"], tuple(x["threads"])) for x in full_launches]:
            return {"skipped": f"fit at {n}: PyTorch's host picks other kernels ({names})"}
        runs.append([pytorch_mps.run(x, counters=True, checkers=False) for x in launches])
    counters = [
        scale_counters(c, factor) for c in big_shapes.fit_counters(runs, fit["points"], fit["x"])
    ]
    slc = int(chip(chip_name)["slc_bytes"])
    for g, c, resident, launch in zip(geometries, counters, residents, full_launches, strict=True):
        pieces = fit["pieces"](launch["name"], g["grid"])
        inline = {b["index"] for b in g["bindings"] if b["kind"] == "bytes"}
        if pieces is not None:
            groups = math.prod(g["grid"])
            written = sum(
                int(b["written"]) for i, b in c["buffers"].items() if int(i) not in inline
            )
            c["dram_read"] = big_shapes.reuse_dram(groups, resident, slc, pieces, written / groups)
            c["dram_written"] = written
            c["dram_source"] = "reuse model (bench/big_shapes.py)"
    result = timing().predict_call(geometries, counters, chip_name, infos)
    result["how"] = f"fitted ({','.join(map(str, fit['points']))}), reuse-model DRAM"
    result["records"] = [
        {"kernel": x["name"], "grid": g["grid"], "threads": g["threads"], "counters": c}
        for x, g, c in zip(full_launches, geometries, counters, strict=True)
    ]
    return result


def _pytorch_geometry(launch: dict) -> dict[str, Any]:
    grid = tuple(launch["grid"]) + (1,) * (3 - len(launch["grid"]))
    threads = tuple(launch["threads"]) + (1,) * (3 - len(launch["threads"]))
    bindings = [
        {"index": i, "kind": "tensor" if isinstance(b, torch.Tensor) else "bytes"}
        for i, b in launch["buffers"].items()
    ]
    return {"grid": grid, "threads": threads, "threadgroup_memory": 0, "bindings": bindings}


def _pytorch_info(launch: dict, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "registers": None,
        "register_basis": "PyTorch's kernel: not estimated",
        "mma_dtype": {torch.float16: "half", torch.bfloat16: "bfloat", torch.float32: "float"}[
            dtype
        ],
        "threadgroup_memory": launch["threadgroup_memory_bytes"],
    }


# --- PyTorch's composite paths, op by op -----------------------------------------------------


def op(name: str, flops: float = 0.0, read: float = 0.0, written: float = 0.0, matmul=False):
    return {"op": name, "flops": flops, "bytes": read + written, "matmul": matmul}


def roofline_peaks(chip_name: str, dtype: torch.dtype) -> dict[str, float]:
    """{"matrix": FLOP/s, "alu": FLOP/s, "dram": bytes/s} of the chip's table: the simdgroup
    matrix rate (x 2 FLOP per FMA; on M5 the neural accelerators' matmul2d rate when larger),
    the ALU rate, the DRAM bandwidth."""
    c = chip(chip_name)
    per_s = int(c["gpu_cores"]) * float(c["clock_ghz"]) * 1e9
    matrix = 2 * float(c[_MMA_FIELD[dtype]])
    if c["family"] == "apple10" and dtype != torch.float32:
        matrix = max(matrix, float(c["matmul2d_flop_per_core_cycle"]))
    return {
        "matrix": matrix * per_s,
        "alu": float(c[_ALU_FIELD[dtype]]) * per_s,
        "dram": float(c["dram_bytes_per_s"]),
    }


def composite_time(ops: Sequence[dict], chip_name: str, dtype: torch.dtype) -> dict[str, Any]:
    """Each op at its roofline plus one dispatch overhead; the bound of the longest op."""
    peaks = roofline_peaks(chip_name, dtype)
    overhead = float(chip(chip_name)["dispatch_overhead_s"])
    parts = []
    for o in ops:
        compute = o["flops"] / (peaks["matrix"] if o["matmul"] else peaks["alu"])
        memory = o["bytes"] / peaks["dram"]
        bound = "compute" if compute >= memory else "dram"
        parts.append({**o, "time_s": max(compute, memory) + overhead, "bound": bound})
    longest = max(parts, key=lambda p: p["time_s"])
    return {
        "time_s": sum(p["time_s"] for p in parts),
        "bound": f"{longest['bound']} ({longest['op']})",
        "ops": parts,
        "dram_bytes": sum(p["bytes"] for p in parts),
    }


def dram_bytes(result: Mapping[str, Any]) -> float:
    if "dram_bytes" in result:
        return float(result["dram_bytes"])
    return float(sum(d.get("dram_bytes", 0) for d in result.get("dispatches", [])))


# --- output --------------------------------------------------------------------------------


def ratio(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> float | None:
    """PyTorch's predicted time over steel's (> 1: steel is predicted faster)."""
    if "time_s" not in ours or "time_s" not in theirs:
        return None
    return theirs["time_s"] / ours["time_s"]


HEADER = (
    f"{'shape':34} {'steel us':>10} {'PyTorch us':>10} {'ratio':>7} {'steel bound':>18} "
    f"{'PyTorch bound':>26} {'steel TF':>8} {'GB/s':>7}  how"
)


def row(name: str, flops: float, ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> str:
    def us(r):
        return f"{r['time_s'] * 1e6:10.1f}" if "time_s" in r else f"{'-':>10}"

    def bound(r, width):
        return f"{str(r.get('bound', '-'))[:width]:>{width}}"

    q = ratio(ours, theirs)
    tf = f"{flops / ours['time_s'] / 1e12:8.2f}" if "time_s" in ours else f"{'-':>8}"
    gbs = f"{dram_bytes(ours) / ours['time_s'] / 1e9:7.1f}" if "time_s" in ours else f"{'-':>7}"
    notes = [
        ours.get("how") or ours.get("skipped", ""),
        theirs.get("how") or theirs.get("skipped", ""),
    ]
    return (
        f"{name[:34]:34} {us(ours)} {us(theirs)} "
        f"{(f'{q:7.2f}' if q is not None else f'{chr(45):>7}')} {bound(ours, 18)} "
        f"{bound(theirs, 26)} {tf} {gbs}  steel: {notes[0]}; PyTorch: {notes[1]}"
    )


def plot(
    path: Path,
    chip_name: str,
    series: Mapping[str, list],
    roof: Mapping[str, float],
    x_label: str = "L",
):
    """series: {label: [(x, TFLOPS, GB/s), ...]}; two panels against x (L by default), with
    the chip's matrix peak and DRAM bandwidth drawn as the roofline. Returns the file written,
    or None without matplotlib."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, points in series.items():
        points = sorted(points)
        if not points:
            continue
        ls = [p[0] for p in points]
        style = "-o" if label.startswith("steel") else "--s"
        left.plot(ls, [p[1] for p in points], style, label=label, markersize=4)
        right.plot(ls, [p[2] for p in points], style, label=label, markersize=4)
    left.axhline(roof["matrix"] / 1e12, color="k", lw=1, label="matrix peak (roofline)")
    right.axhline(roof["dram"] / 1e9, color="k", lw=1, label="DRAM bandwidth (roofline)")
    for ax, what in ((left, "predicted TFLOPS"), (right, "predicted DRAM GB/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(x_label)
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=7)
    fig.suptitle(f"{chip_name}: predicted by the timing model from simulator counters")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
