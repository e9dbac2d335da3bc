"""Run one op through the Metal simulator and the real Metal path on the same inputs; compare.

For bug reports about a kernel that misbehaves on a Mac. Each available path runs the same
inputs: "metal" (MPS tensors, Apple GPU), "sim" (CPU tensors through the simulator, which needs
clang-19: usually Linux) and "reference" (float64 reference math, the oracle). Fallbacks are off
(TORCH_STEEL_STRICT=1), so a refused plan is reported instead of silently hidden.

    python bench/compare_sim_metal.py gemm --m 100 --n 70 --k 300 --dtype float16 --bias
    python bench/compare_sim_metal.py sdpa --q-len 77 --kv-len 130 --causal --backward

When the simulator cannot run where Metal can (a Mac without clang-19), save the case and replay
it where the simulator runs; the replay compares against the saved Metal outputs:

    python bench/compare_sim_metal.py gemm ... --save case.pt      # on the Mac
    python bench/compare_sim_metal.py --load case.pt --print       # on Linux
"""

import argparse
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout too

import torch_steel  # noqa: E402
from torch_steel import backends  # noqa: E402

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def make_inputs(args) -> dict:
    """The op's inputs, float32 on CPU (cast per path), from args.seed."""
    g = torch.Generator().manual_seed(args.seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    if args.op == "gemm":
        batch = [args.batch] if args.batch else []
        inputs = {"a": randn(*batch, args.m, args.k)}
        # --transpose-b: b is a transposed view, which the kernel reads without a copy.
        b = (
            randn(*batch, args.n, args.k).transpose(-1, -2)
            if args.transpose_b
            else randn(*batch, args.k, args.n)
        )
        inputs["b"] = b
        if args.bias:
            inputs["bias"] = randn(args.n)
        if args.beta != 0:
            inputs["c"] = randn(*batch, args.m, args.n)
        return inputs
    shape = (args.batch or 1, args.heads)
    inputs = {
        "q": randn(*shape, args.q_len, args.head_dim),
        "k": randn(*shape, args.kv_len, args.head_dim),
        "v": randn(*shape, args.kv_len, args.head_dim),
    }
    if args.mask:
        inputs["attn_mask"] = torch.rand(args.q_len, args.kv_len, generator=g) > 0.2
    if args.backward:
        inputs["grad"] = randn(*shape, args.q_len, args.head_dim)
    return inputs


def run(args, inputs: dict, path: str) -> dict:
    """The op's outputs (and gradients with --backward) on one path, as float32 CPU tensors."""
    device = "mps" if path == "metal" else "cpu"
    dtype = torch.float64 if path == "reference" else DTYPES[args.dtype]

    def cast(t):
        if t.dtype == torch.bool:
            return t.to(device)
        # Round to the op's dtype first so that the reference sees the same values.
        return t.to(DTYPES[args.dtype]).to(dtype).to(device)

    x = {name: cast(t) for name, t in inputs.items()}
    with torch_steel.backend("reference" if path == "reference" else path):
        if args.op == "gemm":
            out = torch_steel.gemm(
                x["a"],
                x["b"],
                bias=x.get("bias"),
                c=x.get("c"),
                alpha=args.alpha,
                beta=args.beta,
                activation=args.activation,
            )
            return {"out": out.float().cpu()}
        q, k, v = (x[n].requires_grad_(args.backward) for n in ("q", "k", "v"))
        out = torch_steel.sdpa(q, k, v, attn_mask=x.get("attn_mask"), is_causal=args.causal)
        result = {"out": out}
        if args.backward:
            out.backward(x["grad"])
            result.update(dq=q.grad, dk=k.grad, dv=v.grad)
        return {name: t.detach().float().cpu() for name, t in result.items()}


def sim_ok() -> bool:
    """Whether the simulator runs here; a broken simulator must not stop the report."""
    try:
        ok, why = backends.sim_status()
    except Exception as error:
        ok, why = False, f"{type(error).__name__}: {error}"
    if not ok:
        print(f"sim: not run ({why})")
    return ok


def available_paths() -> list[str]:
    paths = ["reference"]
    if sim_ok():
        paths.append("sim")
    ok, why = backends.metal_status()
    if ok:
        paths.append("metal")
    else:
        print(f"metal: not run ({why})")
    return paths


def environment() -> dict:
    from torch_steel import metal

    env = {
        "torch": torch.__version__,
        "torch_steel": torch_steel.__version__,
        "platform": platform.platform(),
        "mps": torch.backends.mps.is_available(),
    }
    if metal.available():
        metallib, sources = metal.library_sources(metal.PACKAGE_DIR)
        env["metal_library"] = str(metallib) if metallib else f"{len(sources)} runtime-compiled"
    return env


def describe_plan(args, inputs: dict) -> None:
    """The launch plan both paths execute (planned by the simulator's build of the planners)."""
    if args.op != "gemm":
        return
    from torch_steel import sim

    x = {n: t.to(DTYPES[args.dtype]) for n, t in inputs.items()}
    plan = sim.plan(
        "gemm",
        [x["a"], x["b"], x.get("bias"), x.get("c")],
        {"alpha": args.alpha, "beta": args.beta, "activation": args.activation},
    )
    if not plan.ok:
        print(f"plan: refused: {plan.reason}")
    for d in plan.dispatches:
        print(f"plan: {d.kernel} grid={d.grid} threads={d.threads} constants={d.constants}")


def compare(results: dict, show: bool) -> None:
    if len(results) < 2:
        print(f"only {', '.join(results) or 'nothing'} ran here: nothing to compare")
        return
    reference = results.get("reference")
    for name in next(iter(results.values())):
        print(f"\n== {name}")
        for path, outputs in results.items():
            if path == "reference" or reference is None:
                continue
            err = (outputs[name] - reference[name]).abs()
            scale = reference[name].abs().max().clamp_min(1e-30)
            print(
                f"{path:>7} vs reference: max abs err {err.max():.3e} "
                f"(relative to max |ref| {err.max() / scale:.3e})"
            )
        if "sim" in results and "metal" in results:
            diff = results["metal"][name] - results["sim"][name]
            worst = diff.abs().argmax()
            index = tuple(int(i) for i in torch.unravel_index(worst, diff.shape))
            metal, sim = results["metal"][name][index], results["sim"][name][index]
            print(
                f"  metal vs sim: max abs diff {diff.abs().max():.3e} at {index} "
                f"(metal {metal:.6g}, sim {sim:.6g})"
            )
            if show:
                print("metal - sim:\n", diff)
        if show:
            for path, outputs in results.items():
                print(f"{path}:\n", outputs[name])


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("op", nargs="?", choices=["gemm", "sdpa"])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=0, help="leading batch size (0: none for gemm)")
    p.add_argument("--m", type=int, default=64)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--transpose-b", action="store_true")
    p.add_argument("--bias", action="store_true")
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--beta", type=float, default=0.0, help="nonzero adds beta * c")
    p.add_argument(
        "--activation", default="none", choices=["none", "relu", "gelu", "gelu_tanh", "silu"]
    )
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--q-len", type=int, default=64)
    p.add_argument("--kv-len", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--mask", action="store_true", help="a random boolean attn_mask")
    p.add_argument("--backward", action="store_true", help="also compare dq, dk, dv (sdpa)")
    p.add_argument("--print", dest="show", action="store_true", help="print the tensors")
    p.add_argument("--save", help="save inputs and outputs here (torch.save)")
    p.add_argument("--load", help="replay a saved case, comparing with its saved outputs")
    args = p.parse_args(argv)
    if args.op is None and args.load is None:
        p.error("give an op (gemm, sdpa) or --load")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    os.environ["TORCH_STEEL_STRICT"] = "1"  # a refused plan is reported, not replaced
    saved = {}
    if args.load:
        saved = torch.load(args.load, weights_only=False)
        print(f"replaying {args.load}, recorded on {saved['environment']}")
        show, save = args.show, args.save
        args = saved["args"]
        args.show, args.save, args.load = show, save, None
    inputs = saved.get("inputs") or make_inputs(args)
    print(
        f"{args.op} {args.dtype}: " + ", ".join(f"{n} {list(t.shape)}" for n, t in inputs.items())
    )
    print(f"here: {environment()}")
    paths = available_paths()
    if "sim" in paths:
        describe_plan(args, inputs)
    results = {}
    for path in paths:
        try:
            results[path] = run(args, inputs, path)
        except Exception as error:  # a report must show every path's failure, not stop at one
            print(f"{path}: FAILED: {type(error).__name__}: {error}")
    for path, outputs in saved.get("results", {}).items():
        results.setdefault(path, outputs)  # saved Metal outputs, when replaying without Metal
    compare(results, args.show)
    if args.save:
        torch.save(
            {"args": args, "inputs": inputs, "results": results, "environment": environment()},
            args.save,
        )
        print(f"\nsaved to {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
