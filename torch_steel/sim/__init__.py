"""The CPU Metal simulator: run the shipped shaders on CPU tensors (DESIGN.md section 4).

    available()                       clang-19 is installed and the simulator builds
    plan(op, tensors, options)        the launch plan the Metal host would encode
    run_op(op, tensors, options)      execute that plan on CPU tensors, return the outputs
    run_kernel(name, sources=...)     launch one kernel of test-only .metal files directly
    device(description)               plan and run in a block as on a made-up GPU
    predict(op, tensors, options, chip=)  the predicted time on an Apple GPU (timing.py)

Kernel faults (out-of-bounds access, threadgroup-memory race, divergent barrier or simd op,
resource limits) raise torch_steel.errors.SimulatorError naming the kernel; refused plans raise
torch_steel.errors.PlanRefused.

The front end of the simulator is this package: this module (planning and running),
build.py (the on-demand build of mps_src/sim and the shaders), translate.py (the MSL source
pre-pass) and ir.py (the IR pass that shows clang's memory intrinsics to the checkers). The
execution half is C++ in mps_src/sim/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from torch_steel.errors import PlanRefused, SimulatorError
from torch_steel.sim import build, traffic

# steel::DType codes (mps_src/plan/plan.h).
_DTYPES = {
    torch.float16: 0,
    torch.bfloat16: 1,
    torch.float32: 2,
    torch.int32: 3,
    torch.int64: 4,
    torch.bool: 5,
    torch.int8: 6,  # quantized K/V codes (torch_steel.kv)
    torch.uint8: 7,
}
_DTYPE_NAMES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def available() -> bool:
    """True when clang-19 is installed and the simulator builds on this machine."""
    return build.available()


@dataclasses.dataclass(frozen=True)
class Binding:
    index: int
    kind: str  # "tensor" or "bytes"
    slot: int  # kind == "tensor"
    bytes: bytes  # kind == "bytes"


@dataclasses.dataclass(frozen=True)
class Dispatch:
    kernel: str
    constants: dict[int, bool | int | float]
    bindings: list[Binding]
    grid: tuple[int, int, int]
    threads: tuple[int, int, int]
    threadgroup_memory: dict[int, int]


@dataclasses.dataclass(frozen=True)
class Allocation:
    name: str
    dtype: torch.dtype
    sizes: tuple[int, ...]
    zero_init: bool
    is_output: bool
    order: tuple[int, ...] = ()  # memory order of the dims, outermost first; () is row-major


@dataclasses.dataclass(frozen=True)
class Plan:
    """Mirror of steel::Plan (mps_src/plan/plan.h)."""

    ok: bool
    reason: str
    inputs: int
    contiguous_inputs: list[int]
    allocations: list[Allocation]
    dispatches: list[Dispatch]
    handle: Any = dataclasses.field(repr=False, compare=False, default=None)


def _desc(t: torch.Tensor | None):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a Tensor or None, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise PlanRefused(f"dtype {t.dtype} is not supported by the Metal kernels")
    return (_DTYPES[t.dtype], list(t.shape), list(t.stride()), int(t.storage_offset()))


def _storages(tensors: Sequence[torch.Tensor | None]) -> list[int]:
    """TensorDesc::storage of each tensor (mps_src/plan/plan.h): 1 + the position of the first
    tensor of the call on the same storage, 0 for None. What the attention planner decides a
    K/V alias from (v a prefix view of k), as the Metal host does from its tensors."""
    first: dict[int, int] = {}
    out = []
    for i, t in enumerate(tensors):
        # The storage object itself (_cdata), not its data pointer: meta tensors (the bench's
        # plans) have none, and empty storages may share one.
        out.append(0 if t is None else first.setdefault(t.untyped_storage()._cdata, i + 1))
    return out


def _options(options: Mapping[str, Any] | None):
    numbers: dict[str, float] = {}
    strings: dict[str, str] = {}
    for name, value in (options or {}).items():
        if isinstance(value, str):
            strings[name] = value
        elif isinstance(value, (bool, int, float)):
            numbers[name] = float(value)
        elif value is None:
            continue
        else:
            raise TypeError(f"option {name!r}: expected a number, bool or str, got {value!r}")
    return numbers, strings


def _wrap_plan(handle) -> Plan:
    d = handle.describe()
    return Plan(
        ok=d["ok"],
        reason=d["reason"],
        inputs=d["inputs"],
        contiguous_inputs=list(d["contiguous_inputs"]),
        allocations=[
            Allocation(
                a["name"],
                _DTYPE_NAMES[a["dtype"]],
                tuple(a["sizes"]),
                a["zero_init"],
                a["is_output"],
                tuple(a["order"]),
            )
            for a in d["allocations"]
        ],
        dispatches=[
            Dispatch(
                kernel=x["kernel"],
                constants=dict(x["constants"]),
                bindings=[
                    Binding(b["index"], b["kind"], b["slot"], b["bytes"]) for b in x["bindings"]
                ],
                grid=tuple(x["grid"]),
                threads=tuple(x["threads"]),
                threadgroup_memory=dict(x["threadgroup_memory"]),
            )
            for x in d["dispatches"]
        ],
        handle=handle,
    )


_described = threading.local()


@contextlib.contextmanager
def device(description: Mapping[str, Any]):
    """Plans (and so run_op and the "sim" backend) in the block as on the GPU that
    `description` describes: the options of mps_src/plan/device.h, e.g.
    {"device_apple_family": 10, "device_metal4": True, "device_tensor_ops": True} for an
    M5-generation GPU with Metal 4 and the tensor-op library, as the Metal host fills them from
    the real device. A call's own options take precedence. Outside such a block no device is
    described and every plan keeps the simdgroup-matrix kernels. Per thread; blocks nest."""
    previous = getattr(_described, "options", {})
    _described.options = {**previous, **description}
    try:
        yield
    finally:
        _described.options = previous


def plan(
    op: str, tensors: Sequence[torch.Tensor | None], options: Mapping[str, Any] | None = None
) -> Plan:
    """The launch plan for `op` (refused plans have ok=False and a reason; nothing is raised)."""
    ext = build.extension()
    numbers, strings = _options({**getattr(_described, "options", {}), **(options or {})})
    try:
        descs = [_desc(t) for t in tensors]
    except PlanRefused as e:
        return Plan(False, str(e), len(tensors), [], [], [])
    return _wrap_plan(ext.make_plan(op, descs, numbers, strings, storages=_storages(tensors)))


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes the view can reach from its storage offset (its bound region)."""
    if t.numel() == 0:
        return 0
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def _allocate(a: Allocation) -> torch.Tensor:
    """A plan allocation, laid out in its memory order (Allocation.order). Metal buffers start
    uninitialized: unless the plan asks for zeros, fill them with NaN (or all-one bits for
    integers), so that an element a kernel forgets to write shows up in the results instead of
    passing as a plausible 0."""
    order = a.order or tuple(range(len(a.sizes)))
    stored = [a.sizes[d] for d in order]
    if a.zero_init:
        t = torch.zeros(stored, dtype=a.dtype)
    elif a.dtype.is_floating_point:
        t = torch.full(stored, float("nan"), dtype=a.dtype)
    elif a.dtype == torch.bool:
        t = torch.ones(stored, dtype=a.dtype)
    else:
        t = torch.full(stored, -1, dtype=a.dtype)
    back = [0] * len(order)
    for i, d in enumerate(order):
        back[d] = i
    return t.permute(back)


def _checkers_default() -> bool:
    return os.environ.get("TORCH_STEEL_SIM_CHECKERS", "1") != "0"


_PC = re.compile(r" \[pc (\S+)\+0x([0-9a-f]+)\]")
_MAX_FRAMES = 6


def _symbolize(message: str) -> str:
    """Replaces the runtime's " [pc <library>+0x<offset>]" markers by the shader source lines
    (file:line:column and function, innermost inlined frame first) using llvm-symbolizer."""
    tool = shutil.which("llvm-symbolizer-19") or shutil.which("llvm-symbolizer")
    if tool is None:
        return message

    def frames(m: re.Match) -> str:
        try:
            out = subprocess.run(
                [tool, f"--obj={m.group(1)}", f"0x{m.group(2)}"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return m.group(0)
        lines = [x for x in out.splitlines() if x.strip()]
        found = []
        for function, location in zip(lines[0::2], lines[1::2], strict=False):
            path, _, rest = location.partition(":")
            if path == "??" or Path(path).resolve().is_relative_to(build.SHIM):
                continue  # the shim's own frames say nothing about the kernel
            try:
                path = str(Path(path).resolve().relative_to(build.ROOT))
            except ValueError:
                pass
            found.append(f"{path}:{rest} ({function})")
        if not found:
            return m.group(0)
        shown = found[:_MAX_FRAMES] + (["..."] if len(found) > _MAX_FRAMES else [])
        return "\n    at " + "\n    in ".join(shown)

    return _PC.sub(frames, message)


def _call(lib: build.ShaderLibrary, fn, *args):
    ext = build.extension()
    try:
        return fn(lib.handle, *args)
    except ext.SimError as e:
        message = _symbolize(str(e))
        if " not found in " in message and lib.errors:
            message += "\nThese shader files did not build:\n" + lib.errors
        raise SimulatorError(message) from None


def _counters(raw: list[dict]) -> list[dict]:
    return [dict(c, buffers={int(k): dict(v) for k, v in c["buffers"].items()}) for c in raw]


def run_op(
    op: str,
    tensors: Sequence[torch.Tensor | None],
    options: Mapping[str, Any] | None = None,
    *,
    counters: bool = False,
    checkers: bool | None = None,
    cache: Mapping[str, Any] | None = None,
    sample: int | Mapping[str, Any] | None = None,
):
    """Execute `op`'s launch plan on CPU tensors; returns the outputs (and per-dispatch counters).

    cache: {"l2_bytes", "slc_bytes", "resident_threadgroups", "line_bytes" (default 128)}: replay
    each dispatch's device accesses through the cache model; each counters dict then has
    dram_read, dram_written (bytes) and l2_hits, l2_misses, slc_hits, slc_misses (lines).
    resident_threadgroups is an int, a list (one per dispatch) or a callable taking the plan's
    Dispatch. sample: T or {"threadgroups": T (64), "waves": K (2), "warm": W (1)}: run T
    strata of threadgroups of each dispatch (and with cache=, K strata of waves, each after W
    warm-up waves) and extrapolate every counter (torch_steel/sim/traffic.py); the outputs are
    then partial, so None is returned in their place. cache and sample need counters=True.

    Raises PlanRefused when the plan refuses, SimulatorError when a kernel faults.
    """
    if (cache is not None or sample is not None) and not counters:
        raise ValueError("cache= and sample= give counters: pass counters=True")
    p = plan(op, tensors, options)
    if not p.ok:
        raise PlanRefused(p.reason)
    slots: list[torch.Tensor | None] = []
    for i, t in enumerate(tensors):
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"the simulator runs on CPU tensors; argument {i} is on {t.device}")
        if t is not None and i in p.contiguous_inputs:
            t = t.contiguous()
        slots.append(t)
    for a in p.allocations:
        slots.append(_allocate(a))
    raw_slots = [None if t is None else (t.data_ptr(), _extent_bytes(t)) for t in slots]
    lib = build.shader_library()
    ext = build.extension()
    use_checkers = _checkers_default() if checkers is None else checkers
    resident_arg = traffic.cache_resident(cache)
    residents = [
        None if resident_arg is None else traffic.resident_for(resident_arg, i, d)
        for i, d in enumerate(p.dispatches)
    ]
    caches = [traffic.cache_arg(cache, r) for r in residents]
    outputs = [slots[p.inputs + i] for i, a in enumerate(p.allocations) if a.is_output]
    if sample is None:
        raw = _call(lib, ext.run_plan, p.handle, raw_slots, use_checkers, caches, [], counters)
        per_dispatch = _counters([r[0] for r in raw])
        return (outputs, per_dispatch) if counters else outputs
    sampling = traffic.Sampling(sample, cache)
    plans = [
        traffic.runs(sampling, d.grid, r) for d, r in zip(p.dispatches, residents, strict=True)
    ]
    by_tg = _call(
        lib, ext.run_plan, p.handle, raw_slots, use_checkers, [], [x[0] for x in plans], counters
    )
    by_wave = [None] * len(plans)
    if cache is not None:
        by_wave = _call(
            lib,
            ext.run_plan,
            p.handle,
            raw_slots,
            use_checkers,
            caches,
            [x[2] for x in plans],
            counters,
        )
    return None, [
        traffic.combine(
            _counters(t), x[1], None if w is None else _counters(w), x[3], _threadgroups(d.grid), r
        )
        for t, w, x, d, r in zip(by_tg, by_wave, plans, p.dispatches, residents, strict=True)
    ]


def _threadgroups(grid: Sequence[int]) -> int:
    return grid[0] * grid[1] * grid[2]


def run_kernel(
    name: str,
    *,
    sources: Sequence[str | os.PathLike],
    grid: Sequence[int] | None = None,
    threads: Sequence[int],
    buffers: Mapping[int, torch.Tensor | bytes],
    threads_grid: Sequence[int] | None = None,
    constants: Mapping[int, bool | int | float] | None = None,
    threadgroup_memory: Mapping[int, int] | None = None,
    counters: bool = False,
    checkers: bool | None = None,
    include_dirs: Sequence[str | os.PathLike] = (),
    cache: Mapping[str, Any] | None = None,
    sample: int | Mapping[str, Any] | None = None,
    std: str | None = None,
):
    """Launch kernel `name` (its host name) from a test library built from `sources` (.metal).

    include_dirs: directories searched by the sources' `#include <dir/name.h>` (the pre-pass
    preprocesses each source with its headers). std: the language version, as `xcrun metal
    -std=` takes it ("metal3.1", "metal4.0"; by default chosen from what each source uses, as
    the package's own build does: *_msl4.metal files are metal4.0).

    grid: threadgroups per grid (dispatchThreadgroups). threads_grid instead: threads per grid
    (dispatchThreads), in ceil(threads_grid / threads) threadgroups, the last one in each
    dimension partial (its threads_per_threadgroup and simdgroups are those of its own size).
    buffers: {index: CPU Tensor (bound at its storage offset, written back in place) or bytes}.
    constants: {function_constant index: value}; threadgroup_memory: {index: bytes}.
    Returns the dispatch's counters dict when counters=True, else None.
    cache, sample: as for run_op (resident_threadgroups an int); a sampled run's buffers hold
    partial results.
    """
    if (cache is not None or sample is not None) and not counters:
        raise ValueError("cache= and sample= give counters: pass counters=True")
    if (grid is None) == (threads_grid is None):
        raise ValueError("pass grid= (threadgroups) or threads_grid= (threads), not both")
    threads3 = _dim3(threads, "threads")
    threads_grid3 = (0, 0, 0)
    if threads_grid is not None:
        threads_grid3 = _dim3(threads_grid, "threads_grid")
        if 0 in threads3:
            raise ValueError(f"threads: expected positive sizes, got {threads3}")
        grid3 = tuple(-(-n // t) for n, t in zip(threads_grid3, threads3, strict=True))
    else:
        grid3 = _dim3(grid, "grid")
    raw_buffers = []
    keep = []
    for index, b in sorted(buffers.items()):
        if isinstance(b, torch.Tensor):
            if b.device.type != "cpu":
                raise ValueError(f"buffer {index}: the simulator runs on CPU tensors")
            raw_buffers.append((int(index), b.data_ptr(), _extent_bytes(b), True))
        elif isinstance(b, (bytes, bytearray, memoryview)):
            data = torch.frombuffer(bytearray(b), dtype=torch.uint8) if len(b) else torch.empty(0)
            keep.append(data)
            raw_buffers.append((int(index), data.data_ptr(), len(b), False))
        else:
            raise TypeError(f"buffer {index}: expected a Tensor or bytes, got {type(b).__name__}")
    raw_constants = []
    for index, v in sorted((constants or {}).items()):
        if isinstance(v, bool):
            raw_constants.append((int(index), 0, int(v), 0.0))
        elif isinstance(v, int):
            raw_constants.append((int(index), 1, v, 0.0))
        elif isinstance(v, float):
            raw_constants.append((int(index), 3, 0, v))
        else:
            raise TypeError(f"constant {index}: expected bool, int or float, got {v!r}")
    raw_tgmem = [(int(i), int(n)) for i, n in sorted((threadgroup_memory or {}).items())]
    lib = build.test_library([Path(s) for s in sources], [Path(d) for d in include_dirs], std)
    ext = build.extension()
    use_checkers = _checkers_default() if checkers is None else checkers
    resident_arg = traffic.cache_resident(cache)
    resident = None if resident_arg is None else traffic.resident_for(resident_arg, 0, None)
    cache_spec = traffic.cache_arg(cache, resident)

    def launch(with_cache, groups):
        return _counters(
            _call(
                lib,
                ext.launch,
                name,
                raw_constants,
                raw_buffers,
                raw_tgmem,
                grid3,
                threads3,
                use_checkers,
                cache_spec if with_cache else None,
                groups,
                counters,
                threads_grid3,
            )
        )

    try:
        if sample is None:
            result = launch(True, [])[0]  # launched either way: the buffers are the output
            return result if counters else None
        tg, tw, wg, ww = traffic.runs(traffic.Sampling(sample, cache), grid3, resident)
        by_tg = launch(False, tg)
        by_wave = None if wg is None else launch(True, wg)
        return traffic.combine(by_tg, tw, by_wave, ww, _threadgroups(grid3), resident)
    finally:
        del keep


def _dim3(v: Sequence[int] | int, what: str) -> tuple[int, int, int]:
    if isinstance(v, int):
        v = (v,)
    v = tuple(int(x) for x in v)
    if not 1 <= len(v) <= 3 or any(x < 0 for x in v):
        raise ValueError(f"{what}: expected 1 to 3 non-negative sizes, got {v}")
    return v + (1,) * (3 - len(v))


def metal_device_name(chip: str) -> str:
    """The name Metal gives the GPU of `chip` (a name of timing.chips()): MTLDevice.name."""
    return f"Apple {chip}"


def metal_description(chip: str) -> dict[str, Any]:
    """The device description (mps_src/plan/device.h) the Metal host gives the plans on `chip`
    (a name of timing.chips()): its core count, as the host reads the IORegistry's, and its
    name, by which the plans know its DRAM rate."""
    from torch_steel.sim import timing  # noqa: PLC0415 (keeps the package import light)

    return {
        "gpu_cores": int(timing.chip(chip)["gpu_cores"]),
        "device_name": metal_device_name(chip),
    }


def predict(
    op: str,
    tensors: Sequence[torch.Tensor | None],
    options: Mapping[str, Any] | None = None,
    *,
    chip: str,
    checkers: bool = False,
    cache: bool = True,
    sample: int | Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Predicted time of `op` on `chip` (a name of timing.chips()): runs the op's plan in the
    simulator with counters and applies the timing model (timing.py) to every dispatch.

    cache: replay the device accesses through the cache model with the chip's L2 and
    system-level cache and waves of timing.resident_threadgroups (DRAM bytes for the model);
    False keeps the model's fallback (the tensors' device bytes). sample: as for run_op (big
    dispatches; outputs are then None).

    The plan is the one the Metal host makes on the chip: for its core count (the
    description's "gpu_cores", as the host reads the GPU's; mps_src/plan/device.h) and its name
    ("device_name", "Apple " and the chip's, as Metal names it: the decode planner's DRAM rate)
    unless `options` set them.

    Returns {"chip", "time_s" (the sum over dispatches), "bound" (that of the longest dispatch),
    "dispatches": [timing.predict_dispatch's result per dispatch], "outputs"}. The checkers are
    off by default: they change no counter and cost time."""
    from torch_steel.sim import timing  # noqa: PLC0415 (keeps the package import light)

    record = timing.chip(chip)
    with device(metal_description(chip)):
        p = plan(op, tensors, options)
        if not p.ok:
            raise PlanRefused(p.reason)
        description = None
        if cache:
            description = {
                "l2_bytes": int(record["l2_bytes"]),
                "slc_bytes": int(record["slc_bytes"]),
                "resident_threadgroups": lambda d: timing.resident_threadgroups(d, record),
            }
        outputs, raw = run_op(
            op, tensors, options, counters=True, checkers=checkers, cache=description, sample=sample
        )
    result = timing.predict_call(p.dispatches, raw, record)
    result["outputs"] = outputs
    return result
