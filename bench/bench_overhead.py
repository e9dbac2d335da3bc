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
  compiled    `overhead` inside a torch.compile'd function (fullgraph), against the eager one
  torch       PyTorch's own op on the same inputs (F.scaled_dot_product_attention, a @ b, ...)

beside the floors: an empty torch.library.custom_op and an empty torch.library.Library op (a
Python kernel registered with Library.impl) of two tensors. Each figure is the best of --runs
runs of --calls calls (the machine may be shared: the best run is the least disturbed one).

    python bench/bench_overhead.py [--calls 2000] [--runs 5] [--no-compile] [--no-metal-host]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch_steel  # noqa: E402
from torch_steel import backends, metal  # noqa: E402
from torch_steel import reference as ref  # noqa: E402


def per_call_us(fn, calls: int, runs: int) -> float:
    """Best over `runs` of the mean time of `calls` calls of fn, in microseconds."""
    for _ in range(max(calls // 10, 10)):
        fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter_ns() - start) / calls / 1e3)
    return best


# ----------------------------------------------------------------------------- floors

_EMPTY_OUT = torch.empty(4, 4)


@torch.library.custom_op("bench_overhead::empty_custom_op", mutates_args=())
def _empty_custom_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _EMPTY_OUT


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
    a, b = rand(4, 8), rand(8, 4)
    x, w, bias = rand(4, 8), rand(16, 8), rand(16)
    return {
        "sdpa decode [1, 8, 1, 64] x 16 keys": (
            lambda: torch_steel.sdpa(q1, k1, v1),
            lambda: F.scaled_dot_product_attention(q1, k1, v1),
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
    """Steel calls on CPU tensors take the MPS path of torch_steel.backends and torch_steel.metal,
    with the host recorder as the Metal extension."""
    saved = (backends._device_type, backends.metal_status, metal._extension, metal._load_library)
    backends._device_type = lambda tensors: "mps"
    backends.metal_status = lambda: (True, "")
    metal._extension = lambda: recorder
    metal._load_library = lambda ext: None
    try:
        yield
    finally:
        (backends._device_type, backends.metal_status, metal._extension, metal._load_library) = (
            saved
        )


# ----------------------------------------------------------------------------- table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-metal-host", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    measure = lambda fn: per_call_us(fn, args.calls, args.runs)  # noqa: E731

    x = torch.empty(4, 4)
    floor_custom = measure(lambda: torch.ops.bench_overhead.empty_custom_op(x, x))
    floor_library = measure(lambda: torch.ops.bench_overhead.empty_library_op(x, x))
    recorder = None if args.no_metal_host else _host_recorder()

    rows = []
    with torch_steel.backend("reference"):
        for grad in (False, True):
            for name, (steel_call, torch_call) in _case_inputs(grad).items():
                if grad and not name.startswith("sdpa "):
                    continue
                label = name + (", grad" if grad else "")
                row = {"call": label, "whole": measure(steel_call), "torch": measure(torch_call)}
                with stubbed_reference(steel_call):
                    row["overhead"] = measure(steel_call)
                    if not args.no_compile and not grad and name in COMPILED:
                        torch._dynamo.reset()
                        compiled = torch.compile(steel_call, fullgraph=True)
                        row["compiled"] = measure(compiled)
                if recorder is not None:
                    with metal_host(recorder):
                        row["metal host"] = measure(steel_call)
                rows.append(row)

    columns = ["whole", "overhead", "metal host", "compiled", "torch"]
    print(
        f"Per-call host time, us (best of {args.runs} runs of {args.calls} calls, one thread, "
        f"torch {torch.__version__}); floors: empty custom_op {floor_custom:.1f} us, empty "
        f"Library op {floor_library:.1f} us\n"
    )
    header = ["call", *columns, "overhead / custom_op floor"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        cells = [row["call"]]
        cells += [f"{row[c]:.1f}" if c in row else "" for c in columns]
        cells.append(f"{row['overhead'] / floor_custom:.2f}x")
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
