"""Host overhead of a steel call against PyTorch's own op and an empty torch.library op (issue 16).

Per-call host time, in microseconds, of each steel entry point on tiny CPU tensors, where the
work itself is negligible, in one run:

  whole       the call as it runs here (reference math)
  overhead    the same call with the reference math replaced by a stub that returns the
              outputs computed once beforehand: what the steel layers cost around the math
  metal host  the call as a Mac makes it, up to the encoder: the op layer, torch_steel.backends
              and torch_steel.metal exactly as on MPS, then the host's C++ (validation, the plan
              cache or planner, pipeline lookup, output allocation, bindings through the
              host's CheckedEncoder) with a recording backend in place of the Metal calls
              (tests/mps/host_record.cpp, the code of mps_src/mps/host.h that module.mm runs)
  torch       PyTorch's own op on the same inputs (F.scaled_dot_product_attention, a @ b, ...)
  compiled    `overhead` inside a torch.compile'd function (fullgraph, compiled afresh with
              inductor's caches off), and `compiled torch`
              PyTorch's op the same way, of one call and of ten (a second table gives steel's
              share per call of each): a compiled call has a cost of its own (guards, the
              graph's runtime wrappers), so steel's share under compile is the difference

beside the floors: an empty torch.library.custom_op and an empty torch.library.Library op (a
Python kernel registered with Library.impl) of two tensors, timed with each row; for the rows
whose inputs require grad, the custom_op has a gradient formula (register_autograd) and both
floors take inputs that require grad, as the call records an autograd node. Each figure is
the best of --runs runs of --calls calls, the runs of one row's functions interleaved, in CPU
time of the thread (the machine may be shared: other jobs do not count, the best run is the
least disturbed one, and a ratio compares runs made under the same load). On a Mac the `torch`
column is the CPU-side time of PyTorch's CPU op; the metal host column holds there as here (the
dispatch_sync onto the MPS stream and the Metal calls themselves are not counted).

    python bench/bench_overhead.py [--calls 300] [--runs 20] [--no-compile] [--no-metal-host]
                                   [--no-plan-cache]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch_steel  # noqa: E402
from torch_steel import backends, metal  # noqa: E402
from torch_steel import reference as ref  # noqa: E402


def per_call_us(fns, calls: int, runs: int) -> list[float]:
    """For each function, the best over `runs` of the mean time of `calls` calls, in
    microseconds. The runs of the functions alternate, so that a ratio of two of them compares
    runs made under the same load."""
    for fn in fns:
        for _ in range(max(calls // 10, 10)):
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(runs):
        for i, fn in enumerate(fns):
            start = time.thread_time_ns()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.thread_time_ns() - start) / calls / 1e3)
    return best


# ----------------------------------------------------------------------------- floors

_EMPTY_OUT = torch.empty(4, 4)


@torch.library.custom_op("bench_overhead::empty_custom_op", mutates_args=())
def _empty_custom_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _EMPTY_OUT


@torch.library.custom_op("bench_overhead::empty_custom_op_grad", mutates_args=())
def _empty_custom_op_grad(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _EMPTY_OUT


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


torch.library.register_autograd(
    "bench_overhead::empty_custom_op_grad",
    lambda ctx, grad: (grad, grad),
    setup_context=_save_inputs,
)


_LIB = torch.library.Library("bench_overhead", "FRAGMENT")
_LIB.define("empty_library_op(Tensor a, Tensor b) -> Tensor")
_LIB.impl("empty_library_op", lambda a, b: _EMPTY_OUT, "CompositeExplicitAutograd")


# ----------------------------------------------------------------------------- cases


def _case_inputs(grad: bool):
    """name -> (steel call, PyTorch's own call, compiles) on tiny CPU tensors."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    q1, k1, v1 = rand(1, 8, 1, 64), rand(1, 8, 16, 64), rand(1, 8, 16, 64)
    qp, kp, vp = rand(1, 8, 32, 64), rand(1, 8, 32, 64), rand(1, 8, 32, 64)
    tq, tk, tv = rand(24, 8, 64), rand(24, 8, 64), rand(24, 8, 64)
    cu = torch.tensor([0, 8, 24], dtype=torch.int32)
    # A decode stream: each call sees one more key of a KV cache (views, whose strides stay),
    # made beforehand: slicing them is the caller's work, not the op's.
    cache_k, cache_v = rand(1, 8, 4096, 64), rand(1, 8, 4096, 64)
    views = [(cache_k[:, :, :n], cache_v[:, :, :n]) for n in range(16, 4096)]

    def stream(attend):
        keys = itertools.cycle(views)

        def step():
            k, v = next(keys)
            return attend(q1, k, v)

        return step

    a, b = rand(4, 8), rand(8, 4)
    x, w, bias = rand(4, 8), rand(16, 8), rand(16)
    return {
        "sdpa decode [1, 8, 1, 64] x 16 keys": (
            lambda: torch_steel.sdpa(q1, k1, v1),
            lambda: F.scaled_dot_product_attention(q1, k1, v1),
        ),
        "sdpa decode stream, one more key per call": (
            stream(torch_steel.sdpa),
            stream(F.scaled_dot_product_attention),
        ),
        "sdpa prefill [1, 8, 32, 64] causal": (
            lambda: torch_steel.sdpa(qp, kp, vp, is_causal=True),
            lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=True),
        ),
        "sdpa_varlen 2 seqs, 24 tokens": (
            lambda: torch_steel.sdpa_varlen(tq, tk, tv, cu, cu, 16, 16),
            # PyTorch's varlen_attn has no CPU kernel: one F.sdpa over the packed tokens.
            lambda: F.scaled_dot_product_attention(
                tq.transpose(0, 1), tk.transpose(0, 1), tv.transpose(0, 1)
            ),
        ),
        "gemm 4x8 @ 8x4": (lambda: torch_steel.gemm(a, b), lambda: a @ b),
        "linear 4x8, 16 out, bias": (
            lambda: torch_steel.linear(x, w, bias),
            lambda: F.linear(x, w, bias),
        ),
    }


COMPILED = ("sdpa decode [1, 8, 1, 64] x 16 keys", "gemm 4x8 @ 8x4")


def _compiled_calls(call, n):
    """A torch.compile'd function (fullgraph) making `call` n times: a graph of n ops, whose
    own cost (guards, runtime wrappers) is paid once for the n."""

    def calls():
        return [call() for _ in range(n)]

    return torch.compile(calls, fullgraph=True)


@contextlib.contextmanager
def stubbed_reference(call):
    """The reference math of the internal ops returns the outputs of one real call of `call`."""
    names = ("sdpa_forward", "sdpa_varlen_forward", "gemm")
    saved = {name: getattr(ref, name) for name in names}
    results = {}

    def recording(name):
        def run(*args, **kwargs):
            results[name] = saved[name](*args, **kwargs)
            return results[name]

        return run

    def stub(name):
        return lambda *args, **kwargs: results[name]

    try:
        for name in names:
            setattr(ref, name, recording(name))
        with torch.no_grad():
            call()
        for name in names:
            setattr(ref, name, stub(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(ref, name, fn)


# ----------------------------------------------------------------------------- Metal host path


def _host_recorder():
    """The host recorder extension (tests/mps/host_record.cpp), or None when it does not build."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "mps"))
    try:
        import host_record_build
    except ImportError:
        return None
    return host_record_build.extension()


@contextlib.contextmanager
def metal_host(recorder):
    """Steel calls on CPU tensors take the MPS path of torch_steel.backends and torch_steel.metal
    (the availability checks included), with the host recorder as the Metal extension, its
    library loaded: only the device of the tensors and the facts about the machine are
    pretended."""
    mps = torch.backends.mps
    saved = (
        backends._device_type,
        mps.is_available,
        mps.is_macos_or_newer,
        metal._load_extension,
        metal._loaded,
    )
    backends._device_type = lambda tensors: "mps"
    mps.is_available = lambda: True
    mps.is_macos_or_newer = lambda major, minor: True
    metal._load_extension = lambda: (recorder, None)
    metal._loaded = True
    try:
        yield
    finally:
        (
            backends._device_type,
            mps.is_available,
            mps.is_macos_or_newer,
            metal._load_extension,
            metal._loaded,
        ) = saved


# ----------------------------------------------------------------------------- table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-metal-host", action="store_true")
    parser.add_argument(
        "--no-plan-cache", action="store_true", help="the host plans every call (as before it)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Graphs compiled afresh: a graph that inductor cached before torch_steel.inductor wrote
    # steel's calls would keep the overloads' calls (the caches' keys do not see that hook).
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    x = torch.empty(4, 4)
    x_grad = torch.empty(4, 4, requires_grad=True)
    floors = [
        lambda: torch.ops.bench_overhead.empty_custom_op(x, x),
        lambda: torch.ops.bench_overhead.empty_library_op(x, x),
    ]
    # A call with a gradient records an autograd node (and saves its inputs): its floor is an
    # empty custom_op with a gradient formula, called on inputs that require grad.
    grad_floors = [
        lambda: torch.ops.bench_overhead.empty_custom_op_grad(x_grad, x_grad),
        lambda: torch.ops.bench_overhead.empty_library_op(x_grad, x_grad),
    ]
    recorder = None if args.no_metal_host else _host_recorder()
    if recorder is not None and args.no_plan_cache:
        recorder.plan_cache_reset(0)

    def measure(row, named, grad):
        """Times the functions of `named` with the floors, runs interleaved."""
        fns = [fn for _, fn in named] + (grad_floors if grad else floors)
        times = per_call_us(fns, args.calls, args.runs)
        row.update(zip([name for name, _ in named], times))
        row["floor custom_op"] = min(row.get("floor custom_op", 1e9), times[-2])
        row["floor Library"] = min(row.get("floor Library", 1e9), times[-1])

    rows = []
    with torch_steel.backend("reference"):
        for grad in (False, True):
            for name, (steel_call, torch_call) in _case_inputs(grad).items():
                if grad and not name.startswith("sdpa "):
                    continue
                row = {"call": name + (", grad" if grad else "")}
                measure(row, [("whole", steel_call), ("torch", torch_call)], grad)
                with stubbed_reference(steel_call):
                    named = [("overhead", steel_call)]
                    if not args.no_compile and not grad and name in COMPILED:
                        torch._dynamo.reset()
                        named.append(("compiled", torch.compile(steel_call, fullgraph=True)))
                        named.append(("compiled torch", torch.compile(torch_call, fullgraph=True)))
                        named.append(("compiled x10", _compiled_calls(steel_call, 10)))
                        named.append(("compiled torch x10", _compiled_calls(torch_call, 10)))
                    measure(row, named, grad)
                if recorder is not None:
                    with metal_host(recorder), torch_steel.backend("auto"):
                        measure(row, [("metal host", steel_call)], grad)
                rows.append(row)
                print(f"  measured {row['call']}", file=sys.stderr)

    columns = ["whole", "overhead", "metal host", "torch", "compiled", "compiled torch"]
    columns += ["floor custom_op", "floor Library"]
    print(
        f"Per-call host time in us, best of {args.runs} runs of {args.calls} calls, one thread, "
        f"torch {torch.__version__}. Floors: the empty ops, timed alongside each row (for the "
        "rows with grad, the custom_op has a gradient formula and both take inputs that require "
        "grad).\n"
    )
    header = ["call", *columns, "overhead / custom_op", "metal host / custom_op"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        cells = [row["call"]]
        cells += [f"{row[c]:.1f}" if c in row else "" for c in columns]
        for c in ("overhead", "metal host"):
            cells.append(f"{row[c] / row['floor custom_op']:.2f}x" if c in row else "")
        print("| " + " | ".join(cells) + " |")
    compiled = [row for row in rows if "compiled" in row]
    if compiled:
        print(
            "\nsteel's share (steel's time minus PyTorch's op's) per call, eagerly and in a "
            "compiled graph of 1 call and of 10 calls (per call):\n"
        )
        print("| call | eager | compiled, 1 call | compiled, 10 calls |")
        print("|---|---|---|---|")
        for row in compiled:
            eager = row["overhead"] - row["torch"]
            one = row["compiled"] - row["compiled torch"]
            ten = (row["compiled x10"] - row["compiled torch x10"]) / 10
            print(f"| {row['call']} | {eager:.1f} | {one:.1f} | {ten:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
