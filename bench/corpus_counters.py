"""Foreign corpora's counters beside steel's on the same shapes (issue 26, deliverable 5), and the
timing model's predicted time of each (issue 24).

    python bench/corpus_counters.py [--family prefill|decode|gemm] [--chips M1,M3 Max,M4 Pro]

For each shape, steel's kernels for the call (the plan the Metal host encodes on the chip,
sim.plan with side_by_side.plan_options) and every foreign kernel that serves the same call, run
in the simulator unmodified with its own host's bindings:

- prefill: steel's forward (sdpa) against PyTorch's prefill kernel (bench/pytorch_mps.py, as
  bench_attention.py --predict runs it), MLX's steel attention (bench/mlx_metal.py) and
  llama.cpp's flash_attn_ext (bench/llama_metal.py: its pad, mask-block and half8x8 kernels);
- decode (1-4 query rows): steel's decode kernels against PyTorch's and MLX's sdpa_vector (one
  pass: both hosts take their two-pass kernel from 1024 keys on; MLX's is not bound, so S stays
  below) and llama.cpp's vector flash_attn_ext (its pad, vector and reduce kernels);
- gemm: steel's GEMM against MLX's steel_gemm_fused (its host's tile for batch * M * N < 2^20).

Per implementation (summed over its dispatches): 8x8x8 simdgroup MMAs, the simd instructions by
class, shuffles/reductions/ballots, device bytes read and written (tensors apart from setBytes
params; per tensor of the call), threadgroup bytes, barriers, DRAM bytes through the cache model
of each chip, and the timing model's predicted time and bound (torch_steel/sim/timing.py, as
bench/side_by_side.py applies it). Counters of a foreign kernel do not depend on the chip; steel's
may (its plan follows the core count), and a chip whose plan differs gets a column of its own.

Assumptions (also in docs/simulator.md, "Counters side by side"):
- the same call: the same shape and dtype, except where the foreign host cannot take it:
  llama.cpp's Q and result are float32 (ggml's flash_attn_ext takes them so), its K/V float16,
  and its KQ mask is always bound (ggml's graphs pass one; without it the kernel divides by
  zero, tests/sim/test_llama_corpus.py): 0 where a key is seen, -inf above the diagonal for a
  causal shape. It runs only on the float16 shapes. MLX's causal diagonal is at the lower right;
  the causal shapes have L = S, where it is steel's (and PyTorch's) top-left one.
- MLX's kernels are instantiated where tests/sim/kernels/mlx_*.metal instantiate them (float32
  head dim 64, float16 head dim 128; GEMM float32 nn, float16 nt): the shapes keep to those.
- registers: steel's kernels carry the timing model's estimate (timing.steel_kernel_info);
  foreign kernels have none, so registers do not limit their occupancy (favouring them).
- chips: no M5-generation chip by default. There MLX's host takes its NAX (matmul2d) kernels,
  which are not bound here, and steel's plan its matmul2d ones: a comparison with MLX's
  simdgroup kernels would not be the one a Mac runs.
- shapes are small (the simulator runs every threadgroup); the predictions at this size are
  dominated by the dispatch overhead and one wave, and say which kernel does less work, not how
  large shapes scale (bench_attention.py --predict has those for PyTorch's kernels).

A corpus that cannot be fetched (offline) is skipped with the reason; steel's side still runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import corpora  # noqa: E402
import llama_metal  # noqa: E402
import mlx_metal  # noqa: E402
import pytorch_mps  # noqa: E402
import side_by_side as sbs  # noqa: E402

from torch_steel import sim  # noqa: E402
from torch_steel.sim import timing  # noqa: E402

CHIPS = ("M1", "M3 Max", "M4 Pro")


@dataclasses.dataclass(frozen=True)
class Case:
    """One call. Attention: B, H, Hkv, L (query rows), S (keys), D, causal; gemm: M, N, K and
    b_transposed (b is the transpose of a contiguous [N, K] matrix, as a linear layer's weight)."""

    family: str  # "prefill", "decode" or "gemm"
    name: str
    dtype: torch.dtype
    dims: Mapping[str, Any]


F16, F32 = torch.float16, torch.float32
CASES = [
    Case("prefill", "prefill f16 d128 H4/2 L=S=100", F16,
         dict(B=1, H=4, Hkv=2, L=100, S=100, D=128, causal=False)),
    Case("prefill", "prefill f16 d128 H2/2 L=S=128 causal", F16,
         dict(B=1, H=2, Hkv=2, L=128, S=128, D=128, causal=True)),
    Case("prefill", "prefill f32 d64 B2 H4/1 L=40 S=200", F32,
         dict(B=2, H=4, Hkv=1, L=40, S=200, D=64, causal=False)),
    Case("decode", "decode f16 d128 1 tok H8/2 S=512", F16,
         dict(B=1, H=8, Hkv=2, L=1, S=512, D=128, causal=False)),
    Case("decode", "decode f16 d128 4 tok H4/4 S=300", F16,
         dict(B=1, H=4, Hkv=4, L=4, S=300, D=128, causal=False)),
    Case("decode", "decode f32 d64 1 tok B2 H8/1 S=1000", F32,
         dict(B=2, H=8, Hkv=1, L=1, S=1000, D=64, causal=False)),
    Case("gemm", "gemm f16 x @ W^T 128x96x200", F16, dict(M=128, N=96, K=200, b_transposed=True)),
    Case("gemm", "gemm f16 x @ W^T 256x256x256", F16,
         dict(M=256, N=256, K=256, b_transposed=True)),
    Case("gemm", "gemm f32 100x72x40", F32, dict(M=100, N=72, K=40, b_transposed=False)),
]  # fmt: skip


# --- inputs --------------------------------------------------------------------------------


def attention_inputs(case: Case, device: str = "cpu") -> dict[str, torch.Tensor]:
    """q [B, H, L, D], k and v [B, Hkv, S, D] of the case's dtype."""
    d = case.dims
    shapes = {"q": (d["B"], d["H"], d["L"], d["D"]), "k": (d["B"], d["Hkv"], d["S"], d["D"])}
    shapes["v"] = shapes["k"]
    if device == "meta":
        return {n: torch.empty(s, dtype=case.dtype, device="meta") for n, s in shapes.items()}
    g = torch.Generator().manual_seed(d["L"] * 7 + d["S"])
    return {n: torch.randn(s, generator=g).to(case.dtype) for n, s in shapes.items()}


def gemm_inputs(case: Case, device: str = "cpu") -> dict[str, torch.Tensor]:
    """a [M, K] and b [K, N] (the transpose of a contiguous [N, K] when b_transposed)."""
    d = case.dims
    shape_b = (d["N"], d["K"]) if d["b_transposed"] else (d["K"], d["N"])
    if device == "meta":
        a = torch.empty(d["M"], d["K"], dtype=case.dtype, device="meta")
        b = torch.empty(shape_b, dtype=case.dtype, device="meta")
    else:
        g = torch.Generator().manual_seed(d["M"] + d["N"] + d["K"])
        a = torch.randn(d["M"], d["K"], generator=g).to(case.dtype)
        b = torch.randn(shape_b, generator=g).to(case.dtype)
    return {"a": a, "b": b.t() if d["b_transposed"] else b}


def inputs(case: Case, device: str = "cpu") -> dict[str, torch.Tensor]:
    return (gemm_inputs if case.family == "gemm" else attention_inputs)(case, device)


# --- steel's side --------------------------------------------------------------------------


def _steel_call(case: Case) -> tuple[str, list[str], dict[str, Any]]:
    """(op, the names of its tensor arguments, options) of steel's call."""
    if case.family == "gemm":
        return "gemm", ["a", "b", None, None], {}
    d = case.dims
    options = {
        "dropout_p": 0.0,
        "is_causal": d["causal"],
        "scale": 1 / math.sqrt(d["D"]),
        "softcap": 0.0,
        "window_left": -1,
        "window_right": -1,
        "bottom_right": False,
    }
    return "sdpa", ["q", "k", "v", None, None], options


def steel_side(case: Case, chip: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """steel's call on `chip`: {"dispatches": [{"kernel", "grid", "threads", "counters",
    "roles": {binding index: tensor name or "params"}}], "prediction": timing's result}."""
    op, names, options = _steel_call(case)

    def make(device, reduced):
        source = tensors if device == "cpu" else inputs(case, "meta")
        return [None if n is None else source[n] for n in names]

    result = sbs.steel_records(op, make, options, 1, chip, math.inf, 0.0)
    if "skipped" in result:
        raise RuntimeError(f"steel's plan: {result['skipped']}")
    plan = sim.plan(op, make("meta", False), sbs.plan_options(chip, options))
    slot_names = list(names) + [a.name for a in plan.allocations]
    dispatches = []
    for d, record in zip(plan.dispatches, result["records"], strict=True):
        roles = {
            b.index: "params" if b.kind == "bytes" else (slot_names[b.slot] or f"slot{b.slot}")
            for b in d.bindings
        }
        dispatches.append({**record, "roles": roles})
    prediction = {k: v for k, v in result.items() if k != "records"}
    return {"dispatches": dispatches, "prediction": prediction}


# --- foreign kernels -----------------------------------------------------------------------


def _geometry(launch: Mapping[str, Any], declared: int) -> dict[str, Any]:
    """The timing model's geometry of a run_kernel launch; declared: the threadgroup memory
    the kernel holds (the counters' threadgroup_memory_bytes of a run)."""
    pad = (1, 1, 1)
    return {
        "kernel": launch["name"],
        "grid": (tuple(launch["grid"]) + pad)[:3],
        "threads": (tuple(launch["threads"]) + pad)[:3],
        "threadgroup_memory": max(declared, sum(launch.get("threadgroup_memory", {}).values())),
        "bindings": [
            {"index": i, "kind": "tensor" if isinstance(b, torch.Tensor) else "bytes"}
            for i, b in launch["buffers"].items()
        ],
    }


_FOREIGN_INFO = {"registers": None, "register_basis": "foreign kernel: not estimated"}


def foreign_side(
    launches: Sequence[Mapping[str, Any]],
    run: Callable[..., dict],
    chips: Sequence[str],
    tensors: Mapping[str, torch.Tensor],
    cache: bool = True,
) -> dict[str, dict[str, Any]]:
    """{chip: {"dispatches", "prediction"}} of one call's launches, run in order: once for the
    chip-independent counters, then once per chip with its cache model (DRAM bytes)."""

    def where(t: torch.Tensor) -> tuple[int, int]:
        # A host may bind a tensor as another view of its storage (llama_metal binds K and V
        # from their first byte to the storage's end, as ggml binds a view of its cache).
        return t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size()

    names = {where(t): n for n, t in tensors.items()}

    def roles(launch):
        return {
            i: "params" if not isinstance(b, torch.Tensor) else names.get(where(b), "scratch")
            for i, b in launch["buffers"].items()
        }

    plain = [run(x, counters=True, checkers=False) for x in launches]
    out = {}
    for chip in chips:
        record = timing.chip(chip)
        geometries, counters = [], []
        for launch, c in zip(launches, plain, strict=True):
            g = _geometry(launch, int(c["threadgroup_memory_bytes"]))
            if cache:
                resident = timing.resident_threadgroups(g, record, _FOREIGN_INFO)
                description = {
                    "l2_bytes": int(record["l2_bytes"]),
                    "slc_bytes": int(record["slc_bytes"]),
                    "resident_threadgroups": resident,
                }
                c = run(launch, counters=True, checkers=False, cache=description)
            geometries.append(g)
            counters.append(c)
        prediction = timing.predict_call(
            geometries, counters, record, [_FOREIGN_INFO] * len(launches)
        )
        out[chip] = {
            "dispatches": [
                {
                    "kernel": x["name"],
                    "grid": g["grid"],
                    "threads": g["threads"],
                    "counters": c,
                    "roles": roles(x),
                }
                for x, g, c in zip(launches, geometries, counters, strict=True)
            ],
            "prediction": prediction,
        }
    return out


def _mlx_launches(case: Case, t: Mapping[str, torch.Tensor]) -> tuple[list, dict]:
    """MLX's launches for the case and the tensors they bind (its output included)."""
    d = case.dims
    if case.family == "gemm":
        a, b = t["a"].unsqueeze(0), t["b"].unsqueeze(0)
        out = torch.empty(1, d["M"], d["N"], dtype=case.dtype)
        return [mlx_metal.gemm_launch(a, b, out)], {"a": a, "b": b, "out": out}
    out = torch.empty(d["B"], d["H"], d["L"], d["D"], dtype=case.dtype)
    scale = d["D"] ** -0.5
    launch = mlx_metal.vector_launch if case.family == "decode" else mlx_metal.attention_launch
    x = launch(t["q"], t["k"], t["v"], out, scale, d["causal"])
    return [x], {"q": t["q"], "k": t["k"], "v": t["v"], "out": out}


def _llama_launches(case: Case, t: Mapping[str, torch.Tensor]) -> tuple[list, dict]:
    """llama.cpp's launches as its host picks them (float32 Q and result, float16 K/V, the KQ
    mask always bound): the vector kernel and its reduce for fewer than 20 queries, else the
    half8x8 kernel."""
    d = case.dims
    q, k, v = t["q"].float(), t["k"].half(), t["v"].half()
    keep = torch.ones(d["L"], d["S"], dtype=torch.bool)
    if d["causal"]:
        keep = keep.tril(d["S"] - d["L"])
    mask = torch.zeros(1, 1, d["L"], d["S"]).masked_fill(~keep, float("-inf")).half()
    out = torch.empty(d["B"], d["L"], d["H"], d["D"])
    launches = llama_metal.launches(q, k, v, out, d["D"] ** -0.5, mask)
    return launches, {"q": q, "k": k, "v": v, "mask": mask, "out": out}


def _pytorch_launches(case: Case, t: Mapping[str, torch.Tensor]) -> tuple[list, dict]:
    """PyTorch's launches as its host picks them (pytorch_mps.launches)."""
    out, launches = pytorch_mps.launches(t["q"], t["k"], t["v"], causal=case.dims["causal"])
    return launches, {"q": t["q"], "k": t["k"], "v": t["v"], "out": out}


def _pytorch_headers() -> None:
    if not pytorch_mps.available():
        raise corpora.CorpusUnavailable(
            f"torch {torch.__version__} ships no Metal kernel headers ({pytorch_mps.HEADERS})"
        )


def foreign_corpora(case: Case) -> list[tuple[str, Callable, Callable, Callable]]:
    """(label, fetch (raises corpora.CorpusUnavailable), launches(case, tensors), run) of
    every foreign kernel serving the case's call."""
    mlx_label = {"prefill": "MLX steel_attention", "decode": "MLX sdpa_vector",
                 "gemm": "MLX steel_gemm_fused"}[case.family]  # fmt: skip
    sides = []
    if case.family != "gemm":  # PyTorch's matmul is MPS's (bench_gemm.py --predict models it)
        label = "PyTorch prefill" if case.family == "prefill" else "PyTorch sdpa_vector"
        sides.append((label, _pytorch_headers, _pytorch_launches, pytorch_mps.run))
    sides.append((mlx_label, mlx_metal.include_dir, _mlx_launches, mlx_metal.run))
    if case.family != "gemm" and case.dtype == torch.float16:
        sides.append(
            ("llama.cpp flash_attn_ext", llama_metal.source_dir, _llama_launches, llama_metal.run)
        )
    return sides


# --- one case ------------------------------------------------------------------------------


def compare(case: Case, chips: Sequence[str] = CHIPS, cache: bool = True) -> dict[str, Any]:
    """{"case", "sides": [{"label", "by_chip": {chip: {"dispatches", "prediction"}},
    "tensors": {name: bytes}}], "skipped": [(label, reason)]} for one case."""
    tensors = inputs(case)
    sides = [
        {
            "label": "steel",
            "by_chip": {c: steel_side(case, c, tensors) for c in chips},
            "tensors": {n: t.nbytes for n, t in tensors.items()},
        }
    ]
    skipped = []
    for label, fetch, make, run in foreign_corpora(case):
        try:
            fetch()
        except corpora.CorpusUnavailable as e:
            skipped.append((label, str(e)))
            continue
        launches, bound = make(case, tensors)
        by_chip = foreign_side(launches, run, chips, bound, cache)
        sides.append(
            {
                "label": label,
                "by_chip": by_chip,
                "tensors": {n: t.nbytes for n, t in bound.items()},
            }
        )
    return {"case": case, "sides": sides, "skipped": skipped}


_SUMS = ("mma", "shuffles", "reductions", "ballots", "threadgroup_read", "threadgroup_written",
         "barriers", "device_loads", "device_stores", "dram_read", "dram_written")  # fmt: skip


def totals(dispatches: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A call's counters summed over its dispatches: the _SUMS counters, "instructions" and
    "mma_by_dtype" by class, "tensor_read" / "tensor_written" (device bytes of tensors),
    "params_read" (setBytes data), "by_tensor" {name: {"read", "written"}}."""
    t: dict[str, Any] = {k: 0 for k in _SUMS}
    t.update(instructions={}, mma_by_dtype={}, by_tensor={}, tensor_read=0, tensor_written=0)
    t["params_read"] = 0
    for d in dispatches:
        c = d["counters"]
        for k in _SUMS:
            t[k] += int(c.get(k, 0))
        for group in ("instructions", "mma_by_dtype"):
            for cls, n in c.get(group, {}).items():
                t[group][cls] = t[group].get(cls, 0) + int(n)
        for index, b in c["buffers"].items():
            role = d["roles"].get(int(index), f"buffer{index}")
            if role == "params":
                t["params_read"] += int(b["read"])
                continue
            t["tensor_read"] += int(b["read"])
            t["tensor_written"] += int(b["written"])
            slot = t["by_tensor"].setdefault(role, {"read": 0, "written": 0})
            slot["read"] += int(b["read"])
            slot["written"] += int(b["written"])
    return t


# --- output --------------------------------------------------------------------------------


def _work_key(dispatches) -> tuple:
    """What a chip's run of one side did, less its DRAM bytes (which follow the chip's caches)."""
    t = totals(dispatches)
    kernels = tuple((d["kernel"], tuple(d["grid"])) for d in dispatches)
    return kernels, tuple(sorted((k, str(v)) for k, v in t.items() if not k.startswith("dram")))


def columns(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One column per side, and per distinct plan of a side across chips: {"label", "chips",
    "dispatches" (of the first of those chips), "totals"}."""
    cols = []
    for side in result["sides"]:
        groups: dict[tuple, list[str]] = {}
        for chip, run in side["by_chip"].items():
            groups.setdefault(_work_key(run["dispatches"]), []).append(chip)
        for chip_list in groups.values():
            label = side["label"]
            if len(groups) > 1:
                label += f" ({', '.join(chip_list)} plan)"
            dispatches = side["by_chip"][chip_list[0]]["dispatches"]
            column = {"label": label, "chips": chip_list, "side": side}
            cols.append({**column, "dispatches": dispatches, "totals": totals(dispatches)})
    return cols


def _mb(n: float) -> str:
    return f"{n / 1e6:.3f}"


def _count(n: int) -> str:
    return f"{n:,}"


def table(result: Mapping[str, Any], chips: Sequence[str]) -> str:
    """The side-by-side table of one case (counters as rows, implementations as columns)."""
    case = result["case"]
    cols = columns(result)
    rows: list[tuple[str, list[str]]] = []

    def add(name, fn):
        """A row: fn(totals, column) for every column."""
        rows.append((name, [fn(c["totals"], c) for c in cols]))

    add("dispatches", lambda t, c: str(len(c["dispatches"])))
    add("threadgroups", lambda t, c: _count(sum(math.prod(d["grid"]) for d in c["dispatches"])))
    add("MMAs 8x8x8", lambda t, c: _count(t["mma"]))
    add("  of them half", lambda t, c: _count(t["mma_by_dtype"].get("half", 0)))
    for cls in sorted({k for c in cols for k in c["totals"]["instructions"]}):
        add(f"instructions {cls}", lambda t, c, cls=cls: _count(t["instructions"].get(cls, 0)))
    simd = ("shuffles", "reductions", "ballots")
    add("shuffles+reductions+ballots", lambda t, c: _count(sum(t[k] for k in simd)))
    add(
        "device loads / stores",
        lambda t, c: f"{_count(t['device_loads'])} / {_count(t['device_stores'])}",
    )
    add("device read MB (tensors)", lambda t, c: _mb(t["tensor_read"]))
    add("device written MB", lambda t, c: _mb(t["tensor_written"]))
    add("params read MB (setBytes)", lambda t, c: _mb(t["params_read"]))

    def reread(t, c, name):
        if name not in t["by_tensor"]:
            return "-"
        return f"{t['by_tensor'][name]['read'] / c['side']['tensors'][name]:.2f}"

    for name in ("q", "k", "v", "a", "b"):
        if any(name in c["totals"]["by_tensor"] for c in cols):
            add(f"  {name} read / its size", lambda t, c, name=name: reread(t, c, name))
    tg = ("threadgroup_read", "threadgroup_written")
    add("threadgroup r+w MB", lambda t, c: _mb(sum(t[k] for k in tg)))
    add("barriers", lambda t, c: _count(t["barriers"]))
    for chip in chips:

        def dram(t, c, chip=chip):
            if chip not in c["chips"]:
                return "-"
            run = totals(c["side"]["by_chip"][chip]["dispatches"])
            return _mb(run["dram_read"] + run["dram_written"])

        def predicted(t, c, chip=chip):
            if chip not in c["chips"]:
                return "-"
            p = c["side"]["by_chip"][chip]["prediction"]
            return f"{p['time_s'] * 1e6:.1f} {p['bound']}"

        add(f"{chip}: DRAM MB", dram)
        add(f"{chip}: predicted us", predicted)
    width = max(22, *(len(c["label"]) for c in cols)) + 2
    lines = [f"{case.name}\n{'':30}" + "".join(f"{c['label']:>{width}}" for c in cols)]
    lines += [f"{name:30}" + "".join(f"{v:>{width}}" for v in vals) for name, vals in rows]
    for c in cols:
        kernels = ", ".join(f"{d['kernel']} {tuple(d['grid'])}" for d in c["dispatches"])
        lines.append(f"  {c['label']}: {kernels}")
    for label, reason in result["skipped"]:
        lines.append(f"  {label}: skipped ({reason})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("prefill", "decode", "gemm"), action="append")
    parser.add_argument("--chips", default=",".join(CHIPS), help="comma-separated chip names")
    parser.add_argument("--no-cache", action="store_true", help="DRAM = device bytes")
    args = parser.parse_args(argv)
    chips = [c.strip() for c in args.chips.split(",")]
    for c in chips:
        timing.chip(c)  # unknown names fail here, naming the table's
    print(
        "Counters per call, summed over its dispatches; predicted times from "
        "torch_steel/sim/timing.py (- where a chip's plan is another column's)."
    )
    for case in CASES:
        if args.family and case.family not in args.family:
            continue
        print()
        print(table(compare(case, chips, cache=not args.no_cache), chips), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
